"""Foreign formulations of `wo_a` (inverse RoPE of the attention output + the grouped wo_a projection), each
differing from the project's model in one named way. Each must be found exactly once and agree with eager:
bit-exact where the ops are the same up to exact identities, one bf16 ulp (atol=1.6e-2, rtol=2^-7) where the
grouped GEMM runs as another contraction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv41.models import functional as fn

from ..harness import assert_found_once, gen, rand, run_passes
from ..test_wo_a import R, T, inputs

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


def slices_then_cast(o, cos, sin, w):
    """equal math written differently: the interleaved pairs as stride-2 slices of the bf16 tail, each cast to fp32
    after slicing (the model casts, then unflattens and selects)."""
    rd = cos.shape[-1] * 2
    tail = o[..., -rd:]
    even, odd = tail[..., 0::2].float(), tail[..., 1::2].float()
    c, s = cos.unsqueeze(1), -sin.unsqueeze(1)
    rot = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2).to(o.dtype)
    return project(torch.cat((o[..., :-rd], rot), dim=-1), w)


def angles_in_head_layout(o, cos, sin, w):
    """layout: cos and sin given as [T, 1, rd/2] (broadcast over the heads as they are), not [T, rd/2] viewed."""
    rd = cos.shape[-1] * 2
    return project(torch.cat((o[..., :-rd], fn.rope(o[..., -rd:], cos, sin, inverse=True)), dim=-1), w)


def bf16_angles(o, cos, sin, w):
    """dtype: cos and sin in bf16, promoted to fp32 by the products with the fp32 pairs (exactly)."""
    return project(fn.apply_rope_tail(o, cos, sin, inverse=True), w)


def output_with_unit_dim(o, cos, sin, w):
    """layout: the result as [T, 1, G*R] (a decode layout's sequence dim), the model's [T, G*R] viewed."""
    t, g = o.shape[0], w.shape[0] // R
    o = fn.apply_rope_tail(o, cos, sin, inverse=True)
    return torch.einsum("tgd,grd->tgr", o.view(t, g, -1), w.view(g, R, -1)).reshape(t, 1, -1)


def megatron_sequence_first(o, angle, w, wo_b):
    """layout and RoPE: Megatron's sequence-first [S=1, T, H, hd] attention output (its projection wo_b by F.linear
    on [1, T, G*R]), the inverse interleaved rotary with the angles repeated per pair by `torch.stack`, cos and -sin
    taken of the repeated angles, the rotary part split off by torch.split, wo_a by bmm over transposed groups."""
    t, g = o.shape[0], w.shape[0] // R
    emb = torch.stack((angle.view(-1, 1), angle.view(-1, 1)), dim=-1).view(1, t, 1, -1)
    rd = emb.shape[-1]
    t_pass, t_rot = torch.split(o.unsqueeze(0), [o.shape[-1] - rd, rd], dim=-1)
    t_rot = t_rot.float()
    rotated = torch.stack((-t_rot[..., 1::2], t_rot[..., ::2]), dim=-1).view(*t_rot.shape)
    t_rot = t_rot * torch.cos(emb) + rotated * -torch.sin(emb)
    core = torch.cat((t_pass, t_rot.to(o.dtype)), dim=-1)
    z = torch.bmm(core.reshape(t, g, -1).transpose(0, 1), w.view(g, R, -1).transpose(1, 2))
    return F.linear(z.transpose(0, 1).reshape(1, t, -1), wo_b)


def megatron_inputs(seed):
    """o, the rotary angles [T, rd/2], w and a wo_b [64, G*R]."""
    o, cos, sin, w = inputs(seed)
    return [o, torch.atan2(sin, cos), w, rand(gen(seed + 9), 64, w.shape[0], scale=0.1)]


def head_layout_inputs(seed, t=T):
    o, cos, sin, w = inputs(seed, t)
    return [o, cos.unsqueeze(1), sin.unsqueeze(1), w]


def bf16_inputs(seed):
    o, cos, sin, w = inputs(seed)
    return [o, cos.bfloat16(), sin.bfloat16(), w]


NEW_LAYOUTS = {f.__name__: (f, of) for f, of in ((slices_then_cast, inputs), (angles_in_head_layout, head_layout_inputs),
                                                 (bf16_angles, bf16_inputs), (output_with_unit_dim, inputs))}


@pytest.mark.parametrize("name", sorted(NEW_LAYOUTS))
def test_found_op_for_op_and_equal_to_eager(name):
    """Each differs from the pattern only by an exact identity the normalisation or the binding applies: found once,
    op for op (no part left to the semantic check), and bit-equal to eager."""
    f, inputs_of = NEW_LAYOUTS[name]
    report = assert_found_once(f, inputs_of, FUSION)
    assert [r["verified"] for r in next(p for p in report.passes if p.name == FUSION).replaced] == [None]


CASES = {f.__name__: (f, tol) for f, tol in (
    (einsum_letters, EXACT), (transposed_bmm, BF16_ULP), (permuted_bmm, BF16_ULP),
    (rope_negated_sin_first, EXACT), (flatten_by_reshape, EXACT), (rope_stride2, EXACT))}


@pytest.mark.parametrize("name", sorted(CASES))
def test_found_once_and_equal_to_eager(name):
    f, tol = CASES[name]
    assert_found_once(f, inputs, FUSION, **tol)


def test_one_token_angles_in_head_layout():
    """At T = 1 cos and sin [1, 1, rd/2] broadcast over [1, H, rd/2] heads as the pattern's [1, rd/2] (whose view
    to [1, 1, rd/2] the normalisation drops before the broadcast) do: bound without the leading unit dim, since the
    op takes [T, rd/2]; found op for op and bit-equal to eager (a `[B=1, S=1, rd/2]` table in the foreign blocks)."""
    report = assert_found_once(angles_in_head_layout, lambda seed: head_layout_inputs(seed, t=1), FUSION)
    assert [r["verified"] for r in next(p for p in report.passes if p.name == FUSION).replaced] == [None]


def test_megatron_sequence_first_found_once_and_equal_to_eager():
    assert_found_once(megatron_sequence_first, megatron_inputs, FUSION)


def cos_view_shared_with_the_q_rope(o, cos, sin, w, q):
    """TorchTitan's habit: one `[T, 1, rd/2]` view of cos and sin read by the q RoPE (outside the fusion) and by the
    inverse RoPE before wo_a; returns (z, the rotated q tail)."""
    t, g, rd = o.shape[0], w.shape[0] // R, cos.shape[-1] * 2
    c, s = cos.view(t, 1, -1), sin.view(t, 1, -1)

    def rotate(x, sin_):
        xf = x.float().unflatten(-1, (-1, 2))
        x0, x1 = xf[..., 0], xf[..., 1]
        return torch.stack((x0 * c - x1 * sin_, x1 * c + x0 * sin_), dim=-1).flatten(-2).to(x.dtype)

    o = torch.cat((o[..., :-rd], rotate(o[..., -rd:], -s)), dim=-1)
    return torch.einsum("tgd,grd->tgr", o.view(t, g, -1), w.view(g, R, -1)).flatten(1), rotate(q[..., -rd:], s)


def _with_q(seed):
    return inputs(seed) + [rand(gen(seed + 100), T, 4, 32)]


def test_a_layout_of_an_input_read_outside_stays_for_its_readers(monkeypatch):
    """The cos / sin views that the q RoPE reads too lie inside the wo_a region: the replacement leaves them in place
    for the q RoPE (`MatchResult.kept`) rather than failing on an extra user. Fused once, equal to eager exactly (both
    outputs); without the rule the site is declined for that extra user."""
    from dsv41.passes import matcher

    assert_found_once(cos_view_shared_with_the_q_rope, _with_q, FUSION)
    monkeypatch.setattr(matcher, "_input_layouts_read_outside", lambda inside, inputs_bound: frozenset())
    (declined,) = run_passes(cos_view_shared_with_the_q_rope, _with_q(0), FUSION)[1].declined[FUSION]
    assert "extra user" in declined and "inside the pattern is also used by" in declined, declined
