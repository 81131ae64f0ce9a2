"""dsv41::moe_route: bit-exact with the model's route on CPU (experts in torch.topk order); argument errors."""

import pytest
import torch

from dsv41.lowerings import ALL_OPS
from dsv41.models import functional as fn

op = ALL_OPS["moe_route"]


@pytest.mark.parametrize("seed", range(3))
def test_reference_matches_model(samples, seed):
    kw = samples("moe_route", seed=seed)
    weights, experts = op(**kw, impl="reference")
    want_w, want_e = fn.route(kw["h"], kw["gate_weight"], kw["bias"], kw["topk"], kw["route_scale"], kw["gate_temp"])
    assert torch.equal(experts, want_e) and torch.equal(weights, want_w)


BAD = {
    "gate_weight D": (lambda kw: dict(gate_weight=kw["gate_weight"][:, :-1]), r"'gate_weight' must have shape \[E, D\] = \[16, 32\]"),
    "bias E": (lambda kw: dict(bias=kw["bias"][:-1]), r"'bias' must have shape \[E\] = \[16\], got \[15\]"),
    "topk zero": (lambda kw: dict(topk=0), r"'topk' must be in \[1, E = 16\] \(from 'gate_weight'\), got 0"),
    "topk > E": (lambda kw: dict(topk=17), r"'topk' must be in \[1, E = 16\] \(from 'gate_weight'\), got 17"),
}


@pytest.mark.parametrize("change", BAD.values(), ids=BAD.keys())
def test_bad_inputs(samples, rejects, change):
    kw = samples("moe_route")
    changes, match = change
    rejects(op, kw, ValueError, match, **changes(kw))
