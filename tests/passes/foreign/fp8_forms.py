"""Spellings of the FP8 fake-quant round trip (`fn.fp8_fake_quant`: per block of 32 along the last dim,
s = 2^ceil(log2(max(amax, 1e-4) / 448)), x <- e4m3(clamp(x/s, +-448)) * s) as users write it, each differing from
the reference in one named way, for the fusions that hold an FP8 step (qkv_norm's KV tail, moe_experts' w2 input).

SAME: equal to the reference on every bf16 input without NaN, so the fusion must absorb the step:
- `exp2_scale`: s = exp2(ceil(log2(amax / 448))) (equal on every bf16 amax and 1e-4: exhaustive test in
  test_qkv_norm.py; on a NaN block the exp2 scale is NaN, the bit scale -0.0, so the blocks then differ beyond
  their NaN elements);
- `rows`: the blocks as `x.reshape(-1, 32)` rows, cast to x.dtype before the reshape back (vLLM / DeepSeek);
- `clamp_kw`: `amax.clamp(min=1e-4)` for `clamp_min`;
- `max_values`: `torch.max(x.abs(), dim=-1, keepdim=True).values` for `amax`;
- `times_reciprocal`: x * (1 / s) for x / s (s is a power of two, so its reciprocal is exact);
- `type_cast`: `.type(torch.float8_e4m3fn)` for `.to(...)`;
- `no_clamp`: no clamp to +-448 before the cast: torch's float -> e4m3fn conversion saturates (finite overflow and
  inf to +-448, NaN stays NaN: c10's `fp8e4m3fn_from_fp32_value`), and |x / s| <= 448 anyway since s >= amax / 448;
- `one_block_flat`: one block per row (the last dim equals the block), its block view dropped: the amax over the
  last dim itself;
- `flat_unflatten`: DeepSeek's `act_quant` / dequantisation pair written with `flatten` / `unflatten`: the e4m3
  values returned flat (`.flatten(-2)`) with scales without keepdim (`torch.pow(2, ...)`), then unflattened into
  blocks again around the cast to fp32 and multiplied by `s.unsqueeze(-1)`;
- `flat_rows_dequant`: the same flat values dequantised as `[M, 32]` rows, `y.float().view(-1, 32) * s.view(-1, 1)`,
  then viewed back to x's shape (a per-row group scale, as vLLM's kernels take it);
- `cast_before_merge`: the dequantised `[..., n, 32]` blocks cast to bf16, then reshaped back
  (`(q * s).to(torch.bfloat16).reshape(x.shape)`; a cast and a view commute);
- `bf16_dequant`: the dequantisation in bf16, `y.to(torch.bfloat16) * s.to(torch.bfloat16)`, then reshaped back:
  the scale is a normal power of two (2^-22 <= s: amax >= 1e-4), which bf16 holds exactly (fp32's exponent range),
  e4m3 values are bf16 values, and torch computes a bf16 product in fp32 and rounds it once, so this is the
  reference's `(y.float() * s).to(torch.bfloat16)` on every input (that fp32 product is exact besides: at most 4
  significant bits on a multiple of 2^-31, overflowing to inf alike);
- `flat_rows_bf16_dequant`: `flat_rows_dequant` in bf16, `y.to(torch.bfloat16).view(-1, 32) *
  s.to(torch.bfloat16).view(-1, 1)` (the `torch.pow(2, ...)` scale cast, then viewed), equal for the same reasons.
DIFFERENT (the fusion must leave the step out and record why):
- `floor_scale`: s = 2^floor(...), which is below amax / 448 and so clamps;
- `e5m2`: the round trip through float8_e5m2;
- `no_amax_floor`: no clamp of amax to >= 1e-4 (an all-zero block is 0 / 0 = NaN, not 0).
"""

from __future__ import annotations

import torch

FP8_MAX, BLOCK = 448.0, 32


def _blocks(x):
    return x.float().unflatten(-1, (-1, BLOCK))


def _round_trip(xf, s, dtype, cast=torch.float8_e4m3fn):
    return ((xf / s).clamp(-FP8_MAX, FP8_MAX).to(cast).float() * s).flatten(-2).to(dtype)


def _exp2_scale(amax):
    return torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))


def exp2_scale(x):
    xf = _blocks(x)
    return _round_trip(xf, _exp2_scale(xf.abs().amax(-1, keepdim=True).clamp_min(1e-4)), x.dtype)


