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

Kernel checking (`with checking() as calls:`): every kernel call made meanwhile also runs the op's reference
(`dsv41.lowerings.<kernel>.reference`, same arguments) on the same inputs and appends a `KernelCheck` to `calls`.
This is teacher forcing at op granularity: each call is judged on its own inputs, so an error does not compound
through the layers and a small one (an iteration too few) is seen at any depth. It syncs with the host, so it is
for direct (uncaptured) calls of a compiled step. Outputs are compared by `compare`, unless the op module defines
its own `compare_kernel(got, want) -> str | None`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Kernel-vs-reference tolerance on the same inputs: the kernels keep the references' fp32 arithmetic and rounding
# points but not their summation order, so fp32 outputs agree to a few ulps of their accumulations and a bf16
# output may round to the neighbouring value. An iteration too few in the Sinkhorn loop moves comb by ~1e-4..1e-3.
KERNEL_RTOL = {torch.float32: (2e-5, 1e-6), torch.bfloat16: (2**-7, 1e-5)}  # dtype -> (rtol, atol)


@functools.cache
def load(kernel: str):
    """(module, None) when `dsv41.kernels.<kernel>` imports, else (None, the ImportError's message)."""
    try:
        return importlib.import_module(f"dsv41.kernels.{kernel}"), None
    except ImportError as e:
        return None, str(e)


@dataclass
class KernelCheck:
    """One checked kernel call: the op, its kernel, and None when it agreed with the reference (else why not)."""

    op: str
    kernel: str
    mismatch: str | None


_CHECKING: list[list[KernelCheck]] = []


@contextlib.contextmanager
def checking():
    """Check every kernel call made inside against its reference; yields the list of `KernelCheck`s."""
    calls: list[KernelCheck] = []
    _CHECKING.append(calls)
    try:
        yield calls
    finally:
        _CHECKING.remove(calls)


def compare(got, want) -> str | None:
    """None when the kernel outputs `got` match the reference outputs `want`, else the first difference: same
    dtypes and shapes, integer outputs equal, floating outputs within KERNEL_RTOL of their dtype, NaN only where
    the reference has NaN."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"output {i}: {g.dtype}{list(g.shape)} vs the reference's {w.dtype}{list(w.shape)}"
        if not g.is_floating_point():
            if not torch.equal(g, w):
                return f"output {i}: {(g != w).sum().item()} of {w.numel()} integer entries differ"
            continue
        rtol, atol = KERNEL_RTOL[w.dtype]
        g32, w32 = g.float(), w.float()
        if not torch.equal(g32.isnan(), w32.isnan()):
            return f"output {i}: NaN at {(g32.isnan() != w32.isnan()).sum().item()} entries where the reference has none"
        err = (g32 - w32).abs().nan_to_num(0.0)
        bound = atol + rtol * w32.abs().nan_to_num(0.0)
        if bool((err > bound).any()):
            worst = int((err - bound).argmax())
            return (f"output {i}: {(err > bound).sum().item()} of {w.numel()} entries beyond rtol={rtol:g} atol={atol:g}; "
                    f"worst {g32.flatten()[worst].item():.6g} vs {w32.flatten()[worst].item():.6g}")
    return None


def _checked(op: str, kernel: str, fn: Callable) -> Callable:
    module = importlib.import_module(f"dsv41.lowerings.{kernel}")
    judge = getattr(module, "compare_kernel", compare)

    def call(*args, **kwargs):
        got = fn(*args, **kwargs)
        mismatch = judge(got, module.reference(*args, **kwargs))
        for calls in _CHECKING:
            calls.append(KernelCheck(op, kernel, mismatch))
        return got

    return call


def select(op: str, kernel: str, impl: str, device: torch.device, args: tuple, kwargs: dict) -> Callable | None:
    """The kernel entry `op` should call for these arguments under `impl`, or None for the reference; inside
    `checking()` the entry also checks itself against the reference."""
    fn = choose(op, kernel, impl, device, args, kwargs)
    return _checked(op, kernel, fn) if fn is not None and _CHECKING else fn


def choose(op: str, kernel: str, impl: str, device: torch.device, args: tuple, kwargs: dict) -> Callable | None:
    """The kernel selection: the entry of `dsv41.kernels.<kernel>` for these arguments under `impl`, or None."""
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
