"""`dsv41::wo_a`: inverse RoPE of the attention output + the grouped wo_a projection."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.lowerings import _checks, _kernels
from dsv41.models import functional

NAME = "wo_a"


def _validate(o, cos, sin, weight, groups, impl):
    _checks.check_impl(NAME, impl)
    device = _checks.check_devices(NAME, o=o, cos=cos, sin=sin, weight=weight)
    dims = _checks.Dims()
    _checks.check_tensor(NAME, "o", o, torch.bfloat16, "T H hd", dims)
    _checks.check_tokens(NAME, "o", dims["T"])
    _checks.check_tensor(NAME, "cos", cos, torch.float32, "T rd/2", dims)
    _checks.check_tensor(NAME, "sin", sin, torch.float32, "T rd/2", dims)
    _checks.check_rotary(NAME, dims, "hd")
    _checks.check_scalar(NAME, "groups", groups, groups >= 1 and dims["H"] % groups == 0,
                         f"must be >= 1 and divide H = {dims['H']} {dims.source('H')}")
    dims.derive("H*hd/groups", dims["H"] // groups * dims["hd"], "H", "hd")
    _checks.check_tensor(NAME, "weight", weight, torch.bfloat16, "groups*R H*hd/groups", dims)
    _checks.check_scalar(NAME, "groups", groups, dims["groups*R"] % groups == 0 and dims["groups*R"] >= groups,
                         f"must divide weight.shape[0] = {dims['groups*R']} (R >= 1 rows per group)")
    return device, dims


def reference(o, cos, sin, weight, groups):
    """Plain torch, the model's own ops in the model's order."""
    t, r = o.shape[0], weight.shape[0] // groups
    o = functional.apply_rope_tail(o, cos, sin, inverse=True)
    return torch.einsum("tgd,grd->tgr", o.view(t, groups, -1), weight.view(groups, r, -1)).flatten(1)


@torch.library.custom_op("dsv41::wo_a", mutates_args=())
def wo_a(o: Tensor, cos: Tensor, sin: Tensor, weight: Tensor, groups: int, impl: str = "auto") -> Tensor:
    """Undo the RoPE of the attention output, then project each head group with its own wo_a block.

    o [T, H, hd] bf16, cos/sin [T, rd/2] fp32 (rd <= hd), weight [groups*R, (H/groups)*hd] bf16 (R >= 1), groups | H:
        o' = apply_rope_tail(o, cos, sin, inverse=True)            (RoPE by -angle on the last rd dims of each head)
        z[t, g*R + r] = sum_d o'.view(T, groups, (H/groups)*hd)[t, g, d] * weight.view(groups, R, -1)[g, r, d]
    -> z [T, groups*R] bf16 (a bf16 batched GEMM over the groups, as the model's einsum).
    impl: "auto" | "cute" | "reference" (see `dsv41.lowerings._kernels`).
    """
    device, _ = _validate(o, cos, sin, weight, groups, impl)
    args, kwargs = (o, cos, sin, weight), dict(groups=groups)
    kernel = _kernels.select(NAME, NAME, impl, device, args, kwargs) or reference
    return kernel(*args, **kwargs)


@wo_a.register_fake
def _(o, cos, sin, weight, groups, impl="auto"):
    _, dims = _validate(o, cos, sin, weight, groups, impl)
    return o.new_empty((dims["T"], dims["groups*R"]))
