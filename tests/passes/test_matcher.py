"""The matcher's input binding (`dsv41.passes.matcher`) on small traced graphs, matched by a one-pattern
`PatternSet` directly: what each pattern input binds, and that the pattern computed on the bound inputs (reshaped
as the op would take them) is the graph's value, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from dsv41.passes.matcher import Derived, MatchResult, Pattern, PatternSet, evaluate
from dsv41.passes.normalize import normalize_graph

from .harness import aten_graph, gen, rand

aten = torch.ops.aten
H, D = 4, 16


def values(gm: fx.GraphModule, *args) -> dict:
    """Every node of gm -> its value on args."""
    seen = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            seen[n] = super().run_node(n)
            return seen[n]

    Recorder(gm).run(*args)
    return seen


def match(fn, args, search, example):
    """fn traced and normalised as the backend does; search as a pattern traced at example() and anchored on its
    sum; (its match at the graph's one sum, the values of the graph's nodes on args)."""
    gm = aten_graph(fn, *args)
    normalize_graph(gm.graph)
    gm.recompile()
    patterns = PatternSet([Pattern("p", search, example, anchor=aten.sum.dim_IntList)])
    (anchor,) = patterns.anchors(gm.graph, 0)
    return patterns.match_one(0, anchor), values(gm, *args)


def weighted_sum(y, z):
    """y [T, D] broadcast against weights z [T, H, 1], summed over H: [T, D] fp32."""
    return (y.float() * z).sum(1)


def one_token(dtype=torch.bfloat16):
    return [torch.empty(1, D, dtype=dtype), torch.empty(1, H, 1)]


def read_directly(y, z):
    """[B=1, L=1, D] fp32 graph input, broadcast as it is (a cast of it would run at [1, D]: its unit dim sinks)."""
    return (y * z).sum(1)


def computed_and_viewed(a, z):
    """a [1, D] computed on and viewed to [B=1, L=1, D], then cast."""
    return (torch.tanh(a).view(1, 1, D).float() * z).sum(1)


def check_values(m, seen):
    """The pattern on the bound inputs (Derived ones computed) is the graph's output, shape and values."""
    got = weighted_sum(*evaluate(m.inputs, seen.__getitem__))
    want = seen[m.outputs[0]]
    assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("fn, y, dtype", [(read_directly, (1, 1, D), torch.float32),
                                          (computed_and_viewed, (1, D), torch.bfloat16)])
def test_an_input_with_leading_unit_dims_that_broadcasting_adds_binds_without_them(fn, y, dtype):
    """At T = 1 a [1, 1, D] value (maybe cast) times [1, H, 1] weights is the product the pattern's [1, D] gives:
    the input binds without the leading unit dim (the op takes [T, D]), a graph input and a value computed in the
    graph alike."""
    g = gen(0)
    args = (rand(g, *y, dtype=dtype), torch.rand(1, H, 1, generator=g))
    m, seen = match(fn, args, weighted_sum, lambda: one_token(dtype))
    assert isinstance(m, MatchResult), m
    bound = m.inputs[0]
    assert isinstance(bound, Derived) and bound.op is aten.reshape.default and list(bound.meta["val"].shape) == [1, D]
    check_values(m, seen)


def test_an_input_keeps_its_unit_dims_where_no_other_operand_has_the_products_rank():
    """Weights given as [H, 1]: the [1, 1, D] input's leading unit dim is what gives the product its [1, H, D] rank
    (and the sum over dim 1 sums the heads); without it the product would be [H, D] and the sum another one. The input
    binds as it is, and the pattern on the bound inputs is the graph's value."""
    g = gen(1)
    args = (rand(g, 1, D), torch.rand(H, 1, generator=g))
    m, seen = match(computed_and_viewed, args, weighted_sum, one_token)
    assert isinstance(m, MatchResult), m
    assert isinstance(m.inputs[0], fx.Node) and list(m.inputs[0].meta["val"].shape) == [1, 1, D]
    check_values(m, seen)
