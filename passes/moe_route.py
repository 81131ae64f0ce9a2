"""`moe_route`: router GEMM (fp32) + sqrt-softplus + bias for selection + top-k + gather + normalise + scale.

    scores = sqrt(softplus(h.float() @ W.float()^T / gate_temp));  experts = topk(scores + bias, k)
    weights = scores[experts] / (sum + 1e-20) * route_scale
  -> dsv41::moe_route(h, W, bias, k, route_scale, gate_temp)

k is read from the graph; route_scale and gate_temp are checked against the config. Formulations: the model's,
and one without the division by the temperature (a model that has none, valid when gate_temp == 1). Each is also
traced with an fp32 router weight (`variants`), where the cast to fp32 is no op: a weight the model holds in fp32
(cast once at load time and cached, as serving engines do) is taken as it is, as a bf16 or fp16 weight cast per
call is; the op computes on the weight's fp32 values either way (`dsv41.lowerings.moe_route`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsv41.models import functional as fn
from dsv41.passes.fusion import FusionPass, Replacement
from dsv41.passes.matcher import Pattern

T, D, E = 3, 32, 16
aten = torch.ops.aten


def _inputs(weight_dtype=torch.bfloat16):
    return [torch.empty(T, D, dtype=torch.bfloat16), torch.empty(E, D, dtype=weight_dtype), torch.empty(E)]


def _fp32_weight_inputs():
    return _inputs(torch.float32)


def route_no_temperature(h, gate_w, bias, topk, route_scale):
    scores = torch.sqrt(F.softplus(torch.mm(h.float(), gate_w.float().t())))
    experts = torch.topk(scores + bias, topk, dim=-1).indices
    w = scores.gather(1, experts)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * route_scale, experts


@dataclass(frozen=True)
class RouteForm:
    """A formulation of the router: `temperature`, the router logits divided by gate_temp (else no division: a model
    that has none, valid when gate_temp == 1)."""

    temperature: bool


class MoeRoutePass(FusionPass):
    name = "moe_route"
    form_type = RouteForm
    tolerance = {torch.float32: (1e-7, 1e-6)}  # the weights, normalised in another fp32 order

    def patterns(self):
        c = self.config
        free, defaults = {"topk": (aten.topk.default, 0, 1)}, {"topk": 6}

        def route(h, gate_w, bias, topk):
            return fn.route(h, gate_w, bias, topk, c.route_scale, c.gate_temp)

        def route_plain(h, gate_w, bias, topk):
            return route_no_temperature(h, gate_w, bias, topk, c.route_scale)

        variants = (_fp32_weight_inputs,)
        pats = [Pattern("route", route, _inputs, free, defaults, variants, anchor=aten.topk.default,
                        form=RouteForm(temperature=True))]
        if c.gate_temp == 1.0:
            pats.append(Pattern("route_no_temperature", route_plain, _inputs, free, defaults, variants,
                                anchor=aten.topk.default, form=RouteForm(temperature=False)))
        return pats

    def free_topk_order(self, form):
        """Every formulation: the router's top-k order is no axis of the formulations (all sort), and the op's
        outputs are the sorted top-k, one result of a site's unsorted top-k (TensorRT-LLM's routing methods select
        with `sorted=False`)."""
        return True

    def replacement(self, m):
        h, gate_w, bias = m.inputs
        c = self.config
        return Replacement(torch.ops.dsv41.moe_route.default, (h, gate_w, bias, m.free["topk"], c.route_scale, c.gate_temp, c.kernel), (0, 1))
