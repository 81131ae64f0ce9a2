"""The choice between a CuTe DSL kernel and the plain-torch reference, made by each op's `impl` argument.

A kernel lives in the module `dsv41.kernels.<kernel>`, imported lazily (CUTLASS may be absent), and exposes

    <kernel>(*tensors, **scalars)                -> the op's outputs
    supports(*tensors, **scalars) -> str | None  # None: supported; otherwise the reason it is not

with the op's tensor arguments positional and its scalar arguments as keywords.

impl = "reference": the reference, always.
impl = "auto":      the kernel when the tensors are CUDA, the module imports and `supports` returns None;
                    the reference otherwise.
impl = "cute":      the kernel; a clear RuntimeError when the tensors are not CUDA, the module does not import
                    or `supports` gives a reason.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch


@functools.cache
def load(kernel: str):
    """(module, None) when `dsv41.kernels.<kernel>` imports, else (None, the ImportError's message)."""
    try:
        return importlib.import_module(f"dsv41.kernels.{kernel}"), None
    except ImportError as e:
        return None, str(e)


def select(op: str, kernel: str, impl: str, device: torch.device, args: tuple, kwargs: dict) -> Callable | None:
    """The kernel entry `op` should call for these arguments under `impl`, or None for the reference."""
    if impl == "reference" or (impl == "auto" and device.type != "cuda"):
        return None
    if device.type != "cuda":
        raise RuntimeError(f"dsv41::{op}: impl='cute' needs CUDA tensors, got tensors on {device}; "
                           f"use impl='auto' or 'reference'")
    module, error = load(kernel)
    if module is None:
        if impl == "auto":
            return None
        raise RuntimeError(f"dsv41::{op}: impl='cute' but the kernel module dsv41.kernels.{kernel} "
                           f"is unavailable ({error})")
    reason = module.supports(*args, **kwargs)
    if reason is None:
        return getattr(module, kernel)
    if impl == "auto":
        return None
    raise RuntimeError(f"dsv41::{op}: impl='cute' but dsv41.kernels.{kernel} does not support these inputs: {reason}")
