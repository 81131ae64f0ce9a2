"""Argument validation shared by the real and the fake implementation of every `dsv41::` op.

Each check reads metadata only (dtype, sizes, device, layout), so it runs unchanged on fake tensors with
symbolic sizes; the one exception, `check_range`, reads values and runs only where `values_on_host` says they
already are on the host (real CPU tensors, not under tracing), so it never adds a device->host sync. Every error
starts with the op's qualified name and names the offending argument: TypeError for a wrong dtype or a missing
tensor, ValueError for a wrong shape, device, layout, scalar value or index value.

Shapes are written as space-separated dim labels, unified across arguments through one `dims` dict per call:
a label seen for the first time binds to the tensor's size, a label seen before must match, and a label that
is a decimal number is a literal size. `dims` is a `Dims`, which also keeps where each size came from, so a
mismatch names both the argument that disagrees and the one that set the size. Derived sizes are bound by the
caller under descriptive labels (`dims.derive("hc*D", hc * d, "hc", "D")`) before the tensor that carries them is
checked; a size given as a scalar argument is bound with `dims.bind(label, size, argument)`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

IMPLS = ("auto", "cute", "reference")
INT32_MAX = 2**31 - 1  # the largest count a size argument may give: the ops' int32 offsets and kernels' int32 indexing


class Dims(dict):
    """label -> size, plus `sources`: label -> the arguments its size came from (in order, no repeats)."""

    def __init__(self):
        super().__init__()
        self.sources: dict[str, tuple[str, ...]] = {}

    def bind(self, label: str, size, argument: str):
        """Bind `label` to `size`, read from `argument`; returns the bound size (an earlier binding wins)."""
        if label not in self:
            self[label], self.sources[label] = size, (argument,)
        return self[label]

    def derive(self, label: str, size, *labels: str) -> None:
        """Bind `label` to `size`, computed from the sizes of `labels`."""
        self[label] = size
        self.sources[label] = tuple(dict.fromkeys(a for lb in labels for a in self.sources.get(lb, ())))

    def source(self, label: str) -> str:
        """'(from 'x')': where label's size came from, for a message."""
        return "(from " + ", ".join(f"'{a}'" for a in self.sources.get(label, ())) + ")"


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


def check_tensor(op: str, name: str, t: Tensor | None, dtypes, shape: str, dims: Dims, optional: bool = False) -> None:
    """t (None allowed only if `optional`) is a strided tensor of one of `dtypes` whose sizes match the labels of
    `shape`; a mismatch names the arguments that set the sizes it differs from."""
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
        want = int(label) if label.isdecimal() else dims.bind(label, size, name)
        if size != want:
            expected = [int(lb) if lb.isdecimal() else dims.get(lb, n) for lb, n in zip(labels, t.shape)]
            differ = [f"{lb} = {dims[lb]} {dims.source(lb)}" for lb, n in zip(labels, t.shape)
                      if not lb.isdecimal() and dims.sources.get(lb, (name,)) != (name,) and n != dims[lb]]
            raise ValueError(f"dsv41::{op}: argument '{name}' must have shape [{', '.join(labels)}] = {expected}, "
                             f"got {list(t.shape)}" + (f"; {', '.join(differ)}" if differ else ""))


def check_scalar(op: str, name: str, value, ok: bool, requirement: str) -> None:
    """A scalar argument meets `requirement` (a phrase such as 'must be >= 1'); `ok` is its truth."""
    if not ok:
        raise ValueError(f"dsv41::{op}: argument '{name}' {requirement}, got {value!r}")


def check_finite(op: str, name: str, value, positive: bool = False) -> None:
    """A float argument is a finite number (and > 0 if `positive`: an eps, a temperature, a limit)."""
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value > 0 or not positive)
    check_scalar(op, name, value, ok, "must be a finite number > 0" if positive else "must be a finite number")


def check_choice(op: str, name: str, value, choices: tuple) -> None:
    """A string argument is one of `choices`."""
    if value not in choices:
        raise ValueError(f"dsv41::{op}: argument '{name}' must be one of {choices}, got {value!r}")


def check_rotary(op: str, dims: Dims, dim_label: str) -> None:
    """cos/sin with dims["rd/2"] columns rotate rd = 2 * rd/2 trailing dims, at most the dims[dim_label] ones."""
    half_rd, dim = dims["rd/2"], dims[dim_label]
    if 2 * half_rd > dim:
        raise ValueError(f"dsv41::{op}: arguments 'cos' and 'sin' have {half_rd} columns, so they rotate "
                         f"rd = {2 * half_rd} dims, more than {dim_label} = {dim} {dims.source(dim_label)}")


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
