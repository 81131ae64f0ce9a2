"""Op edge cases: errors that name the op and the argument. Value checks (token, n_c) run where the values are on
the host (real CPU tensors, outside tracing); on fake tensors they are skipped, so tracing never reads a value."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dsv41.lowerings  # noqa: F401  (registers the dsv41:: ops)

BF16 = torch.bfloat16
ops = torch.ops.dsv41


def _wo_a(t):
    return dict(o=torch.randn(t, 4, 32).to(BF16), cos=torch.rand(t, 8), sin=torch.rand(t, 8),
                weight=torch.randn(16, 64).to(BF16), groups=2)


def _moe_finalize(token):
    return dict(expert_out=torch.randn(len(token), 16).to(BF16), token=torch.tensor(token), shared=torch.randn(3, 16).to(BF16),
                num_tokens=3)


def _indexer_topk(n_c):
    return dict(q=torch.randn(3, 4, 32).to(BF16), w=torch.rand(3, 4), keys=torch.randn(3, 16, 32).to(BF16),
                n_c=torch.tensor(n_c), candidates=None, topk=6, offset=8, cand_block=4, cand_topk_blocks=0)


def _moe_route(h):
    return dict(h=h, gate_weight=torch.randn(16, 32).to(BF16), bias=torch.randn(16), topk=6, route_scale=1.5, gate_temp=1.0)


@pytest.mark.parametrize("op, kwargs, error, message", [
    ("wo_a", _wo_a(0), ValueError, r"dsv41::wo_a: argument 'o' must hold at least one token \(T >= 1\), got T = 0"),
    ("moe_finalize", _moe_finalize([0, 1, 3, 2]), ValueError,
     r"dsv41::moe_finalize: argument 'token' must be in \[0, num_tokens - 1 = 2\], got token\[2\] = 3"),
    ("moe_finalize", _moe_finalize([0, -1]), ValueError, r"dsv41::moe_finalize: argument 'token' .* got token\[1\] = -1"),
    ("indexer_topk", _indexer_topk([16, 17, 0]), ValueError,
     r"dsv41::indexer_topk: argument 'n_c' must be in \[0, Ncap \(keys.shape\[1\]\) = 16\], got n_c\[1\] = 17"),
    ("indexer_topk", _indexer_topk([3, 2, -1]), ValueError, r"dsv41::indexer_topk: argument 'n_c' .* got n_c\[2\] = -1"),
    ("moe_route", _moe_route(None), TypeError, r"dsv41::moe_route: argument 'h' must be a tensor, got NoneType"),
    ("moe_finalize", dict(_moe_finalize([0, 1]), token=None), TypeError,
     r"dsv41::moe_finalize: argument 'token' must be a tensor, got NoneType"),
])
def test_edge_case_names_the_op_and_the_argument(op, kwargs, error, message):
    with pytest.raises(error, match=message):
        getattr(ops, op)(**kwargs)


def test_optional_tensors_stay_optional():
    assert ops.moe_finalize(**dict(_moe_finalize([0, 1, 2]), shared=None)).dtype == torch.float32
    assert ops.indexer_topk(**_indexer_topk([16, 0, 5]))[0].shape == (3, 6)


def test_wo_a_with_tokens_still_runs():
    assert ops.wo_a(**_wo_a(2)).shape == (2, 16)


@pytest.mark.parametrize("op, kwargs", [("moe_finalize", _moe_finalize([0, 1, 3])), ("indexer_topk", _indexer_topk([16, 17, -1]))])
def test_value_checks_are_skipped_on_fake_tensors(op, kwargs):
    """Under tracing the values are unknown (on a GPU, reading them would sync): the fake runs, shapes only."""
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        getattr(ops, op)(**fake)
