"""`moe_metadata`: the stable argsort of the flat expert ids, `order // k`, the per-expert counts and their cumsum,
and the gather of the row weights -> dsv41::moe_metadata, found on synthetic graphs and in the tiny model (fx mode).

Every formulation the pass lists has a test (the unstable argsort is listed to be declined). The op's reference is
the model's own ops, and every output is an integer or a gathered value, so the fused graph equals eager exactly.
"""

from __future__ import annotations

import operator

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from dsv41.lowerings.moe_metadata import reference
from dsv41.models import TINY, DSV41Model
from dsv41.passes.moe_metadata import UNSTABLE

from .harness import aten_graph, assert_close, config, gen, graph_text, make_backend, op_counts, pattern_names, \
    run_declined, run_fused_once, run_passes

FUSION, OP = "moe_metadata", "dsv41.moe_metadata"
T, K, E = 3, 6, 16
GONE = ("aten.sort.stable", "aten.cumsum", "aten.index.Tensor", "aten.div.Tensor_mode")


def inputs(seed, t=T, k=K, e=E):
    """Flat ids of a routing (every other expert gets no pair, so equal ids abound) and their weights."""
    g = gen(seed)
    return [torch.randint(0, e // 2, (t * k,), generator=g) * 2, torch.rand(t * k, generator=g)]


def model(flat_e, flat_w, k=K, e=E):
    return reference(flat_e, flat_w, k, e)


def index_add(flat_e, flat_w):
    """The model's, with the int32 counts by index_add_."""
    order = torch.argsort(flat_e, stable=True)
    counts = torch.zeros(E, dtype=torch.int32).index_add_(0, flat_e, torch.ones_like(flat_e, dtype=torch.int32))
    return order.div(K, rounding_mode="floor"), torch.cumsum(counts, 0, dtype=torch.int32), flat_w[order]


def int64_counts(count):
    """int64 counts by `count(flat_e)`, their int64 cumsum cast to int32; sort(stable=True).indices and `//`."""
    def metadata(flat_e, flat_w):
        order = torch.sort(flat_e, stable=True).indices
        return order // K, count(flat_e).cumsum(0).to(torch.int32), flat_w[order]
    return metadata


FORMULATIONS = {
    "model": model,
    "index_add": index_add,
    "scatter_add_int64": int64_counts(lambda e: torch.zeros(E, dtype=torch.int64).scatter_add_(0, e, torch.ones_like(e))),
    "index_add_int64": int64_counts(lambda e: torch.zeros(E, dtype=torch.int64).index_add_(0, e, torch.ones_like(e))),
    "one_hot": int64_counts(lambda e: F.one_hot(e, E).sum(0)),
}


def unstable(flat_e, flat_w):
    order = torch.argsort(flat_e)
    counts = torch.zeros(E, dtype=torch.int64).scatter_add_(0, flat_e, torch.ones_like(flat_e))
    return order // K, counts.cumsum(0).to(torch.int32), flat_w[order]


def test_every_formulation_has_a_test():
    assert pattern_names(FUSION) == set(FORMULATIONS) | {UNSTABLE}


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_formulation_is_fused(name):
    f = FORMULATIONS[name]
    gm, report, node = run_fused_once(f, inputs(0), FUSION, GONE)
    assert report.passes[1].replaced[0]["pattern"] == name
    assert node.args[2:] == (K, E, "auto")
    for seed in (1, 2):  # fresh random routings
        x = inputs(seed)
        assert_close(gm(*x), f(*x), atol=0, rtol=0)


@pytest.mark.parametrize("k, e", [(1, 4), (4, 12), (8, 384)])
def test_k_and_experts_read_from_the_graph(k, e):
    f = lambda flat_e, flat_w: model(flat_e, flat_w, k, e)  # noqa: E731
    gm, _, node = run_fused_once(f, inputs(0, k=k, e=e), FUSION, GONE)
    assert node.args[2:4] == (k, e)
    x = inputs(1, k=k, e=e)
    assert_close(gm(*x), f(*x), atol=0, rtol=0)


def from_routing(weights, experts):
    """As MoE.forward: the [T, k] routing flattened first (the op takes the ids and weights as views of it)."""
    return model(experts.flatten(), weights.flatten())


def test_flattened_routing():
    g = gen(4)
    routing = [torch.rand(T, K, generator=g), torch.randint(0, E, (T, K), generator=g)]
    gm, _ = run_passes(from_routing, routing, FUSION)
    assert op_counts(gm)[OP] == 1
    fresh = [torch.rand(T, K, generator=g), torch.randint(0, E, (T, K), generator=g)]
    assert_close(gm(*fresh), from_routing(*fresh), atol=0, rtol=0)


def tp_masked(flat_e, flat_w, start=E // 2, n_local=E // 2):
    """MoE.forward at TP > 1: pairs of other ranks' experts go to local expert 0 at weight 0 before the metadata."""
    local = (flat_e >= start) & (flat_e < start + n_local)
    return model(torch.where(local, flat_e - start, 0), torch.where(local, flat_w, 0.0), K, n_local)


def test_tp_masking_stays_outside():
    gm, report = run_passes(tp_masked, inputs(0), FUSION)
    ops = op_counts(gm)
    assert report.matches == {FUSION: 1} and ops[OP] == 1 and ops["aten.where.self"] == 2, ops
    for seed in (1, 2):
        x = inputs(seed)
        assert_close(gm(*x), tp_masked(*x), atol=0, rtol=0)


def two_layers(flat_e, flat_w):
    return (*model(flat_e, flat_w), *model((flat_e + 1) % E, flat_w * 2))


def test_two_sites_two_matches():
    gm, report = run_passes(two_layers, inputs(0), FUSION)
    assert report.matches[FUSION] == 2 and op_counts(gm)[OP] == 2 and op_counts(gm)["aten.sort.stable"] == 0
    x = inputs(3)
    assert_close(gm(*x), two_layers(*x), atol=0, rtol=0)


def test_golden():
    gm, _ = run_passes(model, inputs(0, t=2), FUSION)
    expecttest.assert_expected_inline(graph_text(gm), """\
%arg0_1: i64[12] = input
%arg1_1: f32[12] = input
%moe_metadata_default: (i64[12], i32[16], f32[12]) = dsv41.moe_metadata(%arg0_1, %arg1_1, 6, 16, 'auto')
%getitem_4: f32[12] = getitem(%moe_metadata_default, 2)
%getitem_3: i32[16] = getitem(%moe_metadata_default, 1)
%getitem_2: i64[12] = getitem(%moe_metadata_default, 0)
return [%getitem_2, %getitem_3, %getitem_4]
""")


def rows_back_in_pair_order(flat_e, flat_w, rows):
    """HF's grouped_mm experts: the sort's permutation also read outside the metadata, `inv_perm = argsort(perm,
    stable=True)` putting rows computed in expert order (here: rows[token] scaled by the row weights) back in pair
    order -> (token, offsets, row_weights, [M, D] rows in pair order)."""
    perm = torch.argsort(flat_e, stable=True)
    token = perm // K
    counts = torch.zeros(E, dtype=torch.int32).scatter_add_(0, flat_e, torch.ones_like(flat_e, dtype=torch.int32))
    row_weights = flat_w[perm]
    by_expert = rows[token] * row_weights[:, None]
    return token, torch.cumsum(counts, 0, dtype=torch.int32), row_weights, by_expert[torch.argsort(perm, stable=True)]


def test_the_permutation_read_outside_is_the_stable_argsort_of_the_ids():
    """The permutation's other reader is served by the stable argsort of the same ids, left beside the op (a stable
    sort's permutation is a function of its keys): fused once, not declined as an extra user; the graph's sort of the ids
    gone, one stable argsort of them and the sort of that permutation (its inverse) left; equal to eager exactly on fresh routings,
    where equal ids abound (so an unstable order would differ)."""
    def draw(seed):
        return [*inputs(seed), torch.randn(T, 4, generator=gen(seed + 10))]

    gm, report = run_passes(rows_back_in_pair_order, draw(0), FUSION)
    ops = op_counts(gm)
    assert report.matches == {FUSION: 1} and ops[OP] == 1, (report.declined, ops)
    # the stable argsort the replacement wrote, decomposed as Inductor's table writes it (the indices of a stable
    # sort), and the sort of that permutation (its inverse)
    recomputed, inverse = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.sort.stable)
    (order,) = [u for u in recomputed.users if u.target is operator.getitem and u.args[1] == 1]
    assert recomputed.args[0] is gm.graph.find_nodes(op="placeholder")[0] and inverse.args[0] is order
    for seed in (1, 2):
        x = draw(seed)
        assert_close(gm(*x), rows_back_in_pair_order(*x), atol=0, rtol=0)


# ---- declines ---------------------------------------------------------------------------------------------------
def test_decline_unstable_argsort():
    """An unstable argsort may order one expert's pairs in any order: other rows, so declined with that reason."""
    reasons = run_declined(unstable, inputs(0), FUSION)
    assert reasons == f"{UNSTABLE} at %sort: check: an unstable argsort orders the pairs of one expert in any order, " \
                      "so its rows (token, row_weights) are not the stable order's: a different computation, not fused"


def test_bincount_has_no_graph():
    """bincount(minlength=E) has a value-dependent output size, so it does not trace into one graph (Dynamo breaks
    the graph there): no formulation can hold it. When torch traces it, this fails and a pattern is due."""
    def with_bincount(flat_e, flat_w):
        order = torch.argsort(flat_e, stable=True)
        return order // K, torch.bincount(flat_e, minlength=E).cumsum(0).int(), flat_w[order]
    with pytest.raises(DynamicOutputShapeException, match="bincount"):
        aten_graph(with_bincount, *inputs(0))


def test_decline_token_limit():
    assert "token limit: T=3 > max_tokens=2" in run_declined(model, inputs(0), FUSION, max_tokens=2)


def test_other_counts_not_fused():
    """Counting from 1 (a different computation) is not this fusion: nothing fused, the graph left as it was."""
    def shifted(flat_e, flat_w):
        order = torch.argsort(flat_e, stable=True)
        counts = torch.zeros(E, dtype=torch.int32).scatter_add_(0, flat_e, torch.ones_like(flat_e, dtype=torch.int32))
        return order // K, torch.cumsum(counts + 1, 0, dtype=torch.int32), flat_w[order]
    gm, report = run_passes(shifted, inputs(0), FUSION)
    assert report.matches == {FUSION: 0} and op_counts(gm)["aten.sort.stable"] == 1
    x = inputs(1)
    assert_close(gm(*x), shifted(*x), atol=0, rtol=0)


# ---- the tiny model, fx mode --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_layer():
    torch.manual_seed(0)
    return DSV41Model(TINY, [0], max_batch=8, max_context=128).layers["0"].ffn


@pytest.mark.parametrize("fusions", [(FUSION,), ()], ids=["alone", "all fusions"])
@torch.no_grad()
def test_tiny_moe_layer(moe_layer, fusions):
    """The model's own MoE through the real backend (static shapes): the metadata fuses once per graph, alone and
    beside moe_route, moe_experts and moe_finalize, bit-exact with eager at T = 1, 5, 8."""
    torch._dynamo.reset()  # other test files compiled the same forward (Dynamo's recompile limit)
    backend = make_backend(config(*fusions))
    compiled = torch.compile(moe_layer.forward, backend=backend, fullgraph=True, dynamic=False)
    for t in (1, 5, 8):
        h = torch.randn(t, TINY.dim, generator=gen(t)).bfloat16()
        assert_close(compiled(h), moe_layer(h), atol=0, rtol=0)
    assert len(backend.reports) == 3
    for r in backend.reports:
        assert r.fallback is None and r.matches[FUSION] == 1
        assert r.passes[[p.name for p in r.passes].index(FUSION)].replaced[0]["pattern"] == "model"
        if not fusions:
            assert {f: r.matches[f] for f in ("moe_route", "moe_experts", "moe_finalize")} == \
                {"moe_route": 1, "moe_experts": 1, "moe_finalize": 1}
