"""`dsv41::moe_finalize`: the combine of the (already weighted) expert outputs + the shared-expert add."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41.lowerings import _checks, _kernels

NAME = "moe_finalize"


def _validate(expert_out, token, shared, num_tokens, impl):
    _checks.check_impl(NAME, impl)
    device = _checks.check_devices(NAME, expert_out=expert_out, token=token, shared=shared)
    _checks.check_scalar(NAME, "num_tokens", num_tokens, num_tokens >= 0, "must be >= 0")
    dims = {"T": num_tokens}
    _checks.check_tensor(NAME, "expert_out", expert_out, torch.bfloat16, "M D", dims)
    _checks.check_tensor(NAME, "token", token, torch.int64, "M", dims)
    _checks.check_tensor(NAME, "shared", shared, torch.bfloat16, "T D", dims, optional=True)
    if _checks.values_on_host(token):
        _checks.check_range(NAME, "token", token, 0, num_tokens - 1, "num_tokens - 1")
    return device, dims


def reference(expert_out, token, shared, num_tokens):
    """Plain torch, the model's own ops in the model's order."""
    y = torch.zeros(num_tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    y = y.index_add_(0, token, expert_out.float())
    return y if shared is None else (y + shared.float()).to(torch.bfloat16)


@torch.library.custom_op("dsv41::moe_finalize", mutates_args=())
def moe_finalize(expert_out: Tensor, token: Tensor, shared: Tensor | None, num_tokens: int,
                 impl: str = "auto") -> Tensor:
    """Sum each token's expert rows, then add the shared expert.

    expert_out [M, D] bf16 (rows already scaled by their routing weight), token [M] int64 in [0, num_tokens)
    (the token of each row), shared [num_tokens, D] bf16 or None:
        y[t] = sum_{m: token[m] = t} fp32(expert_out[m])     (index_add_ in row order)     [num_tokens, D] fp32
    -> bf16(y + fp32(shared)) [num_tokens, D] if shared is given, else y in fp32 (for a TP all-reduce that follows).
    impl: "auto" | "cute" | "reference" (see `dsv41.lowerings._kernels`).
    """
    device, _ = _validate(expert_out, token, shared, num_tokens, impl)
    args, kwargs = (expert_out, token, shared), dict(num_tokens=num_tokens)
    kernel = _kernels.select(NAME, NAME, impl, device, args, kwargs) or reference
    return kernel(*args, **kwargs)


@moe_finalize.register_fake
def _(expert_out, token, shared, num_tokens, impl="auto"):
    _, dims = _validate(expert_out, token, shared, num_tokens, impl)
    dtype = torch.float32 if shared is None else torch.bfloat16
    return expert_out.new_empty((num_tokens, dims["D"]), dtype=dtype)
