"""Static compiles of a Dynamo graph whose sizes are symbolic, one per set of sizes that recurs at run time.

The decode fusions need static shapes (a fused op's kernel is built for its T and widths). Dynamo hands the backend
a graph with symbolic sizes under `torch.compile(..., dynamic=True)` and, by default, after it has seen a second
value of a size (automatic dynamic shapes: `torch.compile(model, backend="dsv41")` decoding at batch 1 and then
at batch 2 recompiles with the token count symbolic). Compiled as it is, such a graph declines every fusion whose
inputs have a symbolic shape. When every symbol of the graph is a tensor size (it appears as a dimension of an
input), the backend compiles it as it is AND returns `SizeSpecializedGraph`: a call whose sizes were seen once
before compiles the same graph statically for them (the real inputs as the example inputs, sizes as plain ints,
as a `dynamic=False` recompile would see them) and every later call with those sizes runs that compile. A set of
sizes seen for the first time runs the symbolic compile: a batch size recurs for many steps, a growing cache length
(a cache extended by `torch.cat`, whose length is new at every step) never does, so it never costs a compile.
At most `Dsv41Config.specialize_sizes` static compiles a graph; sizes past that run the symbolic compile, on record.
No compile starts while the current CUDA stream is capturing (that call runs the symbolic compile): call every
batch size twice before capturing it.

A graph with a symbol that is not a tensor size (an int argument Dynamo made symbolic, such as a decode position
passed as a Python int, which changes every step) is compiled as Dynamo gave it, and only so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.fx as fx

log = logging.getLogger("dsv41")

RECURRENCES_BEFORE_COMPILE = 1  # earlier calls with the same sizes before a call compiles them statically
_SEEN_LIMIT = 256  # sets of sizes remembered as seen but not compiled (forgotten all at once past this)


def size_locations(gm: fx.GraphModule) -> dict[str, tuple[int, int]] | None:
    """{symbol: (input index, dim)}: where each symbol of a Dynamo graph can be read at run time, a dimension of an
    input tensor that is that symbol. None when the graph has no symbol, or has one that is no input's dimension
    (an int argument made symbolic), or its inputs carry no example values."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    located: dict[str, tuple[int, int]] = {}
    symbols: set[str] = set()
    for i, node in enumerate(placeholders):
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.SymInt):
            symbols |= {str(s) for s in value.node.expr.free_symbols}
        elif isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    expr = size.node.expr
                    symbols |= {str(s) for s in expr.free_symbols}
                    if expr.is_Symbol:
                        located.setdefault(str(expr), (i, d))
            for stride in value.stride():
                if isinstance(stride, torch.SymInt):
                    symbols |= {str(s) for s in stride.node.expr.free_symbols}
        elif value is None:
            return None
    if not symbols or symbols - set(located):
        return None
    return dict(sorted(located.items()))


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class SizeSpecializedGraph:
    """A Dynamo graph with symbolic sizes: its symbolic compile, and static compiles of recurring sizes (module
    docstring). `compile_static(gm, example_inputs, sizes)` compiles gm for the real inputs of one call (None: it
    could not, on record); `limit` is the most static compiles; `on_overflow(sizes)` records a set of sizes past it."""

    def __init__(self, gm: fx.GraphModule, symbolic: Callable, locations: dict[str, tuple[int, int]], limit: int,
                 compile_static: Callable, on_overflow: Callable):
        self.gm, self.symbolic, self.locations, self.limit = gm, symbolic, locations, limit
        self._compile_static, self._on_overflow = compile_static, on_overflow
        self.compiled: dict[tuple[int, ...], Callable] = {}
        self._seen: dict[tuple[int, ...], int] = {}

    def __call__(self, *args):
        key = tuple(int(args[i].shape[d]) for i, d in self.locations.values())
        fn = self.compiled.get(key)
        if fn is not None:
            return fn(*args)
        seen = self._seen.get(key, 0)
        if seen < RECURRENCES_BEFORE_COMPILE or _capturing():
            if len(self._seen) >= _SEEN_LIMIT:
                self._seen.clear()
            self._seen[key] = seen + 1
            return self.symbolic(*args)
        sizes = dict(zip(self.locations, key))
        del self._seen[key]
        if len(self.compiled) >= self.limit:
            self._on_overflow(sizes)
            fn = self.symbolic
        else:
            log.info("dsv41: compiling the graph for sizes %s", sizes)
            fn = self._compile_static(self.gm, list(args), sizes) or self.symbolic
        self.compiled[key] = fn
        return fn(*args)
