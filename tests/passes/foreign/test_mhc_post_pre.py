"""Foreign formulations of `mhc_post_pre` (post mixing + collapse + RMSNorm), each written here the way another
implementation might, differing from the project's model (`functional.hc_post/hc_collapse/rms_norm`) in one
named way. Each must be found exactly once and agree with eager: bit-exact where the math is the same op for op
up to exact identities (the double-rounding RMSNorm too: the op computes that form when told); within one bf16 ulp (atol=rtol=1.6e-2) where the fp32 order differs (einsum/bmm sums)."""

from __future__ import annotations

import pytest
import torch

from ..harness import NORM_EPS, assert_found_once
from ..test_mhc_post_pre import inputs

FUSION = "mhc_post_pre"
EXACT, BF16_ULP = {}, dict(atol=1.6e-2, rtol=1.6e-2)


def norm(u, w, eps=NORM_EPS):
    uf = u.float()
    return (uf * torch.rsqrt(uf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(u.dtype)


def collapse(x_new, pre):
    return (pre.unsqueeze(-1) * x_new.float()).sum(dim=1).to(x_new.dtype)


def mix_first(y, x, post, comb, pre, w):
    """operand order: the residual mix before the scaled output (add(mix, post*y))."""
    mixed = (comb.unsqueeze(-1) * x.float().unsqueeze(-2)).sum(dim=1)
    x_new = (mixed + post.unsqueeze(-1) * y.float().unsqueeze(-2)).to(x.dtype)
    return x_new, norm(collapse(x_new, pre), w)


def none_indexing(y, x, post, comb, pre, w):
    """layout: broadcast dims by None-indexing and views instead of unsqueeze."""
    t, hc, d = x.shape
    mixed = (comb[:, :, :, None] * x.float()[:, :, None, :]).sum(dim=1)
    x_new = (post.view(t, hc, 1) * y.float().view(t, 1, d) + mixed).to(x.dtype)
    u = (x_new.float() * pre[..., None]).sum(1).to(x_new.dtype)
    return x_new, norm(u, w)


def bmm_mixing(y, x, post, comb, pre, w):
    """contraction: the mixing as bmm over the transposed comb (sums in another fp32 order)."""
    mixed = torch.bmm(comb.transpose(1, 2), x.float())
    x_new = (post.unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(x.dtype)
    return x_new, norm(collapse(x_new, pre), w)


def weight_first_norm(y, x, post, comb, pre, w, eps=NORM_EPS):
    """operand order: the norm weight times the normalised row (w * (x * r))."""
    mixed = (comb.unsqueeze(-1) * x.float().unsqueeze(-2)).sum(dim=1)
    x_new = (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(x.dtype)
    uf = collapse(x_new, pre).float()
    return x_new, (w.float() * (uf * torch.rsqrt(uf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def square_by_mul(y, x, post, comb, pre, w, eps=NORM_EPS):
    """other op: the mean square as mean(u * u) instead of pow(u, 2), reciprocal root after the weight product."""
    mixed = (comb.unsqueeze(-1) * x.float().unsqueeze(-2)).sum(dim=1)
    x_new = (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(x.dtype)
    uf = collapse(x_new, pre).float()
    return x_new, (uf * torch.rsqrt((uf * uf).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def reshape_flatten(y, x, post, comb, pre, w):
    """layout: the collapse through a two-step reshape (flatten the streams, view back) before the sum."""
    t, hc, d = x.shape
    mixed = (comb.unsqueeze(-1) * x.float().unsqueeze(-2)).sum(dim=1)
    x_new = (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(x.dtype)
    weighted = (pre.unsqueeze(-1) * x_new.float()).reshape(t, hc * d).reshape(t, hc, d)
    return x_new, norm(weighted.sum(1).to(x.dtype), w)


def double_rounding_norm(y, x, post, comb, pre, w, eps=NORM_EPS):
    """op contract: HF's RMSNorm, which rounds the normalised row to bf16 before a bf16 weight multiply
    (`weight * u.to(input_dtype)`, weight first): the op's norm_rounding="bf16_then_weight"."""
    mixed = (comb.unsqueeze(-1) * x.float().unsqueeze(-2)).sum(dim=1)
    x_new = (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(x.dtype)
    uf = collapse(x_new, pre).float()
    return x_new, w * (uf * torch.rsqrt(uf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def output_from_a_batch_layout(y, x, post, comb, pre, w):
    """layout: the sublayer output reaches the post as the [T, L=1, D] reshape of a value computed in the graph (a
    MoE's [T, D] result as a JAX port's [B, L, D]), cast and broadcast against [T, hc, 1] weights as it is; einsum
    contractions (JAX style)."""
    y = torch.tanh(y.float()).to(y.dtype).reshape(y.shape[0], 1, -1)
    mixed = torch.einsum("tjk,tjd->tkd", comb, x.float())
    x_new = (post.unsqueeze(-1) * y.float() + mixed).to(x.dtype)
    return x_new, norm(torch.einsum("tj,tjd->td", pre, x_new.float()).to(x.dtype), w)


CASES = {f.__name__: (f, tol) for f, tol in (
    (mix_first, EXACT), (none_indexing, EXACT), (bmm_mixing, BF16_ULP), (weight_first_norm, EXACT),
    (square_by_mul, EXACT), (reshape_flatten, EXACT), (double_rounding_norm, EXACT))}


@pytest.mark.parametrize("name", sorted(CASES))
def test_found_once_and_equal_to_eager(name):
    f, tol = CASES[name]
    assert_found_once(f, inputs, FUSION, **tol)


@pytest.mark.parametrize("t", [1, 3])
def test_output_from_a_batch_layout_at_one_and_more_tokens(t):
    """At T = 1 the [1, 1, D] output and the pattern's [1, D] one broadcast alike against [1, hc, 1] (the pattern's
    view to [1, 1, D] is dropped by the normalisation): bound without the leading unit dim, found once, within one
    bf16 ulp of eager (the einsum sums in another fp32 order); at T = 3 the [3, 1, D] output has the pattern's
    viewed layout."""
    assert_found_once(output_from_a_batch_layout, lambda seed: inputs(seed, t=t), FUSION, **BF16_ULP)
