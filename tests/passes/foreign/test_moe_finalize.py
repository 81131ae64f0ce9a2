"""Foreign formulations of `moe_finalize` (combine of the expert rows + shared add), each differing from the
project's model in one named way. Each must be found exactly once and equal eager bit for bit (the op sums the
rows in index_add's row order; the weighted forms multiply in fp32 before the sum, as written)."""

from __future__ import annotations

import pytest
import torch

from ..harness import assert_found_once
from ..test_moe_finalize import T, inputs, weighted_inputs

FUSION = "moe_finalize"


def shared_first(out, token, shared):
    """operand order: shared + combine."""
    y = torch.zeros(shared.shape[0], out.shape[1], dtype=torch.float32).index_add_(0, token, out.float())
    return (shared.float() + y).to(torch.bfloat16)


def functional_index_add(out, token, shared):
    """other spelling: torch.index_add (not in place) on new_zeros."""
    y = torch.index_add(out.new_zeros(shared.shape[0], out.shape[1], dtype=torch.float32), 0, token, out.float())
    return (y + shared.float()).to(shared.dtype)


def index_put_accumulate(out, token, shared):
    """other op: index_put_ with accumulate=True."""
    y = torch.zeros(shared.shape[0], out.shape[1], dtype=torch.float32)
    y.index_put_((token,), out.float(), accumulate=True)
    return (y + shared.float()).to(shared.dtype)


def weights_after_w2(out, token, w, shared):
    """op contract: the routing weight applied to the down-projection rows in fp32 (vLLM's order)."""
    y = torch.zeros(shared.shape[0], out.shape[1], dtype=torch.float32)
    y.index_add_(0, token, out.to(torch.float32) * w[:, None])
    return (y + shared.float()).to(torch.bfloat16)


def weights_first_operand(out, token, w, shared):
    """op contract + operand order: weight times row (w * out), the combine then shared first in the add."""
    y = torch.zeros(shared.shape[0], out.shape[1], dtype=torch.float32).index_add_(0, token, w.unsqueeze(1) * out.float())
    return (shared.float() + y).to(torch.bfloat16)


def scatter_add_view_expand(out, token):
    """layout: scatter_add over token.view(-1, 1).expand_as(rows), combine only (as under TP)."""
    rows = out.float()
    return torch.zeros(T, out.shape[1], dtype=torch.float32).scatter_add(0, token.view(-1, 1).expand_as(rows), rows)


CASES = {
    "shared_first": (shared_first, inputs),
    "functional_index_add": (functional_index_add, inputs),
    "index_put_accumulate": (index_put_accumulate, inputs),
    "weights_after_w2": (weights_after_w2, weighted_inputs),
    "weights_first_operand": (weights_first_operand, weighted_inputs),
    "scatter_add_view_expand": (scatter_add_view_expand, lambda seed: inputs(seed, shared=False)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_found_once_and_equal_to_eager(name):
    f, inputs_of = CASES[name]
    tol = dict(atol=1e-6, rtol=1e-6) if name.startswith("scatter") else {}  # scatter_add may sum in another order
    assert_found_once(f, inputs_of, FUSION, **tol)
