"""`moe_experts`: the routed experts at small row counts, GEMM1 (w1||w3) + clamped SwiGLU x routing weight (+ FP8
fake quantisation) + GEMM2 (w2) on the expert-sorted rows.

    gu = _grouped_mm(x[token], w13^T, offs);  a = bf16(swiglu_clamped(gu[:, :I], gu[:, I:], limit) * w[:, None])
    a = fp8_fake_quant(a, block) (when present);  out = _grouped_mm(a, w2^T, offs)
  -> dsv41::moe_experts(x, token, w, offs, w13, w2, limit, block)

Its own fusion, not part of `moe_finalize`: the finalize (combine + shared add) applies at every batch and under TP
sits on the far side of an all-reduce, while this one is a bandwidth kernel for few rows that declines above
MAX_ROWS (T * k rows) and leaves the `_grouped_mm` path to larger batches; the two compose (finalize takes this op's
rows as its `expert_out`), so either can be disabled alone. Formulations: the model's, with and without the fake
quantisation of the activation (the config's fp8_block), and both without the routing weight, where the model weights
the rows after w2 (vLLM's order; MaxText's unpermute einsum): the op then takes weights of 1 (`a * 1.0` is `a`, exact);
limit from the config (another limit is a scalar decline). Each also with w1 and w3 held apart (`experts_split...`,
TorchTitan's `GroupedExperts`): g = _grouped_mm(x[token], w1^T, offs) and u = _grouped_mm(x[token], w3^T, offs) in
place of gu's halves; the op takes w1 as its w13 and w3 as its w3 (each expert's gate and up rows read from the two
weights in place, no copy), or, where w1 and w3 are the two dim-1 halves of one [E, 2I, D] value, that value stacked.
A weight stored transposed ([E, D, I] under `_grouped_mm(rows, w1, offs)`) binds through the matcher's inverse view
chain, read in place. And each from GEMM1's input rows given (`experts..._rows...`): rows [M, D] computed outside the
region (TorchTitan rounds the gathered rows to FP8 before its grouped GEMMs, as a float8 grouped GEMM quantises its
operand); the op takes them as its x with token = 0, 1, ..., M - 1 (x[token] = rows, exact). Where the gather is in
the graph, the formulation on x[token] is tried first (`wider`), so the op gathers the T rows itself.

Gathered formulations (gpt-fast's Mixtral `ConditionalFeedForward`, hand-written decode loops): no sort; each (token
t, slot j) pair's expert weights are gathered and multiplied in batched products,

    gu = x[t] . w13[e[t, j]]^T  for all (t, j)  (w13[expert_idx] [T, k, 2I, D] under einsum, or matmul / bmm)
    a = fp8_fake_quant(bf16(swiglu_clamped(gu[..., :I], gu[..., I:], limit) (* weights[..., None])))
    out[t, j] = a[t, j] . w2[e[t, j]]^T  -> [T, k, D]

The replacement computes the op's sorted rows from expert_idx [T, k] in the graph: flat = expert_idx.reshape(T * k),
order = argsort(flat, stable=True) (equal ids by pair index, so deterministic), token = order // k, offsets =
cumsum of the per-expert counts (an int32 scatter_add of ones into zeros, one per expert of w2, the model's count;
`bincount`'s output size depends on the values, so it has no static-shape form; the zeros take their count from w2's
expert dim, so the semantic check's reduced experts carry through them), row_weights = weights.flatten()[order] (or
ones), and puts the op's [T * k, D] rows back in pair order by the inverse permutation,
out[argsort(order)].view(T, k, D). The op takes every weight as the graph stores it: the gathers of each pair's
weights (T * k experts' weights copied on every call, which the kernel would then read again) are gone.
Exact up to the GEMMs' fp32 summation order: the rows are a permutation of the independent (t, j) pairs, and each
row's products (bf16 in, fp32 accumulation, bf16 out), activation, weight, cast and FP8 step are the pattern's. A
gathered match with parts written another way passes the semantic check within the pass's bf16 `tolerance`
(atol 2^-5, rtol 2^-6), as the sorted-rows ones. Declined above MAX_ROWS pairs as those.

The pairs may also be flattened first (HF's `batched_mm` experts, `flat_pair_experts`): ids = expert_idx.reshape(T *
k), rows x[p // k], bmm over the gathered [S, 2I, D] and [S, D, I] weights, the [S, D] rows returned; replaced alike,
the op's rows put back in pair order as [S, D]. Or each of M rows x[token[m]] runs on its own expert's gathered
weights (`per_row_experts`, `gathered_per_row...`: an export-style decode that sorts the pairs but, with no
`_grouped_mm` to export, gathers each sorted row's w13 and w2): the op takes the rows sorted by expert_idx [M] as
above (order = argsort(expert_idx, stable=True), token[order], row_weights[order] or ones, offsets from the counts of
expert_idx) with w13 and w2 as stored, its rows put back in the graph's row order by the inverse permutation. Exact as
above.

With w1 and w3 held apart (gpt-fast), the op takes them as stored (its w13 = w1 and w3 arguments, each expert's gate
and up rows read in place) on the sorted rows, as the sorted formulations with w1 and w3 apart do: no cat of all
experts' weights, no gather of a pair's. Where w1 and w3 are the two dim-1 halves of one [E, 2I, D] graph value
(`w13[:, :I]`, `w13[:, I:]`), that value is w13. Their gathers may also be joined by a cat along I before one
product (`cat([w1[idx], w3[idx]], 2)`, split after it; einsum or matmul): since cat(w1[e], w3[e]) = w13[e], that is
the same formulation (`..._split_cat`), replaced alike (the cat, a copy of the pairs' weights, goes with the region).

Semantic check (a match with parts computed another way): the experts' count E is a size every formulation and the
op compute with whatever its value (`reductions`): the weights are drawn as REDUCED_EXPERTS experts, the expert ids
and offsets over those, so the check's memory is a few experts' weights, not all E (`dsv41.passes.fusion`).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from dsv41.lowerings.moe_experts import MAX_ROWS
from dsv41.models import functional as fn
from dsv41.passes.fusion import Derived, FusionPass, Reduction, Replacement
from dsv41.passes.matcher import Pattern, leaves

T, D, I, E, K = 3, 32, 32, 4, 6
# the experts the semantic check draws in place of all E (a wrong expert index among four still shows)
REDUCED_EXPERTS = 4
aten, prims = torch.ops.aten, torch.ops.prims
# name parts: the gathered formulations' prefix; w1 and w3 held apart; GEMM1's input rows given (not x[token]);
# the gathered pairs flattened; each row x[token[m]] on its own gathered expert weights
GATHERED, SPLIT, ROWS, FLAT, PER_ROW = "gathered", "split", "rows", "flat", "per_row"


class Layout(enum.Enum):
    """Which rows the experts run on and how each finds its expert's weights (see the module)."""

    SORTED = "sorted"          # the expert-sorted rows x[token], grouped GEMMs over offsets
    PAIRS = "pairs"            # the (token, slot) pairs of expert_idx [T, k] on gathered weights -> [T, k, D]
    FLAT_PAIRS = "flat_pairs"  # those pairs flattened first (HF's `batched_mm`) -> [T * k, D] rows
    PER_ROW = "per_row"        # M rows x[token[m]], each on its own expert's gathered weights -> [M, D]


