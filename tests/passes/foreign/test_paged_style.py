"""The paged-KV serving-engine block (paged_style.py) through the real backend, at B = 3 and at one request, in `fx`
mode and in the default (`inductor`) mode: exactly its fused sites (each with the formulation that fused it), no
decline, no narrowed site, no fallback; each fused op runs as its `dsv41::` op in a profiled compiled step, as
often as it fused; the outputs equal eager's (h and x_new bf16 within one bf16 ulp of an fp32 reordering:
atol=rtol=1.6e-2 on at least 99% of elements, since the FP8 round trip may move a bucket; the selected pool slots
exactly), no NaN; and the compiled step writes this step's window row into the paged pool as eager does (bit-equal).

What made it fuse (each a general rule with its own unit test): `moe_route` takes the router weight held in fp32
(cached at load time) as it is; `indexer_topk` fuses the scores and their sorted top-k and leaves the engine's
translation of the selected rows through the block table to the graph (`raw_indices`), its int32 lengths widened;
the routing metadata fuses once the int32 expert-id buffer read back as int64 for the counts, and sorted as int32,
is read as the int64 ids (`passes/normalize.py`: a lossless integer round trip, a sort of a lossless narrowing)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ..harness import compile_fx
from .blocks import assert_outputs_agree, fused_formulations, fused_sites
from .paged_style import PagedStyleBlock, inputs

SITES = {"mhc_coeffs": 2, "mhc_post_pre": 2, "qkv_norm": 1, "wo_a": 1, "indexer_topk": 1, "moe_route": 1,
         "moe_metadata": 1, "moe_experts": 1, "moe_finalize": 1}
FORMULATIONS = {"mhc_coeffs": ["hc_mixes", "hc_mixes"], "mhc_post_pre": ["post_pre_einsum_post"] * 2,
                # the merged qkv_a split, both norms, the in-place interleaved RoPE on strided slices, the KV FP8 step
                "qkv_norm": ["q_kv_norm_rope_fp8"], "wo_a": ["wo_a_bmm"],
                # the scores and their sorted top-k; the block-table translation and the -1 masking stay in the graph
                "indexer_topk": ["index_source_raw"],
                # the fp32 weight read by F.linear without a cast
                "moe_route": ["route_no_temperature"],
                # the int32 ids' sort and their int64 counts read as one int64 value
                "moe_metadata": ["model"], "moe_experts": ["experts_fp8"], "moe_finalize": ["index_add_shared"]}
WINDOW_POOL = 4  # the position of window_pool among the block's inputs


@pytest.fixture(scope="module", params=[(3, "fx"), (1, "fx"), (3, "inductor"), (1, "inductor")],
                ids=["B3-fx", "B1-fx", "B3-inductor", "B1-inductor"])
def compiled(request):
    """The block compiled once per batch size and mode; (backend, [(compiled outputs, eager outputs)] on fresh
    inputs, the window pools after a compiled and an eager step on equal inputs, the dsv41:: calls of a profiled
    compiled step by name)."""
    b, mode = request.param
    block = PagedStyleBlock()
    fn, backend = compile_fx(block, mode=mode)
    with torch.no_grad():
        runs = [(fn(*x), block(*x)) for x in (inputs(seed, block, b=b) for seed in (1, 2, 3))]
        x, y = inputs(4, block, b=b), inputs(4, block, b=b)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(*x)
        block(*y)
    torch._dynamo.reset()
    calls = Counter(e.name for e in prof.events() if e.name.startswith("dsv41::"))
    return backend, runs, (x[WINDOW_POOL], y[WINDOW_POOL], inputs(4, block, b=b)[WINDOW_POOL]), calls


def test_sites_fused_exactly_once(compiled):
    backend, _, _, _ = compiled
    sites, report = fused_sites(backend)
    assert sites == SITES, (sites, report.declined, report.near_misses)
    assert fused_formulations(report) == FORMULATIONS, fused_formulations(report)
    assert not any(report.narrowed.values()), report.narrowed
    assert not any(report.declined.values()), report.declined


def test_each_fused_op_runs(compiled):
    assert compiled[3] == Counter({f"dsv41::{name}": n for name, n in SITES.items()})


def test_agrees_with_eager(compiled):
    assert_outputs_agree(compiled[1])


def test_writes_the_window_row_as_eager(compiled):
    got, want, before = compiled[2]
    assert not torch.equal(got, before)  # the step wrote its row
    assert torch.equal(got, want)
