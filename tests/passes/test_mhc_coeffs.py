"""`mhc_coeffs`: RMS statistic + [T,4D]x[4D,24] GEMM + sigmoids + softmax + Sinkhorn -> dsv41::mhc_coeffs.

Every formulation the pass lists (`MhcCoeffsPass(config).patterns()`) has a user-written function here, traced to
the backend's ATen graph (`harness.aten_graph`) and run through the pass manager; the model's own `hc_mixes` also
goes through the real backend. The fused op computes the model's formulation, so:
- the model's formulation: bit-exact (asserted with atol=rtol=0);
- the pre-normalising / reciprocal formulation: fp32 rounding differences only, atol=1e-5, rtol=1e-4 on the
  fp32 outputs (pre, post, comb are fp32 in [0, 2]).
"""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.nn.functional as F

from dsv41.models import functional as fn

from .harness import BF16, F16, HC_EPS, ITERS, NORM_EPS, assert_close, compiled_matches, declined, gen, graph_text, \
    op_counts, pattern_names, rand, run_declined, run_fused_once, run_passes

FUSION, OP = "mhc_coeffs", "dsv41.mhc_coeffs"
T, HC, D = 3, 4, 16
N_MIX = (2 + HC) * HC


def inputs(seed, t=T, dtype=BF16):
    g = gen(seed)
    return [rand(g, t, HC, D, dtype=dtype), rand(g, N_MIX, HC * D, dtype=torch.float32, scale=(HC * D) ** -0.5),
            rand(g, N_MIX, dtype=torch.float32, scale=0.5), rand(g, 3, dtype=torch.float32, scale=0.1, mean=1.0)]


# ---- the formulations, written as a user's model would -------------------------------------------------------
def gemm_then_scale(x, w, base, scale, norm_eps=NORM_EPS, hc_eps=HC_EPS, iters=ITERS):
    """The model's: GEMM on the raw streams, then scale by the RMS statistic; Sinkhorn as c / (c.sum() + eps)."""
    t, hc, _ = x.shape
    xf = x.flatten(1).float()
    rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + norm_eps)
    return divided_heads((xf @ w.T) * rstd, base, scale, t, hc, hc_eps, iters)


def divided_heads(m, base, scale, t, hc, hc_eps, iters):
    """pre, post and comb of the mixes m, the Sinkhorn normalisations as c / (c.sum() + eps)."""
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = torch.softmax(m[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), dim=-1) + hc_eps
    c = c / (c.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + hc_eps)
        c = c / (c.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, c


def prenorm_reciprocal(x, w, base, scale, norm_eps=NORM_EPS, hc_eps=HC_EPS, iters=ITERS):
    """RMSNorm-without-weight first, then the GEMM; Sinkhorn as multiplication by the reciprocal of the sum."""
    t, hc, _ = x.shape
    xf = x.flatten(1).float()
    m = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)) @ w.t()
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = m[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc)
    c = F.softmax(logits, dim=-1) + hc_eps
    c = c * (1.0 / (c.sum(dim=-2, keepdim=True) + hc_eps))
    for _ in range(iters - 1):
        c = c * (1.0 / (c.sum(dim=-1, keepdim=True) + hc_eps))
        c = c * (1.0 / (c.sum(dim=-2, keepdim=True) + hc_eps))
    return pre, post, c


def prenorm_divide(x, w, base, scale, norm_eps=NORM_EPS, hc_eps=HC_EPS, iters=ITERS):
    """RMSNorm-without-weight first (F.linear), then Sinkhorn as the model's c / (c.sum() + eps)."""
    t, hc, _ = x.shape
    xf = x.flatten(1).float()
    m = F.linear(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps), w)
    return divided_heads(m, base, scale, t, hc, hc_eps, iters)


FORMULATIONS = {"hc_mixes": gemm_then_scale, "hc_mixes_prenorm": prenorm_reciprocal, "hc_mixes_prenorm_div": prenorm_divide}
TOL = {"hc_mixes": dict(atol=0, rtol=0), "hc_mixes_prenorm": dict(atol=1e-5, rtol=1e-4),
       "hc_mixes_prenorm_div": dict(atol=1e-5, rtol=1e-4)}


def model_mixes(x, w, base, scale):
    return fn.hc_mixes(x, w, base, scale, NORM_EPS, HC_EPS, ITERS)


def two_sites(x, w, base, scale):
    """Two mHC sites (attention and FFN of a block): the second reads streams derived from the first's output."""
    pre, post, comb = gemm_then_scale(x, w, base, scale)
    x2 = (x.float() * post.unsqueeze(-1)).to(x.dtype)
    pre2, post2, comb2 = prenorm_reciprocal(x2, w, base, scale)
    return pre + pre2, post * post2, comb @ comb2


