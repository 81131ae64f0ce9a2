"""Argument validation shared by the real and the fake implementation of every `dsv41::` op.

Each check reads metadata only (dtype, sizes, device, layout), so it runs unchanged on fake tensors with
symbolic sizes; the one exception, `check_range`, reads values and runs only where `values_on_host` says they
already are on the host (real CPU tensors, not under tracing), so it never adds a device->host sync. Every error
starts with the op's qualified name and names the offending argument: TypeError for a wrong dtype or a missing
tensor, ValueError for a wrong shape, device, layout, scalar value or index value.

Shapes are written as space-separated dim labels, unified across arguments through one `dims` dict per call:
a label seen for the first time binds to the tensor's size, a label seen before must match, and a label that
is a decimal number is a literal size. Derived sizes are bound by the caller under descriptive labels (e.g.
`dims["hc*D"] = hc * d`) before the tensor that carries them is checked.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

IMPLS = ("auto", "cute", "reference")


def check_impl(op: str, impl: str) -> None:
    """impl must be one of IMPLS."""
    if impl not in IMPLS:
        raise ValueError(f"dsv41::{op}: argument 'impl' must be one of {IMPLS}, got {impl!r}")


def check_devices(op: str, **tensors: Tensor | None) -> torch.device | None:
    """All given tensors (None and non-tensors skipped: check_tensor names those) on one device, the first one's;
    returns that device."""
    first = None
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            continue
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            raise ValueError(f"dsv41::{op}: argument '{name}' is on {t.device}, expected {first[1]} like '{first[0]}'")
    return None if first is None else first[1]


def check_tensor(op: str, name: str, t: Tensor | None, dtypes, shape: str, dims: dict, optional: bool = False) -> None:
    """t (None allowed only if `optional`) is a strided tensor of one of `dtypes` whose sizes match the labels of
    `shape`."""
    if t is None and optional:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"dsv41::{op}: argument '{name}' must be a tensor, got {type(t).__name__}")
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"dsv41::{op}: argument '{name}' must be {want}, got {t.dtype}")
    if t.layout != torch.strided:
        raise ValueError(f"dsv41::{op}: argument '{name}' must be a strided (dense) tensor, got {t.layout}")
    labels = shape.split()
    if t.dim() != len(labels):
        raise ValueError(f"dsv41::{op}: argument '{name}' must be {len(labels)}-D [{', '.join(labels)}], "
                         f"got shape {list(t.shape)}")
    for label, size in zip(labels, t.shape):
        want = int(label) if label.isdecimal() else dims.setdefault(label, size)
        if size != want:
            expected = [int(lb) if lb.isdecimal() else dims.get(lb, n) for lb, n in zip(labels, t.shape)]
            raise ValueError(f"dsv41::{op}: argument '{name}' must have shape [{', '.join(labels)}] = {expected}, "
                             f"got {list(t.shape)}")


def check_scalar(op: str, name: str, value, ok: bool, requirement: str) -> None:
    """A scalar argument meets `requirement` (a phrase such as 'must be >= 1'); `ok` is its truth."""
    if not ok:
        raise ValueError(f"dsv41::{op}: argument '{name}' {requirement}, got {value!r}")


def check_choice(op: str, name: str, value, choices: tuple) -> None:
    """A string argument is one of `choices`."""
    if value not in choices:
        raise ValueError(f"dsv41::{op}: argument '{name}' must be one of {choices}, got {value!r}")


def check_rotary(op: str, half_rd, dim_label: str, dim) -> None:
    """cos/sin with half_rd columns rotate rd = 2 * half_rd trailing dims, at most the `dim_label` = dim ones."""
    if 2 * half_rd > dim:
        raise ValueError(f"dsv41::{op}: arguments 'cos' and 'sin' have {half_rd} columns, so they rotate "
                         f"rd = {2 * half_rd} dims, more than {dim_label} = {dim}")


def check_tokens(op: str, name: str, t: int) -> None:
    """The token count T (dim 0 of argument `name`) is at least 1."""
    if t < 1:
        raise ValueError(f"dsv41::{op}: argument '{name}' must hold at least one token (T >= 1), got T = {t}")


def values_on_host(*tensors: Tensor | None) -> bool:
    """Whether reading the values of `tensors` is free: real CPU tensors, outside any tracing."""
    return not torch.compiler.is_compiling() and all(
        t is None or (t.device.type == "cpu" and not isinstance(t, FakeTensor)) for t in tensors)


def check_range(op: str, name: str, t: Tensor, low: int, high: int, high_label: str) -> None:
    """Every value of the integer tensor t in [low, high] (high_label names the bound). Reads the values: call it
    only where values_on_host(t)."""
    bad = ((t < low) | (t > high)).nonzero()
    if bad.numel():
        index = tuple(bad[0].tolist())
        where = index[0] if len(index) == 1 else list(index)
        raise ValueError(f"dsv41::{op}: argument '{name}' must be in [{low}, {high_label} = {high}], got "
                         f"{name}[{where}] = {t[index].item()}")
