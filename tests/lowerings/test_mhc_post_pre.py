"""dsv41::mhc_post_pre: bit-exact with the model's hc_post -> hc_collapse -> rms_norm on CPU, and with HF's
double-rounding RMSNorm under norm_rounding="bf16_then_weight" (which the CuTe kernel declines); argument errors."""

import pytest
import torch

from dsv41.lowerings import ALL_OPS
from dsv41.models import functional as fn

op = ALL_OPS["mhc_post_pre"]


@pytest.mark.parametrize("seed", range(3))
def test_reference_matches_model(samples, seed):
    kw = samples("mhc_post_pre", seed=seed)
    x_new, h = op(**kw, impl="reference")
    want_x = fn.hc_post(kw["y"], kw["x"], kw["post"], kw["comb"])
    assert torch.equal(x_new, want_x)
    assert torch.equal(h, fn.rms_norm(fn.hc_collapse(want_x, kw["pre"]), kw["norm_weight"], kw["eps"]))


@pytest.mark.parametrize("seed", range(2))
def test_reference_bf16_then_weight_matches_hf_norm(samples, seed):
    kw = samples("mhc_post_pre", seed=seed)
    x_new, h = op(**{**kw, "norm_rounding": "bf16_then_weight"}, impl="reference")
    want_x = fn.hc_post(kw["y"], kw["x"], kw["post"], kw["comb"])
    u = fn.hc_collapse(want_x, kw["pre"]).float()
    want_h = kw["norm_weight"] * (u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + kw["eps"])).bfloat16()
    assert torch.equal(x_new, want_x) and torch.equal(h, want_h)
    assert not torch.equal(h, op(**kw, impl="reference")[1])  # the two roundings are different math here


def test_kernel_declines_bf16_then_weight(samples):
    """The CuTe kernel rounds once: its supports() names the other form, so the reference runs for it."""
    pytest.importorskip("cutlass.cute")
    from dsv41.kernels import mhc_post_pre as kernel

    kw = samples("mhc_post_pre")
    tensors = [kw[k] for k in ("y", "x", "post", "comb", "pre", "norm_weight")]
    reason = kernel.supports(*tensors, eps=kw["eps"], norm_rounding="bf16_then_weight")
    assert reason == "norm_rounding='bf16_then_weight': the kernel rounds the RMSNorm once, after the fp32 weight multiply"


BAD = {
    "norm_rounding": (lambda kw: dict(norm_rounding="twice"),
                      r"'norm_rounding' must be one of \('fp32_weight', 'bf16_then_weight'\), got 'twice'"),
    "y T": (lambda kw: dict(y=kw["y"][:-1]), r"'y' must have shape \[T, D\] = \[3, 16\], got \[2, 16\]"),
    "y D": (lambda kw: dict(y=kw["y"][:, :-1]), r"'y' must have shape \[T, D\]"),
    "post T": (lambda kw: dict(post=kw["post"][:-1]), r"'post' must have shape \[T, hc\] = \[3, 4\]"),
    "comb hc": (lambda kw: dict(comb=kw["comb"][:, :, :-1]), r"'comb' must have shape \[T, hc, hc\] = \[3, 4, 4\]"),
    "pre hc": (lambda kw: dict(pre=kw["pre"][:, :-1]), r"'pre' must have shape \[T, hc\]"),
    "norm_weight D": (lambda kw: dict(norm_weight=kw["norm_weight"][:-1]), r"'norm_weight' must have shape \[D\] = \[16\]"),
}


@pytest.mark.parametrize("change", BAD.values(), ids=BAD.keys())
def test_bad_inputs(samples, rejects, change):
    kw = samples("mhc_post_pre")
    changes, match = change
    rejects(op, kw, ValueError, match, **changes(kw))
