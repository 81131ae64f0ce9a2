"""The decomposition of what the passes wrote (passes/decompose.py): a node written after AOT's decompositions (a
replacement's `ones_like(ids).cumsum(0)` offsets, a stable argsort) is traced through Inductor's table and spliced in
with the same values; the debug check names a created node Inductor would not lower; Inductor compiles the result."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch._inductor.decomposition import select_decomp_table

from dsv41.config import Dsv41Config
from dsv41.passes.decompose import PRECISION_BARRIER, DecomposePass, mark_precision_barriers, unlowerable
from dsv41.passes.manager import check_lowerable
from dsv41.passes.streams import STREAM

from .harness import aten_graph

aten = torch.ops.aten


def ids_plus_one(ids):
    return (ids + 1,)


def graph_with_written_nodes(n=7):
    """An ATen graph of `ids + 1` ([n] int64), to which a pass-like rewrite adds the offsets
    `cumsum(ones_like(ids), 0, dtype=int32)` and the stable `argsort(ids)` as outputs, with metadata as a pass
    writes it (fake values, a stream tag); (module, [the written nodes])."""
    gm = aten_graph(ids_plus_one, torch.randint(0, 5, (n,)))
    graph = gm.graph
    (ids,) = graph.find_nodes(op="placeholder")
    out = next(iter(graph.find_nodes(op="output")))
    fake = ids.meta["val"]
    with graph.inserting_before(out):
        ones = graph.call_function(aten.ones_like.default, (ids,))
        offsets = graph.call_function(aten.cumsum.default, (ones, 0), {"dtype": torch.int32})
        order = graph.call_function(aten.argsort.stable, (ids,), {"stable": True})
    ones.meta["val"] = torch.ones_like(fake)
    offsets.meta["val"] = torch.ones_like(fake).cumsum(0, dtype=torch.int32)
    order.meta["val"] = torch.argsort(fake, stable=True)
    for node in (ones, offsets, order):
        node.meta[STREAM] = 1
    out.args = ((*out.args[0], offsets, order),)
    gm.recompile()
    return gm, [ones, offsets, order]


def test_written_ops_inductor_decomposes_are_traced_through_its_table():
    gm, written = graph_with_written_nodes()
    table = select_decomp_table()
    assert aten.ones_like.default in table and aten.argsort.stable in table  # the two ops of the observed failures
    ids = torch.tensor([3, 1, 4, 1, 0, 4, 2])
    want = gm(ids)

    result = DecomposePass(Dsv41Config())(gm.graph)
    gm.recompile()
    assert result.matches == 2 and [r["pattern"] for r in result.replaced] == ["aten::ones_like", "aten::argsort.stable"]
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert not [n for n in calls if n.target in (aten.ones_like.default, aten.argsort.stable)]
    assert unlowerable(calls) == [], [n.format_node() for n in calls]
    created = {name for r in result.replaced for name in r["created"]}
    assert created and all(n.meta.get(STREAM) == 1 for n in calls if n.name in created)  # the stream is inherited
    got = gm(ids)
    assert len(got) == len(want) and all(torch.equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want))


def test_the_debug_check_names_a_written_node_inductor_would_not_lower():
    gm, (ones, offsets, order) = graph_with_written_nodes()
    bad = unlowerable([ones, offsets, order])
    assert bad == [f"%{ones.name} = aten::ones_like: Inductor has a decomposition for it and no lowering",
                   f"%{order.name} = aten::argsort.stable: Inductor has a decomposition for it and no lowering"], bad
    with pytest.raises(RuntimeError, match=f"created nodes Inductor does not lower: %{ones.name}"):
        check_lowerable([ones, offsets, order])


def test_a_graph_with_nothing_written_is_left_as_it_is():
    gm = aten_graph(ids_plus_one, torch.randint(0, 5, (7,)))
    before = [n.format_node() for n in gm.graph.nodes]
    assert DecomposePass(Dsv41Config())(gm.graph).matches == 0
    assert [n.format_node() for n in gm.graph.nodes] == before


def test_inductor_compiles_the_decomposed_graph():
    """The written graph fails in Inductor as the passes left it (the observed `both a fallback and a decomp`), and
    compiles and computes the same values once decomposed."""
    from torch._inductor.compile_fx import compile_fx_inner

    gm, _ = graph_with_written_nodes()
    ids = torch.tensor([3, 1, 4, 1, 0, 4, 2])
    want = gm(ids)
    fake = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    with pytest.raises(Exception, match="both a fallback and a decomp|a decomposition exists"):
        compile_fx_inner(_copy(gm), fake)
    DecomposePass(Dsv41Config())(gm.graph)
    gm.recompile()
    compiled = compile_fx_inner(gm, fake)
    got = compiled([ids])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def test_a_tuple_output_is_spliced_through_its_getitems():
    """A written op with several outputs that Inductor decomposes (`aten.std_mean`) keeps its users' values, read
    through two getitems."""
    def f(x):
        return (x * 2,)

    gm = aten_graph(f, torch.randn(4, 6))
    graph = gm.graph
    (x,) = graph.find_nodes(op="placeholder")
    out = next(iter(graph.find_nodes(op="output")))
    assert aten.std_mean.correction in select_decomp_table()
    with graph.inserting_before(out):
        sm = graph.call_function(aten.std_mean.correction, (x, [1]), {"correction": 0})
        std = graph.call_function(operator.getitem, (sm, 0))
        mean = graph.call_function(operator.getitem, (sm, 1))
    sm.meta["val"] = torch.std_mean(x.meta["val"], [1], correction=0)
    std.meta["val"], mean.meta["val"] = sm.meta["val"]
    out.args = ((*out.args[0], std, mean),)
    gm.recompile()
    value = torch.randn(4, 6)
    want = gm(value)
    assert DecomposePass(Dsv41Config())(gm.graph).matches == 1
    gm.recompile()
    assert not gm.graph.find_nodes(op="call_function", target=aten.std_mean.correction)
    got = gm(value)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_written_nodes_on_low_precision_values_are_rounding_points():
    """`mark_precision_barriers` marks a written op that reads or returns bf16 (Inductor then rounds there, as eager
    does), and not one on integers or fp32 only; Inductor's FX-graph-cache key names the marks
    (`backend.RoundingPoints`), which its hash of the graph's code does not."""
    from dsv41.backend import RoundingPoints

    def f(x, ids):
        return (x.float() * 2, ids + 1)

    gm = aten_graph(f, torch.randn(4, 8).to(torch.bfloat16), torch.randint(0, 5, (7,)))
    calls = {n.name: n for n in gm.graph.nodes if n.op == "call_function"}
    key_before = RoundingPoints(gm.graph).uuid()
    mark_precision_barriers(calls.values())
    marked = {name for name, n in calls.items() if n.meta.get(PRECISION_BARRIER)}
    convert = next(name for name, n in calls.items() if n.target is torch.ops.prims.convert_element_type.default)
    assert marked == {convert}, marked  # the bf16 -> fp32 cast; not the fp32 product, not the int64 add
    assert RoundingPoints(gm.graph).uuid() != key_before


