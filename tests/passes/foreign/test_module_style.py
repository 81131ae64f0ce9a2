"""The user's-own-PyTorch block (module_style.py) through the real backend in both modes (inductor and fx): outputs equal to eager (h and
x_new bf16 within one bf16 ulp of an fp32 reordering: atol=rtol=1.6e-2 on at least 99% of elements, since the FP8
round trip may move a bucket; the indexer's indices exactly, ascending, so the index sets agree), and every one of
its sites fused, exactly once each."""

from __future__ import annotations

import math

import pytest
import torch

from ..harness import gen, rand
from .blocks import assert_one_request_fuses, assert_outputs_agree, compile_and_run, fused_sites
from .module_style import T_SITES, ModuleStyleBlock

B, N = 3, 24


def inputs(seed, block, b=B):
    """x [B, 1, hc, D], pre_mix [B, 1, hc], the complex64 [B, 1, rd/2] RoPE table, index keys, n_c (0..N rows)."""
    g = gen(seed)
    angle = torch.rand(b, 1, 8, generator=g) * 2 * math.pi
    n_c = torch.randint(0, N + 1, (b,), generator=g)
    return [rand(g, b, 1, block.hc, 64), torch.softmax(torch.randn(b, 1, block.hc, generator=g), -1),
            torch.polar(torch.ones_like(angle), angle), rand(g, b, N, block.index_dim), n_c]


@pytest.fixture(scope="module")
def compiled(mode):
    """The block compiled once; (backend, [(compiled outputs, eager outputs)] on three fresh inputs)."""
    return compile_and_run(ModuleStyleBlock(), inputs, (1, 2, 3), mode)


def test_every_site_is_fused(compiled):
    sites, report = fused_sites(compiled[0])
    assert sites == T_SITES, report.declined


def test_agrees_with_eager(compiled):
    assert_outputs_agree(compiled[1])


def test_one_request(mode):
    """B = 1: every site in T_SITES fuses as at B = 3 (the last mhc_post_pre site's sublayer output, a `[1, 1, D]` value cast beside `[1, hc, 1]` weights, and wo_a's `[1, 1, rd/2]` cos/sin beside `[1, H, rd/2]` heads bind without the leading unit dim that broadcasting adds anyway)."""
    assert_one_request_fuses(ModuleStyleBlock(), inputs, T_SITES, mode)
