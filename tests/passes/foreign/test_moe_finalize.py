"""Foreign formulations of `moe_finalize` (combine of the expert rows + shared add), each differing from the
project's model in one named way. Each must be found exactly once and equal eager bit for bit (the op sums the
rows in index_add's row order; the weighted forms multiply in fp32 before the sum, as written), but for scatter_add
(fp32 tolerance) and the per-slot sums of rows in (token, slot) order (`slots_`: a batched product may sum a token's
k products in another order than the op's slot order; one bf16 ulp, atol 0, rtol 2^-7)."""

from __future__ import annotations

import pytest
import torch

from ..harness import assert_close, assert_found_once, gen, op_counts, rand, run_passes
from ..test_moe_finalize import D, T, inputs, slot_inputs, weighted_inputs

FUSION = "moe_finalize"


def shared_first(out, token, shared):
    """operand order: shared + combine."""
    y = torch.zeros(shared.shape[0], out.shape[1], dtype=torch.float32).index_add_(0, token, out.float())
    return (shared.float() + y).to(torch.bfloat16)


def functional_index_add(out, token, shared):
    """other spelling: torch.index_add (not in place) on new_zeros."""
    y = torch.index_add(out.new_zeros(shared.shape[0], out.shape[1], dtype=torch.float32), 0, token, out.float())
    return (y + shared.float()).to(shared.dtype)


def index_put_accumulate(out, token, shared):
    """other op: index_put_ with accumulate=True."""
    y = torch.zeros(shared.shape[0], out.shape[1], dtype=torch.float32)
    y.index_put_((token,), out.float(), accumulate=True)
    return (y + shared.float()).to(shared.dtype)


def weights_after_w2(out, token, w, shared):
    """op contract: the routing weight applied to the down-projection rows in fp32 (vLLM's order)."""
    y = torch.zeros(shared.shape[0], out.shape[1], dtype=torch.float32)
    y.index_add_(0, token, out.to(torch.float32) * w[:, None])
    return (y + shared.float()).to(torch.bfloat16)


def weights_first_operand(out, token, w, shared):
    """op contract + operand order: weight times row (w * out), the combine then shared first in the add."""
    y = torch.zeros(shared.shape[0], out.shape[1], dtype=torch.float32).index_add_(0, token, w.unsqueeze(1) * out.float())
    return (shared.float() + y).to(torch.bfloat16)


def scatter_add_view_expand(out, token):
    """layout: scatter_add over token.view(-1, 1).expand_as(rows), combine only (as under TP)."""
    rows = out.float()
    return torch.zeros(T, out.shape[1], dtype=torch.float32).scatter_add(0, token.view(-1, 1).expand_as(rows), rows)


def slots_gptfast_einsum(expert_outs, expert_weights, shared):
    """gpt-fast's Mixtral combine: rows in (token, slot) order, `einsum('tai,ta->ti')` with the routing weights."""
    y = torch.einsum("tai,ta->ti", expert_outs.float(), expert_weights)
    return (y + shared.float()).to(shared.dtype)


def slots_weights_first_type_as(rows, w, shared):
    """operand order + other spelling: w[:, :, None] * rows summed over dim -2, the shared first, `type_as`."""
    return (shared.float() + (w[:, :, None] * rows.to(torch.float32)).sum(-2)).type_as(shared)


def slots_bmm_in_place(rows, w, shared):
    """other op: `bmm(w[:, None], rows)` viewed [T, D], the shared added in place."""
    y = torch.bmm(w.unsqueeze(1), rows.float()).view(rows.shape[0], rows.shape[2])
    y.add_(shared.float())
    return y.bfloat16()


def slots_stacked_per_slot_rows(x, w, shared):
    """a user's own per-slot experts (a Python loop over the slots, each a dense product stacked to [T, k, D]),
    combined by the weighted sum over the slots."""
    rows = torch.stack([(x * (j + 1)).bfloat16() for j in range(w.shape[1])], dim=1)
    return ((rows.float() * w[..., None]).sum(dim=1) + shared.float()).to(shared.dtype)


def slots_unweighted_torch_sum(rows, shared):
    """rows weighted before w2: `torch.sum(rows.float(), 1)`, the shared added by `add_`."""
    return torch.sum(rows.float(), dim=1).add_(shared.float()).to(torch.bfloat16)


