"""`moe_route`: router GEMM (fp32) + sqrt-softplus + bias + top-k + gather + normalise + scale -> dsv41::moe_route.

Both formulations the pass lists (the model's, dividing the logits by gate_temp; and one without the temperature,
listed only when gate_temp == 1) have a user-written function here; k is read from the graph, route_scale and
gate_temp are checked against the config. The router weight may be held in fp32 (cached at load time, no cast in the
graph) or fp16 (cast per call) as well as bf16: the op takes it as it is; a float64 weight (which the cast rounds)
is declined.

Comparison: the experts are compared per token as sets, each weight following its expert (rows sorted by expert
id), with the tie rule: experts whose biased score equals the token's k-th largest are interchangeable. With
continuous random inputs there are no such ties, so the sets must be equal and the weights (fp32) equal within
atol=rtol=1e-6 (bit-exact in practice: the op's reference is the model's function).
"""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.nn.functional as F

from dsv41.models import functional as fn

from .harness import BF16, F16, assert_scalar_decline, compiled_matches, gen, graph_text, op_counts, pattern_names, rand, \
    run_declined, run_fused_once, run_passes

FUSION, OP = "moe_route", "dsv41.moe_route"
T, D, E, K = 3, 32, 16, 6
ROUTE_SCALE = 1.5


def inputs(seed, t=T, dtype=BF16):
    g = gen(seed)
    return [rand(g, t, D, dtype=dtype), rand(g, E, D, dtype=dtype, scale=D ** -0.5), rand(g, E, dtype=torch.float32, scale=0.1)]


def route_with_temperature(h, gate_w, bias, k=K, scale=ROUTE_SCALE, temp=1.0):
    """The model's: logits / gate_temp."""
    logits = torch.mm(h.float(), gate_w.float().t()) / temp
    scores = F.softplus(logits).sqrt()
    experts = (scores + bias).topk(k, dim=-1).indices
    w = scores.gather(1, experts)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale, experts


def route_without_temperature(h, gate_w, bias, k=K, scale=ROUTE_SCALE):
    """No temperature at all (a model without one): equal to the model's when gate_temp == 1."""
    scores = torch.sqrt(F.softplus(h.float() @ gate_w.float().T))
    experts = torch.topk(scores + bias, k, dim=-1).indices
    w = torch.gather(scores, 1, experts)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale, experts


FORMULATIONS = {"route": route_with_temperature, "route_no_temperature": route_without_temperature}


def assert_same_routing(got, want, h, gate_w, bias, k=K):
    (gw, ge), (ww, we) = got, want
    assert ge.dtype == we.dtype == torch.int64 and gw.dtype == ww.dtype == torch.float32 and ge.shape == we.shape
    biased = torch.sqrt(F.softplus(h.float() @ gate_w.float().T)) + bias
    for r in range(ge.shape[0]):
        kth = biased[r].topk(k).values[-1]
        differ = set(ge[r].tolist()) ^ set(we[r].tolist())
        assert all(biased[r, e] == kth for e in differ), f"token {r}: experts {sorted(differ)} differ, not ties"
        if not differ:
            og, ow = ge[r].argsort(), we[r].argsort()
            torch.testing.assert_close(gw[r][og], ww[r][ow], atol=1e-6, rtol=1e-6)


def test_every_formulation_has_a_test():
    assert pattern_names(FUSION) == set(FORMULATIONS)
    assert pattern_names(FUSION, gate_temp=2.0) == {"route"}  # without a temperature only when it is 1


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_formulation_is_fused(name):
    f = FORMULATIONS[name]
    gone = ("aten.topk", "aten.mm", "aten.softplus", "aten.sqrt", "aten.gather")
    gm, _, _ = run_fused_once(f, inputs(0), FUSION, gone)
    x = inputs(1)
    assert_same_routing(gm(*x), f(*x), *x)


