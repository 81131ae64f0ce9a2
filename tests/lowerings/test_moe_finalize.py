"""dsv41::moe_finalize: bit-exact with the model's index_add_ combine + shared-expert add on CPU (bf16 with the
shared expert, fp32 without it, as before a TP all-reduce); argument errors."""

import pytest
import torch

from dsv41.lowerings import ALL_OPS

op = ALL_OPS["moe_finalize"]


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("seed", range(2))
def test_reference_matches_model(samples, shared, seed):
    kw = samples("moe_finalize", seed=seed, shared=shared)
    out, token, t = kw["expert_out"], kw["token"], kw["num_tokens"]
    y = torch.zeros(t, out.shape[1], dtype=torch.float32).index_add_(0, token, out.float())
    want = (y + kw["shared"].float()).to(torch.bfloat16) if shared else y
    got = op(**kw, impl="reference")
    assert got.dtype == want.dtype and torch.equal(got, want)


BAD = {
    "token M": (lambda kw: dict(token=kw["token"][:-1]), r"'token' must have shape \[M\] = \[18\], got \[17\]"),
    "shared T": (lambda kw: dict(shared=kw["shared"][:-1]), r"'shared' must have shape \[T, D\] = \[3, 32\], got \[2, 32\]"),
    "shared D": (lambda kw: dict(shared=kw["shared"][:, :-1]), r"'shared' must have shape \[T, D\] = \[3, 32\]"),
    "num_tokens": (lambda kw: dict(num_tokens=-1), r"'num_tokens' must be in \[0, 2\*\*31 - 1\], got -1"),
}


@pytest.mark.parametrize("change", BAD.values(), ids=BAD.keys())
def test_bad_inputs(samples, rejects, change):
    kw = samples("moe_finalize")
    changes, match = change
    rejects(op, kw, ValueError, match, **changes(kw))
