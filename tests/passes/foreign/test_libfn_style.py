"""The library-function-style block (libfn_style.py) through the real backend in both modes (inductor and fx), at B = 3 and at one
request: exactly its fused sites (each once, with the formulation that fused), outputs equal to eager (h and x_new
bf16 within one bf16 ulp of an fp32 reordering: atol=rtol=1.6e-2 on at least 99% of elements, since the FP8 round
trip may move a bucket; the indexer's indices exactly), no NaN.

Before its normalisations (passes/normalize.py) 10 of its 11 sites fused at B = 3 and 9 at B = 1: qkv_norm only
as its norms (`q_kv_norm_none`: the KV RoPE's `addcmul(a * cos, b, sin, value=-1)` was no subtraction), wo_a a near
miss at B = 1 (the same inverse-RoPE addcmul), and moe_metadata a near miss at its `torch.searchsorted` offsets. The
SwiGLU's 0-d tensor limit, written into the block after that measurement, left moe_experts a near miss (a
`clamp_max.Tensor` bound) before the tensor-literal rule."""

from __future__ import annotations

import pytest

from .blocks import assert_outputs_agree, compile_and_run, fused_sites
from .libfn_style import SITES, LibFnBlock, inputs

# The formulation each site fused by (the FP8 step of qkv_norm and moe_experts inside the op; the block's
# searchsorted offsets read as the model's counts; the router without a temperature division).
FORMULATIONS = {"mhc_coeffs": ["hc_mixes", "hc_mixes"], "qkv_norm": ["q_kv_norm_rope_fp8"],
                "indexer_topk": ["index_source"], "wo_a": ["wo_a_bmm"], "mhc_post_pre": ["post_pre", "post_pre"],
                "moe_route": ["route_no_temperature"], "moe_metadata": ["model"], "moe_experts": ["experts_fp8"],
                "moe_finalize": ["index_add_shared"]}


@pytest.fixture(scope="module", params=[3, 1], ids=["B3", "B1"])
def compiled(request, mode):
    """The block compiled once per batch size B; (backend, [(compiled outputs, eager outputs)] on three fresh inputs
    of B requests)."""
    return compile_and_run(LibFnBlock(), lambda seed, block: inputs(seed, block, request.param), (1, 2, 3), mode)


def test_sites_fused_exactly_once(compiled):
    sites, report = fused_sites(compiled[0])
    assert sites == SITES, (sites, report.declined, report.near_misses)
    patterns = {p.name: [r["pattern"] for r in p.replaced] for p in report.passes if p.name in SITES}
    assert patterns == FORMULATIONS, patterns


def test_agrees_with_eager(compiled):
    assert_outputs_agree(compiled[1])
