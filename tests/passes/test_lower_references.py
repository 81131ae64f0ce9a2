"""Lowering of fused ops without a kernel to their reference decomposition (what inductor mode does on CUDA)."""

import copy

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dsv41.lowerings  # noqa: F401
from dsv41.config import Dsv41Config
from dsv41.passes.lower_references import LowerReferencesPass, lower_references
from dsv41.passes.streams import STREAM

ops = torch.ops.dsv41
T, HC, D, E = 3, 4, 32, 16


def site(y, x, post, comb, pre, w, h, gate, bias):
    x_new, h2 = ops.mhc_post_pre(y, x, post, comb, pre, w, 1e-20)
    weights, experts = ops.moe_route(h, gate, bias, 6, 1.5, 1.0)
    return x_new, h2, weights, experts


def inputs():
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    return (torch.randn(T, D, generator=g).to(bf), torch.randn(T, HC, D, generator=g).to(bf), torch.rand(T, HC, generator=g) * 2,
            torch.rand(T, HC, HC, generator=g), torch.rand(T, HC, generator=g), torch.randn(D, generator=g).to(bf),
            torch.randn(T, D, generator=g).to(bf), torch.randn(E, D, generator=g).to(bf), torch.randn(E, generator=g) * 0.1)


def dsv41_ops(gm):
    return sorted(str(n.target) for n in gm.graph.nodes if getattr(n.target, "namespace", None) == "dsv41")


def test_lowered_graph_computes_the_same():
    args = inputs()
    gm = make_fx(site, tracing_mode="fake")(*args)
    want = gm(*args)
    node = next(n for n in gm.graph.nodes if n.target is ops.moe_route.default)
    node.meta[STREAM] = 1
    result = lower_references(gm.graph, keep=set())
    gm.graph.lint()
    gm.recompile()
    assert result.matches == 2 and dsv41_ops(gm) == []
    assert {n.meta.get(STREAM) for n in gm.graph.nodes if n.name in result.replaced[1]["created"]} == {1}
    got = gm(*args)
    # bf16 outputs and the expert ids are exact; the fp32 routing weights go through the decomposed softplus,
    # which rounds differently from the eager kernel in the last bit
    for i in (0, 1, 3):
        assert torch.equal(got[i], want[i])
    torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-7)


def test_ops_with_a_kernel_stay_calls():
    gm = make_fx(site, tracing_mode="fake")(*inputs())
    lower_references(gm.graph, keep={"mhc_post_pre"})
    assert dsv41_ops(gm) == ["dsv41.mhc_post_pre.default"]


def test_pass_applies_only_to_inductor_mode_on_cuda():
    gm = make_fx(site, tracing_mode="fake")(*inputs())
    before = copy.deepcopy(gm.graph)
    for mode in ("inductor", "fx"):
        assert LowerReferencesPass(Dsv41Config(mode=mode))(gm.graph).matches == 0  # CPU graph
    assert len(gm.graph.nodes) == len(before.nodes)


def test_ops_with_arguments_after_the_tensors_lower():
    """moe_finalize with and without its routing weights and indexer_topk in mask form (optional arguments before
    `impl`): the lowered graph holds no dsv41 op and computes what the ops compute, bit-exact."""
    def f(out, token, shared, weights, q, w, keys, n_c):
        return (ops.moe_finalize(out, token, shared, T, weights, "auto"), ops.moe_finalize(out, token, None, T, None, "auto"),
                ops.indexer_topk(q, w, keys, n_c, None, 4, 0, 0, 0, True, "auto")[0])

    g = torch.Generator().manual_seed(1)
    bf = torch.bfloat16
    args = (torch.randn(2 * T, D, generator=g).to(bf), torch.arange(T).repeat_interleave(2), torch.randn(T, D, generator=g).to(bf),
            torch.rand(2 * T, generator=g), torch.randn(T, 2, 16, generator=g).to(bf), torch.rand(T, 2, generator=g),
            torch.randn(T, 12, 16, generator=g).to(bf), torch.tensor([12, 3, 0]))
    gm = make_fx(f, tracing_mode="fake")(*args)
    want = gm(*args)
    lower_references(gm.graph, set())
    gm.recompile()
    assert dsv41_ops(gm) == []
    for got, ref in zip(gm(*args), want):
        assert torch.equal(got, ref)


def test_arguments_after_impl_reach_the_reference_by_name():
    """indexer_topk's schema has `impl` before `score_scale` and `return_scores`: the reference, which takes no
    `impl`, gets the others by name (positionally the kernel's name would land in `score_scale`)."""
    g = torch.Generator().manual_seed(1)
    t, ih, ihd, n = 2, 4, 32, 24
    args = (torch.randn(t, ih, ihd, generator=g).to(torch.bfloat16), torch.rand(t, ih, generator=g),
            torch.randn(t, n, ihd, generator=g).to(torch.bfloat16), torch.tensor([n, 17]))

    def site(q, w, keys, n_c):
        return ops.indexer_topk(q, w, keys, n_c, None, 8, 128, 1, 0, False, "reference", 0.5, True)

    gm = make_fx(site, tracing_mode="fake")(*args)
    want = gm(*args)
    lower_references(gm.graph, set())
    gm.recompile()
    assert not dsv41_ops(gm)
    got = gm(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