def test_the_backend_traces_with_rounding_points():
    """The graph the passes see was traced under the backend's Inductor settings: its bf16 ops are marked (without
    the marks Inductor keeps fp32 through a fused chain of bf16 pointwise ops, and a foreign block's outputs moved by
    many bf16 ulps in the default mode)."""
    from dsv41.backend import make_backend

    seen = []

    class Spy(DecomposePass):
        def __call__(self, graph):
            seen.append({n.name for n in graph.nodes if n.meta.get(PRECISION_BARRIER)})
            return super().__call__(graph)

    def f(x, y):
        return (x * y + x).sigmoid()

    backend = make_backend(mode="inductor", streams=False, pass_cache=False)  # the passes run (no warm start)
    passes = backend.pass_manager.passes
    index = next(i for i, p in enumerate(passes) if isinstance(p, DecomposePass))
    passes[index] = Spy(backend.config)
    x, y = (torch.randn(4, 8).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        got = torch.compile(f, backend=backend, fullgraph=True, dynamic=False)(x, y)
    torch._dynamo.reset()
    assert seen and len(seen[0]) >= 3, seen  # mul, add, sigmoid (each bf16 in eager)
    assert torch.equal(got, f(x, y))


def test_a_written_op_of_no_tensor_argument_is_traced_in_the_graphs_fake_mode():
    """`zeros([n], dtype=int32)` (decomposed by the table, no tensor argument to take a fake mode from) is traced in
    the fake mode of the graph's inputs."""
    gm = aten_graph(ids_plus_one, torch.randint(0, 5, (7,)))
    graph = gm.graph
    out = next(iter(graph.find_nodes(op="output")))
    with graph.inserting_before(out):
        zeros = graph.call_function(aten.zeros.default, ([5],), {"dtype": torch.int32, "device": torch.device("cpu")})
    zeros.meta["val"] = torch.zeros(5, dtype=torch.int32)
    out.args = ((*out.args[0], zeros),)
    gm.recompile()
    assert aten.zeros.default in select_decomp_table() and unlowerable([zeros])
    assert DecomposePass(Dsv41Config())(graph).matches == 1
    gm.recompile()
    calls = [n for n in graph.nodes if n.op == "call_function"]
    assert unlowerable(calls) == [] and all(isinstance(n.meta["val"], torch._subclasses.FakeTensor) for n in calls)
    got = gm(torch.tensor([1, 2]))
    assert torch.equal(got[1], torch.zeros(5, dtype=torch.int32))
