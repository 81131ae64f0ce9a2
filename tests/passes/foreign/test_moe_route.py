"""Foreign formulations of `moe_route` (router GEMM + sqrt-softplus + biased top-k + normalised weights), each
differing from the project's model in one named way. Each must be found exactly once and agree with eager:
experts as per-token sets with the tie rule of test_moe_route.assert_same_routing, weights within 1e-6 (a GEMM
as a batched einsum rounds in another fp32 order).
softplus written as log1p(exp(x)) equals torch's softplus (threshold 20) on logits below 20, the domain of the
random inputs here (|logits| < 5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ..harness import run_passes
from ..test_moe_route import K, ROUTE_SCALE, assert_same_routing, inputs

FUSION = "moe_route"


def normalise(w):
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * ROUTE_SCALE


def linear_router(h, gate_w, bias):
    """contraction: F.linear for the router GEMM."""
    scores = F.softplus(F.linear(h.float(), gate_w.float())).sqrt()
    experts = torch.topk(scores + bias, K).indices
    return normalise(scores.gather(1, experts)), experts


def bias_first(h, gate_w, bias):
    """operand order: bias + scores for the selection."""
    scores = torch.sqrt(F.softplus(h.float() @ gate_w.float().t()))
    experts = (bias + scores).topk(K, dim=-1).indices
    return normalise(scores.gather(1, experts)), experts


def take_along_dim(h, gate_w, bias):
    """other spelling: torch.take_along_dim for the gather of the selected scores."""
    scores = torch.sqrt(F.softplus(h.float() @ gate_w.float().t()))
    _, experts = torch.topk(scores + bias, K, dim=1)
    return normalise(torch.take_along_dim(scores, experts, dim=1)), experts


def softplus_written_out(h, gate_w, bias):
    """equal math written differently (on logits < 20): softplus as log1p(exp(x))."""
    scores = torch.log1p(torch.exp(h.float() @ gate_w.float().t())).sqrt()
    experts = torch.topk(scores + bias, K).indices
    return normalise(scores.gather(1, experts)), experts


def sqrt_as_power(h, gate_w, bias):
    """other op: the square root as softplus(x) ** 0.5."""
    scores = F.softplus(h.float() @ gate_w.float().t()) ** 0.5
    experts = torch.topk(scores + bias, K).indices
    return normalise(scores.gather(1, experts)), experts


def einsum_router(h, gate_w, bias):
    """contraction: the router GEMM as an einsum."""
    scores = torch.sqrt(F.softplus(torch.einsum("td,ed->te", h.float(), gate_w.float())))
    experts = torch.topk(scores + bias, K).indices
    return normalise(scores.gather(1, experts)), experts


def descending_sort_prefix(h, gate_w, bias):
    """other op: the top-k as the first k of a stable descending sort (SGLang-native code; the same experts but among
    tied scores, where topk's order is unspecified), scores square-rooted in place."""
    scores = F.softplus(torch.mm(h.float(), gate_w.float().t())).sqrt_()
    experts = torch.sort(scores + bias, dim=-1, descending=True, stable=True)[1][:, :K]
    return normalise(scores.gather(1, experts)), experts


CASES = {f.__name__: f for f in (linear_router, bias_first, take_along_dim, softplus_written_out,
                                 sqrt_as_power, einsum_router, descending_sort_prefix)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_found_once_and_equal_to_eager(name):
    f = CASES[name]
    gm, report = run_passes(f, inputs(0), FUSION)
    assert report.matches == {FUSION: 1}, report.declined
    x = inputs(1)
    assert_same_routing(gm(*x), f(*x), *x)


def weight_stored_transposed(h, gate_w_t, bias):
    """layout: the gate weight stored transposed, [D, E], read as `x @ W` with no transpose in the graph (the
    pattern's weight binds through the inverse of its transpose)."""
    scores = F.softplus(h.float() @ gate_w_t.float()).sqrt()
    experts = scores.add(bias).topk(K, dim=-1)[1]
    return normalise(scores.gather(1, experts)), experts


def test_weight_stored_transposed_is_found_once_and_equal_to_eager():
    def transposed(seed):
        h, gate_w, bias = inputs(seed)
        return [h, gate_w.t().contiguous(), bias]

    gm, report = run_passes(weight_stored_transposed, transposed(0), FUSION)
    assert report.matches == {FUSION: 1}, report.declined
    x, (h, gate_w, bias) = transposed(1), inputs(1)
    assert_same_routing(gm(*x), weight_stored_transposed(*x), h, gate_w, bias)


def cached_weight_softplus_written_out(h, gate_w32, bias):
    """a serving engine's: the router weight cached in fp32 (no cast in the graph), softplus as log1p(exp(x)), a part
    computed another way, so the semantic check runs on random fp32 weights (values no bf16 holds): the op must
    compute on the weight as it is."""
    scores = torch.log1p(torch.exp(F.linear(h.float(), gate_w32))).sqrt()
    experts = torch.topk(scores + bias, K).indices
    return normalise(scores.gather(1, experts)), experts


def test_cached_fp32_weight_with_a_part_computed_another_way_is_found_once_and_equal_to_eager():
    def fp32_weight(seed):
        h, gate_w, bias = inputs(seed)
        return [h, gate_w.float() + 1e-3 * torch.randn(gate_w.shape, generator=torch.Generator().manual_seed(seed)),
                bias]

    gm, report = run_passes(cached_weight_softplus_written_out, fp32_weight(0), FUSION)
    assert report.matches == {FUSION: 1}, report.declined
    (replaced,) = next(p for p in report.passes if p.name == FUSION).replaced
    assert "random draws" in replaced["verified"], replaced  # the semantic check ran and agreed
    x = fp32_weight(1)
    assert_same_routing(gm(*x), cached_weight_softplus_written_out(*x), *x)
