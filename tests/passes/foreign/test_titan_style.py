"""The TorchTitan-style block (titan_style.py) through the real backend (fx mode), at B = 3 and at one request:
exactly its fused sites (each once, with the formulation that fused), outputs equal to eager (h and x_new bf16
within one bf16 ulp of an fp32 reordering: atol=rtol=1.6e-2 on at least 99% of elements, since the FP8 round trip may
move a bucket; the indexer's indices exactly), no NaN; and the unfused moe_experts with its records."""

from __future__ import annotations

import pytest
import torch

from ..harness import gen, rand
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
def compiled(request):
    """The block compiled once per batch size; (backend, [(compiled outputs, eager outputs)] on fresh inputs)."""
    b = request.param
    return compile_and_run(TitanStyleBlock(), lambda seed, block: inputs(seed, block, b), (1, 2, 3))


def test_sites_fused_exactly_once(compiled):
    sites, report = fused_sites(compiled[0])
    assert sites == SITES, (sites, report.declined, report.near_misses)
    patterns = {p.name: [r["pattern"] for r in p.replaced] for p in report.passes}
    assert patterns["qkv_norm"] == ["q_kv_norm_rope_fp8_split"] and patterns["wo_a"] == ["wo_a_einsum"], patterns
    # histc's counts read as the model's int32 scatter_add counts; the combine accumulated into the shared output
    assert patterns["moe_metadata"] == ["model"], patterns
    assert patterns["moe_finalize"] == ["scatter_add_weighted_into_shared"], patterns


def test_grouped_experts_with_w1_w3_apart_stay_unfused(compiled):
    """GroupedExperts' separate w1 / w3 parameters: no moe_experts formulation binds them (the op's stacked w13
    would be a cat copying every expert's weights per call), so each of the three grouped GEMMs is a near miss
    where the pattern slices GEMM1's output into its w1 / w3 halves."""
    _, report = fused_sites(compiled[0])
    assert report.matches["moe_experts"] == 0 and not report.declined.get("moe_experts")
    misses = report.near_misses["moe_experts"]
    assert len(misses) == 3 and all(
        "expected aten::slice.Tensor, found %_grouped_mm" in m and "(moe.experts)" in m for m in misses), misses


def test_agrees_with_eager(compiled):
    assert_outputs_agree(compiled[1])