def rows(x):
    xf = x.float().reshape(-1, BLOCK)
    amax = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-4)
    s = _exp2_scale(amax)
    return ((xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).to(x.dtype).reshape(x.shape)


def clamp_kw(x):
    xf = _blocks(x)
    return _round_trip(xf, _exp2_scale(xf.abs().amax(-1, keepdim=True).clamp(min=1e-4)), x.dtype)


def max_values(x):
    xf = _blocks(x)
    return _round_trip(xf, _exp2_scale(torch.max(xf.abs(), dim=-1, keepdim=True).values.clamp_min(1e-4)), x.dtype)


def times_reciprocal(x):
    xf = _blocks(x)
    s = _exp2_scale(xf.abs().amax(-1, keepdim=True).clamp_min(1e-4))
    return ((xf * (1.0 / s)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).flatten(-2).to(x.dtype)


def type_cast(x):
    xf = _blocks(x)
    s = _exp2_scale(xf.abs().amax(-1, keepdim=True).clamp_min(1e-4))
    return ((xf / s).clamp(-FP8_MAX, FP8_MAX).type(torch.float8_e4m3fn).float() * s).flatten(-2).type(x.dtype)


def no_clamp(x):
    xf = _blocks(x)
    s = _exp2_scale(xf.abs().amax(-1, keepdim=True).clamp_min(1e-4))
    return ((xf / s).to(torch.float8_e4m3fn).float() * s).flatten(-2).to(x.dtype)


def one_block_flat(x):
    assert x.shape[-1] == BLOCK
    xf = x.float()
    s = _exp2_scale(xf.abs().amax(-1, keepdim=True).clamp_min(1e-4))
    return ((xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).to(x.dtype)


def _act_quant_flat(x):
    """(e4m3 values in x's shape, fp32 scales [..., n]): the reference's act_quant, its blocks flattened back."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    s = torch.pow(2.0, torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=1e-4) / FP8_MAX)))
    return (blocks / s.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2), s


def flat_unflatten(x):
    y, s = _act_quant_flat(x)
    return (y.float().unflatten(-1, (-1, BLOCK)) * s.unsqueeze(-1)).flatten(-2).to(x.dtype)


def flat_rows_dequant(x):
    y, s = _act_quant_flat(x)
    return (y.float().view(-1, BLOCK) * s.view(-1, 1)).view(x.shape).to(x.dtype)


def flat_rows_bf16_dequant(x):
    y, s = _act_quant_flat(x)
    return (y.to(torch.bfloat16).view(-1, BLOCK) * s.to(torch.bfloat16).view(-1, 1)).view(x.shape)


def _quantised_blocks(x):
    """(e4m3 blocks [..., n, 32], their fp32 scales [..., n, 1]) of the reference's round trip."""
    xf = _blocks(x)
    s = _exp2_scale(xf.abs().amax(-1, keepdim=True).clamp_min(1e-4))
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def cast_before_merge(x):
    y, s = _quantised_blocks(x)
    return (y.float() * s).to(torch.bfloat16).reshape(x.shape)


def bf16_dequant(x):
    y, s = _quantised_blocks(x)
    return (y.to(torch.bfloat16) * s.to(torch.bfloat16)).reshape(x.shape)


def floor_scale(x):
    xf = _blocks(x)
    s = torch.exp2(torch.floor(torch.log2(xf.abs().amax(-1, keepdim=True).clamp_min(1e-4) / FP8_MAX)))
    return _round_trip(xf, s, x.dtype)


def e5m2(x):
    xf = _blocks(x)
    return _round_trip(xf, _exp2_scale(xf.abs().amax(-1, keepdim=True).clamp_min(1e-4)), x.dtype, torch.float8_e5m2)


def no_amax_floor(x):
    xf = _blocks(x)
    return _round_trip(xf, _exp2_scale(xf.abs().amax(-1, keepdim=True)), x.dtype)


SAME = {f.__name__: f for f in (exp2_scale, rows, clamp_kw, max_values, times_reciprocal, type_cast, no_clamp,
                                flat_unflatten, flat_rows_dequant, flat_rows_bf16_dequant, cast_before_merge,
                                bf16_dequant)}
ONE_BLOCK = {f.__name__: f for f in (one_block_flat,)}
DIFFERENT = {f.__name__: f for f in (floor_scale, e5m2, no_amax_floor)}
