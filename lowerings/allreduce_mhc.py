"""`dsv41::allreduce_mhc`: the TP all-reduce of a sublayer output fused with `dsv41::mhc_post_pre`.

On CUDA, for a process group opted in with `enable_symmetric_memory`, one kernel does both (dsv41.kernels.allreduce_mhc:
a one-shot all-reduce through symmetric memory); otherwise, and as the reference, NCCL's all-reduce is followed by
`dsv41::mhc_post_pre`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.lowerings import _checks, _kernels
from dsv41.lowerings.mhc_post_pre import post_pre, validate_streams
from dsv41.lowerings.mhc_post_pre import compare_kernel  # noqa: F401  the fused kernel is judged as mhc_post_pre's
from dsv41.lowerings.mhc_post_pre import reference as post_pre_reference

NAME = "allreduce_mhc"

_SYMMETRIC_GROUPS: set[str] = set()  # groups opted in to the fused symmetric-memory kernel


def enable_symmetric_memory(group_name: str, enabled: bool = True) -> None:
    """Opt the process group ``group_name`` in to (or out of) the fused one-shot kernel of
    `dsv41.kernels.allreduce_mhc` (impl "auto" and "cute"); every rank of the group must make the same call. The
    kernel's symmetric workspace is allocated collectively at the group's first call outside CUDA-graph capture."""
    if not isinstance(group_name, str):
        raise TypeError(f"dsv41::{NAME}: 'group_name' must be a str, got {type(group_name).__name__}")
    if not isinstance(enabled, bool):
        raise TypeError(f"dsv41::{NAME}: 'enabled' must be a bool, got {type(enabled).__name__}")
    (_SYMMETRIC_GROUPS.add if enabled else _SYMMETRIC_GROUPS.discard)(group_name)


def symmetric_memory_enabled(group_name: str) -> bool:
    """Whether ``group_name`` is opted in to the fused kernel (`enable_symmetric_memory`)."""
    return group_name in _SYMMETRIC_GROUPS


def _validate(y, y_add, x, post, comb, pre, norm_weight, eps, impl):
    _checks.check_impl(NAME, impl)
    _checks.check_finite(NAME, "eps", eps, positive=True)
    device = _checks.check_devices(NAME, y=y, y_add=y_add, x=x, post=post, comb=comb, pre=pre, norm_weight=norm_weight)
    dims = _checks.Dims()
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
    group_name: a registered process group's name (`dist.group.WORLD.group_name`). impl (see
    `dsv41.lowerings._kernels`): "cute" and "auto" pick the fused one-shot kernel of `dsv41.kernels.allreduce_mhc`
    (symmetric memory; its `supports` says when it cannot serve: the group not opted in with
    `enable_symmetric_memory`, not NCCL on CUDA, T > 64, ...). Otherwise ("auto", "reference") the all-reduce is
    `_c10d_functional.all_reduce` followed by `dsv41::mhc_post_pre` under the same impl (its kernel or reference).
    Every rank of the group must reach the same choice (same opt-in, shapes and capture state).
    """
    device, _ = _validate(y, y_add, x, post, comb, pre, norm_weight, eps, impl)
    group_name = _group(group_name)
    args, kwargs = (y, y_add, x, post, comb, pre, norm_weight), dict(eps=eps, group_name=group_name)
    fused = _kernels.select(NAME, NAME, impl, device, args, kwargs)
    if fused is not None:
        return fused(*args, **kwargs)
    ys = reduce(y, y_add, group_name)
    return post_pre(NAME, impl, device, ys, x, post, comb, pre, norm_weight, eps)


@allreduce_mhc.register_fake
def _(y, y_add, x, post, comb, pre, norm_weight, eps, group_name, impl="auto"):
    _, dims = _validate(y, y_add, x, post, comb, pre, norm_weight, eps, impl)
    return x.new_empty(x.shape), x.new_empty((dims["T"], dims["D"]))
