"""Foreign formulations of `moe_metadata` (the stable argsort of the flat expert ids, `order // k`, the per-expert
counts and their cumsum, the gather of the row weights), each differing from the project's model in one named way.
Each must be found exactly once and equal eager exactly (integer outputs and gathered values)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ..harness import assert_close, gen, op_counts, run_passes
from ..test_moe_metadata import E, FUSION, K, OP, T, inputs


def _model_counts(flat_e):
    return torch.zeros(E, dtype=torch.int32).scatter_add_(0, flat_e, torch.ones_like(flat_e, dtype=torch.int32))


def sort_indices_floor_divide(flat_e, flat_w):
    """other spellings: torch.sort(stable=True).indices, torch.floor_divide, the gather by index_select."""
    order = torch.sort(flat_e, stable=True).indices
    return torch.floor_divide(order, K), torch.cumsum(_model_counts(flat_e), 0, dtype=torch.int32), \
        flat_w.index_select(0, order)


def sort_tuple_take(flat_e, flat_w):
    """other spellings: the sort's second element as the order, the row weights by torch.take, the counts by a
    one-hot with the num_classes keyword and the cumsum's dim keyword."""
    order = flat_e.sort(dim=0, stable=True)[1]
    counts = F.one_hot(flat_e, num_classes=E).sum(dim=0)
    return order // K, torch.cumsum(counts, dim=0).int(), torch.take(flat_w, order)


def arange_comparison(flat_e, flat_w):
    """counts written out: the column sums of flat_e[:, None] == arange(E)."""
    order = flat_e.argsort(stable=True)
    counts = (flat_e[:, None] == torch.arange(E)[None, :]).long().sum(0)
    return order.div(K, rounding_mode="floor"), counts.cumsum(0).to(torch.int32), flat_w[order]


def out_of_place_scatter(flat_e, flat_w):
    """functional forms: torch.scatter_add on new_zeros (no in-place op), the cumsum as a tensor method."""
    order = torch.argsort(flat_e, stable=True)
    counts = torch.scatter_add(flat_e.new_zeros(E), 0, flat_e, torch.ones_like(flat_e))
    return order // K, counts.cumsum(0).to(torch.int32), flat_w[order]


def index_add_int32(flat_e, flat_w):
    """counts by index_add_ in int32, as the model keeps them, summed by cumsum(dtype=int32)."""
    order = torch.argsort(flat_e, stable=True)
    ones = torch.ones(flat_e.shape[0], dtype=torch.int32)
    counts = torch.zeros(E, dtype=torch.int32).index_add_(0, flat_e, ones)
    return order // K, counts.cumsum(0, dtype=torch.int32), flat_w[order]


def weights_first(flat_e, flat_w):
    """statement order: the row weights gathered and the offsets computed before the tokens."""
    order = torch.argsort(flat_e, stable=True)
    row_weights = flat_w[order]
    offsets = torch.cumsum(_model_counts(flat_e), 0, dtype=torch.int32)
    return order // K, offsets, row_weights


def one_hot_int32(flat_e, flat_w):
    """counts as `jax.nn.one_hot(ids, E, dtype=int32).sum(0)` ports it: the comparison cast to int32, which the sum
    promotes to int64; the order by torch.argsort(stable=True) of torch.ravel."""
    order = torch.argsort(torch.ravel(flat_e), stable=True)
    counts = (flat_e[:, None] == torch.arange(E)[None, :]).to(torch.int32).sum(0)
    return order // K, torch.cumsum(counts, dim=0).to(torch.int32), flat_w[order]


def index_add_int64_cumsum_int32(flat_e, flat_w):
    """counts by an int64 `index_add_` (`torch.zeros(E, dtype=torch.long)`), summed by `torch.cumsum(dtype=int32)`."""
    order = torch.argsort(flat_e, stable=True)
    counts = torch.zeros(E, dtype=torch.long).index_add_(0, flat_e, torch.ones_like(flat_e))
    return order // K, torch.cumsum(counts, 0, dtype=torch.int32), flat_w[order]


