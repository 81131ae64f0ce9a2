"""`dsv41::qkv_norm`: the q and kv RMSNorms of the merged wq_a|wkv output, with the KV RoPE and FP8 fake-quant."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.lowerings import _checks, _kernels
from dsv41.models import functional

NAME = "qkv_norm"


def _validate(qkv, q_weight, kv_weight, cos, sin, eps, quant_block, norm_rounding, impl):
    _checks.check_impl(NAME, impl)
    _checks.check_finite(NAME, "eps", eps, positive=True)
    _checks.check_choice(NAME, "norm_rounding", norm_rounding, functional.NORM_ROUNDINGS)
    device = _checks.check_devices(NAME, qkv=qkv, q_weight=q_weight, kv_weight=kv_weight, cos=cos, sin=sin)
    dims = _checks.Dims()
    _checks.check_tensor(NAME, "q_weight", q_weight, torch.bfloat16, "q_dim", dims)
    _checks.check_tensor(NAME, "kv_weight", kv_weight, torch.bfloat16, "kv_dim", dims)
    dims.derive("q_dim+kv_dim", dims["q_dim"] + dims["kv_dim"], "q_dim", "kv_dim")
    _checks.check_tensor(NAME, "qkv", qkv, torch.bfloat16, "T q_dim+kv_dim", dims)
    if (cos is None) != (sin is None):
        raise ValueError(f"dsv41::{NAME}: arguments 'cos' and 'sin' must both be tensors or both be None")
    _checks.check_tensor(NAME, "cos", cos, torch.float32, "T rd/2", dims, optional=True)
    _checks.check_tensor(NAME, "sin", sin, torch.float32, "T rd/2", dims, optional=True)
    if cos is not None:
        _checks.check_rotary(NAME, dims, "kv_dim")
    _checks.check_scalar(NAME, "quant_block", quant_block, quant_block >= 0, "must be >= 0")
    if quant_block > 0:
        _checks.check_scalar(NAME, "quant_block", quant_block, dims["kv_dim"] % quant_block == 0,
                             f"must divide kv_dim = {dims['kv_dim']} {dims.source('kv_dim')}")
    return device, dims


# A kernel's outputs against the reference on the same inputs (`_kernels.checking`): the kernels sum the squares in
# another order and take an approximate rsqrt, so a bf16 output may round to a neighbour (two roundings under
# "bf16_then_weight": up to 2^-6 relative). Through the RoPE a neighbour moves a rotated element by up to 2^-7 of its
# pair's magnitude (which cancellation may make large against the element), and through the FP8 step by one e4m3
# step (2^-3 relative, or 2^-9 of the block's scale <= 2^-7 of the row's largest entry below the normal range).
# Only a few elements may differ at all: a wrong rounding mode moves about half of them.
KERNEL_TOL = {"qr": (2.0**-6, 1e-5, 0.01), "kv": (2.0**-3, 2.0**-6, 0.02)}  # name -> (rtol, atol x row max, fraction)


def compare_kernel(got, want) -> str | None:
    """None when qr and kv of a kernel are within KERNEL_TOL of the reference's (NaN only where it has NaN), else
    why not: |got - want| <= rtol |want| + atol (for kv: atol x the row's largest |want|), at most the fraction (or
    4) of elements differing at all."""
    for (name, (rtol, atol, frac)), g, w in zip(KERNEL_TOL.items(), got, want, strict=True):
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"{name}: {g.dtype}{list(g.shape)} vs the reference's {w.dtype}{list(w.shape)}"
        g32, w32 = g.float(), w.float()
        bound = atol * (w32.abs().amax(dim=-1, keepdim=True).nan_to_num(0.0) if name == "kv" and w32.numel() else 1.0)
        if not torch.equal(g32.isnan(), w32.isnan()):
            return f"{name}: NaN at {(g32.isnan() != w32.isnan()).sum().item()} entries where the reference has none"
        err = (g32 - w32).abs().nan_to_num(0.0)
        if bool((err > bound + rtol * w32.abs().nan_to_num(0.0)).any()):
            return (f"{name}: max |kernel - reference| {err.max().item():.3g} beyond rtol={rtol:g} "
                    f"atol={atol:g}{' x row max' if name == 'kv' else ''}")
        differing = ((g32 != w32) & ~w32.isnan()).sum().item()
        if differing > max(4, frac * g.numel()):
            return f"{name}: {differing} of {g.numel()} elements differ (at most {frac:.0%})"
    return None


def reference(qkv, q_weight, kv_weight, cos, sin, eps, quant_block, norm_rounding="fp32_weight"):
    """Plain torch, the model's own functions in the model's order (the RMSNorms rounded as `norm_rounding` says)."""
    q_dim = q_weight.shape[0]
    qr = functional.rms_norm(qkv[:, :q_dim], q_weight, eps, norm_rounding)
    kv = functional.rms_norm(qkv[:, q_dim:], kv_weight, eps, norm_rounding)
    if cos is not None:
        kv = functional.apply_rope_tail(kv, cos, sin)
    if quant_block > 0:
        kv = functional.fp8_fake_quant(kv, quant_block)
    return qr, kv


@torch.library.custom_op("dsv41::qkv_norm", mutates_args=())
def qkv_norm(qkv: Tensor, q_weight: Tensor, kv_weight: Tensor, cos: Tensor | None, sin: Tensor | None, eps: float,
             quant_block: int, norm_rounding: str = "fp32_weight", impl: str = "auto") -> tuple[Tensor, Tensor]:
    """RMSNorm of the q and kv parts of qkv, then (optionally) RoPE and FP8 fake-quant of kv.

    qkv [T, q_dim + kv_dim] bf16, q_weight [q_dim] bf16, kv_weight [kv_dim] bf16, cos/sin [T, rd/2] fp32 or both
    None (rd <= kv_dim), eps finite and > 0, quant_block >= 0 (0: no quantisation; else it divides kv_dim):
        qr = rms_norm(qkv[:, :q_dim], q_weight, eps)                                  [T, q_dim] bf16
        kv = rms_norm(qkv[:, q_dim:], kv_weight, eps)                                 [T, kv_dim] bf16
        kv = apply_rope_tail(kv, cos, sin)        (interleaved RoPE on the last rd dims; if cos is given)
        kv = fp8_fake_quant(kv, quant_block)      (ue8m0-scaled e4m3 round trip per block; if quant_block > 0)
    rms_norm(v, w, eps) = bf16(w * v * rsqrt(mean(v^2) + eps)) in fp32 (norm_rounding "fp32_weight"), or
    bf16(w * bf16(v * rsqrt(mean(v^2) + eps))) ("bf16_then_weight", see `dsv41.models.functional.rms_norm`).
    impl: "auto" | "cute" | "reference" (see `dsv41.lowerings._kernels`).
    """
    device, _ = _validate(qkv, q_weight, kv_weight, cos, sin, eps, quant_block, norm_rounding, impl)
    args, kwargs = (qkv, q_weight, kv_weight, cos, sin), dict(eps=eps, quant_block=quant_block, norm_rounding=norm_rounding)
    kernel = _kernels.select(NAME, NAME, impl, device, args, kwargs) or reference
    return kernel(*args, **kwargs)


@qkv_norm.register_fake
def _(qkv, q_weight, kv_weight, cos, sin, eps, quant_block, norm_rounding="fp32_weight", impl="auto"):
    _, dims = _validate(qkv, q_weight, kv_weight, cos, sin, eps, quant_block, norm_rounding, impl)
    return qkv.new_empty((dims["T"], dims["q_dim"])), qkv.new_empty((dims["T"], dims["kv_dim"]))
