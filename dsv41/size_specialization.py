"""Static compiles of a Dynamo graph whose sizes are symbolic: one per distinct set of sizes seen at run time.

The decode fusions need static shapes (a fused op's kernel is built for its T and widths). Dynamo hands the backend
a graph with symbolic sizes under `torch.compile(..., dynamic=True)` and, by default, after it has seen a second
value of a size (automatic dynamic shapes: `torch.compile(model, backend="dsv41")` decoding at batch 1 and then
at batch 2 recompiles with the token count symbolic). Compiled as it is, such a graph declines every fusion whose
inputs have a symbolic shape. Instead, when every symbol of the graph is a tensor size (it appears as a dimension
of an input), the backend returns `SizeSpecializedGraph`: on the first call with a new set of sizes it compiles the
same graph statically for them (the real inputs as the example inputs, sizes as plain ints, as a graph compiled with
`dynamic=False` would see them), and calls that compile from then on. At most `Dsv41Config.specialize_sizes`
such compiles; past that, a set of sizes runs the captured graph uncompiled (correct, slow), with a warning and a
report naming the setting. A graph with a symbol that is not a size (an int argument Dynamo made symbolic, such as
a decode position passed as a Python int, which changes every step) is compiled as Dynamo gave it.

Like a graph compiled with `dynamic=False`, a specialisation compiles on its first call: warm up every batch size
before capturing CUDA graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.fx as fx

log = logging.getLogger("dsv41")


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


class SizeSpecializedGraph:
    """A Dynamo graph with symbolic sizes, called through one static compile per set of sizes (module docstring).

    `compile_static(gm, example_inputs, sizes)` compiles gm for the real inputs of one call and returns the callable;
    `limit` is the most sets of sizes compiled; `on_overflow(sizes)` records a set past it."""

    def __init__(self, gm: fx.GraphModule, locations: dict[str, tuple[int, int]], limit: int,
                 compile_static: Callable, on_overflow: Callable):
        self.gm, self.locations, self.limit = gm, locations, limit
        self._compile_static, self._on_overflow = compile_static, on_overflow
        self.compiled: dict[tuple[int, ...], Callable] = {}

    def __call__(self, *args):
        key = tuple(int(args[i].shape[d]) for i, d in self.locations.values())
        fn = self.compiled.get(key)
        if fn is None:
            sizes = dict(zip(self.locations, key))
            if len(self.compiled) >= self.limit:
                self._on_overflow(sizes)
                fn = self.gm.forward
            else:
                log.info("dsv41: compiling graph for sizes %s", sizes)
                fn = self._compile_static(self.gm, list(args), sizes)
            self.compiled[key] = fn
        return fn(*args)
