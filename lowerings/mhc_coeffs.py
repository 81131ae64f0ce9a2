"""`dsv41::mhc_coeffs`: the mHC coefficients of one site (spec 2.2), = `functional.hc_mixes`."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.lowerings import _checks, _kernels
from dsv41.models import functional

NAME = "mhc_coeffs"


MAX_ITERS = 1024  # Sinkhorn iterations an op call may ask for (the model's 20; the kernel unrolls them)


def _validate(x, fn, base, scale, norm_eps, hc_eps, iters, impl):
    _checks.check_impl(NAME, impl)
    _checks.check_finite(NAME, "norm_eps", norm_eps, positive=True)
    _checks.check_finite(NAME, "hc_eps", hc_eps, positive=True)
    device = _checks.check_devices(NAME, x=x, fn=fn, base=base, scale=scale)
    dims = _checks.Dims()
    _checks.check_tensor(NAME, "x", x, torch.bfloat16, "T hc D", dims)
    hc = dims["hc"]
    dims.derive("(2+hc)*hc", (2 + hc) * hc, "hc")
    dims.derive("hc*D", hc * dims["D"], "hc", "D")
    _checks.check_tensor(NAME, "fn", fn, torch.float32, "(2+hc)*hc hc*D", dims)
    _checks.check_tensor(NAME, "base", base, torch.float32, "(2+hc)*hc", dims)
    _checks.check_tensor(NAME, "scale", scale, torch.float32, "3", dims)
    _checks.check_scalar(NAME, "iters", iters, 1 <= iters <= MAX_ITERS, f"must be in [1, MAX_ITERS = {MAX_ITERS}]")
    return device, dims["T"], hc


# A kernel's outputs against the reference on the same inputs (`_kernels.checking`): the split-K product sums in
# another order, which moves pre/post by ~1e-6 and comb, through the Sinkhorn loop, by ~1e-5.
KERNEL_ATOL = {"pre": 1e-5, "post": 1e-5, "comb": 1e-4}


def compare_kernel(got, want) -> str | None:
    """None when pre, post, comb of a kernel are within KERNEL_ATOL of the reference's (no NaN), else why not."""
    for (name, atol), g, w in zip(KERNEL_ATOL.items(), got, want, strict=True):
        err = (g - w).abs()
        if g.isnan().any() or bool((err > atol).any()):
            return f"{name}: max |kernel - reference| {err.max().item():.3g} > {atol:g} (or NaN)"
    return None


def reference(x, fn, base, scale, norm_eps, hc_eps, iters):
    """Plain torch, the model's own function."""
    return functional.hc_mixes(x, fn, base, scale, norm_eps, hc_eps, iters)


@torch.library.custom_op("dsv41::mhc_coeffs", mutates_args=())
def mhc_coeffs(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, norm_eps: float, hc_eps: float, iters: int,
               impl: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """pre, post, comb of the hc streams x (spec 2.2).

    x [T, hc, D] bf16, fn [(2+hc)*hc, hc*D] fp32, base [(2+hc)*hc] fp32, scale [3] fp32; in fp32, X = x.flatten(1):
        m    = (X @ fn^T) * rsqrt(mean(X^2) + norm_eps)                             [T, (2+hc)*hc]
        pre  = sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps                   [T, hc]
        post = 2 * sigmoid(m[:, hc:2hc] * scale[1] + base[hc:2hc])                  [T, hc]
        comb = sinkhorn(m[:, 2hc:].view(T, hc, hc) * scale[2] + base[2hc:], iters, hc_eps)   [T, hc, hc]
    (sinkhorn: softmax over the last dim + hc_eps, column-normalise, then iters-1 row/column normalisations).
    norm_eps, hc_eps finite and > 0, 1 <= iters <= MAX_ITERS. impl: "auto" | "cute" | "reference" (see `dsv41.lowerings._kernels`).
    """
    device, _, _ = _validate(x, fn, base, scale, norm_eps, hc_eps, iters, impl)
    args, kwargs = (x, fn, base, scale), dict(norm_eps=norm_eps, hc_eps=hc_eps, iters=iters)
    kernel = _kernels.select(NAME, NAME, impl, device, args, kwargs) or reference
    return kernel(*args, **kwargs)


@mhc_coeffs.register_fake
def _(x, fn, base, scale, norm_eps, hc_eps, iters, impl="auto"):
    _, t, hc = _validate(x, fn, base, scale, norm_eps, hc_eps, iters, impl)
    f32 = torch.float32
    return x.new_empty((t, hc), dtype=f32), x.new_empty((t, hc), dtype=f32), x.new_empty((t, hc, hc), dtype=f32)
