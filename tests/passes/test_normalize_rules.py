"""The normalisation's rule tables (`dsv41.passes.normalize`: `LOCAL_RULES`, then `CANONICAL_RULES`, per sweep):
each rule declared once with the ops it rewrites at; and on every fusion's pattern traces (244 graphs) the normal
form does not depend on the rules' order within a phase (two shuffles), compared as the computation each graph's
outputs read (blind to node names and order). Known exception, not covered here: on the Megatron-, JAX-, module-
and tutorial-style blocks `sink_units` and `drop_broadcast_views` reach different forms in the other order
(docs/matching.md)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.fx as fx
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from dsv41.config import Dsv41Config
from dsv41.passes import build_passes
from dsv41.passes import normalize
from dsv41.passes.fusion import FusionPass


def test_every_rule_is_declared_once_with_its_ops():
    rules = [r for phase in normalize.PHASES for r in phase]
    assert len({r.name for r in rules}) == len(rules)
    assert len({r.rewrite for r in rules}) == len(rules)
    for r in rules:
        assert callable(r.rewrite) and all(callable(t) for t in (*r.roots, *r.skip)), r.name
        assert not (set(r.roots) & set(r.skip)), r.name


def _raw_traces() -> list[tuple[str, fx.GraphModule]]:
    """Every formulation's trace at each of its example inputs, before normalisation."""
    out = []
    for fusion in build_passes(Dsv41Config()):
        if not isinstance(fusion, FusionPass):
            continue
        for p in fusion.patterns():
            for build in (p.inputs, *p.variants):
                with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                    args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in build()]
                    fn = torch.func.functionalize(lambda *a, p=p: p.search(*a, **p.free_defaults), remove="mutations")
                    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="real")(*args)
                out.append((f"{fusion.name}:{p.name}", gm))
    return out


def _computation(gm: fx.GraphModule) -> str:
    """The graph's computation as text: each value numbered by first reach in a depth-first walk from the outputs
    (arguments in order), so node names and graph order do not show."""
    numbers, lines = {}, []

    def visit(n: fx.Node) -> int:
        if n not in numbers:
            text = f"{n.op} {n.target} {arg(n.args)} {arg(n.kwargs)}"
            numbers[n] = len(numbers)
            lines.append(f"{numbers[n]} = {text}")
        return numbers[n]

    def arg(a) -> str:
        if isinstance(a, fx.Node):
            return f"%{visit(a)}"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(arg(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{arg(v)}" for k, v in a.items()) + "}"
        return repr(a)

    visit(gm.graph.output_node())
    return "\n".join(lines)


@pytest.mark.parametrize("seed", [1, 2])
def test_the_patterns_normal_forms_do_not_depend_on_the_rules_order(seed):
    import copy

    rng = random.Random(seed)
    phases = [rng.sample(list(phase), len(phase)) for phase in normalize.PHASES]
    assert phases != [list(p) for p in normalize.PHASES]
    differ = []
    for name, gm in _raw_traces():
        a, b = copy.deepcopy(gm), copy.deepcopy(gm)
        normalize.normalize_graph(a.graph)
        normalize.normalize_graph(b.graph, phases)
        if _computation(a) != _computation(b):
            differ.append(name)
    assert not differ, differ
