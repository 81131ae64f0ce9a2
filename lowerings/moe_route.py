"""`dsv41::moe_route`: the MoE router (spec 2.6), = `functional.route`."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.lowerings import _checks, _kernels
from dsv41.models import functional

NAME = "moe_route"


def _validate(h, gate_weight, bias, topk, impl):
    _checks.check_impl(NAME, impl)
    device = _checks.check_devices(NAME, h=h, gate_weight=gate_weight, bias=bias)
    dims = {}
    _checks.check_tensor(NAME, "h", h, torch.bfloat16, "T D", dims)
    _checks.check_tensor(NAME, "gate_weight", gate_weight, torch.bfloat16, "E D", dims)
    _checks.check_tensor(NAME, "bias", bias, torch.float32, "E", dims)
    _checks.check_scalar(NAME, "topk", topk, 1 <= topk <= dims["E"], f"must be in [1, E = {dims['E']}]")
    return device, dims


def reference(h, gate_weight, bias, topk, route_scale, gate_temp):
    """Plain torch, the model's own function."""
    return functional.route(h, gate_weight, bias, topk, route_scale, gate_temp)


@torch.library.custom_op("dsv41::moe_route", mutates_args=())
def moe_route(h: Tensor, gate_weight: Tensor, bias: Tensor, topk: int, route_scale: float, gate_temp: float,
              impl: str = "auto") -> tuple[Tensor, Tensor]:
    """noaux_tc routing with sqrt-softplus scores: each token's top-k experts and their weights.

    h [T, D] bf16, gate_weight [E, D] bf16, bias [E] fp32, 1 <= topk <= E; in fp32:
        score   = sqrt(softplus((h @ gate_weight^T) / gate_temp))                         [T, E]
        experts = torch.topk(score + bias, topk).indices                                  [T, topk] int64
        weights = score[experts] / (sum_k score[experts] + 1e-20) * route_scale          [T, topk] fp32
    experts come in torch.topk's order (descending biased score); the order among equal scores is
    torch.topk's and may differ between implementations, so compare experts as per-token sets (weights follow
    their expert). impl: "auto" | "cute" | "reference" (see `dsv41.lowerings._kernels`).
    """
    device, _ = _validate(h, gate_weight, bias, topk, impl)
    args, kwargs = (h, gate_weight, bias), dict(topk=topk, route_scale=route_scale, gate_temp=gate_temp)
    kernel = _kernels.select(NAME, NAME, impl, device, args, kwargs) or reference
    return kernel(*args, **kwargs)


@moe_route.register_fake
def _(h, gate_weight, bias, topk, route_scale, gate_temp, impl="auto"):
    _, dims = _validate(h, gate_weight, bias, topk, impl)
    return h.new_empty((dims["T"], topk), dtype=torch.float32), h.new_empty((dims["T"], topk), dtype=torch.int64)