@dataclass(frozen=True)
class ExpertsForm:
    """A formulation of the routed experts: `layout`, the rows it runs on; `fp8`, with the FP8 fake quantisation of
    the activation; `weighted`, the activation times the routing weight (else the rows are weighted after w2);
    `split`, w1 and w3 held apart (else one w13); `rows_given`, GEMM1's input rows computed outside the region (else
    x[token]; sorted only); `products`, the spelling of the pairs' batched products ("einsum" or "matmul"; pairs
    only); `joined`, w1's and w3's gathers joined by a cat before one product (pairs with w1 and w3 apart only)."""

    layout: Layout
    fp8: bool
    weighted: bool
    split: bool = False
    rows_given: bool = False
    products: str | None = None
    joined: bool = False


def _sorted_example(name):
    """A small example tensor for the sorted formulations' input `name`."""
    bf = torch.bfloat16
    return {"x": lambda: torch.empty(T, D, dtype=bf), "rows": lambda: torch.empty(T * K, D, dtype=bf),
            "token": lambda: torch.empty(T * K, dtype=torch.int64), "row_weights": lambda: torch.empty(T * K),
            "offsets": lambda: torch.empty(E, dtype=torch.int32), "w13": lambda: torch.empty(E, 2 * I, D, dtype=bf),
            "w1": lambda: torch.empty(E, I, D, dtype=bf), "w3": lambda: torch.empty(E, I, D, dtype=bf),
            "w2": lambda: torch.empty(E, D, I, dtype=bf)}[name]()


