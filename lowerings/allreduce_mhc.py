"""`dsv41::allreduce_mhc`: the TP all-reduce of a sublayer output fused with `dsv41::mhc_post_pre`."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.lowerings import _checks
from dsv41.lowerings.mhc_post_pre import post_pre, validate_streams
from dsv41.lowerings.mhc_post_pre import reference as post_pre_reference

NAME = "allreduce_mhc"


def _validate(y, y_add, x, post, comb, pre, norm_weight, impl):
    _checks.check_impl(NAME, impl)
    device = _checks.check_devices(NAME, y=y, y_add=y_add, x=x, post=post, comb=comb, pre=pre, norm_weight=norm_weight)
    dims = {}
    validate_streams(NAME, x, post, comb, pre, norm_weight, dims)
    _checks.check_tensor(NAME, "y", y, (torch.bfloat16, torch.float32), "T D", dims)
    _checks.check_tensor(NAME, "y_add", y_add, torch.bfloat16, "T D", dims, optional=True)
    return device, dims


def _group(group_name: str) -> str:
    """group_name, checked to name a registered process group."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        _resolve_process_group(group_name)
    except RuntimeError:
        raise ValueError(f"dsv41::{NAME}: argument 'group_name' does not name a registered process group, "
                         f"got {group_name!r}") from None
    return group_name


def reduce(y, y_add, group_name):
    """bf16(all_reduce_sum(fp32(y)) [+ fp32(y_add)]): exactly the model's attention and MoE output tails."""
    c10d = torch.ops._c10d_functional
    r = c10d.wait_tensor(c10d.all_reduce(y.float(), "sum", group_name))
    return (r if y_add is None else r + y_add.float()).to(torch.bfloat16)


def reference(y, y_add, x, post, comb, pre, norm_weight, eps, group_name):
    """Plain torch: the all-reduce tail, then the mhc_post_pre reference."""
    return post_pre_reference(reduce(y, y_add, group_name), x, post, comb, pre, norm_weight, eps)


@torch.library.custom_op("dsv41::allreduce_mhc", mutates_args=())
def allreduce_mhc(y: Tensor, y_add: Tensor | None, x: Tensor, post: Tensor, comb: Tensor, pre: Tensor,
                  norm_weight: Tensor, eps: float, group_name: str, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """All-reduce a TP-partial sublayer output, then `dsv41::mhc_post_pre`.

    y [T, D] bf16 (attention) or fp32 (routed MoE sum), y_add [T, D] bf16 (shared expert) or None; the rest as in
    `dsv41::mhc_post_pre` (x [T, hc, D] bf16, post/pre [T, hc], comb [T, hc, hc] fp32, norm_weight [D] bf16):
        ys       = bf16(all_reduce_sum(fp32(y), group_name) [+ fp32(y_add)])
        x_new, h = mhc_post_pre(ys, x, post, comb, pre, norm_weight, eps)   -> [T, hc, D], [T, D] bf16
    group_name: a registered process group's name (`dist.group.WORLD.group_name`). The all-reduce is
    `_c10d_functional.all_reduce`; impl ("auto" | "cute" | "reference") chooses the kernel of
    `dsv41::mhc_post_pre` for the rest (see `dsv41.lowerings._kernels`).
    """
    device, _ = _validate(y, y_add, x, post, comb, pre, norm_weight, impl)
    ys = reduce(y, y_add, _group(group_name))
    return post_pre(NAME, impl, device, ys, x, post, comb, pre, norm_weight, eps)


@allreduce_mhc.register_fake
def _(y, y_add, x, post, comb, pre, norm_weight, eps, group_name, impl="auto"):
    _, dims = _validate(y, y_add, x, post, comb, pre, norm_weight, impl)
    return x.new_empty(x.shape), x.new_empty((dims["T"], dims["D"]))
