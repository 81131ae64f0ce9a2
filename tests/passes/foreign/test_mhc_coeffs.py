"""Foreign formulations of `mhc_coeffs` (RMS statistic + GEMM + sigmoids + softmax + Sinkhorn), each differing from
the project's model in one named way. Each must be found exactly once and agree with eager: bit-exact where the
ops are the same up to exact identities, else within the pass's fp32 tolerance (atol=1e-5, rtol=1e-4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv41.models import functional as fn

from ..harness import HC_EPS, ITERS, NORM_EPS, assert_found_once
from ..test_mhc_coeffs import inputs

FUSION = "mhc_coeffs"
EXACT, FP32 = {}, dict(atol=1e-5, rtol=1e-4)


def sinkhorn(logits):
    return fn.sinkhorn(logits, ITERS, HC_EPS)


def gates(m, base, scale, hc):
    """pre and post of the mixes m."""
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + HC_EPS
    return pre, 2.0 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])


def heads(m, base, scale, hc):
    t = m.shape[0]
    return *gates(m, base, scale, hc), sinkhorn(m[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc))


def rms(xf):
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)


def linear_gemm(x, w, base, scale):
    """contraction: F.linear for the mixing GEMM."""
    xf = x.flatten(1).float()
    return heads(F.linear(xf, w) * rms(xf), base, scale, x.shape[1])


def scale_first(x, w, base, scale):
    """operand order: r * GEMM, base + logits, eps + softmax."""
    t, hc, _ = x.shape
    xf = x.flatten(1).float()
    m = rms(xf) * (xf @ w.t())
    pre = HC_EPS + torch.sigmoid(base[:hc] + scale[0] * m[:, :hc])
    post = 2.0 * torch.sigmoid(base[hc:2 * hc] + scale[1] * m[:, hc:2 * hc])
    return pre, post, sinkhorn(base[2 * hc:].view(hc, hc) + scale[2] * m[:, 2 * hc:].view(t, hc, hc))


def view_streams(x, w, base, scale):
    """layout: the streams flattened by view(t, hc * d) and the comb logits by reshape."""
    t, hc, d = x.shape
    xf = x.view(t, hc * d).float()
    m = (xf @ w.t()) * rms(xf)
    return *gates(m, base, scale, hc), sinkhorn(m[:, 2 * hc:].reshape(t, hc, hc) * scale[2] + base[2 * hc:].reshape(hc, hc))


def alternating_loop(x, w, base, scale):
    """loop form: one loop over 2*iters - 1 normalisations alternating the dim (column first)."""
    t, hc, _ = x.shape
    xf = x.flatten(1).float()
    m = (xf @ w.t()) * rms(xf)
    pre, post = gates(m, base, scale, hc)
    c = torch.softmax(m[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), dim=-1) + HC_EPS
    for i in range(2 * ITERS - 1):
        dim = -2 if i % 2 == 0 else -1
        c = c / (c.sum(dim=dim, keepdim=True) + HC_EPS)
    return pre, post, c


def softmax_written_out(x, w, base, scale):
    """other op: the softmax written out as exp(z - max) / sum."""
    t, hc, _ = x.shape
    xf = x.flatten(1).float()
    m = (xf @ w.t()) * rms(xf)
    pre, post = gates(m, base, scale, hc)
    z = m[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc)
    e = torch.exp(z - z.max(dim=-1, keepdim=True).values)
    c = e / e.sum(dim=-1, keepdim=True) + HC_EPS
    c = c / (c.sum(dim=-2, keepdim=True) + HC_EPS)
    for _ in range(ITERS - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + HC_EPS)
        c = c / (c.sum(dim=-2, keepdim=True) + HC_EPS)
    return pre, post, c


def mean_square_by_mul(x, w, base, scale):
    """other op: the mean square as mean(x * x)."""
    xf = x.flatten(1).float()
    return heads((xf @ w.t()) * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + NORM_EPS), base, scale, x.shape[1])


def logits_scaled_before_view(x, w, base, scale):
    """layout: the comb logits scaled and biased at [T, hc * hc], then viewed to [T, hc, hc] (the model views first)."""
    hc, t = x.shape[1], x.shape[0]
    xf = x.flatten(1).float()
    m = (xf @ w.t()) * rms(xf)
    return *gates(m, base, scale, hc), sinkhorn((m[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(t, hc, hc))


def _sequence_first(view_first):
    def sequence_first(x, w, base, scale):
        """layout: Megatron's sequence-first [S=1, T, hc, D] streams, the coefficients at [1, T, ...] (the GEMM by
        F.linear, which views the activations to [T, hc * D] and back), the comb logits viewed [1, T, hc, hc]
        before or after their scale and bias."""
        hc = x.shape[1]
        xf = x.unsqueeze(0).flatten(2).float()
        m = F.linear(xf, w) * rms(xf)
        pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + HC_EPS
        post = 2.0 * torch.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
        if view_first:
            logits = m[..., 2 * hc:].view(1, -1, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc)
        else:
            logits = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).view(1, -1, hc, hc)
        return pre[0], post[0], sinkhorn(logits)[0]
    sequence_first.__name__ = "sequence_first_view_first" if view_first else "sequence_first"
    return sequence_first


CASES = {f.__name__: (f, tol) for f, tol in (
    (linear_gemm, EXACT), (scale_first, EXACT), (view_streams, EXACT), (alternating_loop, EXACT),
    (softmax_written_out, FP32), (mean_square_by_mul, FP32), (logits_scaled_before_view, EXACT),
    (_sequence_first(False), EXACT), (_sequence_first(True), EXACT))}


@pytest.mark.parametrize("name", sorted(CASES))
def test_found_once_and_equal_to_eager(name):
    f, tol = CASES[name]
    assert_found_once(f, inputs, FUSION, **tol)


def test_logits_scaled_before_view_found_op_for_op():
    """The scale and bias commute with the [hc, hc] view (the normalisation's exact identity): matched op for op,
    with no part left to the semantic check."""
    report = assert_found_once(logits_scaled_before_view, inputs, FUSION)
    assert [r["verified"] for r in next(p for p in report.passes if p.name == FUSION).replaced] == [None]
