"""The gpt-fast-style MoE sublayer (gptfast_style.py) through the real backend in both modes (inductor and fx): exactly its sites fused
(moe_route, moe_experts as the gathered split formulation, moe_finalize as the per-slot einsum combine), at B = 3 and
at one request, outputs equal to eager within one bf16 ulp of an fp32 reordering on at least 99% of elements (the FP8
round trip may move a bucket), no NaN; the combine reads the experts' op's rows in place."""

from __future__ import annotations

import pytest
import torch

from ..harness import gen, rand, run_passes
from .blocks import compile_and_run, fused_formulations, fused_sites
from .gptfast_style import SITES, GptFastStyleMoE


def inputs(seed, block, b=3):
    return [rand(gen(seed), b, 1, block.dim)]


def assert_agrees(runs):
    for got, want in runs:
        close = torch.isclose(got.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)
        assert got.shape == want.shape and not got.isnan().any() and close.float().mean() >= 0.99, (~close).sum()


@pytest.mark.parametrize("b", [3, 1])
def test_sites_fused_and_agree(b, mode):
    backend, runs = compile_and_run(GptFastStyleMoE(), lambda seed, block: inputs(seed, block, b), (1, 2), mode)
    sites, report = fused_sites(backend)
    assert sites == SITES, (report.declined, report.near_misses)
    patterns = fused_formulations(report)
    assert patterns == {"moe_route": ["route_no_temperature"], "moe_experts": ["gathered_einsum_split_fp8_unweighted"],
                        "moe_finalize": ["slots_einsum_shared"]}, patterns
    # the combine's einsum, a batched product that moe_experts anchors on too, is inside moe_finalize's region
    assert report.near_misses["moe_experts"] == report.declined["moe_experts"] == [], report.near_misses
    assert_agrees(runs)


def test_combine_reads_the_experts_rows_in_place():
    """With w1 and w3 apart the experts' op takes both as stored, on the rows sorted by expert, and puts its rows back
    in pair order (a gather of its [T k, D] output by the inverse permutation), which the per-slot combine reads
    through views only; no weight is gathered or joined."""
    block = GptFastStyleMoE()
    with torch.no_grad():
        gm, report = run_passes(block, inputs(0, block))
    assert {k: v for k, v in report.matches.items() if v} == SITES
    (finalize,) = gm.graph.find_nodes(op="call_function", target=torch.ops.dsv41.moe_finalize.default)
    rows = finalize.args[0]
    while rows.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default):
        rows = rows.args[0]
    assert rows.target is torch.ops.aten.index.Tensor, gm.code
    experts = rows.args[0]
    assert experts.target is torch.ops.dsv41.moe_experts.default, gm.code
    assert [experts.args[i].op for i in (4, 5, 8)] == ["get_attr"] * 3, gm.code  # w1, w2, w3 as stored
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default), gm.code
