"""The numerics of DeepSeek-V4.1 decode as plain torch functions (spec sections 2.2-2.6, 2.9).

Every function is written with ops that Dynamo traces and Inductor lowers (no complex tensors, no host syncs,
static shapes). The fusion passes of `dsv41.passes` search for exactly these op sequences (and for the other
common formulations listed in their files).
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0
FP4_MAX = 6.0


# Where an RMSNorm rounds to bf16: once, after the fp32 weight multiply (spec 2.2, the model's), or first the
# normalised value and then again after a bf16 weight multiply (HF's `weight * x.to(input_dtype)`).
NORM_ROUNDINGS = ("fp32_weight", "bf16_then_weight")


def rms_norm(x: Tensor, weight: Tensor, eps: float, rounding: str = "fp32_weight") -> Tensor:
    """v = x * rsqrt(mean(x^2) + eps) in fp32 over the last dim, then "fp32_weight": bf16(w * v), one rounding
    (spec 2.2); "bf16_then_weight": bf16(w * bf16(v)), two."""
    if rounding not in NORM_ROUNDINGS:
        raise ValueError(f"rms_norm: rounding must be one of {NORM_ROUNDINGS}, got {rounding!r}")
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if rounding == "bf16_then_weight":
        return weight * xf.to(x.dtype)
    return (xf * weight.float()).to(x.dtype)


def rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Interleaved RoPE on adjacent pairs (x[2i], x[2i+1]) of the last dim, fp32 math, result in x.dtype.

    x [..., rd]; cos, sin [T, rd/2] broadcast over the dims between the token dim and the last one
    (the caller reshapes them). `inverse` rotates by the conjugate.
    """
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    if inverse:
        sin = -sin
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def apply_rope_tail(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """RoPE on the trailing rd dims of x [T, ..., d]; cos/sin [T, rd/2]. Returns a new tensor."""
    rd = cos.shape[-1] * 2
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    tail = rope(x[..., -rd:], cos.view(shape), sin.view(shape), inverse)
    return torch.cat((x[..., :-rd], tail), dim=-1)


def _pow2_ceil(x: Tensor) -> Tensor:
    """2^ceil(log2(x)) for positive normal fp32 x, through the IEEE bit pattern (exact, no log2 rounding)."""
    bits = x.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def fp8_fake_quant(x: Tensor, block: int = 32) -> Tensor:
    """The reference act_quant(x, block, ue8m0) round trip: per block of `block` along the last dim,
    s = 2^ceil(log2(max(amax, 1e-4) / 448)), x <- fp8_e4m3(clamp(x/s, +-448)) * s. Result in x.dtype."""
    xf = x.float().unflatten(-1, (-1, block))
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = _pow2_ceil(amax * (1.0 / FP8_MAX))
    q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).flatten(-2).to(x.dtype)


def e2m1_round(x: Tensor) -> Tensor:
    """Round fp32 x (|x| <= 6) to the nearest E2M1 value {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even mantissa."""
    a = x.abs()
    q = torch.where(a < 2.0, torch.round(a * 2.0) * 0.5, torch.where(a < 4.0, torch.round(a), torch.round(a * 0.5) * 2.0))
    return torch.copysign(q, x)


def fp4_fake_quant(x: Tensor, block: int, e4m3_scale: bool) -> Tensor:
    """The reference fp4_act_quant round trip per block along the last dim.

    ue8m0 scales: s = 2^ceil(log2(max(amax, 6*2^-126) / 6)); e4m3 scales: s = e4m3(max(amax, 6*2^-9) / 6);
    then x <- e2m1_round(clamp(x/s, +-6)) * s. Result in x.dtype.
    """
    xf = x.float().unflatten(-1, (-1, block))
    amax = xf.abs().amax(-1, keepdim=True)
    if e4m3_scale:
        s = (amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).to(torch.float8_e4m3fn).float()
    else:
        s = _pow2_ceil(amax.clamp_min(FP4_MAX * 2.0**-126) / FP4_MAX)
    q = e2m1_round((xf / s).clamp(-FP4_MAX, FP4_MAX))
    return (q * s).flatten(-2).to(x.dtype)


