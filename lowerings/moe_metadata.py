"""`dsv41::moe_metadata`: the grouped-GEMM metadata of one MoE layer's routing (spec 2.6), the model's stable
argsort of the flat expert ids, `order // k`, the per-expert counts and their cumsum, and the gather of the row
weights: what lies between `moe_route` and `moe_experts` / `moe_finalize`."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.lowerings import _checks, _kernels

NAME = "moe_metadata"


def _validate(flat_experts, flat_weights, topk, num_experts, impl):
    _checks.check_impl(NAME, impl)
    device = _checks.check_devices(NAME, flat_experts=flat_experts, flat_weights=flat_weights)
    dims = _checks.Dims()
    _checks.check_tensor(NAME, "flat_experts", flat_experts, torch.int64, "M", dims)
    _checks.check_tensor(NAME, "flat_weights", flat_weights, torch.float32, "M", dims)
    if dims["M"] < 1:
        raise ValueError(f"dsv41::{NAME}: argument 'flat_experts' must hold at least one (token, slot) pair "
                         f"(M >= 1), got M = 0")
    _checks.check_scalar(NAME, "topk", topk, topk >= 1 and dims["M"] % topk == 0,
                         f"must be >= 1 and divide M = {dims['M']} {dims.source('M')} (M = T * topk)")
    _checks.check_scalar(NAME, "num_experts", num_experts, 1 <= num_experts <= _checks.INT32_MAX,
                         "must be in [1, 2**31 - 1] (offsets are int32)")
    if _checks.values_on_host(flat_experts):
        _checks.check_range(NAME, "flat_experts", flat_experts, 0, num_experts - 1, "num_experts - 1")
    return device, dims


def reference(flat_experts, flat_weights, topk, num_experts):
    """Plain torch, the model's own ops in the model's order (`MoE.forward` of `dsv41.models.model`)."""
    order = torch.argsort(flat_experts, stable=True)
    token = order.div(topk, rounding_mode="floor")
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat_experts.device).scatter_add_(
        0, flat_experts, torch.ones_like(flat_experts, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    return token, offsets, flat_weights[order]


@torch.library.custom_op("dsv41::moe_metadata", mutates_args=())
def moe_metadata(flat_experts: Tensor, flat_weights: Tensor, topk: int, num_experts: int,
                 impl: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """The expert-sorted rows of a routing: M = T * topk (token, slot) pairs, pair p = t * topk + slot.

    flat_experts [M] int64 in [0, num_experts) (the routed expert of each pair, after any TP remapping),
    flat_weights [M] fp32 (its routing weight), topk >= 1 dividing M, 1 <= num_experts = E < 2**31:
        order       = the stable argsort of flat_experts (pairs by expert, equal experts in pair order)   [M]
        token       = order // topk                                                         [M] int64
        offsets[e]  = #{p : flat_experts[p] <= e}    (the inclusive cumsum of the counts)    [E] int32
        row_weights = flat_weights[order]                                                   [M] fp32
    so expert e owns rows [offsets[e - 1], offsets[e]) (offsets[-1] = 0): `moe_experts`' token, offsets and
    row_weights, and `moe_finalize`'s token. Values of flat_experts are checked where they are on the host; on a
    device they are not (that would sync): there the kernel sorts an id outside [0, E) after every expert, while
    the reference (the model's scatter_add) fails its device-side index assert.
    impl: "auto" | "cute" | "reference" (see `dsv41.lowerings._kernels`).
    """
    device, _ = _validate(flat_experts, flat_weights, topk, num_experts, impl)
    args, kwargs = (flat_experts, flat_weights), dict(topk=topk, num_experts=num_experts)
    kernel = _kernels.select(NAME, NAME, impl, device, args, kwargs) or reference
    return kernel(*args, **kwargs)


@moe_metadata.register_fake
def _(flat_experts, flat_weights, topk, num_experts, impl="auto"):
    _, dims = _validate(flat_experts, flat_weights, topk, num_experts, impl)
    m = dims["M"]
    return (flat_experts.new_empty((m,)), flat_experts.new_empty((num_experts,), dtype=torch.int32),
            flat_weights.new_empty((m,)))