def _sorted_pattern(form, limit, quant_block):
    """The sorted formulation of `form`: `experts` on inputs named x, token (or rows: GEMM1's input rows given,
    computed outside the region, e.g. FP8-rounded after the gather as a float8 grouped GEMM's input), row_weights (if
    weighted), offsets, w13 (or w1, w3: held apart), w2."""
    names = [*(("rows",) if form.rows_given else ("x", "token")), *(("row_weights",) if form.weighted else ()),
             "offsets", *(("w1", "w3") if form.split else ("w13",)), "w2"]

    def search(*tensors):
        t = dict(zip(names, tensors, strict=True))
        x, token = (t["rows"], None) if form.rows_given else (t["x"], t["token"])
        return experts(x, token, t.get("row_weights"), t["offsets"], t["w1"] if form.split else t["w13"], t["w2"],
                       limit, quant_block, w3=t.get("w3"))

    search.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    name = (f"experts{f'_{SPLIT}' if form.split else ''}{f'_{ROWS}' if form.rows_given else ''}"
            f"{'_fp8' if form.fp8 else ''}{'' if form.weighted else '_unweighted'}")
    return Pattern(name, search, lambda: [_sorted_example(n) for n in names], anchor=aten._grouped_mm.default,
                   form=form)


def _gathered_inputs(tokens=T):
    bf = torch.bfloat16
    return [torch.empty(tokens, D, dtype=bf), torch.empty(tokens, K, dtype=torch.int64), torch.empty(tokens, K),
            torch.empty(E, 2 * I, D, dtype=bf), torch.empty(E, D, I, dtype=bf)]


def _split_inputs(tokens=T):
    x, expert_idx, weights, w13, w2 = _gathered_inputs(tokens)
    return [x, expert_idx, weights, w13[:, :I].clone(), w13[:, I:].clone(), w2]


def _per_row_inputs(tokens=T):
    """x [T, D], token [M], expert_idx [M], row_weights [M], w13, w2 (M = T * K rows)."""
    x, _, _, w13, w2 = _gathered_inputs(tokens)
    rows = tokens * K
    return [x, torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.int64), torch.empty(rows), w13, w2]


def _without_row_weights(inputs):
    """The example inputs of the unweighted per-row form: the row weights (the fourth input) dropped."""
    def unweighted(*shape):
        x, token, expert_idx, _, *rest = inputs(*shape)
        return [x, token, expert_idx, *rest]
    return unweighted


def _without_weights(inputs):
    """The example inputs of the unweighted form: the weights (the third input) dropped."""
    def unweighted(*shape):
        first, second, _, *rest = inputs(*shape)
        return [first, second, *rest]
    return unweighted


def _activation(g, u, weights, limit, quant_block, dtype):
    """g, u [..., I] (the w1 and w3 outputs) -> fp8_fake_quant(dtype(swiglu_clamped(g, u, limit) * weights[..., None]))
    [..., I]; weights None: unweighted; quant_block 0: no FP8 step."""
    a = fn.swiglu_clamped(g, u, limit)
    if weights is not None:
        a = a * weights.unsqueeze(-1)
    a = a.to(dtype)
    return fn.fp8_fake_quant(a, quant_block) if quant_block else a


