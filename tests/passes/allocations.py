"""What the pass manager allocates: every real (not fake, not meta) tensor an ATen op creates while
`PassManager.run` runs, seen by a `TorchDispatchMode` active only there, with its op, shape and bytes. Fake tensors
(the graph's `meta["val"]`, traces of patterns and references) take no memory and are not counted; an op's output
that shares storage with one of its inputs (a view) allocates nothing and is not counted either."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from dsv41.passes.manager import PassManager


@dataclass
class Allocation:
    op: str
    shape: tuple
    dtype: torch.dtype
    nbytes: int


@dataclass
class PassAllocations:
    """The real tensors allocated while the pass manager ran (every run inside the `record` block), the pass
    manager's wall time, and per run (the names of the nodes it was given, the graph it returned)."""

    allocations: list[Allocation] = field(default_factory=list)
    seconds: float = 0.0
    graphs: list = field(default_factory=list)

    def largest(self) -> Allocation | None:
        return max(self.allocations, key=lambda a: a.nbytes, default=None)

    def largest_bytes(self) -> int:
        a = self.largest()
        return 0 if a is None else a.nbytes


def _real(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.device.type != "meta"


class _AllocationMode(TorchDispatchMode):
    def __init__(self, log: PassAllocations):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if _real(t)}
        for t in pytree.tree_leaves(out):
            if _real(t) and t.untyped_storage().data_ptr() not in inputs:
                self.log.allocations.append(Allocation(str(func), tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return out


@contextlib.contextmanager
def record():
    """Inside: every `PassManager.run` records its real allocations and time into the yielded PassAllocations."""
    log = PassAllocations()
    run = PassManager.run

    def recorded(self, graph, report):
        start = time.perf_counter()
        log.graphs.append(({n.name for n in graph.nodes}, graph))
        try:
            with _AllocationMode(log):
                return run(self, graph, report)
        finally:
            log.seconds += time.perf_counter() - start

    PassManager.run = recorded
    try:
        yield log
    finally:
        PassManager.run = run


def eager_allocations(fn, *args) -> PassAllocations:
    """The real tensors `fn(*args)` allocates when run eagerly (its activations; no grad)."""
    log = PassAllocations()
    with torch.no_grad(), _AllocationMode(log):
        fn(*args)
    return log
