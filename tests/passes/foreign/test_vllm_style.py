"""The vLLM/reference-style block (vllm_style.py) through the real backend in both modes (inductor and fx): outputs equal to eager (h and
x_new bf16 within one bf16 ulp of an fp32 reordering: atol=rtol=1.6e-2 on at least 99% of elements, since the FP8
round trip may move a bucket; the indexer's indices exactly, ascending, so the index sets agree), and every one of
its 11 sites fused, the FP8 steps inside qkv_norm and moe_experts. Sites that need the normalisations of
`dsv41.passes.normalize` beyond op-for-op matching: `torch.split` / `chunk` / `unbind` pieces (every site), the bf16
RMSNorm weight promoted by the fp32 multiply (qkv_norm, mhc_post_pre), and the reference's FP8 blocks as
`x.reshape(-1, 32)` rows (moe_experts, qkv_norm, whose kv the block also reads as `kv[:, None]`); qkv_norm's FP8
step, whose exp2 scale is a part computed another way, needs its RoPE formulation widened (`FusionPass.wider`)."""

from __future__ import annotations

import math

import pytest
import torch

from ..harness import gen, rand
from .blocks import assert_outputs_agree, compile_and_run, fused_sites
from .vllm_style import T_SITES, VllmStyleBlock

T, N = 3, 24


def inputs(seed, block):
    """x, pre_mix, the [T, rd/2, 2] (cos, sin) table, index keys, n_c (0..N visible rows)."""
    g = gen(seed)
    angle = torch.rand(T, 8, generator=g) * 2 * math.pi
    n_c = torch.randint(0, N + 1, (T,), generator=g)
    return [rand(g, T, block.hc, 64), torch.softmax(torch.randn(T, block.hc, generator=g), -1),
            torch.stack((angle.cos(), angle.sin()), dim=-1), rand(g, T, N, block.index_dim), n_c]


@pytest.fixture(scope="module")
def compiled(mode):
    """The block compiled once; (backend, [(compiled outputs, eager outputs)] on three fresh inputs)."""
    return compile_and_run(VllmStyleBlock(), inputs, (1, 2, 3), mode)


def test_every_site_is_fused(compiled):
    sites, report = fused_sites(compiled[0])
    assert sites == T_SITES, report.declined
    patterns = {p.name: [r["pattern"] for r in p.replaced] for p in report.passes}
    assert patterns["qkv_norm"] == ["q_kv_norm_rope_fp8"] and patterns["moe_experts"] == ["experts_fp8"], patterns


def test_agrees_with_eager(compiled):
    assert_outputs_agree(compiled[1])