def experts(x, token, row_weights, offsets, w13, w2, limit, quant_block, w3=None):
    """The model's routed experts (`MoE.forward`) from the sorted rows x[token] (token None: x is those rows) to the
    down projection's output; row_weights None: the rows unweighted (weighted after w2); w3 given: w13 is w1
    [E, I, D] and w3 [E, I, D] is held apart (TorchTitan's `GroupedExperts`), a grouped GEMM each."""
    rows = x if token is None else x[token]
    if w3 is None:
        gu = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
        inter = w2.shape[2]
        g, u = gu[:, :inter], gu[:, inter:]
    else:
        g = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
        u = torch._grouped_mm(rows, w3.transpose(1, 2), offs=offsets)
    a = _activation(g, u, row_weights, limit, quant_block, x.dtype)
    return torch._grouped_mm(a, w2.transpose(1, 2), offs=offsets)


# The batched products over gathered weights, per spelling: (x [T, D], w13[expert_idx] [T, k, 2I, D]) -> [T, k, 2I]
# and (a [T, k, I], w2[expert_idx] [T, k, D, I]) -> [T, k, D].
GATHERED_PRODUCTS = {
    "einsum": (lambda x, w: torch.einsum("td,tkod->tko", x, w), lambda a, w: torch.einsum("tki,tkdi->tkd", a, w)),
    "matmul": (lambda x, w: (w @ x[:, None, :, None]).squeeze(-1), lambda a, w: (w @ a[..., None]).squeeze(-1)),
}


def gathered_experts(x, expert_idx, weights, w13, w2, limit, quant_block, spelling):
    """The routed experts on gathered weights: x [T, D] bf16, expert_idx [T, k] int64, weights [T, k] fp32 (None:
    unweighted), w13 [E, 2I, D], w2 [E, D, I] -> [T, k, D] bf16, pair (t, j) on expert expert_idx[t, j]."""
    up, down = GATHERED_PRODUCTS[spelling]
    inter = w2.shape[2]
    gu = up(x, w13[expert_idx])
    return down(_activation(gu[..., :inter], gu[..., inter:], weights, limit, quant_block, x.dtype), w2[expert_idx])


def gathered_split_experts(x, expert_idx, weights, w1, w3, w2, limit, quant_block, spelling, joined):
    """As `gathered_experts` with w1 [E, I, D] and w3 [E, I, D] held apart (gpt-fast's `ConditionalFeedForward`):
    a product each, or (joined) one product over their gathers joined along I, cat(w1[e], w3[e]) = w13[e]."""
    up, down = GATHERED_PRODUCTS[spelling]
    if joined:
        gu = up(x, torch.cat([w1[expert_idx], w3[expert_idx]], dim=2))
        g, u = gu[..., :w1.shape[1]], gu[..., w1.shape[1]:]
    else:
        g, u = up(x, w1[expert_idx]), up(x, w3[expert_idx])
    return down(_activation(g, u, weights, limit, quant_block, x.dtype), w2[expert_idx])


def flat_pair_experts(x, expert_idx, weights, w13, w2, limit, quant_block):
    """The gathered experts over the S = T * k (token, slot) pairs flattened (HF's `batched_mm` experts, a per-pair
    loop batched): row p = t * k + j is x[t] with pair (t, j)'s expert weights, x [T, D] bf16, expert_idx [T, k],
    weights [T, k] fp32 (None: unweighted), w13 [E, 2I, D], w2 [E, D, I] -> [S, D] bf16 rows in pair order,

        gu[p] = w13[ids[p]] @ x[p // k]   (bmm over [S, 2I, D] and [S, D, 1]),  ids = expert_idx.reshape(S)
        out[p] = w2[ids[p]] @ a[p],  a as `_activation` of gu's halves with weights.reshape(S)."""
    t, k = expert_idx.shape
    flat_weights = None if weights is None else weights.reshape(t * k)
    return _row_products(x.repeat_interleave(k, 0), expert_idx.reshape(t * k), flat_weights, w13, w2, limit,
                         quant_block)


