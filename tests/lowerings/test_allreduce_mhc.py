"""dsv41::allreduce_mhc in a 1-process gloo group: bit-exact with the model's all-reduce tails (attention: bf16 y;
MoE: fp32 routed sum + bf16 shared expert) followed by the mHC post/pre, under every impl that runs on the CPU; the
choice between the fused kernel and the NCCL path; argument errors. (The kernel itself: tests/kernels.)"""

import pytest
import torch

from dsv41.lowerings import ALL_OPS, _kernels
from dsv41.lowerings import allreduce_mhc as L
from dsv41.lowerings import mhc_post_pre as post_pre_lowering
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
    for impl in ("reference", "auto"):  # auto on CPU tensors: the NCCL (here gloo) path with the reference
        x_new, h = op(**kw, impl=impl)
        assert torch.equal(x_new, want_x) and torch.equal(h, want_h), impl


def test_cute_needs_cuda(samples, gloo_group):
    with pytest.raises(RuntimeError, match=r"dsv41::allreduce_mhc: impl='cute' needs CUDA tensors, got tensors on cpu"):
        op(**samples("allreduce_mhc", group_name=gloo_group), impl="cute")


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "nccl-path"])
def test_op_calls_the_chosen_kernel(samples, gloo_group, monkeypatch, fused):
    """The op asks `_kernels.select` for the fused kernel (module allreduce_mhc, the op's tensors positional, eps and
    the group by keyword) and returns its outputs; when there is none it runs the all-reduce, then asks for the
    mhc_post_pre kernel under the same impl."""
    kw = samples("allreduce_mhc", group_name=gloo_group, moe=True)
    asked = []
    marker = (kw["x"] + 1, kw["y_add"] - 1)

    def select(op_name, kernel, impl, device, args, kwargs):
        asked.append((op_name, kernel, impl, device.type, len(args), sorted(kwargs)))
        return (lambda *a, **k: marker) if fused and kernel == "allreduce_mhc" else None

    monkeypatch.setattr(_kernels, "select", select)
    got = op(**kw, impl="auto")
    assert asked[0] == ("allreduce_mhc", "allreduce_mhc", "auto", "cpu", 7, ["eps", "group_name"])
    if fused:
        assert len(asked) == 1 and all(torch.equal(g, m) for g, m in zip(got, marker))
    else:
        assert asked[1] == ("allreduce_mhc", "mhc_post_pre", "auto", "cpu", 6, ["eps"])
        want = L.reference(**kw)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_symmetric_memory_opt_in(gloo_group):
    assert not L.symmetric_memory_enabled(gloo_group)
    L.enable_symmetric_memory(gloo_group)
    assert L.symmetric_memory_enabled(gloo_group)
    L.enable_symmetric_memory(gloo_group, enabled=False)
    assert not L.symmetric_memory_enabled(gloo_group)
    with pytest.raises(TypeError, match="'group_name' must be a str, got int"):
        L.enable_symmetric_memory(0)
    with pytest.raises(TypeError, match="'enabled' must be a bool, got str"):
        L.enable_symmetric_memory(gloo_group, enabled="yes")
    # kernel checking judges the fused kernel as mhc_post_pre's kernel (same outputs, same tolerance)
    assert L.compare_kernel is post_pre_lowering.compare_kernel


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
