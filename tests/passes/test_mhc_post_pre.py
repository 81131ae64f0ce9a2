"""`mhc_post_pre`: mHC post of a sublayer output + collapse with the carried pre + the next RMSNorm
-> dsv41::mhc_post_pre.

Every formulation the pass lists has a user-written function here (broadcast-multiply-sum or einsum stream
mixing and collapse, in every combination; RMSNorm written out or as F.rms_norm, or written out rounding twice as
HF's does, which the op computes with norm_rounding="bf16_then_weight"). The fused op computes the model's formulation (broadcast-sum,
written-out norm) and the double-rounding one with the model's mixing, so those are bit-exact (atol=rtol=0); the
einsum / F.rms_norm ones sum or normalise in
another fp32 order, and both outputs are bf16: compared within bf16 tolerance (atol=rtol=1.6e-2, one bf16 ulp
at |v| <= 2).
"""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.nn.functional as F

from dsv41.models import functional as fn

from .harness import BF16, F16, NORM_EPS, assert_close, assert_scalar_decline, compiled_matches, gen, graph_text, \
    op_counts, pattern_names, rand, run_declined, run_fused_once, run_passes

FUSION, OP = "mhc_post_pre", "dsv41.mhc_post_pre"
T, HC, D = 3, 4, 32
BF16_TOL = dict(atol=1.6e-2, rtol=1.6e-2)


def inputs(seed, t=T, d=D, dtype=BF16):
    """y [T, D], x [T, hc, D] (dtype), post, comb, pre fp32 with realistic ranges, norm weight bf16."""
    g = gen(seed)
    return [rand(g, t, d, dtype=dtype), rand(g, t, HC, d, dtype=dtype), 2 * torch.rand(t, HC, generator=g),
            torch.softmax(torch.randn(t, HC, HC, generator=g), -1), torch.rand(t, HC, generator=g) + 0.1,
            rand(g, d, scale=0.1, mean=1.0)]


