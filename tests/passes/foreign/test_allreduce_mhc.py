"""Foreign formulations of `allreduce_mhc` (TP all-reduce of a sublayer output + mHC post + collapse + RMSNorm),
each the all-reduce tail of a foreign `mhc_post_pre` formulation (tests/passes/foreign/test_mhc_post_pre.py) or
differing in how the reduced output is formed. Each must be found exactly once and agree with eager (bit-exact,
or one bf16 ulp where the formulation sums in another fp32 order), on the 1-process gloo group."""

from __future__ import annotations

import pytest
import torch

from . import test_mhc_post_pre as post_pre
from ..harness import assert_found_once
from ..test_allreduce_mhc import inputs, reduce

FUSION = "allreduce_mhc"


@pytest.fixture(scope="module", autouse=True)
def gloo_world(gloo_group):
    yield
    torch._dynamo.reset()


def attention(streams):
    def f(y_partial, x, post, comb, pre, w):
        return streams(reduce(y_partial.float()).to(torch.bfloat16), x, post, comb, pre, w)
    return f


def ffn_shared_first(y_routed, shared, x, post, comb, pre, w):
    """operand order: the shared expert before the reduced routed sum."""
    y = (shared.float() + reduce(y_routed)).to(shared.dtype)
    return post_pre.mix_first(y, x, post, comb, pre, w)


CASES = {
    "attention_mix_first": (attention(post_pre.mix_first), "attention", {}),
    "attention_none_indexing": (attention(post_pre.none_indexing), "attention", {}),
    "attention_weight_first_norm": (attention(post_pre.weight_first_norm), "attention", {}),
    "attention_square_by_mul": (attention(post_pre.square_by_mul), "attention", {}),
    "attention_bmm_mixing": (attention(post_pre.bmm_mixing), "attention", post_pre.BF16_ULP),
    "ffn_shared_first": (ffn_shared_first, "ffn", {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_found_once_and_equal_to_eager(name):
    f, kind, tol = CASES[name]
    assert_found_once(f, lambda seed: inputs(seed, kind), FUSION, **tol)
