"""`moe_finalize`: the combine of the routed expert outputs + the shared-expert add + the cast.

    y = zeros(T, D, fp32).index_add(0, token, expert_out.float());  out = bf16(y + shared.float())
  -> dsv41::moe_finalize(expert_out, token, shared, T)

Under TP an all-reduce sits between the combine and the shared add: then only the combine is replaced
(`shared` None, fp32 out) and `allreduce_mhc` takes the rest. Formulations: index_add (the model's) or
scatter_add over an expanded index; the rows as given (weighted before w2) or times their routing weight in fp32
after w2 (vLLM's order: `weights` of the op); and MaxText's unpermute, the expert-sorted rows put back in (token,
slot) order by the inverse of the sort's permutation (`argsort(order)`), viewed [T, k, D] and summed with the
[T, k] routing weights by `einsum('tkd,tk->td')` (the op then takes token = order // k and the weights gathered by
order; the same products, summed in the op's row order rather than the slot order: fp32 reordering). That one
needs `order` to be a sort's indices (a permutation); other indices are declined. The unpermute also without
weights, the rows weighted before w2 as the spec has it (`rows[argsort(order)].view(T, k, D).float().sum(1)`;
SGLang's `new_x[order] = rows`, normalised to that gather): the op then takes no weights. And the combine
accumulated into the shared output itself, `shared.float().scatter_add(0, index, rows)` (or `index_add`), weighted
or not (TorchTitan's `out = shared_experts(x); out.scatter_add(0, index, routed_output)`, in fp32): the same sum with
the shared row added first rather than last (fp32 reordering).

Per-slot sums (gpt-fast's Mixtral `MOEFeedForward`, the gathered-weight experts' rows, a loop or a dense batched
product per slot): rows [T, k, D] already in (token, slot) order, combined per token with the [T, k] fp32 routing
weights, the shared expert added in fp32 and rounded once,

    out = bf16(sum_j weights[t, j] * fp32(rows[t, j]) + fp32(shared[t]))   (einsum 'tkd,tk->td', `w[:, None] @
    rows`, `(rows * w[..., None]).sum(1)`; unweighted: `rows.float().sum(1)`, the rows weighted before w2)

is the op on the rows viewed [T * k, D] in pair order, token = p // k of row p (the identity order: row t * k + j
is token t's slot j) and the weights flattened the same way: each token's k products, summed in slot order from
+0.0 (the op's row order), where the graph's batched product may sum them in another order or fused (fp32
reordering). Only with the shared add: without it the per-slot weighted sum is any weighted reduction over a middle
dim (the mHC collapse `einsum('tjd,tj->td')` is one), so the pattern alone would not say it is the MoE combine; the
TP combine in this form is therefore not taken. Where the rows are the gathered experts' op put back in pair order
(`passes/moe_experts.py`), the op reads them in that order: with w1 and w3 apart they are the op's own rows (a view),
with a stacked w13 a gather by the inverse permutation that the graph keeps.

Listed to be declined: the combine accumulated in bf16, `zeros_like(shared).index_add_(0, token, rows.to(bf16))`
then `+ shared` in bf16 (Hugging Face's `batched_mm` / `grouped_mm` experts and its DeepSeek MoE's shared add):
each row is rounded to bf16, each accumulation step and the shared add round the running sum to bf16 (k + 1
roundings a token, errors of up to about k + 1 bf16 ulps), where the op sums in fp32 and rounds once. That is not
an fp32 reordering of the program's sum but another function; torch's own bf16 `index_add_` rounds after every
row, so the op would not compute what the program promises (`BF16_ACCUMULATION`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from dsv41.passes.fusion import Derived, FusionPass, Replacement
from dsv41.passes.matcher import Pattern
from dsv41.passes.moe_experts import pair_tokens
from dsv41.passes.normalize import sort_permutation

M, T, D = 6, 3, 32
aten = torch.ops.aten
# name parts
UNPERMUTE = "unpermute"
UNWEIGHTED = f"{UNPERMUTE}_unweighted"
PER_SLOT = "slots"
BF16_ACCUMULATION = "index_add_bf16_shared"


class Rows(enum.Enum):
    """How the combine finds each row's token (see the module)."""

    AT_TOKENS = "at_tokens"  # rows [M, D] added at token[m] (index_add, or scatter_add over the expanded index)
    UNPERMUTE = "unpermute"  # expert-sorted rows put back in (token, slot) order by argsort(order), summed per token
    PER_SLOT = "per_slot"    # rows [T, k, D] already in (token, slot) order, summed per token


