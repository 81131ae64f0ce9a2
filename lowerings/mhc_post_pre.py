"""`dsv41::mhc_post_pre`: the mHC post of a sublayer output, then the pre (collapse + RMSNorm) of the next one."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.lowerings import _checks, _kernels
from dsv41.models import functional

NAME = "mhc_post_pre"
def validate_streams(op, x, post, comb, pre, norm_weight, dims):
    """The stream arguments shared with `dsv41::allreduce_mhc`; x binds T, hc, D in `dims`."""
    _checks.check_tensor(op, "x", x, torch.bfloat16, "T hc D", dims)
    _checks.check_tensor(op, "post", post, torch.float32, "T hc", dims)
    _checks.check_tensor(op, "comb", comb, torch.float32, "T hc hc", dims)
    _checks.check_tensor(op, "pre", pre, torch.float32, "T hc", dims)
    _checks.check_tensor(op, "norm_weight", norm_weight, torch.bfloat16, "D", dims)


def _validate(y, x, post, comb, pre, norm_weight, eps, norm_rounding, impl):
    _checks.check_impl(NAME, impl)
    _checks.check_finite(NAME, "eps", eps, positive=True)
    _checks.check_choice(NAME, "norm_rounding", norm_rounding, functional.NORM_ROUNDINGS)
    device = _checks.check_devices(NAME, y=y, x=x, post=post, comb=comb, pre=pre, norm_weight=norm_weight)
    dims = _checks.Dims()
    validate_streams(NAME, x, post, comb, pre, norm_weight, dims)
    _checks.check_tensor(NAME, "y", y, torch.bfloat16, "T D", dims)
    return device, dims


# A kernel's outputs against the reference on the same inputs (`_kernels.checking`): x_new may round to the
# neighbouring bf16 value (another fp32 summation order); h, normalised from the kernel's own x_new, may then
# differ by a few bf16 ulps on up to 2% of its elements.
KERNEL_TOL = {"x_new": (2.0**-7, 1e-5, 0.01), "h": (2.0**-6, 2e-2, 0.02)}  # name -> (rtol, atol, max fraction off)


def compare_kernel(got, want) -> str | None:
    """None when x_new and h of a kernel are within KERNEL_TOL of the reference's (no NaN), else why not."""
    for (name, (rtol, atol, frac)), g, w in zip(KERNEL_TOL.items(), got, want, strict=True):
        g32, w32 = g.float(), w.float()
        err = (g32 - w32).abs()
        if g32.isnan().any() or bool((err > atol + rtol * w32.abs()).any()):
            return f"{name}: max |kernel - reference| {err.max().item():.3g} beyond rtol={rtol:g} atol={atol:g} (or NaN)"
        if (g != w).sum().item() > max(4, frac * g.numel()):
            return f"{name}: {(g != w).sum().item()} of {g.numel()} elements differ (at most {frac:.0%})"
    return None


def reference(y, x, post, comb, pre, norm_weight, eps, norm_rounding="fp32_weight"):
    """Plain torch, the model's own functions in the model's order (the RMSNorm rounded as `norm_rounding` says)."""
    x_new = functional.hc_post(y, x, post, comb)
    return x_new, functional.rms_norm(functional.hc_collapse(x_new, pre), norm_weight, eps, norm_rounding)


def post_pre(op, impl, device, y, x, post, comb, pre, norm_weight, eps, norm_rounding="fp32_weight"):
    """The kernel of dsv41.kernels.mhc_post_pre or the reference, chosen for `op` by `impl`. The kernel is asked
    about a rounding form other than the model's (its `supports` declines the forms it does not compute)."""
    args, kwargs = (y, x, post, comb, pre, norm_weight), dict(eps=eps)
    if norm_rounding != "fp32_weight":
        kwargs["norm_rounding"] = norm_rounding
    kernel = _kernels.select(op, NAME, impl, device, args, kwargs) or reference
    return kernel(*args, **kwargs)


@torch.library.custom_op("dsv41::mhc_post_pre", mutates_args=())
def mhc_post_pre(y: Tensor, x: Tensor, post: Tensor, comb: Tensor, pre: Tensor, norm_weight: Tensor, eps: float,
                 norm_rounding: str = "fp32_weight", impl: str = "auto") -> tuple[Tensor, Tensor]:
    """Expand a sublayer output into the hc streams, then collapse and normalise the next sublayer's input.

    y [T, D] bf16, x [T, hc, D] bf16, post [T, hc], comb [T, hc, hc], pre [T, hc] fp32, norm_weight [D] bf16, eps finite and > 0:
        x_new[t, k] = bf16(post[t, k] * y[t] + sum_j comb[t, j, k] * x[t, j])       [T, hc, D] bf16
        u[t]        = bf16(sum_j pre[t, j] * x_new[t, j])                            [T, D]
        h[t]        = bf16(norm_weight * u[t] * rsqrt(mean(u[t]^2) + eps))           [T, D] bf16
    with fp32 arithmetic inside each bf16(...); norm_rounding "bf16_then_weight" computes h as
    bf16(norm_weight * bf16(u[t] * rsqrt(mean(u[t]^2) + eps))) instead (`models.functional.rms_norm`).
    impl: "auto" | "cute" | "reference" (see `dsv41.lowerings._kernels`).
    """
    device, _ = _validate(y, x, post, comb, pre, norm_weight, eps, norm_rounding, impl)
    return post_pre(NAME, impl, device, y, x, post, comb, pre, norm_weight, eps, norm_rounding)


@mhc_post_pre.register_fake
def _(y, x, post, comb, pre, norm_weight, eps, norm_rounding="fp32_weight", impl="auto"):
    _, dims = _validate(y, x, post, comb, pre, norm_weight, eps, norm_rounding, impl)
    return x.new_empty(x.shape), x.new_empty((dims["T"], dims["D"]))
