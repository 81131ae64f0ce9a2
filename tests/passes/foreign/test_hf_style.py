"""The HF-style block (hf_style.py) through the real backend (fx mode): outputs equal to eager (h and x_new bf16
within one bf16 ulp of the fp32 reordering: atol=rtol=1.6e-2 on at least 99% of elements, since the FP8 round trip
may move a bucket; the indices exactly), and the sites it fuses: 7 of its 9 today. Not fused:
- moe_finalize: the routing weights come flattened from [T, k] (`weights.flatten()[:, None]`), whose layout chain
  collapses onto the [T, k] tensor, so the op's `weights` [M] input does not bind (layout-derived inputs are not
  re-derived yet);
- the ffn-side mhc_post_pre (einsum post mixing with a multiply-then-sum collapse): its region closes on the wrong
  inputs and the semantic check declines it.
`test_every_site_is_fused` states the goal and is expected to fail until both are fixed."""

from __future__ import annotations

import math

import pytest
import torch

from ..harness import compile_fx, gen, rand
from .hf_style import T_SITES, HFStyleBlock

T, N = 3, 24


def inputs(seed, block):
    g = gen(seed)
    angle = torch.rand(T, 8, generator=g) * 2 * math.pi
    n_c = torch.randint(0, N + 1, (T,), generator=g)
    return [rand(g, T, block.hc, 64), torch.softmax(torch.randn(T, block.hc, generator=g), -1), angle.cos(), angle.sin(),
            rand(g, T, N, block.index_dim), n_c]


@pytest.fixture(scope="module")
def compiled():
    """The block compiled once; (block, backend, [(compiled outputs, eager outputs)] on two fresh inputs)."""
    block = HFStyleBlock()
    fn, backend = compile_fx(block)
    with torch.no_grad():
        runs = [(fn(*x), block(*x)) for x in (inputs(seed, block) for seed in (1, 2))]
    torch._dynamo.reset()
    return block, backend, runs


FUSED_TODAY = {**T_SITES, "mhc_post_pre": 1}
del FUSED_TODAY["moe_finalize"]


def test_fused_sites(compiled):
    _, backend, _ = compiled
    report = backend.reports[-1]
    assert len(backend.reports) == 1 and report.fallback is None
    assert {k: v for k, v in report.matches.items() if v} == FUSED_TODAY, report.declined


@pytest.mark.xfail(strict=True, reason="moe_finalize weights bound through a layout chain; ffn-side mhc_post_pre")
def test_every_site_is_fused(compiled):
    _, backend, _ = compiled
    assert {k: v for k, v in backend.reports[-1].matches.items() if v} == T_SITES


def test_agrees_with_eager(compiled):
    for (gh, gx, gi), (wh, wx, wi) in compiled[2]:
        assert torch.equal(gi, wi)
        for g_, w_ in ((gh, wh), (gx, wx)):
            close = torch.isclose(g_.float(), w_.float(), atol=1.6e-2, rtol=1.6e-2)
            assert not g_.isnan().any() and close.float().mean() >= 0.99, (~close).sum()
