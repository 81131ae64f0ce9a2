"""Random frozen parameters for the foreign-style blocks (hf_style.py, vllm_style.py)."""

from __future__ import annotations

import torch
from torch import nn


def param_factory(seed: int):
    """p(*shape, scale=None, dtype=bf16, mean=0.0): a frozen parameter of N(mean, scale^2) values drawn from one
    generator seeded with `seed` (scale defaults to shape[-1] ** -0.5, the fan-in scale)."""
    g = torch.Generator().manual_seed(seed)

    def p(*shape, scale=None, dtype=torch.bfloat16, mean=0.0):
        scale = shape[-1] ** -0.5 if scale is None else scale
        return nn.Parameter((torch.randn(shape, generator=g) * scale + mean).to(dtype), requires_grad=False)

    return p