def per_row_experts(x, token, expert_idx, row_weights, w13, w2, limit, quant_block):
    """Each of M rows on its own expert's gathered weights, rows x[token] (an export-style decode that sorts the
    pairs but, without `_grouped_mm`, gathers each sorted row's expert weights): x [T, D] bf16, token [M], expert_idx
    [M] (row m's expert), row_weights [M] fp32 (None: unweighted), w13 [E, 2I, D], w2 [E, D, I] -> [M, D] bf16."""
    return _row_products(x[token], expert_idx, row_weights, w13, w2, limit, quant_block)


def _row_products(rows, ids, row_weights, w13, w2, limit, quant_block):
    """out[m] = w2[ids[m]] @ a[m], a = `_activation` of the halves of gu[m] = w13[ids[m]] @ rows[m] (bmm over the
    gathered [M, 2I, D] and [M, D, I] weights): rows [M, D] -> [M, D]."""
    inter = w2.shape[2]
    gu = torch.bmm(w13[ids], rows.unsqueeze(-1)).squeeze(-1)
    a = _activation(gu[:, :inter], gu[:, inter:], row_weights, limit, quant_block, rows.dtype)
    return torch.bmm(w2[ids], a.unsqueeze(-1)).squeeze(-1)


class MoeExpertsPass(FusionPass):
    name = "moe_experts"
    form_type = ExpertsForm
    int_ranges = {"token": lambda metas, free: (0, metas["x"].shape[0]),
                  "expert_idx": lambda metas, free: (0, metas["w2"].shape[0])}
    reductions = {"E": Reduction({"w13": 0, "w1": 0, "w3": 0, "w2": 0, "offsets": 0}, REDUCED_EXPERTS)}
    # a formulation computed with other ops may round g, u or a to the neighbouring bf16 and so flip an FP8 step
    tolerance = {torch.bfloat16: (2.0**-5, 2.0**-6)}

    def patterns(self):
        c = self.config
        pats = [_sorted_pattern(ExpertsForm(Layout.SORTED, fp8, weighted, split, rows_given), c.swiglu_limit,
                                c.fp8_block if fp8 else 0)
                for rows_given in (False, True) for split in (False, True) for fp8 in (True, False)
                for weighted in (True, False)]
        for spelling in GATHERED_PRODUCTS:
            for quant_block, fp8 in ((c.fp8_block, "_fp8"), (0, "")):
                def gathered(x, expert_idx, weights, w13, w2, quant_block=quant_block, spelling=spelling):
                    return gathered_experts(x, expert_idx, weights, w13, w2, c.swiglu_limit, quant_block, spelling)

                def gathered_unweighted(x, expert_idx, w13, w2, quant_block=quant_block, spelling=spelling):
                    return gathered_experts(x, expert_idx, None, w13, w2, c.swiglu_limit, quant_block, spelling)

                def form(layout, weighted, split=False, joined=False):
                    return ExpertsForm(layout, bool(fp8), weighted, split,
                                       products=spelling if layout is Layout.PAIRS else None, joined=joined)

                weighted_forms = [(f"{GATHERED}_{spelling}{fp8}", gathered, _gathered_inputs,
                                   form(Layout.PAIRS, True))]
                unweighted_forms = [(f"{GATHERED}_{spelling}{fp8}_unweighted", gathered_unweighted,
                                     _without_weights(_gathered_inputs), form(Layout.PAIRS, False))]
                for joined, cat in ((False, ""), (True, "_cat")):
                    def split(x, expert_idx, weights, w1, w3, w2, quant_block=quant_block, spelling=spelling,
                              joined=joined):
                        return gathered_split_experts(x, expert_idx, weights, w1, w3, w2, c.swiglu_limit, quant_block,
                                                      spelling, joined)

                    def split_unweighted(x, expert_idx, w1, w3, w2, quant_block=quant_block, spelling=spelling,
                                         joined=joined):
                        return gathered_split_experts(x, expert_idx, None, w1, w3, w2, c.swiglu_limit, quant_block,
                                                      spelling, joined)

                    weighted_forms.append((f"{GATHERED}_{spelling}_{SPLIT}{cat}{fp8}", split, _split_inputs,
                                           form(Layout.PAIRS, True, True, joined)))
                    unweighted_forms.append((f"{GATHERED}_{spelling}_{SPLIT}{cat}{fp8}_unweighted", split_unweighted,
                                             _without_weights(_split_inputs), form(Layout.PAIRS, False, True, joined)))
                if spelling == "einsum":  # the flat pairs' form has one spelling (bmm; matmul normalises to it)
                    def flat(x, expert_idx, weights, w13, w2, quant_block=quant_block):
                        return flat_pair_experts(x, expert_idx, weights, w13, w2, c.swiglu_limit, quant_block)

                    def flat_unweighted(x, expert_idx, w13, w2, quant_block=quant_block):
                        return flat_pair_experts(x, expert_idx, None, w13, w2, c.swiglu_limit, quant_block)

                    weighted_forms.append((f"{GATHERED}_{FLAT}{fp8}", flat, _gathered_inputs,
                                           form(Layout.FLAT_PAIRS, True)))
                    unweighted_forms.append((f"{GATHERED}_{FLAT}{fp8}_unweighted", flat_unweighted,
                                             _without_weights(_gathered_inputs), form(Layout.FLAT_PAIRS, False)))

                    def per_row(x, token, expert_idx, row_weights, w13, w2, quant_block=quant_block):
                        return per_row_experts(x, token, expert_idx, row_weights, w13, w2, c.swiglu_limit,
                                               quant_block)

                    def per_row_unweighted(x, token, expert_idx, w13, w2, quant_block=quant_block):
                        return per_row_experts(x, token, expert_idx, None, w13, w2, c.swiglu_limit, quant_block)

                    weighted_forms.append((f"{GATHERED}_{PER_ROW}{fp8}", per_row, _per_row_inputs,
                                           form(Layout.PER_ROW, True)))
                    unweighted_forms.append((f"{GATHERED}_{PER_ROW}{fp8}_unweighted", per_row_unweighted,
                                             _without_row_weights(_per_row_inputs), form(Layout.PER_ROW, False)))
                for name, search, inputs, pattern_form in weighted_forms + unweighted_forms:
                    # at one token the batched product's broadcast x needs no contiguous copy: another form
                    pats.append(Pattern(name, search, inputs, variants=(lambda inputs=inputs: inputs(1),),
                                        anchor=aten.bmm.default, form=pattern_form))
        return pats

    def check(self, m):
        rows = m.inputs[1].meta["val"].numel()
        if rows > MAX_ROWS:
            return f"rows: M = T*k = {rows} > {MAX_ROWS} (small-row kernel); the _grouped_mm path stays"
        return None

    def wider(self, index):
        """A formulation on given rows is widened by the same one on x[token] (the gather inside the op)."""
        forms = [p.form for p in self._patterns.patterns]
        if not forms[index].rows_given:
            return ()
        return (forms.index(dataclasses.replace(forms[index], rows_given=False)),)

    def sample_inputs(self, m, draws):
        """As the base class, with the first token's routing weights zero, so its activation rows are all-zero FP8
        blocks, where the amax floor (1e-4) decides the scale (without it 0 / 0 is NaN); for the sorted rows, valid
        offsets over the drawn experts: random expert row counts (some zero) that sum to M."""
        values = super().sample_inputs(m, draws)
        named = dict(zip(m.pattern.input_names(), m.inputs))
        weights = named.get("row_weights", named.get("weights"))
        if weights is not None and leaves([weights])[0] in values:
            values[leaves([weights])[0]][0] = 0
        if m.pattern.form.layout is not Layout.SORTED:
            return values
        offsets = values[named["offsets"]]  # [E] at the drawn experts' count
        rows = named.get("token", named.get("rows")).meta["val"].shape[0]
        ids = torch.randint(0, len(offsets), (rows,), generator=draws.generator(offsets.device), device=offsets.device)
        values[named["offsets"]] = torch.cumsum(torch.bincount(ids, minlength=len(offsets)), 0).to(torch.int32)
        return values

    def replacement(self, m):
        form = m.pattern.form
        quant_block = self.config.fp8_block if form.fp8 else 0
        tail, kernel = (self.config.swiglu_limit, quant_block), self.config.kernel
        if form.layout is Layout.SORTED:
            return _sorted_formulation_replacement(dict(zip(m.pattern.input_names(), m.inputs)), tail, kernel)
        inputs = list(m.inputs)
        if form.layout is Layout.PER_ROW:
            return _per_row_replacement(inputs, form.weighted, tail, kernel)
        w3 = None
        if form.split:  # the inputs end in w1, w3, w2
            w1, w3, w2 = inputs[-3:]
            w13 = _stacked_halves(w1, w3)
            w13, w3 = (w1, w3) if w13 is None else (w13, None)  # apart: the op takes both as stored
            inputs[-3:] = [w13, w2]
        return _sorted_replacement(inputs, form.weighted, tail, kernel, w3, rows_out=form.layout is Layout.FLAT_PAIRS)


