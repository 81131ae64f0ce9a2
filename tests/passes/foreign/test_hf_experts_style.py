"""The MoE sublayer with HF's experts implementations (hf_experts_style.py) through the real backend in both modes (inductor and fx), at
B = 3 and at one request: exactly its fused sites with the formulation that fused, the record of every site that
does not fuse, outputs equal to eager (bf16 within one ulp of a reordering on at least 99% of elements), no NaN."""

from __future__ import annotations

import re

import pytest
import torch

from ..harness import gen, rand
from .blocks import compile_and_run, fused_formulations, fused_sites
from .hf_experts_style import HFExpertsStyleMoE

BF16_COMBINE = ("index_add_bf16_shared at %index_add (experts): check: the combine accumulates in bf16")
# per implementation: the fused sites and their formulations
FUSED = {"grouped_mm": {"moe_route": ["route_no_temperature"], "moe_metadata": ["model"],
                        "moe_experts": ["experts_fp8_unweighted"]},
         "batched_mm": {"moe_route": ["route_no_temperature"], "moe_experts": ["gathered_flat_fp8_unweighted"]}}


@pytest.fixture(scope="module", params=[(i, b) for i in FUSED for b in (3, 1)], ids=lambda p: f"{p[0]}-B{p[1]}")
def compiled(request, mode):
    implementation, b = request.param
    backend, runs = compile_and_run(HFExpertsStyleMoE(implementation),
                                    lambda seed, block: [rand(gen(seed), b, 1, block.dim)], (1, 2), mode)
    return implementation, backend, runs, b


def test_sites_fused_exactly(compiled):
    implementation, backend, _, _ = compiled
    sites, report = fused_sites(backend)
    want = FUSED[implementation]
    assert sites == {name: len(p) for name, p in want.items()}, (report.declined, report.near_misses)
    patterns = fused_formulations(report)
    assert patterns == want, patterns


def test_bf16_combine_declined_with_its_reason(compiled):
    """HF's combine (bf16 zeros_like + index_add_ of bf16 rows, + shared in bf16) is HF's function, not the op's fp32
    sum rounded once: declined, with that reason."""
    _, backend, _, _ = compiled
    _, report = fused_sites(backend)
    assert report.matches["moe_finalize"] == 0
    assert sum(d.startswith(BF16_COMBINE) for d in report.declined["moe_finalize"]) == 1, report.declined


def test_grouped_records(compiled):
    """grouped_mm: the metadata fuses (histc over [0, E - 1], token_idx[perm], the permuted ids' counts), the sort's
    indices also read by `inv_perm = argsort(perm)` served by the stable argsort of the ids left beside the op (no
    extra user); that argsort, another anchor of the metadata, matches the pattern's sort and its indices and then
    indexes where the pattern takes `order // k` (a near miss named at that index); the histc's counts are a near
    miss of moe_finalize's scatter_add combine (int32 counts)."""
    implementation, backend, _, _ = compiled
    if implementation != "grouped_mm":
        pytest.skip("grouped_mm only")
    _, report = fused_sites(backend)
    assert not report.declined["moe_metadata"], report.declined
    (inverse,) = report.near_misses["moe_metadata"]
    assert re.fullmatch(r"model at %sort_\d+ \(experts\): wrong op after 2 of 8 pattern ops: expected "
                        r"aten::div\.Tensor_mode reading %getitem_\d+ = getitem, found %index_\d+ = index\.Tensor",
                        inverse), inverse
    (counts,) = report.near_misses["moe_finalize"]
    assert "keyword dtype: expected torch.float32, found torch.int32" in counts, counts


def test_batched_records(compiled):
    """batched_mm: the per-sample gathered experts on flat pairs (`gate_up_proj[expert_ids]` [S, 2I, D] under bmm
    with `hidden_states[token_idx]`) fuse as the flat pairs' formulation at B = 3 and 1 alike, their FP8 step's exp2
    scale computed another way than the pattern's bit-built one (no experts record); the weighted rows are no
    per-slot combine (declined by the semantic check), and the bf16 combine is declined."""
    implementation, backend, _, _ = compiled
    if implementation != "batched_mm":
        pytest.skip("batched_mm only")
    _, report = fused_sites(backend)
    assert not report.declined["moe_experts"] and not report.near_misses["moe_experts"], report.near_misses
    assert len(report.declined["moe_finalize"]) == 2
    assert sum(d.startswith("slots_einsum_shared") and "semantic" in d for d in report.declined["moe_finalize"]) == 1


def test_agrees_with_eager(compiled):
    for got, want in compiled[2]:
        close = torch.isclose(got.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)
        assert got.shape == want.shape and not got.isnan().any() and close.float().mean() >= 0.99, (~close).sum()