CASES = {f.__name__: f for f in (sort_indices_floor_divide, sort_tuple_take, arange_comparison, out_of_place_scatter,
                                 index_add_int32, weights_first, one_hot_int32, index_add_int64_cumsum_int32)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_found_once_and_equal_to_eager(name):
    f = CASES[name]
    gm, report = run_passes(f, inputs(0), FUSION)
    assert report.matches == {FUSION: 1} and op_counts(gm)[OP] == 1, report.declined
    for seed in (1, 2):
        x = inputs(seed)
        assert_close(gm(*x), f(*x), atol=0, rtol=0)


def routing_map(scores, flat_w):
    """Megatron-Core's dispatcher: the routing map [T, E] scattered from the top-k experts, its column sums as the
    counts (`tokens_per_expert = routing_map.sum(dim=0)`), the flat ids sorted by `torch.argsort(stable=True)`,
    the row weights by `torch.gather` on the flat weights."""
    top = torch.topk(scores, K, dim=1).indices
    routing_map = torch.zeros_like(scores).int().scatter(1, top, 1).bool()
    order = torch.argsort(top.view(-1), stable=True)
    offsets = routing_map.sum(dim=0).cumsum(0).to(torch.int32)
    return order // K, offsets, torch.gather(flat_w, 0, order)


def scores_inputs(seed):
    """Router scores [T, E] (the top-k ids from them) and flat weights [T * K]."""
    g = gen(seed)
    return [torch.randn(T, E, generator=g), torch.rand(T * K, generator=g)]


def test_routing_map_counts_found_once_and_equal_to_eager():
    gm, report = run_passes(routing_map, scores_inputs(0), FUSION)
    assert report.matches == {FUSION: 1} and op_counts(gm)[OP] == 1, report.declined
    assert op_counts(gm)["aten.scatter.value"] == 0  # the map was only counted: gone with the counts
    for seed in (1, 2):
        x = scores_inputs(seed)
        assert_close(gm(*x), routing_map(*x), atol=0, rtol=0)


def searched_offsets(search):
    """A library user's metadata (libfn_style.py): the top-k ids sorted by `torch.sort(stable=True)`, whose indices
    are the order, and the offsets found by `torch.searchsorted(sorted_ids, torch.arange(E), right=True)` (or
    `torch.bucketize(torch.arange(E), sorted_ids, right=True)`) cast to int32, the row weights by `index_select`."""
    def metadata(scores, flat_w):
        sorted_ids, order = torch.sort(torch.topk(scores, K, dim=1).indices.flatten(), stable=True)
        experts = torch.arange(E)
        found = torch.searchsorted(sorted_ids, experts, right=True) if search == "searchsorted" else \
            torch.bucketize(experts, sorted_ids, right=True)
        return order // K, found.to(torch.int32), flat_w.index_select(0, order)
    return metadata


@pytest.mark.parametrize("search", ["searchsorted", "bucketize"])
def test_searched_offsets_found_once_and_equal_to_eager(search):
    """The searched offsets of ids known to lie in [0, E) are the cumsum of their counts: fused once, no search
    left, equal to eager exactly (also on scores of two experts ahead and the rest tied)."""
    f = searched_offsets(search)
    gm, report = run_passes(f, scores_inputs(0), FUSION)
    assert report.matches == {FUSION: 1} and op_counts(gm)[OP] == 1, report.declined
    assert op_counts(gm)[f"aten.{search}.Tensor"] == 0
    tied = torch.full((T, E), -1.0).index_fill_(1, torch.tensor([E - 1, 0]), 1.0)
    for x in (scores_inputs(1), scores_inputs(2), [tied, torch.rand(T * K)]):
        assert_close(gm(*x), f(*x), atol=0, rtol=0)


def histc_counts(scores, flat_w):
    """TorchTitan's `TokenReorderer`: the counts by `torch.histc(ids.view(-1).float(), bins=E, min=0, max=E)` of the
    top-k ids (float counts), summed by `torch.cumsum(counts, dim=0, dtype=torch.int32)`, the order by
    `argsort(ids.view(-1), stable=True)`, the row weights by `view(-1)[order]`."""
    top = torch.topk(scores, K, dim=1).indices
    counts = torch.histc(top.view(-1).float(), bins=E, min=0, max=E)
    order = torch.argsort(top.view(-1), stable=True)
    return order // K, torch.cumsum(counts, dim=0, dtype=torch.int32), flat_w.view(-1)[order]


def test_histc_counts_found_once_and_equal_to_eager():
    """histc of indices known to lie in [0, E) with unit bins over [0, E] is their counts: fused once, the histc
    gone, equal to eager exactly (also where every id is one expert, all counts in one bin)."""
    gm, report = run_passes(histc_counts, scores_inputs(0), FUSION)
    assert report.matches == {FUSION: 1} and op_counts(gm)[OP] == 1, report.declined
    assert op_counts(gm)["aten.histc"] == 0
    one_expert = torch.full((T, E), -1.0).index_fill_(1, torch.tensor([E - 1, 0]), 1.0)  # ids E - 1 and 0 only
    for x in (scores_inputs(1), scores_inputs(2), [one_expert, torch.rand(T * K)]):
        assert_close(gm(*x), histc_counts(*x), atol=0, rtol=0)


def histc_counts_over(upper):
    """histc_counts with the bins over [0, upper] (E bins)."""
    def f(scores, flat_w):
        top = torch.topk(scores, K, dim=1).indices
        counts = torch.histc(top.view(-1).float(), bins=E, min=0, max=upper)
        order = torch.argsort(top.view(-1), stable=True)
        return order // K, torch.cumsum(counts, dim=0, dtype=torch.int32), flat_w.view(-1)[order]
    return f


@pytest.mark.parametrize("upper", [E - 1, E - 0.5, float(torch.nextafter(torch.tensor(E - 1.0), torch.tensor(E)))])
def test_histc_over_a_max_from_e_minus_1_to_e_is_the_counts(upper):
    """bin = floor(id * E / max) puts every id in [0, E) in its own bin for max in [E - 1, E] (HF's `max=E - 1`; E -
    1 itself by the last edge's closure): fused once, the histc gone, equal to eager exactly, also where every id is
    E - 1 or 0 (the edges)."""
    f = histc_counts_over(upper)
    gm, report = run_passes(f, scores_inputs(0), FUSION)
    assert report.matches == {FUSION: 1} and op_counts(gm)["aten.histc"] == 0, report.declined
    one_expert = torch.full((T, E), -1.0).index_fill_(1, torch.tensor([E - 1, 0]), 1.0)
    for x in (scores_inputs(1), scores_inputs(2), [one_expert, torch.rand(T * K)]):
        assert_close(gm(*x), f(*x), atol=0, rtol=0)


@pytest.mark.parametrize("upper", [E + 0.5, float(torch.nextafter(torch.tensor(float(E)), torch.tensor(E + 1.0))),
                                   E - 1.5])
def test_histc_over_a_max_outside_e_minus_1_to_e_is_not_the_counts(upper):
    """Just above E the bins are wider than 1 (some id lands a bin low); below E - 1 the id E - 1 lies above max and is
    dropped: the histc stays and no metadata fuses (a near miss at the histc); eager's counts do differ there."""
    f = histc_counts_over(upper)
    gm, report = run_passes(f, scores_inputs(0), FUSION)
    assert report.matches == {FUSION: 0} and op_counts(gm)["aten.histc"] == 1
    (miss,) = report.near_misses[FUSION]
    assert "found %histc" in miss, miss
    every_id = torch.arange(E).float()
    assert not torch.equal(torch.histc(every_id, bins=E, min=0, max=upper), torch.ones(E))


def hf_grouped_metadata(scores, flat_w):
    """HF's `grouped_mm_experts_forward` metadata: `token_idx = arange(T).unsqueeze(1).expand(-1, k).reshape(-1)`,
    `perm = argsort(ids, stable=True)`, the tokens by `token_idx[perm]`, the counts by `histc(ids[perm].float(),
    bins=E, min=0, max=E - 1)`, the row weights by `flat_w[perm]`."""
    ids = torch.topk(scores, K, dim=1).indices.reshape(-1)
    token_idx = torch.arange(T).unsqueeze(1).expand(-1, K).reshape(-1)
    perm = torch.argsort(ids, stable=True)
    counts = torch.histc(ids[perm].float(), bins=E, min=0, max=E - 1)
    return token_idx[perm], torch.cumsum(counts, dim=0, dtype=torch.int32), flat_w[perm]


def test_hf_grouped_metadata_found_once_and_equal_to_eager():
    """token_idx[perm] is perm // k (a lookup in the flattened broadcast arange), the counts of the permuted ids are
    the ids' counts: fused once, the histc and the lookups gone, equal to eager exactly."""
    gm, report = run_passes(hf_grouped_metadata, scores_inputs(0), FUSION)
    assert report.matches == {FUSION: 1} and op_counts(gm)[OP] == 1, (report.declined, report.near_misses)
    assert op_counts(gm)["aten.histc"] == op_counts(gm)["aten.index.Tensor"] == 0, gm.code
    for x in (scores_inputs(1), scores_inputs(2)):
        assert_close(gm(*x), hf_grouped_metadata(*x), atol=0, rtol=0)
