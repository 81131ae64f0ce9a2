"""dsv41::mhc_post_pre: bit-exact with the model's hc_post -> hc_collapse -> rms_norm on CPU; shape errors."""

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


BAD = {
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