def _sorted_formulation_replacement(named, tail, kernel):
    """The op for a sorted formulation whose inputs are `named` (see `_sorted_pattern`): rows given are the op's x,
    row m its own token (token = 0, 1, ..., M - 1); unweighted, weights of 1; w1 and w3 apart go in as w13 and w3,
    or as the one stacked value whose two halves they are."""
    if "token" in named:
        x, token = named["x"], named["token"]
    else:
        x = named["rows"]
        token = pair_tokens(Derived(aten.select.int, (x, 1, 0)), 1)
    row_weights = named["row_weights"] if "row_weights" in named else _ones(token)
    w13, w3 = named.get("w13"), None
    if w13 is None:
        w13 = _stacked_halves(named["w1"], named["w3"])
        w13, w3 = (named["w1"], named["w3"]) if w13 is None else (w13, None)
    return Replacement(torch.ops.dsv41.moe_experts.default,
                       (x, token, row_weights, named["offsets"], w13, named["w2"], *tail, w3, kernel), (None,))


def _ones(like):
    """[M] fp32 ones, the row weights of an unweighted formulation (`a * 1.0` is `a`, exact)."""
    return Derived(prims.convert_element_type.default, (Derived(aten.ones_like.default, (like,)), torch.float32))


def _pairs(expert_idx):
    """(T, k) of the [T, k] ids of a gathered match; ids bound with extra unit dims (`[B = 1, S = 1, k]`, which the
    pattern reads as `[1, k]`) count their leading dims as tokens."""
    shape = expert_idx.meta["val"].shape
    return math.prod(shape[:-1]), shape[-1]


