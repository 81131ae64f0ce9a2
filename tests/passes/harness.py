"""Helpers of the pass tests: trace a small function to the graph the backend's passes see, run the pass
manager on it, count ops, compile through the real backend.

`aten_graph` traces like the backend's AOT step (functionalised, Inductor's decompositions, fake tensors so every
node carries `meta["val"]`), so a pass sees the same ATen ops as under `torch.compile`; `compile_fx` goes through
Dynamo + AOTAutograd + the pass manager for real (`make_backend(mode="fx")`).
"""

from __future__ import annotations

import math
import re
from collections import Counter

import torch
import torch.fx as fx
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import dsv41.lowerings  # noqa: F401  (registers the dsv41:: ops)
from dsv41.backend import make_backend
from dsv41.config import Dsv41Config
from dsv41.passes import fusion_pass_class
from dsv41.passes.manager import CompileReport, PassManager
from dsv41.passes.printing import graph_code, op_name

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# The model constants the passes check by default (Dsv41Config / spec 2.9).
NORM_EPS, HC_EPS, ITERS = 1e-20, 1e-6, 20


def aten_graph(fn, *inputs) -> fx.GraphModule:
    """fn traced to a functionalised ATen graph with the backend's decompositions (fake tensors: shapes only),
    dead code removed."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in inputs]
        functional = torch.func.functionalize(lambda *args: fn(*args), remove="mutations")
        gm = make_fx(functional, decomposition_table=select_decomp_table())(*fake)
    gm.graph.eliminate_dead_code()  # as AOTAutograd's graphs: decompositions may leave dead casts behind
    gm.recompile()
    return gm


def config(*fusions, **changes) -> Dsv41Config:
    """fx mode, debug invariant checks on, side streams off, only `fusions` enabled (all when none given)."""
    base = Dsv41Config(mode="fx", debug=True, streams=False)
    if fusions:
        base = base.replace(fusions=frozenset(fusions))
    return base.replace(**changes)


def run_passes(fn, inputs, *fusions, **changes) -> tuple[fx.GraphModule, CompileReport]:
    """Trace fn, run the pass manager of config(*fusions, **changes) on the graph; the recompiled module and report."""
    gm = aten_graph(fn, *inputs)
    report = PassManager(config(*fusions, **changes)).run(gm.graph, CompileReport(graph_id=0))
    gm.recompile()
    return gm, report


def op_counts(gm_or_graph) -> Counter:
    graph = gm_or_graph.graph if isinstance(gm_or_graph, fx.GraphModule) else gm_or_graph
    return Counter(op_name(n.target) for n in graph.nodes if n.op == "call_function")


def run_fused_once(fn, inputs, fusion: str, gone: tuple[str, ...]) -> tuple[fx.GraphModule, CompileReport, fx.Node]:
    """run_passes with only `fusion`, asserting that it fused exactly one site into one `dsv41.<fusion>` node and
    left none of the `gone` ops; the module, the report and the fused node."""
    gm, report = run_passes(fn, inputs, fusion)
    assert report.matches == {fusion: 1} and report.fallback is None
    ops = op_counts(gm)
    op = f"dsv41.{fusion}"
    assert ops[op] == 1
    for name in gone:
        assert ops[name] == 0, f"{name} left after the fusion: {ops}"
    return gm, report, next(n for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target) == op)


def run_declined(fn, inputs, fusion: str, **changes) -> str:
    """run_passes with only `fusion`, asserting that it fused nothing; the reasons it recorded (`declined`)."""
    gm, report = run_passes(fn, inputs, fusion, **changes)
    assert report.matches[fusion] == 0 and op_counts(gm)[f"dsv41.{fusion}"] == 0
    return declined(report, fusion)


def pattern_names(fusion: str, **changes) -> set[str]:
    """The names of the formulations (Pattern objects) that the fusion pass accepts under config(**changes)."""
    return {p.name for p in fusion_pass_class(fusion)(config(**changes)).patterns()}


def compile_fx(fn, **changes):
    """torch.compile(fn, backend=make_backend(config(**changes)), fullgraph=True): the compiled fn and backend."""
    backend = make_backend(config(**changes))
    return torch.compile(fn, backend=backend, fullgraph=True), backend


def compiled_matches(fn, inputs_of, seeds=(3, 4), check=None) -> dict[str, int]:
    """fn compiled through the real backend (compile_fx) and run on inputs_of(seed) for each seed, each output
    checked against eager fn by check(got, want, inputs) (default: bit-identical); asserts the compile did not fall
    back, and returns the fusions that matched (those with a nonzero count)."""
    compiled, backend = compile_fx(fn)
    for seed in seeds:
        x = inputs_of(seed)
        got, want = compiled(*x), fn(*x)
        if check is None:
            assert_close(got, want, atol=0, rtol=0)
        else:
            check(got, want, x)
    report = backend.reports[-1]
    assert report.fallback is None
    return {k: v for k, v in report.matches.items() if v}


def declined(report: CompileReport, fusion: str) -> str:
    """All decline reasons of `fusion` in one string (for `in` checks)."""
    return "\n".join(report.declined.get(fusion, []))


def assert_scalar_decline(reasons: str, expected: float, found: float):
    """A 'scalar' decline whose reason names both values ("expected E, found F"; a value may be printed as its
    fp32 rounding, e.g. 9.999999682655225e-21 for 1e-20, so the numbers are compared to fp32 precision)."""
    assert "scalar" in reasons, reasons
    pairs = [(float(e), float(f)) for e, f in re.findall(r"expected ([-+0-9.e]+), found ([-+0-9.e]+)", reasons)]
    assert any(math.isclose(e, expected, rel_tol=1e-6) and math.isclose(f, found, rel_tol=1e-6) for e, f in pairs), reasons


def as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def assert_close(got, want, **tol):
    """Element-wise comparison of (tuples of) tensors: same dtype and shape, values within `tol`."""
    got, want = as_tuple(got), as_tuple(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


def graph_text(gm) -> str:
    return graph_code(gm.graph)


def rand(g: torch.Generator, *shape, dtype=BF16, scale=1.0, mean=0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale + mean).to(dtype)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rope_angles(g, t, half):
    angle = torch.rand(t, half, generator=g) * 2 * math.pi
    return angle.cos(), angle.sin()


def assert_found_once(fn, inputs_of, fusion: str, **tol) -> CompileReport:
    """A foreign formulation: run_passes with only `fusion` fuses exactly one site, no dsv41 op besides it, and
    the fused graph equals eager fn on fresh inputs (inputs_of(1)) to `tol` (exact when none given); the report."""
    gm, report = run_passes(fn, inputs_of(0), fusion)
    assert report.matches == {fusion: 1}, report.declined
    assert op_counts(gm)[f"dsv41.{fusion}"] == 1
    x = inputs_of(1)
    assert_close(gm(*x), fn(*x), **(tol or dict(atol=0, rtol=0)))
    return report
