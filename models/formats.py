"""The checkpoint's weight formats (spec 1.3) and their quantisers.

- FP8: W [N, K] float8_e4m3fn plus a scale [ceil(N/32), ceil(K/32)] float8_e8m0fnu, one per 32x32 block:
  W_deq[n, k] = e4m3(W[n, k]) * 2^(scale_byte[n // 32, k // 32] - 127).
- FP4 (routed experts): W [N, K/2], two E2M1 codes per byte (low nibble = element 2j, high nibble = element 2j+1;
  nibble bit 3 = sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}), plus a scale [N, K/32] float8_e8m0fnu, one per
  1x32 group along K: W_deq[n, k] = e2m1(code[n, k]) * scale[n, k // 32]. The checkpoint stores the bytes as I8;
  the model holds them as uint8 (the same bytes).
- E8M0: one exponent byte b meaning 2^(b - 127); byte 255 is NaN (torch.float8_e8m0fnu, safetensors F8_E8M0).

Both dequantisations are exact in fp32, and in bf16 wherever the product is a normal bf16 number (an e4m3 or e2m1
value times a power of two). The quantisers here are host code (they check their input); the model's forward
dequantises with `dsv41.models.functional.dequant_fp8_blocks` / `dequant_fp4`, the loader with its own
`dequantize_fp8` / `dequantize_fp4`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv41.models.functional import FP4_MAX, FP8_MAX, e2m1_round

FP8_BLOCK = 32  # FP8 weight scale block: 32 x 32
FP4_GROUP = 32  # FP4 weight scale group: 1 x 32 along K
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of a 3-bit E2M1 code
_E2M1_MAG = torch.tensor(E2M1_VALUES)


def _ceil_log2(x: Tensor) -> Tensor:
    """ceil(log2(x)) as int32 for positive finite fp32 x, exact: x = m * 2^e with m in [0.5, 1) (frexp), so
    ceil(log2 x) = e - 1 when m == 0.5 (x a power of two) and e otherwise."""
    m, e = torch.frexp(x)
    return e - (m == 0.5).to(torch.int32)


def _e8m0(exponent: Tensor) -> Tensor:
    """Integer exponents in [-127, 127] -> float8_e8m0fnu scales 2^exponent (byte = exponent + 127)."""
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2_scale_exponent(amax: Tensor, qmax: float) -> Tensor:
    """The E8M0 exponent ceil(log2(amax / qmax)), amax floored at qmax * 2^-126 (all-zero blocks get 2^-126)."""
    return _ceil_log2(amax.clamp_min(qmax * 2.0**-126) / qmax)


def _check_2d_finite(w: Tensor, arg: str) -> None:
    if not isinstance(w, Tensor) or w.dim() != 2:
        raise ValueError(f"{arg} must be a 2-D tensor, got {getattr(w, 'shape', type(w).__name__)}")
    if not torch.isfinite(w).all():
        raise ValueError(f"{arg} has non-finite values; they cannot be quantised")


def quantize_fp8(w: Tensor) -> tuple[Tensor, Tensor]:
    """W [N, K] -> (q [N, K] float8_e4m3fn, scale [ceil(N/32), ceil(K/32)] float8_e8m0fnu).

    Per 32x32 block b (edge blocks padded with zeros): s_b = 2^ceil(log2(amax_b / 448)), amax_b floored at
    448 * 2^-126; q = e4m3(clamp(W / s_b, -448, 448)) with round-to-nearest-even.
    """
    _check_2d_finite(w, "w")
    n, k = w.shape
    rb, cb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    wf = F.pad(w.float(), (0, cb * FP8_BLOCK - k, 0, rb * FP8_BLOCK - n)).view(rb, FP8_BLOCK, cb, FP8_BLOCK)
    scale = _e8m0(_pow2_scale_exponent(wf.abs().amax(dim=(1, 3)), FP8_MAX))
    q = (wf / scale.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rb * FP8_BLOCK, cb * FP8_BLOCK)[:n, :k].contiguous(), scale


def quantize_fp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """W [N, K] (K % 32 == 0) -> (packed [N, K/2] int8, scale [N, K/32] float8_e8m0fnu).

    Per 1x32 group g: s_g = 2^ceil(log2(amax_g / 6)), amax_g floored at 6 * 2^-126; x = e2m1(clamp(W / s_g, -6, 6))
    rounded to the nearest E2M1 value, ties to even mantissa; code = 8 * signbit(x) + index of |x| in
    {0, .5, 1, 1.5, 2, 3, 4, 6}; byte j of a row = code[2j] | code[2j+1] << 4.
    """
    _check_2d_finite(w, "w")
    n, k = w.shape
    if k % FP4_GROUP:
        raise ValueError(f"w has K={k} columns; FP4 needs a multiple of {FP4_GROUP}")
    wf = w.float().reshape(n, k // FP4_GROUP, FP4_GROUP)
    scale = _e8m0(_pow2_scale_exponent(wf.abs().amax(-1), FP4_MAX))
    x = e2m1_round((wf / scale.float().unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)).view(n, k)
    code = torch.searchsorted(_E2M1_MAG.to(x.device), x.abs().contiguous()) | (torch.signbit(x).to(torch.int64) << 3)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale
