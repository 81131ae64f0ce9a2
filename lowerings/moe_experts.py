"""`dsv41::moe_experts`: the routed experts of one MoE layer (spec 2.6) on the expert-sorted rows, GEMM1 (w1||w3,
stacked in one weight or held apart), the clamped SwiGLU times the routing weight, (the FP8 fake quantisation,) GEMM2
(w2): the model's two `torch._grouped_mm` calls and what lies between them."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.lowerings import _checks, _kernels
from dsv41.models import functional

NAME = "moe_experts"
MAX_ROWS = 384  # T * k rows the fusion takes (T = 64 at k = 6): above it the model's _grouped_mm path stays
# Kernel vs reference (same inputs): the GEMMs sum in another order, so g, u and a may round to the neighbouring
# bf16. Outputs agree within KERNEL_RTOL * |want| + KERNEL_ATOL * rms(want row), except in rows where such a bf16
# step then flips the FP8 fake quantisation of an a element by one e4m3 step (1/16..1/8 of it): that moves every
# entry of the row by (step) * w2[:, i], up to amax(a) / (8 rms(a) sqrt(I)) of the row's magnitude in relative L2
# (~2^-5 at Flash sizes; measured on the H200: 1 row in 96 and 1 in 384). Such rows pass when their relative L2
# distance is within FLIPPED_ROW_REL_L2 (twice that estimate), and at most one row in FLIPPED_ROWS_PER does.
KERNEL_RTOL, KERNEL_ATOL = 2.0**-6, 2.0**-5
FLIPPED_ROW_REL_L2, FLIPPED_ROWS_PER = 2.0**-4, 16


GEMM_ALIGN = 8  # bf16 elements in 16 bytes: torch._grouped_mm's row alignment


def _check_gemm_layout(name, w):
    """w's last two dims are a matrix as torch._grouped_mm takes one: one dim of unit stride, the other's stride a
    multiple of GEMM_ALIGN."""
    rows, cols = w.stride()[-2:]
    if not ((cols == 1 and rows % GEMM_ALIGN == 0) or (rows == 1 and cols % GEMM_ALIGN == 0)):
        raise ValueError(f"dsv41::{NAME}: argument '{name}' must have unit stride in one of its last two dims and a "
                         f"multiple of {GEMM_ALIGN} in the other (torch._grouped_mm's layout), got strides {list(w.stride())}")


def _validate(x, token, row_weights, offsets, w13, w2, swiglu_limit, quant_block, w3, impl):
    _checks.check_impl(NAME, impl)
    device = _checks.check_devices(NAME, x=x, token=token, row_weights=row_weights, offsets=offsets, w13=w13, w2=w2,
                                   w3=w3)
    dims = _checks.Dims()
    _checks.check_tensor(NAME, "x", x, torch.bfloat16, "T D", dims)
    _checks.check_tokens(NAME, "x", dims["T"])
    _checks.check_tensor(NAME, "token", token, torch.int64, "M", dims)
    _checks.check_tensor(NAME, "row_weights", row_weights, torch.float32, "M", dims)
    _checks.check_tensor(NAME, "offsets", offsets, torch.int32, "E", dims)
    if dims["E"] < 1:
        raise ValueError(f"dsv41::{NAME}: argument 'offsets' must hold at least one expert (E >= 1), got E = 0")
    _checks.check_tensor(NAME, "w2", w2, torch.bfloat16, "E D I", dims)
    if w3 is None:
        dims.derive("2*I", 2 * dims["I"], "I")
        _checks.check_tensor(NAME, "w13", w13, torch.bfloat16, "E 2*I D", dims)
    else:
        _checks.check_tensor(NAME, "w13", w13, torch.bfloat16, "E I D", dims)
        _checks.check_tensor(NAME, "w3", w3, torch.bfloat16, "E I D", dims)
    for label, name in (("D", "x"), ("I", "w2")):
        _checks.check_scalar(NAME, name, f"{label} = {dims[label]}", dims[label] % GEMM_ALIGN == 0,
                             f"must have {label} a multiple of {GEMM_ALIGN} (torch._grouped_mm's 16-byte rows)")
    for name, w in (("w13", w13), ("w2", w2), ("w3", w3)):
        if w is not None:
            _check_gemm_layout(name, w)
    _checks.check_finite(NAME, "swiglu_limit", swiglu_limit, positive=True)
    _checks.check_scalar(NAME, "quant_block", quant_block, quant_block >= 0, "must be >= 0")
    if quant_block > 0:
        _checks.check_scalar(NAME, "quant_block", quant_block, dims["I"] % quant_block == 0,
                             f"must divide I = {dims['I']} {dims.source('I')}")
    if _checks.values_on_host(token, offsets):
        _checks.check_range(NAME, "token", token, 0, dims["T"] - 1, "T - 1")
        _checks.check_range(NAME, "offsets", offsets, 0, dims["M"], "M")
        if (offsets.diff() < 0).any():
            raise ValueError(f"dsv41::{NAME}: argument 'offsets' must be non-decreasing (the end of each expert's rows)")
        if offsets[-1].item() != dims["M"]:
            raise ValueError(f"dsv41::{NAME}: argument 'offsets' must end at M = {dims['M']} (every row belongs to an "
                             f"expert), got offsets[-1] = {offsets[-1].item()}")
    return device, dims


def reference(x, token, row_weights, offsets, w13, w2, swiglu_limit, quant_block, w3=None):
    """Plain torch, the model's own ops in the model's order (`MoE.forward` of `dsv41.models.model`); with w3 given,
    a `_grouped_mm` each for the gate (w13 = w1) and the up projection (w3)."""
    rows = x[token]
    if w3 is None:
        inter = w2.shape[2]
        gu = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
        g, u = gu[:, :inter], gu[:, inter:]
    else:
        g = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
        u = torch._grouped_mm(rows, w3.transpose(1, 2), offs=offsets)
    a = functional.swiglu_clamped(g, u, swiglu_limit) * row_weights.unsqueeze(-1)
    a = a.to(x.dtype)
    if quant_block > 0:
        a = functional.fp8_fake_quant(a, quant_block)
    return torch._grouped_mm(a, w2.transpose(1, 2), offs=offsets)


def compare_kernel(got: Tensor, want: Tensor) -> str | None:
    """None when the kernel's output is within the module's kernel tolerance of the reference's (NaN never is)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{list(got.shape)} vs the reference's {want.dtype}{list(want.shape)}"
    g, w = got.float(), want.float()
    rms = w.pow(2).mean(dim=-1, keepdim=True).sqrt()
    bad = ~((g - w).abs() <= KERNEL_RTOL * w.abs() + KERNEL_ATOL * rms) | g.isnan() | w.isnan()
    rows = bad.any(dim=-1)
    row_rel_l2 = ((g - w).norm(dim=-1) / w.norm(dim=-1)).nan_to_num(float("inf"))
    flipped = rows & (row_rel_l2 <= FLIPPED_ROW_REL_L2)
    allowed = -(-w.shape[0] // FLIPPED_ROWS_PER)
    if bool((rows & ~flipped).any()) or int(flipped.sum()) > allowed:
        worst = int(((g - w).abs() - KERNEL_RTOL * w.abs()).nan_to_num(float("inf")).argmax())
        return (f"{int(bad.sum())} of {w.numel()} entries in {int(rows.sum())} of {w.shape[0]} rows beyond "
                f"rtol={KERNEL_RTOL:g}, atol={KERNEL_ATOL:g} x row rms ({int(flipped.sum())} of them within a flipped "
                f"FP8 step's relative L2 {FLIPPED_ROW_REL_L2:g}, at most {allowed} allowed); worst "
                f"{g.flatten()[worst].item():.6g} vs {w.flatten()[worst].item():.6g}, row relative L2 up to "
                f"{row_rel_l2[rows].max().item():.3g}")
    return None


@torch.library.custom_op("dsv41::moe_experts", mutates_args=())
def moe_experts(x: Tensor, token: Tensor, row_weights: Tensor, offsets: Tensor, w13: Tensor, w2: Tensor,
                swiglu_limit: float, quant_block: int, w3: Tensor | None = None, impl: str = "auto") -> Tensor:
    """The routed experts on the M = T * k expert-sorted rows (row m: token token[m] at routing weight row_weights[m]).

    x [T, D] bf16, token [M] int64 in [0, T), row_weights [M] fp32, offsets [E] int32 non-decreasing with
    offsets[E - 1] = M (expert e owns rows [offsets[e - 1], offsets[e]), offsets[-1] = 0), w2 [E, D, I] bf16, and
    either w13 [E, 2I, D] bf16 (w1 rows then w3 rows) with w3 None, or w1 and w3 held apart: w13 = w1 [E, I, D] and
    w3 [E, I, D] bf16 (D and I multiples of GEMM_ALIGN = 8, each weight a matrix of unit stride in one of its last
    two dims), swiglu_limit finite and > 0, quant_block >= 0 (0: none; else it divides I).
    For row m of expert e, with W1 = w13[e, :I], W3 = w13[e, I:] (stacked) or W1 = w13[e], W3 = w3[e] (apart):
        g, u = bf16(x[token[m]] @ W1^T), bf16(x[token[m]] @ W3^T)                       fp32 accumulation   [I]
        a    = bf16(silu(min(g, limit)) * clamp(u, -limit, limit) * row_weights[m])     in fp32             [I]
        a    = fp8_fake_quant(a, quant_block)                                           (if quant_block > 0)
        out[m] = bf16(a @ w2[e]^T)                                                      fp32 accumulation   [D]
    -> out [M, D] bf16 (the rows `moe_finalize` combines).
    impl: "auto" | "cute" | "reference" (see `dsv41.lowerings._kernels`).
    """
    device, _ = _validate(x, token, row_weights, offsets, w13, w2, swiglu_limit, quant_block, w3, impl)
    args = (x, token, row_weights, offsets, w13, w2)
    kwargs = dict(swiglu_limit=swiglu_limit, quant_block=quant_block, w3=w3)
    kernel = _kernels.select(NAME, NAME, impl, device, args, kwargs) or reference
    return kernel(*args, **kwargs)


@moe_experts.register_fake
def _(x, token, row_weights, offsets, w13, w2, swiglu_limit, quant_block, w3=None, impl="auto"):
    _, dims = _validate(x, token, row_weights, offsets, w13, w2, swiglu_limit, quant_block, w3, impl)
    return x.new_empty((dims["M"], dims["D"]))