CASES = {
    "shared_first": (shared_first, inputs),
    "functional_index_add": (functional_index_add, inputs),
    "index_put_accumulate": (index_put_accumulate, inputs),
    "weights_after_w2": (weights_after_w2, weighted_inputs),
    "weights_first_operand": (weights_first_operand, weighted_inputs),
    "scatter_add_view_expand": (scatter_add_view_expand, lambda seed: inputs(seed, shared=False)),
    "slots_gptfast_einsum": (slots_gptfast_einsum, slot_inputs),
    "slots_weights_first_type_as": (slots_weights_first_type_as, slot_inputs),
    "slots_bmm_in_place": (slots_bmm_in_place, slot_inputs),
    "slots_stacked_per_slot_rows": (slots_stacked_per_slot_rows,
                                    lambda seed: [rand(gen(seed + 50), T, D, dtype=torch.float32)] + slot_inputs(seed)[1:]),
    "slots_unweighted_torch_sum": (slots_unweighted_torch_sum, lambda seed: slot_inputs(seed, weights=False)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_found_once_and_equal_to_eager(name):
    f, inputs_of = CASES[name]
    # scatter_add may sum in another order; a batched product over the slots too, before the bf16 rounding
    tol = (dict(atol=1e-6, rtol=1e-6) if name.startswith("scatter") else dict(atol=0, rtol=2**-7)
           if name.startswith("slots") else {})
    assert_found_once(f, inputs_of, FUSION, **tol)


def test_megablox_unpermute_and_its_metadata():
    """MaxText's permute / unpermute around already computed expert rows: the stable argsort of the flat ids, the
    group sizes (an int32 one-hot sum), and the rows put back by argsort(order), [T, k, D], summed with the
    routing weights by einsum, the shared expert added. moe_finalize takes the unpermute (token = order // k, the
    graph's own node, and the weights gathered by order), after which the metadata (order // k, offsets, those row
    weights) is the model's: both fuse, each once; equal to eager within one bf16 ulp (the finalize sums in row
    order)."""
    k, e = 2, 8

    def f(out, ids, w, shared):
        flat = torch.ravel(ids)
        order = torch.argsort(flat, stable=True)
        token = order // k
        offsets = torch.cumsum((flat[:, None] == torch.arange(e)).to(torch.int32).sum(0), dim=0).to(torch.int32)
        rows = (out[token].float() * 2.0).to(out.dtype)  # stands for the experts
        y = torch.einsum("tkd,tk->td", rows[torch.argsort(order)].reshape(-1, k, out.shape[1]).float(), w)
        return (y + shared.float()).to(shared.dtype), offsets

    def inputs(seed):
        g = gen(seed)
        return [torch.randn(T, 16, generator=g).bfloat16(), torch.randint(0, e, (T, k), generator=g),
                torch.rand(T, k, generator=g), torch.randn(T, 16, generator=g).bfloat16()]

    gm, report = run_passes(f, inputs(0), FUSION, "moe_metadata")
    assert report.matches == {FUSION: 1, "moe_metadata": 1}, (report.declined, report.near_misses)
    ops = op_counts(gm)
    assert ops["aten.sort"] == ops["aten.sort.stable"] == ops["aten.bmm"] == 0, gm.code
    for seed in (1, 2):
        x = inputs(seed)
        got, want = gm(*x), f(*x)
        assert torch.equal(got[1], want[1])
        assert_close(got[0], want[0], atol=1.6e-2, rtol=1.6e-2)


def test_sglang_unpermute_of_rows_weighted_before_w2_and_its_metadata():
    """SGLang's `moe_forward_native` around already computed expert rows: the top-k by a descending sort's first k,
    the counts as the column sums of a scattered [T, E] map, the stable argsort of the flat ids, the routing weights
    gathered in that order, and the rows put back by `new_x[order] = rows` into `empty_like`, viewed [T, k, D] and
    summed over k (the rows weighted before w2, so no weights), the shared expert added. The scatter by a
    permutation is the gather by its inverse (`argsort(order)`), the unweighted unpermute; moe_finalize takes it
    (token = order // k, the graph's node), after which the metadata is the model's: both fuse, each once; equal
    to eager (k = 2: a two-row sum is the same in either order)."""
    k, e = 2, 8

    def f(out, scores, shared):
        ids = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        counts = ids.new_zeros(scores.shape).scatter_(1, ids, 1).sum(dim=0)
        order = ids.reshape(-1).argsort(stable=True)
        offsets = counts.cumsum(dim=0).to(torch.int32)
        row_weights = scores.gather(1, ids).view(-1)[order]
        rows = (out[order // k].float() * row_weights[:, None]).to(out.dtype)  # stands for the experts
        new_x = torch.empty_like(rows)
        new_x[order] = rows
        y = new_x.view(-1, k, out.shape[1]).float().sum(dim=1)
        return y.add_(shared.float()).to(shared.dtype), offsets

    def inputs(seed):
        g = gen(seed)
        return [torch.randn(T, 16, generator=g).bfloat16(), torch.randn(T, e, generator=g),
                torch.randn(T, 16, generator=g).bfloat16()]

    gm, report = run_passes(f, inputs(0), FUSION, "moe_metadata")
    assert report.matches == {FUSION: 1, "moe_metadata": 1}, (report.declined, report.near_misses)
    ops = op_counts(gm)
    # the routing top-k, a topk after normalisation, is taken by no fusion run here (moe_route is not): its stable
    # sort is restored; the argsorts of the ids and of the order are gone
    assert ops["aten.index_put"] == ops["aten.sort"] == ops["aten.topk"] == 0, gm.code
    assert ops["aten.sort.stable"] == 1, gm.code
    for seed in (1, 2):
        x = inputs(seed)
        got, want = gm(*x), f(*x)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])



def into_shared_output(out, token, w, shared):
    """TorchTitan's spelling of the combine into the shared output: the index by `reshape(-1, 1).expand(-1, D)`,
    `scatter_add` by keywords, the weights by `reshape(-1, 1)` (`out = shared_experts(x); out.scatter_add(dim=0,
    index=..., src=routed_output)`), in fp32, one cast after."""
    rows = out.float() * w.reshape(-1, 1)
    index = token.reshape(-1, 1).expand(-1, out.shape[1])
    return shared.float().scatter_add(dim=0, index=index, src=rows).to(shared.dtype)


def test_titan_combine_into_the_shared_output():
    """Found once, the scatter_add gone; equal to eager within one bf16 ulp (the op adds the shared row last, the
    graph first: fp32 reordering before the one rounding); no NaN."""
    gm, report = run_passes(into_shared_output, weighted_inputs(0), FUSION)
    assert report.matches == {FUSION: 1} and op_counts(gm)["dsv41.moe_finalize"] == 1, report.near_misses
    assert op_counts(gm)["aten.scatter_add"] == 0, gm.code
    for seed in (1, 2):
        x = weighted_inputs(seed)
        got = gm(*x)
        assert not got.isnan().any()
        assert_close(got, into_shared_output(*x), atol=2 ** -7, rtol=2 ** -7)
