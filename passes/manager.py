"""The dsv41 pass manager: normalisation, the fusions (most specific first), side-stream scheduling, and
defunctionalisation last (nothing may remove "dead" nodes after it).

It runs inside the backend's inference compiler, before code generation, so Inductor's FX graph cache keys on the
rewritten graph itself (a warm start reruns the passes, then hits that cache). Snapshots of the graph before and
after every pass are taken only when a recorder is attached (the graph-diff tool); in debug mode every pass is
followed by invariant checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from dsv41.passes.complex_arith import real_pairs
from dsv41.passes.fusion import GraphPass, PassResult
from dsv41.passes.normalize import normalize_graph

# Recorders of `dsv41.tools.graphdiff.record(...)`: while one is active, every PassManager reports to it too.
ACTIVE_RECORDERS: list = []


@dataclass
class CompileReport:
    """One compiled graph: `matches[fusion]` = replacements made, `declined[fusion]` = reasons for the candidate
    subgraphs that matched but were not replaced (a check, the token limit, the semantic check, ...),
    `near_misses[fusion]` = the sites found by the fusion's distinctive op that stopped matching past the first
    pattern ops, each with the first differing op, `notes[fusion]` = "no candidate: ..." when the graph holds none
    of the fusion's distinctive ops (or a graph-break note), `passes` = per-pass results in order, `fallback` = why
    the backend handed the graph to plain Inductor (None when it did not)."""

    graph_id: int
    matches: dict[str, int] = field(default_factory=dict)
    declined: dict[str, list[str]] = field(default_factory=dict)
    near_misses: dict[str, list[str]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    passes: list[PassResult] = field(default_factory=list)
    fallback: str | None = None


class NormalizePass(GraphPass):
    name = "normalize"

    def __call__(self, graph: fx.Graph) -> PassResult:
        rewritten, left = real_pairs(graph)  # complex RoPE (DeepSeek's reference) as real pairs, first
        return PassResult(self.name, matches=rewritten + normalize_graph(graph), note="; ".join(left) or None)


class PassManager:
    def __init__(self, config):
        from dsv41.passes import build_passes

        self.config = config
        self.passes: list[GraphPass] = build_passes(config)
        # set by the graph-diff tool: recorder.begin_graph(graph_id, passes), then per pass
        # recorder.snapshot(graph_id, index, pass, recorder.capture(graph) before, ... after, result)
        self.recorder = None

    def run(self, graph: fx.Graph, report: CompileReport) -> CompileReport:
        recorders = [r for r in (self.recorder, *ACTIVE_RECORDERS) if r is not None]  # [] when off: no snapshots
        recorders = list(dict.fromkeys(recorders))
        for r in recorders:
            r.begin_graph(report.graph_id, self.passes)
        for index, p in enumerate(self.passes):
            befores = [r.capture(graph) for r in recorders]
            result = p(graph)
            report.passes.append(result)
            if p.name in self.config.fusions:
                report.matches[p.name] = result.matches
                report.declined[p.name] = [f"{d.pattern} at %{d.anchor}: {d.kind}: {d.reason}" for d in result.declined]
                report.near_misses[p.name] = [
                    f"{a.pattern} at %{a.anchor}: {a.kind} after {a.progress} of {a.total} pattern ops: {a.reason}"
                    for a in result.attempts if not any(a is d for d in result.declined)]
                if result.note:
                    report.notes[p.name] = result.note
            for r, before in zip(recorders, befores):
                r.snapshot(report.graph_id, index, p, before, r.capture(graph), result)
            if self.config.debug:
                check_invariants(graph, p.name)
        return report


def check_invariants(graph: fx.Graph, after: str) -> None:
    """graph.lint() plus: every call_function node carries meta['val']."""
    try:
        graph.lint()
    except Exception as e:
        raise RuntimeError(f"graph invalid after pass {after!r}: {e}") from e
    missing = [n.name for n in graph.nodes if n.op == "call_function" and "val" not in n.meta and _returns_value(n)]
    if missing:
        raise RuntimeError(f"after pass {after!r}: nodes without meta['val']: {missing[:10]}")


def _returns_value(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is None or len(schema.returns) > 0
