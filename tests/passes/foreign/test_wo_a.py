"""Foreign formulations of `wo_a` (inverse RoPE of the attention output + the grouped wo_a projection), each
differing from the project's model in one named way. Each must be found exactly once and agree with eager:
bit-exact where the ops are the same up to exact identities, one bf16 ulp (atol=1.6e-2, rtol=2^-7) where the
grouped GEMM runs as another contraction."""

from __future__ import annotations

import pytest
import torch

from dsv41.models import functional as fn

from ..harness import assert_found_once
from ..test_wo_a import R, inputs

FUSION = "wo_a"
EXACT, BF16_ULP = {}, dict(atol=1.6e-2, rtol=2.0**-7)


def project(o, w):
    t, g = o.shape[0], w.shape[0] // R
    return torch.einsum("tgd,grd->tgr", o.reshape(t, g, -1), w.view(g, R, -1)).flatten(1)


def einsum_letters(o, cos, sin, w):
    """other spelling: the einsum with other index letters and the groups by unflatten."""
    t, g = o.shape[0], w.shape[0] // R
    o = fn.apply_rope_tail(o, cos, sin, inverse=True)
    return torch.einsum("bhk,hnk->bhn", o.flatten(1).unflatten(1, (g, -1)), w.unflatten(0, (g, R))).reshape(t, -1)


def transposed_bmm(o, cos, sin, w):
    """contraction: bmm over the groups with the weight transposed by mT and the result by transpose(0, 1)."""
    t, g = o.shape[0], w.shape[0] // R
    o = fn.apply_rope_tail(o, cos, sin, inverse=True)
    z = torch.bmm(o.view(t, g, -1).transpose(0, 1), w.view(g, R, -1).mT)
    return z.transpose(0, 1).reshape(t, g * R)


def permuted_bmm(o, cos, sin, w):
    """layout: groups to the front by permute, bmm, back by permute and reshape."""
    t, g = o.shape[0], w.shape[0] // R
    o = fn.apply_rope_tail(o, cos, sin, inverse=True)
    z = torch.bmm(o.reshape(t, g, -1).permute(1, 0, 2), w.reshape(g, R, -1).permute(0, 2, 1))
    return z.permute(1, 0, 2).reshape(t, -1)


def rope_negated_sin_first(o, cos, sin, w):
    """operand order: the inverse rotation written as (-sin) * x1 + cos * x0."""
    rd = cos.shape[-1] * 2
    xf = o[..., -rd:].float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos.view(cos.shape[0], 1, -1), -sin.view(sin.shape[0], 1, -1)
    rot = torch.stack((c * x0 - s * x1, s * x0 + c * x1), dim=-1).flatten(-2).to(o.dtype)
    return project(torch.cat((o[..., :-rd], rot), dim=-1), w)


def flatten_by_reshape(o, cos, sin, w):
    """layout: the result flattened in two steps (view to [T, G, R] then reshape to [T, G*R])."""
    t, g = o.shape[0], w.shape[0] // R
    o = fn.apply_rope_tail(o, cos, sin, inverse=True)
    z = torch.einsum("tgd,grd->tgr", o.view(t, g, -1), w.view(g, R, -1))
    return z.contiguous().view(t, g, R).reshape(t, g * R)


def rope_stride2(o, cos, sin, w):
    """equal math written differently: the interleaved pairs of the inverse RoPE by stride-2 slicing instead of
    unflatten + select."""
    rd = cos.shape[-1] * 2
    tail = o[..., -rd:].float()
    x0, x1 = tail[..., 0::2], tail[..., 1::2]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = torch.stack((x0 * c + x1 * s, x1 * c - x0 * s), dim=-1).flatten(-2).to(o.dtype)
    return project(torch.cat((o[..., :-rd], rot), dim=-1), w)


CASES = {f.__name__: (f, tol) for f, tol in (
    (einsum_letters, EXACT), (transposed_bmm, BF16_ULP), (permuted_bmm, BF16_ULP),
    (rope_negated_sin_first, EXACT), (flatten_by_reshape, EXACT), (rope_stride2, EXACT))}


@pytest.mark.parametrize("name", sorted(CASES))
def test_found_once_and_equal_to_eager(name):
    f, tol = CASES[name]
    assert_found_once(f, inputs, FUSION, **tol)