def test_k_is_read_from_the_graph():
    def f(h, gate_w, bias):
        return route_with_temperature(h, gate_w, bias, k=4)

    gm, report = run_passes(f, inputs(0), FUSION)
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and "moe_route" in str(n.target))
    assert report.matches[FUSION] == 1 and node.args[3] == 4
    x = inputs(2)
    assert_same_routing(gm(*x), f(*x), *x, k=4)


def test_other_temperature_fuses_under_that_config():
    def f(h, gate_w, bias):
        return route_with_temperature(h, gate_w, bias, temp=2.0)

    gm, report = run_passes(f, inputs(0), FUSION, gate_temp=2.0)
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and "moe_route" in str(n.target))
    assert report.matches[FUSION] == 1 and node.args[5] == 2.0
    x = inputs(3)
    got, want = gm(*x), f(*x)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def two_layers(h, gate_w, bias):
    w1, e1 = route_with_temperature(h, gate_w, bias)
    h2 = (h.float() * w1.sum(-1, keepdim=True)).to(h.dtype)
    w2, e2 = route_without_temperature(h2, gate_w, bias)
    return w1, e1, w2, e2


def test_two_sites_two_matches():
    gm, report = run_passes(two_layers, inputs(0), FUSION)
    assert report.matches[FUSION] == 2 and op_counts(gm)[OP] == 2 and op_counts(gm)["aten.topk"] == 0
    x = inputs(4)
    got, want = gm(*x), two_layers(*x)
    assert_same_routing(got[:2], want[:2], *x)
    h2 = (x[0].float() * want[0].sum(-1, keepdim=True)).to(x[0].dtype)
    assert_same_routing(got[2:], want[2:], h2, *x[1:])


@torch.no_grad()
def test_model_router_through_the_backend():
    def router(h, gate_w, bias):
        return fn.route(h, gate_w, bias, K, ROUTE_SCALE, 1.0)

    def check(got, want, x):
        assert_same_routing(got, want, *x)

    assert compiled_matches(router, inputs, seeds=(5, 6), check=check) == {FUSION: 1}


def cached_fp32_weight(h, gate_w32, bias):
    """A serving engine's router: the weight cast to fp32 once at load time and cached, read by F.linear without a
    cast."""
    scores = F.softplus(F.linear(h.float(), gate_w32)).sqrt()
    experts = torch.topk(scores + bias, K, dim=-1).indices
    w = scores.gather(1, experts)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * ROUTE_SCALE, experts


def weight_inputs(seed, weight_dtype):
    """inputs(seed) with the router weight drawn in weight_dtype (fp32: values no bf16 holds)."""
    g = gen(seed)
    return [rand(g, T, D), rand(g, E, D, dtype=weight_dtype, scale=D ** -0.5), rand(g, E, dtype=torch.float32, scale=0.1)]


@pytest.mark.parametrize("f, weight_dtype", [(cached_fp32_weight, torch.float32),
                                             (route_without_temperature, torch.float16),
                                             (route_with_temperature, torch.float32)],
                         ids=["fp32-cached", "fp16-cast-per-call", "fp32-model"])
def test_weight_in_another_dtype_is_taken_as_it_is(f, weight_dtype):
    """A router weight held in fp32 (no cast in the graph) or in fp16 (cast per call) fuses; the op takes the
    weight itself (no copy, no cast to bf16, which would round an fp32 weight) and routes as eager on fresh weights
    of that dtype."""
    gone = ("aten.topk", "aten.mm", "aten.softplus", "aten.sqrt", "aten.gather")
    gm, _, node = run_fused_once(f, weight_inputs(0, weight_dtype), FUSION, gone)
    assert node.args[1].op == "placeholder" and node.args[1].meta["val"].dtype == weight_dtype
    for seed in (1, 2):
        x = weight_inputs(seed, weight_dtype)
        assert_same_routing(gm(*x), f(*x), *x)


