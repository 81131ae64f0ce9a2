"""The TorchTitan-style block (titan_style.py) through the real backend in both modes (inductor and fx), at B = 3 and at one request:
exactly its fused sites (each once, with the formulation that fused), outputs equal to eager (h and x_new bf16
within one bf16 ulp of an fp32 reordering: atol=rtol=1.6e-2 on at least 99% of elements, since the FP8 round trip may
move a bucket; the indexer's indices exactly), no NaN; and moe_experts on GroupedExperts' w1 and w3 parameters in
place."""

from __future__ import annotations

import pytest
import torch

from ..harness import gen, rand, run_passes
from .blocks import assert_outputs_agree, compile_and_run, fused_sites
from .titan_style import SITES, TitanStyleBlock

N = 24


def inputs(seed, block, b):
    """x [B, 1, hc, D], pre_mix [B, 1, hc], positions [B] (< max_seq_len), index keys [B, N, ihd], n_c (0..N)."""
    g, a = gen(seed), block.args
    return [rand(g, b, 1, a.hc_mult, a.dim), torch.softmax(torch.randn(b, 1, a.hc_mult, generator=g), -1),
            torch.randint(0, a.max_seq_len, (b,), generator=g), rand(g, b, N, a.index_head_dim),
            torch.randint(0, N + 1, (b,), generator=g)]


@pytest.fixture(scope="module", params=[3, 1], ids=["B3", "B1"])
def compiled(request, mode):
    """The block compiled once per batch size; (backend, [(compiled outputs, eager outputs)] on fresh inputs)."""
    b = request.param
    return compile_and_run(TitanStyleBlock(), lambda seed, block: inputs(seed, block, b), (1, 2, 3), mode)


def test_sites_fused_exactly_once(compiled):
    sites, report = fused_sites(compiled[0])
    assert sites == SITES, (sites, report.declined, report.near_misses)
    patterns = {p.name: [r["pattern"] for r in p.replaced] for p in report.passes}
    assert patterns["qkv_norm"] == ["q_kv_norm_rope_fp8_split"] and patterns["wo_a"] == ["wo_a_einsum"], patterns
    # histc's counts read as the model's int32 scatter_add counts; the combine accumulated into the shared output
    assert patterns["moe_metadata"] == ["model"], patterns
    assert patterns["moe_finalize"] == ["scatter_add_weighted_into_shared"], patterns
    # w1 and w3 apart, the routed rows FP8-rounded after the gather (given rows), weighted after w2
    assert patterns["moe_experts"] == ["experts_split_rows_fp8_unweighted"], patterns


def test_grouped_experts_take_w1_and_w3_in_place():
    """The experts' op reads GroupedExperts' w1 and w3 parameters themselves (its w13 and w3 arguments are the
    parameters' nodes: no cat, no copy of the experts' weights) and w2 likewise; no grouped GEMM is left."""
    block = TitanStyleBlock()
    with torch.no_grad():
        gm, report = run_passes(block, inputs(0, block, 3))
    assert report.matches["moe_experts"] == 1
    (op,) = gm.graph.find_nodes(op="call_function", target=torch.ops.dsv41.moe_experts.default)
    w1, w2, w3 = op.args[4], op.args[5], op.args[8]
    experts = block.moe.experts
    assert all(w.op == "get_attr" for w in (w1, w2, w3)), gm.code
    assert [getattr(gm, w.target).data_ptr() for w in (w1, w2, w3)] == [
        experts.w1.data_ptr(), experts.w2.data_ptr(), experts.w3.data_ptr()]
    assert [tuple(w.meta["val"].shape) for w in (w1, w3, w2)] == [(8, 32, 64), (8, 32, 64), (8, 64, 32)]
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten._grouped_mm.default), gm.code


def test_agrees_with_eager(compiled):
    assert_outputs_agree(compiled[1])
