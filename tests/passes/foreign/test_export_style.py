"""The export-style block (export_style.py) through the real backend in both modes (inductor and fx), at B = 3 and at one request, with
its experts under `_grouped_mm` and on each sorted row's gathered weights: exactly its fused sites (each once, with
the formulation that fused), the record of the one that does not fuse, outputs equal to eager (h and x_new bf16
within one bf16 ulp of an fp32 reordering: atol=rtol=1.6e-2 on at least 99% of elements, since the FP8 round trip may
move a bucket; the indexer's indices exactly), no NaN."""

from __future__ import annotations

import re

import pytest

from .blocks import assert_outputs_agree, compile_and_run, fused_formulations, fused_sites
from .export_style import ExportStyleBlock, inputs

SITES = {"mhc_coeffs": 2, "mhc_post_pre": 2, "qkv_norm": 1, "wo_a": 1, "indexer_topk": 1, "moe_route": 1,
         "moe_metadata": 1, "moe_experts": 1, "moe_finalize": 1}
FORMULATIONS = {"mhc_coeffs": ["hc_mixes", "hc_mixes"], "mhc_post_pre": ["post_pre_einsum_post"] * 2,
                # the arange-indexed RoPE pairs read as strided slices, so the KV RoPE and FP8 step fuse too
                "qkv_norm": ["q_kv_norm_rope_fp8"], "wo_a": ["wo_a_bmm"],
                # the expanded visibility and validity comparisons read as broadcasts
                "indexer_topk": ["index_source"],
                # sort(descending)[..., :k] as topk; the bias expanded to the scores' shape as the broadcast
                "moe_route": ["route"],
                "moe_metadata": ["one_hot"], "moe_experts": ["experts_fp8"], "moe_finalize": ["scatter_add_shared"]}
# Each sorted row on its gathered expert weights: no counts, no offsets, so no routing metadata to fuse (the sort,
# `order // k` and the row weights' gather stay; the metadata op's offsets would be an output the graph never
# computes); the experts fuse as one op with each row its own expert.
GATHERED_SITES = {k: v for k, v in SITES.items() if k != "moe_metadata"}
GATHERED_FORMULATIONS = {**{k: v for k, v in FORMULATIONS.items() if k != "moe_metadata"},
                         "moe_experts": ["gathered_per_row_fp8"]}
# the metadata's one record: its count-by-scatter_add formulation matches the sort, `order // k` and the gather of
# the row weights around the anchor, then the block has no counts: nothing scatter-adds the flat ids the sort reads
METADATA_NEAR_MISS = (r"scatter_add_int64 at %sort_\d+: wrong op after 4 of 9 pattern ops: expected aten::scatter_add "
                      r"reading %view_\d+ = view.default \(an input of the pattern\), found none that matches")


@pytest.fixture(scope="module", params=[(3, True), (1, True), (3, False), (1, False)],
                ids=["B3", "B1", "B3-gathered", "B1-gathered"])
def compiled(request, mode):
    """The block compiled once per batch size and experts' form; (grouped, backend, [(compiled outputs, eager
    outputs)] on fresh inputs)."""
    b, grouped = request.param
    backend, runs = compile_and_run(ExportStyleBlock(grouped_experts=grouped),
                                    lambda seed, block: inputs(seed, block, b=b), (1, 2, 3), mode)
    return grouped, backend, runs


def test_sites_fused_exactly_once(compiled):
    grouped, backend, _ = compiled
    sites, report = fused_sites(backend)
    assert sites == (SITES if grouped else GATHERED_SITES), (sites, report.declined, report.near_misses)
    patterns = fused_formulations(report)
    assert patterns == (FORMULATIONS if grouped else GATHERED_FORMULATIONS), patterns
    assert not any(report.narrowed.values()), report.narrowed
    assert not any(report.declined.values()), report.declined


def test_metadata_without_counts_is_a_recorded_near_miss(compiled):
    grouped, backend, _ = compiled
    report = backend.reports[-1]
    if grouped:
        assert not report.near_misses.get("moe_metadata"), report.near_misses
    else:
        (record,) = report.near_misses["moe_metadata"]
        assert re.fullmatch(METADATA_NEAR_MISS, record), record


def test_agrees_with_eager(compiled):
    assert_outputs_agree(compiled[2])