# ---- the formulations, written as a user's model would -------------------------------------------------------
def broadcast_sum(y, x, post, comb, pre, w, eps=NORM_EPS):
    """The model's: broadcast-multiply-sum mixing, RMSNorm written out."""
    mixed = (comb.unsqueeze(-1) * x.float().unsqueeze(-2)).sum(dim=1)
    x_new = (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(x.dtype)
    u = (pre.unsqueeze(-1) * x_new.float()).sum(dim=1).to(x_new.dtype)
    uf = u.float()
    return x_new, (uf * torch.rsqrt(uf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(u.dtype)


def einsum_mixing(y, x, post, comb, pre, w, eps=NORM_EPS):
    """Stream mixing and collapse as einsum; RMSNorm written out."""
    x_new = (post.unsqueeze(-1) * y.float().unsqueeze(1) + torch.einsum("bjk,bjd->bkd", comb, x.float())).to(x.dtype)
    u = torch.einsum("bj,bjd->bd", pre, x_new.float()).to(x_new.dtype)
    uf = u.float()
    return x_new, (uf * torch.rsqrt(uf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(u.dtype)


def functional_rms_norm(y, x, post, comb, pre, w, eps=NORM_EPS):
    """Broadcast-multiply-sum mixing; RMSNorm as F.rms_norm."""
    x_new = fn.hc_post(y, x, post, comb)
    u = fn.hc_collapse(x_new, pre)
    return x_new, F.rms_norm(u.float(), (u.shape[-1],), w.float(), eps).to(u.dtype)


def norm_bf16_then_weight(u, w, eps):
    """HF's RMSNorm: the normalised u rounded to bf16, then the weight multiply in bf16."""
    uf = u.float()
    return w * (uf * torch.rsqrt(uf.pow(2).mean(-1, keepdim=True) + eps)).to(u.dtype)


def double_rounding_norm(y, x, post, comb, pre, w, eps=NORM_EPS):
    """Broadcast-multiply-sum mixing; the RMSNorm rounds twice."""
    x_new = fn.hc_post(y, x, post, comb)
    return x_new, norm_bf16_then_weight(fn.hc_collapse(x_new, pre), w, eps)


def einsum_double_rounding_norm(y, x, post, comb, pre, w, eps=NORM_EPS):
    """Stream mixing and collapse as einsum; the RMSNorm rounds twice."""
    x_new = (post.unsqueeze(-1) * y.float().unsqueeze(1) + torch.einsum("bjk,bjd->bkd", comb, x.float())).to(x.dtype)
    return x_new, norm_bf16_then_weight(torch.einsum("bj,bjd->bd", pre, x_new.float()).to(x_new.dtype), w, eps)


# the parts a user mixes freely: each combination of a post, a collapse and a norm spelling is a formulation
POSTS = {"": fn.hc_post,
         "einsum": lambda y, x, post, comb: (torch.einsum("bjk,bjd->bkd", comb, x.float())
                                             + y.float().unsqueeze(1) * post.unsqueeze(-1)).to(x.dtype)}
COLLAPSES = {"": fn.hc_collapse, "einsum": lambda x, pre: torch.einsum("bj,bjd->bd", pre, x.float()).to(x.dtype)}
NORMS = {"": lambda u, w, eps: fn.rms_norm(u, w, eps),
         "_F_rms_norm": lambda u, w, eps: F.rms_norm(u.float(), (u.shape[-1],), w.float(), eps).to(u.dtype),
         "_bf16_then_weight": norm_bf16_then_weight}


def combination(post_fn, collapse_fn, norm_fn):
    def f(y, x, post, comb, pre, w, eps=NORM_EPS):
        x_new = post_fn(y, x, post, comb)
        return x_new, norm_fn(collapse_fn(x_new, pre), w, eps)
    return f


def contraction_suffix(post, collapse):
    return "_einsum" if post and collapse else "_einsum_post" if post else "_einsum_collapse" if collapse else ""


STREAM_COMBINATIONS = {contraction_suffix(p, c) + n: combination(POSTS[p], COLLAPSES[c], NORMS[n])
                       for n in NORMS for p in POSTS for c in COLLAPSES}
FORMULATIONS = {"post_pre": broadcast_sum, "post_pre_einsum": einsum_mixing, "post_pre_F_rms_norm": functional_rms_norm,
                "post_pre_bf16_then_weight": double_rounding_norm,
                "post_pre_einsum_bf16_then_weight": einsum_double_rounding_norm}
FORMULATIONS |= {f"post_pre{suffix}": f for suffix, f in STREAM_COMBINATIONS.items() if f"post_pre{suffix}" not in FORMULATIONS}
TOL = {name: dict(atol=0, rtol=0) if name in ("post_pre", "post_pre_bf16_then_weight") else BF16_TOL
       for name in FORMULATIONS}
ROUNDING = {name: "bf16_then_weight" if name.endswith("_bf16_then_weight") else "fp32_weight" for name in FORMULATIONS}


def model_site(y, x, post, comb, pre, w):
    x_new = fn.hc_post(y, x, post, comb)
    return x_new, fn.rms_norm(fn.hc_collapse(x_new, pre), w, NORM_EPS)


def two_sites(y, x, post, comb, pre, w):
    """The attention site, a stand-in sublayer on its normalised output, then the FFN site."""
    x1, h1 = broadcast_sum(y, x, post, comb, pre, w)
    return einsum_mixing(torch.tanh(h1), x1, post, comb, pre, w)


def test_every_formulation_has_a_test():
    assert pattern_names(FUSION) == set(FORMULATIONS)


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_formulation_is_fused(name):
    f = FORMULATIONS[name]
    gone = ("aten.sum.dim_IntList", "aten.rsqrt", "aten.mean.dim", "aten.pow.Tensor_Scalar", "aten.bmm")
    gm, report, node = run_fused_once(f, inputs(0), FUSION, gone)
    assert report.passes[1].replaced[0]["pattern"] == name and node.args[7] == ROUNDING[name]
    x = inputs(1)
    assert_close(gm(*x), f(*x), **TOL[name])


@pytest.mark.parametrize("name", ["post_pre", "post_pre_F_rms_norm", "post_pre_bf16_then_weight"])
def test_batch_one(name):
    gm, report = run_passes(FORMULATIONS[name], inputs(0, t=1), FUSION)
    assert report.matches[FUSION] == 1
    x = inputs(9, t=1)
    assert_close(gm(*x), FORMULATIONS[name](*x), **TOL[name])


def test_two_sites_two_matches():
    gm, report = run_passes(two_sites, inputs(0), FUSION)
    assert report.matches[FUSION] == 2 and op_counts(gm)[OP] == 2 and op_counts(gm)["aten.tanh"] == 1
    x = inputs(2)
    assert_close(gm(*x), two_sites(*x), **BF16_TOL)


@torch.no_grad()
def test_model_functions_through_the_backend():
    assert compiled_matches(model_site, inputs) == {FUSION: 1}


def test_golden():
    gm, _ = run_passes(model_site, inputs(0, t=2, d=8), FUSION)
    expecttest.assert_expected_inline(graph_text(gm), """\
%arg0_1: bf16[2, 8] = input
%arg1_1: bf16[2, 4, 8] = input
%arg2_1: f32[2, 4] = input
%arg3_1: f32[2, 4, 4] = input
%arg4_1: f32[2, 4] = input
%arg5_1: bf16[8] = input
%mhc_post_pre_default: (bf16[2, 4, 8], bf16[2, 8]) = dsv41.mhc_post_pre(%arg0_1, %arg1_1, %arg2_1, %arg3_1, %arg4_1, %arg5_1, 1e-20, 'fp32_weight', 'auto')
%getitem_1: bf16[2, 8] = getitem(%mhc_post_pre_default, 1)
%getitem: bf16[2, 4, 8] = getitem(%mhc_post_pre_default, 0)
return [%getitem, %getitem_1]
""")


# ---- declines ---------------------------------------------------------------------------------------------------
def test_decline_token_limit():
    reasons = run_declined(model_site, inputs(0, t=3), FUSION, max_tokens=2)
    assert "token limit: T=3 > max_tokens=2" in reasons


def test_decline_fp16_activations():
    reasons = run_declined(model_site, inputs(0, dtype=F16), FUSION)
    assert "dtype" in reasons and "float16" in reasons


def test_decline_what_the_op_rejects():
    """fp64 mixing coefficients: the subgraph has the same structure and passes the pass's own checks; the op's
    validation names the argument and the site is declined, not fused into an op that would raise at run time."""
    args = list(inputs(0))
    for i in (2, 3, 4):
        args[i] = args[i].double()
    reasons = run_declined(model_site, tuple(args), FUSION)
    assert "dtype: dsv41::mhc_post_pre: argument 'post'" in reasons, reasons


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_decline_other_eps(name):
    def f(*args):
        return FORMULATIONS[name](*args, eps=1e-6)

    reasons = run_declined(f, inputs(0), FUSION)
    assert_scalar_decline(reasons, 1e-20, 1e-6)


def test_einsum_mixing_with_negative_unsqueeze_dims():
    def f(y, x, post, comb, pre, w):
        x_new = (post[..., None] * y.float().unsqueeze(-2) + torch.einsum("bjk,bjd->bkd", comb, x.float())).to(x.dtype)
        return x_new, fn.rms_norm(torch.einsum("bj,bjd->bd", pre, x_new.float()).to(x.dtype), w, NORM_EPS)

    gm, report = run_passes(f, inputs(0), FUSION)
    assert report.matches[FUSION] == 1, report.declined[FUSION]
    x = inputs(7)
    assert_close(gm(*x), f(*x), **BF16_TOL)


def test_einsum_formulation_at_batch_one():
    gm, report = run_passes(einsum_mixing, inputs(0, t=1), FUSION)
    assert report.matches[FUSION] == 1, report.declined[FUSION]
