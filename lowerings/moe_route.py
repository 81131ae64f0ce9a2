"""`dsv41::moe_route`: the MoE router (spec 2.6), = `functional.route` with a defined tie rule.

The router weight is taken in the dtype the model holds it in: bf16 as the checkpoint stores it, or fp16 / fp32 (a
serving engine caches an fp32 copy at load time, which the spec allows); the logits are the fp32 GEMM of h and the
weight's fp32 values, which every one of those dtypes converts to exactly. The CuTe DSL kernel reads a bf16 weight
(its `supports` says so for any other), so with another dtype "auto" runs the reference and "cute" raises."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.lowerings import _checks, _kernels

NAME = "moe_route"
# the router weight's dtypes: those whose values the fp32 router GEMM reads exactly
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _validate(h, gate_weight, bias, topk, route_scale, gate_temp, impl):
    _checks.check_impl(NAME, impl)
    _checks.check_finite(NAME, "route_scale", route_scale)
    _checks.check_finite(NAME, "gate_temp", gate_temp, positive=True)
    device = _checks.check_devices(NAME, h=h, gate_weight=gate_weight, bias=bias)
    dims = _checks.Dims()
    _checks.check_tensor(NAME, "h", h, torch.bfloat16, "T D", dims)
    _checks.check_tensor(NAME, "gate_weight", gate_weight, WEIGHT_DTYPES, "E D", dims)
    _checks.check_tensor(NAME, "bias", bias, torch.float32, "E", dims)
    _checks.check_scalar(NAME, "topk", topk, 1 <= topk <= dims["E"], f"must be in [1, E = {dims['E']}] {dims.source('E')}")
    return device, dims


def reference(h, gate_weight, bias, topk, route_scale, gate_temp):
    """Plain torch: the model's function with its top-k taken by a stable descending sort, which orders equal
    biased scores by expert index (the op's tie rule) and gives torch.topk's result wherever they are distinct."""
    logits = torch.mm(h.float(), gate_weight.float().t()) / gate_temp
    scores = torch.sqrt(torch.nn.functional.softplus(logits))
    experts = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :topk].contiguous()
    w = scores.gather(1, experts)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * route_scale, experts


@torch.library.custom_op("dsv41::moe_route", mutates_args=())
def moe_route(h: Tensor, gate_weight: Tensor, bias: Tensor, topk: int, route_scale: float, gate_temp: float,
              impl: str = "auto") -> tuple[Tensor, Tensor]:
    """noaux_tc routing with sqrt-softplus scores: each token's top-k experts and their weights.

    h [T, D] bf16, gate_weight [E, D] bf16, fp16 or fp32 (computed on as its fp32 values), bias [E] fp32, 1 <= topk <= E, route_scale finite, gate_temp finite
    and > 0; in fp32:
        score   = sqrt(softplus((h @ gate_weight^T) / gate_temp))                         [T, E]
        experts = torch.topk(score + bias, topk).indices   (tie rule below)               [T, topk] int64
        weights = score[experts] / (sum_k score[experts] + 1e-20) * route_scale          [T, topk] fp32
    experts come in descending biased score; the tie rule: of equal biased scores the lower expert index ranks
    first (and is selected first at the k-th place). Implementations sum the logits in different orders, so
    compare experts as per-token sets (weights follow their expert) where biased scores are close but not equal.
    impl: "auto" | "cute" | "reference" (see `dsv41.lowerings._kernels`); the kernel takes a bf16 gate_weight only.
    """
    device, _ = _validate(h, gate_weight, bias, topk, route_scale, gate_temp, impl)
    args, kwargs = (h, gate_weight, bias), dict(topk=topk, route_scale=route_scale, gate_temp=gate_temp)
    kernel = _kernels.select(NAME, NAME, impl, device, args, kwargs) or reference
    return kernel(*args, **kwargs)


@moe_route.register_fake
def _(h, gate_weight, bias, topk, route_scale, gate_temp, impl="auto"):
    _, dims = _validate(h, gate_weight, bias, topk, route_scale, gate_temp, impl)
    return h.new_empty((dims["T"], topk), dtype=torch.float32), h.new_empty((dims["T"], topk), dtype=torch.int64)