def test_golden():
    gm, _ = run_passes(route_with_temperature, inputs(0, t=2), FUSION)
    expecttest.assert_expected_inline(graph_text(gm), """\
%arg0_1: bf16[2, 32] = input
%arg1_1: bf16[16, 32] = input
%arg2_1: f32[16] = input
%moe_route_default: (f32[2, 6], i64[2, 6]) = dsv41.moe_route(%arg0_1, %arg1_1, %arg2_1, 6, 1.5, 1.0, 'auto')
%getitem_3: i64[2, 6] = getitem(%moe_route_default, 1)
%getitem_2: f32[2, 6] = getitem(%moe_route_default, 0)
return [%getitem_2, %getitem_3]
""")


# ---- declines ---------------------------------------------------------------------------------------------------
def test_decline_token_limit():
    reasons = run_declined(route_with_temperature, inputs(0, t=3), FUSION, max_tokens=2)
    assert "token limit: T=3 > max_tokens=2" in reasons


def test_decline_fp16():
    reasons = run_declined(route_without_temperature, inputs(0, dtype=F16), FUSION)
    assert "dtype" in reasons and "argument 'h' must be torch.bfloat16, got torch.float16" in reasons


def test_decline_fp64_weight():
    """A float64 weight cast to fp32 per call rounds: the op takes no such weight (the reason names it)."""
    reasons = run_declined(route_without_temperature, weight_inputs(0, torch.float64), FUSION)
    assert "dtype" in reasons and "argument 'gate_weight' must be" in reasons and "got torch.float64" in reasons


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_decline_other_route_scale(name):
    reasons = run_declined(lambda h, g, b: FORMULATIONS[name](h, g, b, scale=2.5), inputs(0), FUSION)
    assert_scalar_decline(reasons, ROUTE_SCALE, 2.5)


def test_decline_other_temperature():
    reasons = run_declined(lambda h, g, b: route_with_temperature(h, g, b, temp=2.0), inputs(0), FUSION)
    assert_scalar_decline(reasons, 1.0, 2.0)


def route_unsorted(h, gate_w, bias, k=K, scale=ROUTE_SCALE):
    """TensorRT-LLM's routing methods: `topk(..., sorted=False)`, then the weights gathered by its indices."""
    scores = torch.sqrt(F.softplus(h.float() @ gate_w.float().T))
    experts = torch.topk(scores + bias, k, dim=-1, sorted=False).indices
    w = torch.gather(scores, 1, experts)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale, experts


def test_an_unsorted_topk_takes_the_ops_sorted_one():
    """The router's order is no formulation axis (`MoeRoutePass.free_topk_order`): a site's unsorted top-k, whose
    order torch leaves unspecified, fuses; the semantic check ran its region with that top-k sorted (one result of
    it), and the op's routing is the site's as per-token sets of (expert, weight) on fresh inputs."""
    gm, report = run_passes(route_unsorted, inputs(0), FUSION)
    assert report.matches[FUSION] == 1 and not report.declined[FUSION], report.declined
    replaced = next(p for p in report.passes if p.name == FUSION).replaced
    assert "argument 4: expected True, found False" in replaced[0]["verified"]  # the top-k checked as an island
    for seed in (1, 2):
        x = inputs(seed)
        assert_same_routing(gm(*x), route_unsorted(*x), *x)


def test_the_unsorted_topk_is_sorted_only_for_a_fusion_that_declares_its_order_free(monkeypatch):
    """Without the declaration (the default, which the indexer keeps: its sorted and unsorted formulations are
    different ops) the semantic check compares the region's unsorted top-k as it is, and the site is declined."""
    from dsv41.passes.moe_route import MoeRoutePass

    monkeypatch.setattr(MoeRoutePass, "free_topk_order", lambda self, form: False)
    reasons = run_declined(route_unsorted, inputs(0), FUSION)
    assert "argument 4: expected True, found False" in reasons and "differs" in reasons, reasons
