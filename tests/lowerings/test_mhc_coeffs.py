"""dsv41::mhc_coeffs: bit-exact with the model's hc_mixes on CPU; shape and scalar errors name the argument."""

import pytest
import torch

from dsv41.lowerings import ALL_OPS
from dsv41.models import functional as fn
from dsv41.models.config import TINY
from dsv41.models.model import DSV41Model

op = ALL_OPS["mhc_coeffs"]


@pytest.mark.parametrize("seed", range(3))
def test_reference_matches_model(samples, seed):
    kw = samples("mhc_coeffs", seed=seed)
    for got, want in zip(op(**kw, impl="reference"), fn.hc_mixes(**kw), strict=True):
        assert torch.equal(got, want)


def test_matches_block_mixes():
    """With the tiny model's weights and eps, as Block._mixes calls it."""
    block = DSV41Model(TINY, layer_ids=[0]).layers["0"]
    x = torch.randn(5, TINY.hc_mult, TINY.dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = op(x, block.hc_ffn_fn, block.hc_ffn_base, block.hc_ffn_scale, TINY.norm_eps, TINY.hc_eps, TINY.hc_sinkhorn_iters)
    for g, w in zip(got, block._mixes(x, "ffn"), strict=True):
        assert torch.equal(g, w)


BAD = {
    "fn rows": (lambda kw: dict(fn=kw["fn"][:-1]), r"'fn' must have shape \[\(2\+hc\)\*hc, hc\*D\] = \[24, 64\]"),
    "fn cols": (lambda kw: dict(fn=kw["fn"][:, :-1]), r"'fn' must have shape"),
    "base size": (lambda kw: dict(base=kw["base"][:-2]), r"'base' must have shape \[\(2\+hc\)\*hc\] = \[24\]"),
    "scale size": (lambda kw: dict(scale=torch.ones(4)), r"'scale' must have shape \[3\] = \[3\], got \[4\]"),
    "iters": (lambda kw: dict(iters=0), r"'iters' must be in \[1, MAX_ITERS = 1024\], got 0"),
}


@pytest.mark.parametrize("change", BAD.values(), ids=BAD.keys())
def test_bad_inputs(samples, rejects, change):
    kw = samples("mhc_coeffs")
    changes, match = change
    rejects(op, kw, ValueError, match, **changes(kw))