def sinkhorn(logits: Tensor, iters: int, eps: float) -> Tensor:
    """comb = softmax over targets + eps, then column-normalise; (iters-1) x (row, column) normalisations.

    logits [T, hc, hc] fp32 with [j, k] = source j, target k. Ends on a column normalisation (spec 2.2).
    """
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def hc_mixes(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, norm_eps: float, hc_eps: float, iters: int):
    """mHC coefficients of one site (spec 2.2): X [T, hc, D] bf16, fn [(2+hc)*hc, hc*D], base [(2+hc)*hc],
    scale [3] fp32 -> pre [T, hc], post [T, hc], comb [T, hc, hc] fp32."""
    t, hc, _ = x.shape
    xf = x.flatten(1).float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)
    m = torch.mm(xf, fn.t()) * r
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = m[:, 2 * hc :].view(t, hc, hc) * scale[2] + base[2 * hc :].view(hc, hc)
    return pre, post, sinkhorn(logits, iters, hc_eps)


def hc_post(y: Tensor, x: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """X'_k = post_k * y + sum_j comb[j, k] * X_j in fp32, stored bf16. y [T, D], x [T, hc, D]."""
    mixed = (comb.unsqueeze(-1) * x.float().unsqueeze(-2)).sum(dim=1)
    return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(x.dtype)


def hc_collapse(x: Tensor, pre: Tensor) -> Tensor:
    """u = sum_j pre_j * X_j in fp32, stored bf16. x [T, hc, D], pre [T, hc] -> [T, D]."""
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


def swiglu_clamped(g: Tensor, u: Tensor, limit: float) -> Tensor:
    """silu(min(g, limit)) * clamp(u, -limit, limit) in fp32."""
    g = g.float().clamp(max=limit)
    u = u.float().clamp(-limit, limit)
    return torch.nn.functional.silu(g) * u


def route(h: Tensor, gate_w: Tensor, bias: Tensor, topk: int, route_scale: float, gate_temp: float):
    """noaux_tc routing with sqrt-softplus scores (spec 2.6): h [T, D] bf16, gate_w [E, D], bias [E] fp32
    -> weights [T, topk] fp32 (from the unbiased score, normalised, x route_scale), experts [T, topk] int64."""
    logits = torch.mm(h.float(), gate_w.float().t()) / gate_temp
    scores = torch.sqrt(torch.nn.functional.softplus(logits))
    experts = torch.topk(scores + bias, topk, dim=-1).indices
    w = scores.gather(1, experts)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * route_scale
    return w, experts


# The checkpoint's weight formats (spec 1.3; `dsv41.models.formats`), dequantised as a user's code writes it right
# before the GEMM. Both products are exact in fp32 and (in range) in bf16, so the result is the value the checkpoint
# means; a NaN code (e4m3 0x7F/0xFF, E8M0 byte 255) gives NaN, as torch's dtypes define them (the spec is silent).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by nibble


def dequant_fp8_blocks(w: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16, block: int = 32) -> Tensor:
    """FP8 weights with one E8M0 scale per block x block tile: w [..., N, K] float8_e4m3fn, scale
    [..., N/block, K/block] float8_e8m0fnu -> w[n, k] * scale[n // block, k // block] in `dtype` (N and K
    multiples of block)."""
    *lead, n, k = w.shape
    if n % block or k % block or list(scale.shape) != [*lead, n // block, k // block]:
        raise ValueError(f"dequant_fp8_blocks: weight {list(w.shape)} needs N, K multiples of {block} and scale "
                         f"{[*lead, n // block, k // block]}, got scale {list(scale.shape)}")
    wf = w.float().view(*lead, n // block, block, k // block, block)
    s = scale.float().view(*lead, n // block, 1, k // block, 1)
    return (wf * s).view(*lead, n, k).to(dtype)


def dequant_fp4(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16, group: int = 32) -> Tensor:
    """Packed FP4 (E2M1) weights with one E8M0 scale per `group` along K: packed [..., N, K/2] uint8 (element 2j in
    the low nibble of byte j, 2j+1 in the high one; nibble bit 3 the sign), scale [..., N, K/group]
    float8_e8m0fnu -> e2m1(code[n, k]) * scale[n, k // group] in `dtype`."""
    *lead, n, half = packed.shape
    k = 2 * half
    if k % group or list(scale.shape) != [*lead, n, k // group]:
        raise ValueError(f"dequant_fp4: packed {list(packed.shape)} needs K = {k} a multiple of {group} and scale "
                         f"{[*lead, n, k // group]}, got scale {list(scale.shape)}")
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).view(*lead, n, k).long()
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)[codes]
    s = scale.float().view(*lead, n, k // group, 1)
    return (values.view(*lead, n, k // group, group) * s).view(*lead, n, k).to(dtype)
