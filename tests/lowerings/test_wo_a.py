"""dsv41::wo_a: bit-exact with the model's inverse RoPE + grouped wo_a einsum on CPU; argument errors."""

import pytest
import torch

from dsv41.lowerings import ALL_OPS
from dsv41.models import functional as fn

op = ALL_OPS["wo_a"]


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("seed", range(2))
def test_reference_matches_model(samples, groups, seed):
    kw = samples("wo_a", seed=seed, groups=groups)
    o, w, t, g = kw["o"], kw["weight"], kw["o"].shape[0], groups
    o = fn.apply_rope_tail(o, kw["cos"], kw["sin"], inverse=True)
    want = torch.einsum("tgd,grd->tgr", o.view(t, g, -1), w.view(g, w.shape[0] // g, -1)).flatten(1)
    assert torch.equal(op(**kw, impl="reference"), want)


BAD = {
    "cos T": (lambda kw: dict(cos=kw["cos"][:-1]), r"'cos' must have shape \[T, rd/2\] = \[3, 8\]"),
    "sin rd": (lambda kw: dict(sin=kw["sin"][:, :-1]), r"'sin' must have shape \[T, rd/2\] = \[3, 8\]"),
    "rd > hd": (lambda kw: dict(cos=torch.ones(3, 20), sin=torch.ones(3, 20)), r"rotate rd = 40 dims, more than hd = 32"),
    "groups divides H": (lambda kw: dict(groups=3), r"'groups' must be >= 1 and divide H = 4 \(from 'o'\), got 3"),
    "groups zero": (lambda kw: dict(groups=0), r"'groups' must be >= 1 and divide H = 4 \(from 'o'\), got 0"),
    "weight cols": (lambda kw: dict(weight=kw["weight"][:, :-1]),
                    r"'weight' must have shape \[groups\*R, H\*hd/groups\] = \[16, 64\], got \[16, 63\]"),
    "weight rows": (lambda kw: dict(weight=kw["weight"][:-1]), r"'groups' must divide weight.shape\[0\] = 15 \(R >= 1 rows per group\), got 2"),
}


@pytest.mark.parametrize("change", BAD.values(), ids=BAD.keys())
def test_bad_inputs(samples, rejects, change):
    kw = samples("wo_a")
    changes, match = change
    rejects(op, kw, ValueError, match, **changes(kw))


def test_cos_sin_as_halves_of_a_complex_table(samples, rejects):
    """cos and sin as the real and imaginary halves of a complex64 table (strided views, as
    `dsv41.passes.complex_arith` hands them to the op) give the result of contiguous copies; the complex table
    itself is rejected, naming the argument."""
    kw = samples("wo_a")
    halves = torch.view_as_real(torch.polar(torch.ones_like(kw["cos"]), torch.rand_like(kw["cos"]) * 6))
    cos, sin = halves[..., 0], halves[..., 1]
    assert not cos.is_contiguous()
    got = op(**{**kw, "cos": cos, "sin": sin}, impl="reference")
    assert torch.equal(got, op(**{**kw, "cos": cos.contiguous(), "sin": sin.contiguous()}, impl="reference"))
    rejects(op, kw, TypeError, r"'cos' must be torch.float32, got torch.complex64", cos=torch.view_as_complex(halves))
