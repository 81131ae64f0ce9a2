"""The gpt-fast-style MoE sublayer (gptfast_style.py) through the real backend (fx mode): exactly its sites fused
(moe_route, moe_experts as the gathered split formulation), at B = 3 and at one request, outputs equal to eager within
one bf16 ulp of an fp32 reordering on at least 99% of elements (the FP8 round trip may move a bucket), no NaN; the
combine einsum left unfused, with its record."""

from __future__ import annotations

import pytest
import torch

from ..harness import gen, rand
from .blocks import compile_and_run, fused_sites
from .gptfast_style import SITES, GptFastStyleMoE


def inputs(seed, block, b=3):
    return [rand(gen(seed), b, 1, block.dim)]


def assert_agrees(runs):
    for got, want in runs:
        close = torch.isclose(got.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)
        assert got.shape == want.shape and not got.isnan().any() and close.float().mean() >= 0.99, (~close).sum()


@pytest.mark.parametrize("b", [3, 1])
def test_sites_fused_and_agree(b):
    backend, runs = compile_and_run(GptFastStyleMoE(), lambda seed, block: inputs(seed, block, b), (1, 2))
    sites, report = fused_sites(backend)
    assert sites == SITES, (report.declined, report.near_misses)
    assert [r["pattern"] for p in report.passes if p.name == "moe_experts" for r in p.replaced] == [
        "gathered_einsum_split_fp8_unweighted"]
    # the combine's einsum is a batched product too: a moe_experts anchor, recorded as a near miss
    (combine,) = report.near_misses["moe_experts"]
    assert "at %bmm" in combine, combine
    assert report.notes["moe_finalize"].startswith("no candidate")
    assert_agrees(runs)