def pair_tokens(per_pair, k):
    """The token of each (token, slot) pair in pair order, p // k for p in [0, T * k) (the pair indices as the
    cumsum of ones less one): [T * k] int64 on the device of per_pair, any [T * k] value (a Derived needs a graph
    value to compute from)."""
    ones = Derived(aten.ones_like.default, (per_pair,), (("dtype", torch.int64),))
    pair = Derived(aten.sub.Tensor, (Derived(aten.cumsum.default, (ones, 0)), 1))
    return Derived(aten.div.Tensor_mode, (pair, k), (("rounding_mode", "floor"),))


def _sorted_replacement(inputs, weighted, tail, kernel, w3=None, rows_out=False):
    """The op on the sorted rows of a gathered match (see the module): x, expert_idx [T, k], (weights [T, k],) w13,
    w2 (and w3 where w1 and w3 are apart: w13 is w1) -> the op's [T * k, D] rows, put back in (t, j) order as
    [T, k, D] (rows_out: as [T * k, D], the flat pairs' form)."""
    x, expert_idx, *rest = inputs
    t, k = _pairs(expert_idx)
    rows, dim = t * k, x.meta["val"].shape[-1]
    flat = Derived(aten.reshape.default, (expert_idx, [rows]))
    weights = Derived(aten.reshape.default, (rest[0], [rows])) if weighted else None

    def pair_token(order):  # pair p = t * k + j is token t's
        return Derived(aten.div.Tensor_mode, (order, k), (("rounding_mode", "floor"),))

    return _expert_sorted(x, flat, pair_token, weights, rest[-2], rest[-1], w3, tail, kernel,
                          [rows, dim] if rows_out else [t, k, dim])


