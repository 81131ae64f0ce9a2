"""dsv41::moe_route: bit-exact with the model's route on CPU (experts in torch.topk order), on a bf16, fp16 or fp32
router weight; the kernel declines a weight other than bf16; argument errors."""

import pytest
import torch

from dsv41.lowerings import ALL_OPS, _kernels
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
BAD_DTYPE = {
    "gate_weight fp64": (lambda kw: dict(gate_weight=kw["gate_weight"].double()),
                         r"argument 'gate_weight' must be torch.bfloat16 or torch.float16 or torch.float32, got torch.float64"),
    "h fp32": (lambda kw: dict(h=kw["h"].float()), r"argument 'h' must be torch.bfloat16, got torch.float32"),
}


@pytest.mark.parametrize("change", BAD.values(), ids=BAD.keys())
def test_bad_inputs(samples, rejects, change):
    kw = samples("moe_route")
    changes, match = change
    rejects(op, kw, ValueError, match, **changes(kw))


@pytest.mark.parametrize("change", BAD_DTYPE.values(), ids=BAD_DTYPE.keys())
def test_bad_dtypes(samples, rejects, change):
    kw = samples("moe_route")
    changes, match = change
    rejects(op, kw, TypeError, match, **changes(kw))


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16])
def test_weight_in_another_dtype_is_computed_on_as_it_is(samples, weight_dtype):
    """An fp32 (cached) or fp16 router weight: the op routes on the weight's own values, bit-exact with the model's
    route on that weight (an fp32 weight of values no bf16 holds: a cast to bf16 would route otherwise)."""
    kw = samples("moe_route", seed=4)
    kw["gate_weight"] = kw["gate_weight"].float() * (1 + 1e-3 * torch.rand(kw["gate_weight"].shape))
    kw["gate_weight"] = kw["gate_weight"].to(weight_dtype)
    weights, experts = op(**kw, impl="reference")
    want_w, want_e = fn.route(kw["h"], kw["gate_weight"], kw["bias"], kw["topk"], kw["route_scale"], kw["gate_temp"])
    assert torch.equal(experts, want_e) and torch.equal(weights, want_w)
    fake = op(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
    assert [(t.dtype, t.shape) for t in fake] == [(t.dtype, t.shape) for t in (weights, experts)]


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16])
def test_kernel_declines_a_weight_it_does_not_read(samples, weight_dtype):
    """The CuTe DSL kernel reads a bf16 weight: for another dtype its `supports` names the weight's dtype, so on a
    GPU "auto" runs the reference and "cute" raises that reason (the op hands the kernel selection the weight as
    it is)."""
    if _kernels.load("moe_route")[0] is None:
        pytest.skip("the kernel module does not import here (no CUTLASS)")
    kw = samples("moe_route")
    args = (kw["h"], kw["gate_weight"].to(weight_dtype), kw["bias"])
    scalars = dict(topk=kw["topk"], route_scale=kw["route_scale"], gate_temp=kw["gate_temp"])
    reason = _kernels.load("moe_route")[0].supports(*args, **scalars)
    assert reason == f"gate_weight must be torch.bfloat16, got {weight_dtype}"
    cuda = torch.device("cuda")
    assert _kernels.choose("moe_route", "moe_route", "auto", cuda, args, scalars) is None
    with pytest.raises(RuntimeError, match="does not support these inputs: gate_weight must be torch.bfloat16"):
        _kernels.choose("moe_route", "moe_route", "cute", cuda, args, scalars)