class Shared(enum.Enum):
    """Where the shared expert's output enters the sum."""

    NONE = "none"    # not at all (the TP combine: fp32 out, the shared add after the all-reduce)
    ADDED = "added"  # added to the combined rows in fp32, rounded once
    INTO = "into"    # the rows accumulated into it (the shared row first)


@dataclass(frozen=True)
class FinalizeForm:
    """A formulation of the combine: `rows`, how each row finds its token; `weighted`, the rows times their [T, k]
    or [M] routing weights in fp32 (else weighted before w2); `shared`, where the shared expert's output enters;
    `method`, the op the sum is written with where formulations differ only in it (index_add or scatter_add at the
    tokens; einsum or mul_sum for the weighted per-slot sums; else None); `bf16_accumulation`, the combine
    accumulated in bf16 (declined: another function)."""

    rows: Rows
    weighted: bool
    shared: Shared
    method: str | None = None
    bf16_accumulation: bool = False


def _inputs(with_shared):
    def inputs():
        base = [torch.empty(M, D, dtype=torch.bfloat16), torch.empty(M, dtype=torch.int64)]
        return base + ([torch.empty(T, D, dtype=torch.bfloat16)] if with_shared else [])
    return inputs


def combine_index_add(out, token, num_tokens):
    return torch.zeros(num_tokens, out.shape[1], dtype=torch.float32, device=out.device).index_add_(0, token, out.float())


def combine_scatter_add(out, token, num_tokens):
    index = token.unsqueeze(-1).expand(-1, out.shape[1])
    return torch.zeros(num_tokens, out.shape[1], dtype=torch.float32, device=out.device).scatter_add_(0, index, out.float())


def accumulate_into(init, rows, token, method):
    """init [T, D] fp32 with rows [M, D] fp32 added at their tokens, by `index_add` or by `scatter_add` over the
    token index expanded along D: init[t] + sum_{i: token[i] = t} rows[i] -> [T, D] fp32."""
    if method == "index_add":
        return init.index_add(0, token, rows)
    return init.scatter_add(0, token.unsqueeze(-1).expand(-1, rows.shape[1]), rows)


# The per-slot weighted sums of rows [T, k, D] bf16 with weights [T, k] fp32 -> [T, D] fp32, y[t] = sum_j
# weights[t, j] * fp32(rows[t, j]), per spelling, with its distinctive op (`w[:, None] @ rows` and `bmm` normalise
# to the einsum's product).
SLOT_SUMS = {
    "einsum": (lambda rows, weights: torch.einsum("tkd,tk->td", rows.float(), weights), aten.bmm.default),
    "mul_sum": (lambda rows, weights: (rows.float() * weights.unsqueeze(-1)).sum(dim=1), aten.sum.dim_IntList),
}


def unweighted_slot_sum(rows):
    """Rows [T, k, D] bf16 weighted before w2 -> y[t] = sum_j fp32(rows[t, j]) [T, D] fp32."""
    return rows.float().sum(dim=1)


def unpermute(out, order, weights):
    """MaxText's unpermute: y[t] = sum_j weights[t, j] * out[inv[t * k + j]] in fp32, inv = argsort(order) the inverse
    of the sort's permutation; out [M, D], order [M], weights [T, k] fp32, M = T * k -> [T, D] fp32."""
    rows = out[torch.argsort(order)].reshape(weights.shape[0], weights.shape[1], out.shape[1])
    return SLOT_SUMS["einsum"][0](rows, weights)


