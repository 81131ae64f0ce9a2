"""dsv41::allreduce_mhc in a 1-process gloo group: bit-exact with the model's all-reduce tails (attention: bf16 y;
MoE: fp32 routed sum + bf16 shared expert) followed by the mHC post/pre; argument errors."""

import pytest
import torch

from dsv41.lowerings import ALL_OPS
from dsv41.models import functional as fn
from dsv41.models.model import _all_reduce

op = ALL_OPS["allreduce_mhc"]


@pytest.mark.parametrize("moe", [False, True], ids=["attention", "moe"])
def test_reference_matches_model(samples, gloo_group, moe):
    kw = samples("allreduce_mhc", group_name=gloo_group, moe=moe)
    y, y_add = kw["y"], kw["y_add"]
    ys = (_all_reduce(y) + y_add.float()).to(torch.bfloat16) if moe else _all_reduce(y.float()).to(torch.bfloat16)
    want_x = fn.hc_post(ys, kw["x"], kw["post"], kw["comb"])
    want_h = fn.rms_norm(fn.hc_collapse(want_x, kw["pre"]), kw["norm_weight"], kw["eps"])
    x_new, h = op(**kw, impl="reference")
    assert torch.equal(x_new, want_x) and torch.equal(h, want_h)


def test_unknown_group_name(samples, gloo_group):
    kw = samples("allreduce_mhc", group_name="no-such-group")
    with pytest.raises(ValueError, match=r"'group_name' does not name a registered process group, got 'no-such-group'"):
        op(**kw)


BAD = {
    "y T": (lambda kw: dict(y=kw["y"][:-1]), ValueError, r"'y' must have shape \[T, D\] = \[3, 16\]"),
    "y_add D": (lambda kw: dict(y_add=kw["y_add"][:, :-1]), ValueError, r"'y_add' must have shape \[T, D\] = \[3, 16\]"),
    "y_add fp32": (lambda kw: dict(y_add=kw["y_add"].float()), TypeError, r"'y_add' must be torch.bfloat16, got torch.float32"),
    "comb T": (lambda kw: dict(comb=kw["comb"][:-1]), ValueError, r"'comb' must have shape \[T, hc, hc\]"),
    "norm_weight D": (lambda kw: dict(norm_weight=kw["norm_weight"][:-1]), ValueError, r"'norm_weight' must have shape \[D\]"),
}


@pytest.mark.parametrize("change", BAD.values(), ids=BAD.keys())
def test_bad_inputs(samples, rejects, change):
    """Validation precedes the collective, so no group is needed to reject."""
    kw = samples("allreduce_mhc", group_name="unused", moe=True)
    changes, exc, match = change
    rejects(op, kw, exc, match, **changes(kw))
