"""The DeepSeek-reference-style block (ref_style.py) through the real backend in both modes (inductor and fx): outputs equal to eager (h
and x_new bf16 within one bf16 ulp of an fp32 reordering: atol=rtol=1.6e-2 on at least 99% of elements, since the
FP8 round trip may move a bucket; the indexer's indices exactly, ascending, so the index sets agree), every site
but wo_a fused, exactly once each; wo_a declined because its weight, stored [G, in, out], would be copied into the
op's layout on every call; qkv_norm holds the window KV's FP8 round trip (`act_quant` and its dequantisation)."""

from __future__ import annotations

import pytest
import torch

from ..harness import gen, rand
from .blocks import assert_outputs_agree, compile_and_run, fused_sites
from .ref_style import T_SITES, RefStyleBlock

T, N = 3, 24


def inputs(seed, block):
    """x [T, hc, D], pre_mix [T, hc], positions [T] (< max_seq_len), index keys [T, N, ihd], n_c (0..N rows)."""
    g = gen(seed)
    a = block.args
    return [rand(g, T, a.hc_mult, a.dim), torch.softmax(torch.randn(T, a.hc_mult, generator=g), -1),
            torch.randint(0, a.max_seq_len, (T,), generator=g), rand(g, T, N, a.index_head_dim),
            torch.randint(0, N + 1, (T,), generator=g)]


@pytest.fixture(scope="module")
def compiled(mode):
    """The block compiled once; (backend, [(compiled outputs, eager outputs)] on three fresh inputs)."""
    return compile_and_run(RefStyleBlock(), inputs, (1, 2, 3), mode)


def test_every_site_is_fused(compiled):
    sites, report = fused_sites(compiled[0])
    assert sites == T_SITES, report.declined


def test_wo_a_declined_for_the_weight_copy(compiled):
    """The transposed wo_a weight binds only through views: the site is declined, naming the weight and the copy."""
    _, report = fused_sites(compiled[0])
    (why,) = report.declined["wo_a"]
    assert "is stored in the layout of the pattern's" in why and "would copy it on every call" in why, why


def test_fp8_step_is_inside_the_op(compiled):
    """The qkv_norm formulation that fused includes the window KV's FP8 round trip."""
    _, report = fused_sites(compiled[0])
    fused = {p.name: [r["pattern"] for r in p.replaced] for p in report.passes}
    assert fused["qkv_norm"] == ["q_kv_norm_rope_fp8_split"], fused


def test_agrees_with_eager(compiled):
    assert_outputs_agree(compiled[1])