def unpermute_unweighted(out, order, topk):
    """MaxText's unpermute of rows weighted before w2 (the spec's order): y[t] = sum_j out[inv[t * k + j]] in fp32,
    inv = argsort(order); out [M, D], order [M], k = topk, M = T * k -> [T, D] fp32."""
    return unweighted_slot_sum(out[torch.argsort(order)].reshape(out.shape[0] // topk, topk, out.shape[1]))


def bf16_accumulation(rows, token, shared):
    """The combine accumulated in shared's dtype (bf16): zeros [T, D].index_add_(0, token, rows.to(bf16)) + shared,
    rows [M, D] (any float dtype, weighted), token [M], shared [T, D] bf16 -> [T, D] bf16, rounded at every step."""
    return torch.zeros_like(shared).index_add_(0, token, rows.to(shared.dtype)) + shared


def _unpermute_inputs(with_shared):
    def inputs():
        out, token, *shared = _inputs(with_shared)()
        return [out, token, torch.empty(T, M // T)] + shared
    return inputs


def _slot_inputs(weighted):
    """rows [T, k, D] bf16 in (token, slot) order, (weights [T, k] fp32,) shared [T, D] bf16."""
    def inputs():
        rows, shared = torch.empty(T, M // T, D, dtype=torch.bfloat16), torch.empty(T, D, dtype=torch.bfloat16)
        return [rows, torch.empty(T, M // T), shared] if weighted else [rows, shared]
    return inputs


def _weighted_inputs(with_shared):
    def inputs():
        out, token, *shared = _inputs(with_shared)()
        return [out, token, torch.empty(M)] + shared
    return inputs


class MoeFinalizePass(FusionPass):
    name = "moe_finalize"
    form_type = FinalizeForm
    # the token count: the zeros' row count, or (accumulated into the shared output, which has no zeros) its rows
    int_ranges = {"token": lambda metas, free: (0, free["num_tokens"] if "num_tokens" in free
                                                else metas["shared"].shape[0])}

    def patterns(self):
        free, defaults = {"num_tokens": (aten.full.default, 0, (0, 0))}, {"num_tokens": T}
        combine_op = (aten.index_add.default, aten.index_put.default, aten.scatter_add.default)  # index_add may decompose
        pats = []
        for name, combine in (("index_add", combine_index_add), ("scatter_add", combine_scatter_add)):
            def with_shared(out, token, shared, num_tokens, combine=combine):
                return (combine(out, token, num_tokens) + shared.float()).to(shared.dtype)

            def combine_only(out, token, num_tokens, combine=combine):
                return combine(out, token, num_tokens)

            def weighted_shared(out, token, weights, shared, num_tokens, combine=combine):
                return (combine(out.float() * weights.unsqueeze(-1), token, num_tokens) + shared.float()).to(shared.dtype)

            def weighted_only(out, token, weights, num_tokens, combine=combine):
                return combine(out.float() * weights.unsqueeze(-1), token, num_tokens)

            def weighted_into_shared(out, token, weights, shared, method=name):
                rows = out.float() * weights.unsqueeze(-1)
                return accumulate_into(shared.float(), rows, token, method).to(shared.dtype)

            def into_shared(out, token, shared, method=name):
                return accumulate_into(shared.float(), out.float(), token, method).to(shared.dtype)

            def at_tokens(weighted, shared, method=name):
                return FinalizeForm(Rows.AT_TOKENS, weighted, shared, method)

            pats.append(Pattern(f"{name}_weighted_into_shared", weighted_into_shared, _weighted_inputs(True),
                                anchor=combine_op, form=at_tokens(True, Shared.INTO)))
            pats.append(Pattern(f"{name}_into_shared", into_shared, _inputs(True), anchor=combine_op,
                                form=at_tokens(False, Shared.INTO)))
            pats.append(Pattern(f"{name}_weighted_shared", weighted_shared, _weighted_inputs(True), free, defaults,
                                anchor=combine_op, form=at_tokens(True, Shared.ADDED)))
            pats.append(Pattern(f"{name}_weighted_only", weighted_only, _weighted_inputs(False), free, defaults,
                                anchor=combine_op, form=at_tokens(True, Shared.NONE)))
            pats.append(Pattern(f"{name}_shared", with_shared, _inputs(True), free, defaults, anchor=combine_op,
                                form=at_tokens(False, Shared.ADDED)))
            pats.append(Pattern(f"{name}_only", combine_only, _inputs(False), free, defaults, anchor=combine_op,
                                form=at_tokens(False, Shared.NONE)))

        def bf16_rows_inputs():
            out, token, shared = _inputs(True)()
            return [out.float(), token, shared]

        pats.append(Pattern(BF16_ACCUMULATION, bf16_accumulation, bf16_rows_inputs, anchor=combine_op,
                            form=FinalizeForm(Rows.AT_TOKENS, False, Shared.ADDED, "index_add", True)))

        def unpermute_shared(out, order, weights, shared):
            return (unpermute(out, order, weights) + shared.float()).to(shared.dtype)

        inverse = aten.sort.default  # argsort of the permutation
        pats.append(Pattern(f"{UNPERMUTE}_shared", unpermute_shared, _unpermute_inputs(True), anchor=inverse,
                            form=FinalizeForm(Rows.UNPERMUTE, True, Shared.ADDED)))
        pats.append(Pattern(f"{UNPERMUTE}_only", unpermute, _unpermute_inputs(False), anchor=inverse,
                            form=FinalizeForm(Rows.UNPERMUTE, True, Shared.NONE)))

        def unpermute_unweighted_shared(out, order, shared, topk):
            return (unpermute_unweighted(out, order, topk) + shared.float()).to(shared.dtype)

        k_free, k_default = {"topk": (aten.view.default, 0, (1, 1))}, {"topk": M // T}
        pats.append(Pattern(f"{UNWEIGHTED}_shared", unpermute_unweighted_shared, _inputs(True), k_free,
                            k_default, anchor=inverse, form=FinalizeForm(Rows.UNPERMUTE, False, Shared.ADDED)))
        pats.append(Pattern(f"{UNWEIGHTED}_only", unpermute_unweighted, _inputs(False), k_free, k_default,
                            anchor=inverse, form=FinalizeForm(Rows.UNPERMUTE, False, Shared.NONE)))
        # after the unpermutes, which take rows put back by a sort's inverse without that gather
        for spelling, (slot_sum, anchor) in SLOT_SUMS.items():
            def slots_shared(rows, weights, shared, slot_sum=slot_sum):
                return (slot_sum(rows, weights) + shared.float()).to(shared.dtype)

            pats.append(Pattern(f"{PER_SLOT}_{spelling}_shared", slots_shared, _slot_inputs(True), anchor=anchor,
                                form=FinalizeForm(Rows.PER_SLOT, True, Shared.ADDED, spelling)))

        def slots_unweighted_shared(rows, shared):
            return (unweighted_slot_sum(rows) + shared.float()).to(shared.dtype)

        pats.append(Pattern(f"{PER_SLOT}_unweighted_shared", slots_unweighted_shared, _slot_inputs(False),
                            anchor=aten.sum.dim_IntList, form=FinalizeForm(Rows.PER_SLOT, False, Shared.ADDED)))
        return pats

    def tokens(self, m):
        form = m.pattern.form
        if form.rows is Rows.PER_SLOT:
            return m.inputs[0].meta["val"].shape[0]
        if form.rows is Rows.UNPERMUTE and not form.weighted:
            return m.inputs[0].meta["val"].shape[0] // m.free["topk"]
        if form.rows is Rows.UNPERMUTE:
            return m.inputs[2].meta["val"].shape[0]
        if form.shared is Shared.INTO or form.bf16_accumulation:
            return m.inputs[-1].meta["val"].shape[0]
        return m.free["num_tokens"]

    def check(self, m):
        if m.pattern.form.bf16_accumulation:
            return ("the combine accumulates in bf16 (index_add_ into a bf16 zeros_like, then the shared expert added "
                    "in bf16: a rounding per row and per step), the op in fp32 with one rounding: another function, "
                    "not fused")
        if m.pattern.form.rows is Rows.UNPERMUTE and not sort_permutation(m.inputs[1]):
            return (f"%{m.inputs[1].name} is not the indices of a sort of {m.inputs[0].meta['val'].shape[0]} values, so "
                    "its argsort need not be its inverse permutation: the unpermute is not the op's combine")
        return None

    def replacement(self, m):
        form = m.pattern.form
        if form.rows is Rows.PER_SLOT:
            rows, *weights, shared = m.inputs
            t, k, dim = rows.meta["val"].shape
            pair_rows = Derived(aten.reshape.default, (rows, [t * k, dim]))
            pair_weights = Derived(aten.reshape.default, (weights[0], [t * k])) if weights else None
            token = pair_tokens(Derived(aten.select.int, (pair_rows, 1, 0)), k)
            args = (pair_rows, token, shared, t, pair_weights, self.config.kernel)
            return Replacement(torch.ops.dsv41.moe_finalize.default, args, (None,))
        if form.rows is Rows.UNPERMUTE and not form.weighted:
            out, order, *shared = m.inputs
            k = m.free["topk"]
            token = Derived(aten.div.Tensor_mode, (order, k), (("rounding_mode", "floor"),))
            args = (out, token, shared[0] if shared else None, self.tokens(m), None, self.config.kernel)
            return Replacement(torch.ops.dsv41.moe_finalize.default, args, (None,))
        if form.rows is Rows.UNPERMUTE:
            out, order, weights, *shared = m.inputs
            t, k = weights.meta["val"].shape
            token = Derived(aten.div.Tensor_mode, (order, k), (("rounding_mode", "floor"),))
            row_weights = Derived(aten.index.Tensor, (Derived(aten.reshape.default, (weights, [t * k])), [order]))
            args = (out, token, shared[0] if shared else None, t, row_weights, self.config.kernel)
            return Replacement(torch.ops.dsv41.moe_finalize.default, args, (None,))
        out, token = m.inputs[:2]
        weights = m.inputs[2] if form.weighted else None
        shared = m.inputs[3 if form.weighted else 2] if form.shared is not Shared.NONE else None
        args = (out, token, shared, self.tokens(m), weights, self.config.kernel)
        return Replacement(torch.ops.dsv41.moe_finalize.default, args, (None,))
