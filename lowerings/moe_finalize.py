"""`dsv41::moe_finalize`: the combine of the expert outputs (weighted before, or by `weights` here after the down
projection, vLLM's order) + the shared-expert add."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.lowerings import _checks, _kernels

NAME = "moe_finalize"


def _validate(expert_out, token, shared, num_tokens, weights, impl):
    _checks.check_impl(NAME, impl)
    device = _checks.check_devices(NAME, expert_out=expert_out, token=token, shared=shared, weights=weights)
    _checks.check_scalar(NAME, "num_tokens", num_tokens, 0 <= num_tokens <= _checks.INT32_MAX, "must be in [0, 2**31 - 1]")
    dims = _checks.Dims()
    dims.bind("T", num_tokens, "num_tokens")
    _checks.check_tensor(NAME, "expert_out", expert_out, torch.bfloat16, "M D", dims)
    _checks.check_tensor(NAME, "token", token, torch.int64, "M", dims)
    _checks.check_tensor(NAME, "shared", shared, torch.bfloat16, "T D", dims, optional=True)
    _checks.check_tensor(NAME, "weights", weights, torch.float32, "M", dims, optional=True)
    if _checks.values_on_host(token):
        _checks.check_range(NAME, "token", token, 0, num_tokens - 1, "num_tokens - 1")
    return device, dims


def reference(expert_out, token, shared, num_tokens, weights=None):
    """Plain torch, the model's own ops in the model's order (rows times their weight in fp32 first if given)."""
    y = torch.zeros(num_tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    rows = expert_out.float() if weights is None else expert_out.float() * weights.unsqueeze(-1)
    y = y.index_add_(0, token, rows)
    return y if shared is None else (y + shared.float()).to(torch.bfloat16)


@torch.library.custom_op("dsv41::moe_finalize", mutates_args=())
def moe_finalize(expert_out: Tensor, token: Tensor, shared: Tensor | None, num_tokens: int,
                 weights: Tensor | None = None, impl: str = "auto") -> Tensor:
    """Sum each token's expert rows (times their routing weight when `weights` is given), then add the shared expert.

    expert_out [M, D] bf16 (rows already scaled by their routing weight, or scaled here), token [M] int64 in
    [0, num_tokens) (the token of each row), shared [num_tokens, D] bf16 or None (0 <= num_tokens < 2**31), weights [M] fp32 or None:
        y[t] = sum_{m: token[m] = t} fp32(expert_out[m]) [* weights[m]]   (index_add_ in row order)   [num_tokens, D] fp32
    -> bf16(y + fp32(shared)) [num_tokens, D] if shared is given, else y in fp32 (for a TP all-reduce that follows).
    impl: "auto" | "cute" | "reference" (see `dsv41.lowerings._kernels`).
    """
    device, _ = _validate(expert_out, token, shared, num_tokens, weights, impl)
    args, kwargs = (expert_out, token, shared), dict(num_tokens=num_tokens, weights=weights)
    kernel = _kernels.select(NAME, NAME, impl, device, args, kwargs) or reference
    return kernel(*args, **kwargs)


@moe_finalize.register_fake
def _(expert_out, token, shared, num_tokens, weights=None, impl="auto"):
    _, dims = _validate(expert_out, token, shared, num_tokens, weights, impl)
    dtype = torch.float32 if shared is None else torch.bfloat16
    return expert_out.new_empty((num_tokens, dims["D"]), dtype=dtype)