def test_every_formulation_has_a_test():
    assert pattern_names(FUSION) == set(FORMULATIONS)


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_formulation_is_fused(name):
    f = FORMULATIONS[name]
    gone = ("aten.sigmoid", "aten.mm", "aten.rsqrt", "aten.sum.dim_IntList", "aten.div.Tensor", "aten._softmax")
    gm, report, _ = run_fused_once(f, inputs(0), FUSION, gone)
    assert report.passes[1].replaced[0]["pattern"] == name
    x = inputs(1)  # fresh inputs: the graph was traced on fake tensors of these shapes
    assert_close(gm(*x), f(*x), **TOL[name])


def test_two_sites_two_matches():
    gm, report = run_passes(two_sites, inputs(0), FUSION)
    assert report.matches[FUSION] == 2
    assert op_counts(gm)[OP] == 2 and op_counts(gm)["aten.sigmoid"] == 0
    assert sorted(r["pattern"] for r in report.passes[1].replaced) == ["hc_mixes", "hc_mixes_prenorm"]
    x = inputs(2)
    assert_close(gm(*x), two_sites(*x), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_model_function_through_the_backend():
    assert compiled_matches(model_mixes, inputs) == {FUSION: 1}


def test_golden():
    gm, _ = run_passes(model_mixes, inputs(0, t=2), FUSION)
    expecttest.assert_expected_inline(graph_text(gm), """\
%arg0_1: bf16[2, 4, 16] = input
%arg1_1: f32[24, 64] = input
%arg2_1: f32[24] = input
%arg3_1: f32[3] = input
%mhc_coeffs_default: (f32[2, 4], f32[2, 4], f32[2, 4, 4]) = dsv41.mhc_coeffs(%arg0_1, %arg1_1, %arg2_1, %arg3_1, 1e-20, 1e-06, 20, 'auto')
%getitem_2: f32[2, 4, 4] = getitem(%mhc_coeffs_default, 2)
%getitem_1: f32[2, 4] = getitem(%mhc_coeffs_default, 1)
%getitem: f32[2, 4] = getitem(%mhc_coeffs_default, 0)
return [%getitem, %getitem_1, %getitem_2]
""")


# ---- declines ---------------------------------------------------------------------------------------------------
def test_decline_token_limit():
    gm, report = run_passes(model_mixes, inputs(0, t=5), FUSION, max_tokens=4)
    assert report.matches[FUSION] == 0 and op_counts(gm)[OP] == 0
    assert "token limit" in declined(report, FUSION) and "T=5 > max_tokens=4" in declined(report, FUSION)
    gm, report = run_passes(model_mixes, inputs(0, t=4), FUSION, max_tokens=4)  # the limit itself is accepted
    assert report.matches[FUSION] == 1


def test_decline_fp16_streams():
    reasons = run_declined(model_mixes, inputs(0, dtype=F16), FUSION)
    assert "dtype" in reasons and "float16" in reasons


@pytest.mark.parametrize("what, kwargs, expected, found", [
    ("hc_eps", dict(hc_eps=1e-5), "1e-06", "1e-05"),
    ("norm_eps", dict(norm_eps=1e-6), "1e-20", "1e-06"),
])
def test_decline_other_eps(what, kwargs, expected, found):
    def f(x, w, base, scale):
        return gemm_then_scale(x, w, base, scale, **kwargs)

    reasons = run_declined(f, inputs(0), FUSION)
    assert "scalar" in reasons and f"expected {expected}, found {found}" in reasons


def test_decline_other_sinkhorn_iterations():
    def f(x, w, base, scale):
        return gemm_then_scale(x, w, base, scale, iters=10)

    gm, report = run_passes(f, inputs(0), FUSION)
    assert report.matches[FUSION] == 0 and op_counts(gm)[OP] == 0
    reasons = declined(report, FUSION)
    assert "scalar" in reasons and "20" in reasons and "10" in reasons, report.passes[1].attempts


def test_reshape_with_inferred_size_is_fused():
    """`x.reshape(t, -1)` is the same reshape as `x.flatten(1)` (a user's model may write either)."""
    def g(x, w, base, scale):
        t, hc, _ = x.shape
        xf = x.reshape(t, -1).float()  # as gemm_then_scale, with reshape(t, -1) for flatten(1)
        m = (xf @ w.T) * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + NORM_EPS)
        pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + HC_EPS
        post = 2.0 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
        return pre, post, fn.sinkhorn(m[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), ITERS, HC_EPS)

    gm, report = run_passes(g, inputs(0), FUSION)
    assert report.matches[FUSION] == 1, report.declined[FUSION]
    x = inputs(6)
    assert_close(gm(*x), g(*x), atol=0, rtol=0)


def test_config_iterations_follow_the_model():
    """The iteration count is a config constant: a model with 10 iterations fuses under sinkhorn_iters=10."""
    def f(x, w, base, scale):
        return gemm_then_scale(x, w, base, scale, iters=10)

    gm, report = run_passes(f, inputs(0), FUSION, sinkhorn_iters=10)
    assert report.matches[FUSION] == 1
    x = inputs(5)
    assert_close(gm(*x), f(*x), atol=0, rtol=0)