def _per_row_replacement(inputs, weighted, tail, kernel):
    """The op on the rows of a per-row match sorted by expert (see the module): x, token [M], expert_idx [M],
    (row_weights [M],) w13, w2 -> the op's [M, D] rows in the graph's row order."""
    x, token, expert_idx, *rest = inputs
    rows, dim = expert_idx.meta["val"].shape[0], x.meta["val"].shape[-1]

    def row_token(order):
        return Derived(aten.index.Tensor, (token, [order]))

    return _expert_sorted(x, expert_idx, row_token, rest[0] if weighted else None, rest[-2], rest[-1], None, tail,
                          kernel, [rows, dim])


def _expert_sorted(x, ids, token_of, row_weights, w13, w2, w3, tail, kernel, shape):
    """The op on M rows sorted by expert, each weight as the graph stores it: row m (in the graph's order) is token
    token_of(m) on expert ids[m] [M] at weight row_weights[m] [M] (None: 1); order = argsort(ids, stable=True), the
    op's token = token_of(order) (token_of maps row positions to tokens), its offsets the cumsum of the per-expert
    counts, its rows put back in the graph's order by the inverse permutation and viewed `shape`."""
    order = Derived(aten.argsort.stable, (ids,), (("stable", True),))
    ones = Derived(aten.ones_like.default, (ids,), (("dtype", torch.int32),))
    counts = Derived(aten.scatter_add.default, (_per_expert_zeros(w2), 0, ids, ones))
    offsets = Derived(aten.cumsum.default, (counts, 0), (("dtype", torch.int32),))
    weights = Derived(aten.index.Tensor, (row_weights, [order])) if row_weights is not None else _ones(order)
    inverse = Derived(aten.argsort.stable, (order,), (("stable", True),))

    def in_graph_order(out):
        rows = Derived(aten.index.Tensor, (out, [inverse]))
        return rows if len(shape) == 2 else Derived(aten.view.default, (rows, shape))

    return Replacement(torch.ops.dsv41.moe_experts.default,
                       (x, token_of(order), weights, offsets, w13, w2, *tail, w3, kernel), (in_graph_order,))


def _per_expert_zeros(w2):
    """[E] int32 zeros, one per expert of w2 [E, D, I] (its count read from w2's value, not written into the graph as
    a number, so a semantic check on fewer experts counts over those)."""
    experts = Derived(aten.select.int, (Derived(aten.select.int, (w2, 2, 0)), 1, 0))
    return Derived(aten.zeros_like.default, (experts,), (("dtype", torch.int32),
                                                          ("memory_format", torch.contiguous_format)))


def _stacked_halves(w1, w3):
    """The graph value [E, 2I, D] whose dim-1 halves w1 = w13[:, :I] and w3 = w13[:, I:] are (slices of one value),
    or None: then w1 and w3 are held apart."""
    if not all(isinstance(w, fx.Node) and w.target is aten.slice.Tensor for w in (w1, w3)):
        return None
    (root, dim1, start1, end1, *step1), (root3, dim3, start3, end3, *step3) = w1.args, w3.args
    inter, whole = w1.meta["val"].shape[1], root.meta["val"].shape
    if root is not root3 or len(whole) != 3 or whole[1] != 2 * inter or {dim1, dim3} != {1} or step1 + step3 not in ([], [1], [1, 1]):
        return None
    return root if (start1, min(end1, whole[1]), start3, min(end3, whole[1])) == (0, inter, inter, 2 * inter) else None
