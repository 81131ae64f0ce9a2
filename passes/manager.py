"""The dsv41 pass manager: normalisation, the fusions (most specific first), side-stream scheduling, and
defunctionalisation last (nothing may remove "dead" nodes after it).

It runs inside the backend's inference compiler, before code generation, so Inductor's FX graph cache keys on the
rewritten graph itself. `run_cached` puts `dsv41.pass_cache` in front: a warm start finds the rewritten graph and
the report on disk, keyed by the ATen graph and `fingerprint()`, and runs no pass. Snapshots of the graph before and
after every pass are taken only when a recorder is attached (the graph-diff tool); in debug mode every pass is
followed by invariant checks. Either turns the cache off, since both exist to watch the passes run.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

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
    the backend handed the graph to plain Inductor (None when it did not), `cache` = what the pass cache did (on a
    hit `passes` stays empty: no pass ran)."""

    graph_id: int
    matches: dict[str, int] = field(default_factory=dict)
    declined: dict[str, list[str]] = field(default_factory=dict)
    near_misses: dict[str, list[str]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    passes: list[PassResult] = field(default_factory=list)
    fallback: str | None = None
    cache: str | None = None  # the pass cache: "hit", "miss" (stored), "off: <why>"


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

    def fingerprint(self) -> str:
        """Hash of what decides the passes' output besides the graph: dsv41's sources, the config, torch's version."""
        settings = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)}
        settings = {k: sorted(v) if isinstance(v, frozenset) else v for k, v in settings.items()}
        return hashlib.sha256(f"{_sources_digest()} {settings} {torch.__version__}".encode()).hexdigest()

    def run_cached(self, gm: fx.GraphModule, report: CompileReport) -> CompileReport:
        """`run` on gm's graph behind the pass cache (`dsv41.pass_cache`); report.cache says what it did."""
        from dsv41 import pass_cache

        off = ("the config's pass_cache is off" if not self.config.pass_cache else
               "a graph-diff recorder is attached" if self.recorder is not None or ACTIVE_RECORDERS else
               "debug mode" if self.config.debug else None)
        key = None
        if off is None:
            try:
                key = pass_cache.graph_key(gm, self.fingerprint())
            except pass_cache.Uncacheable as e:
                off = str(e)
        if key is not None and pass_cache.load(key, gm, report):
            report.cache = "hit"
        else:
            self.run(gm.graph, report)
            if key is not None:
                off = pass_cache.store(key, gm, report)
            report.cache = "miss" if off is None else f"off: {off}"
        counters["dsv41"]["pass_cache_" + report.cache.split(":")[0]] += 1  # pass_cache_hit / _miss / _off
        return report

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


@functools.lru_cache(maxsize=1)
def _sources_digest() -> str:
    """Hash of every Python source of the dsv41 package (backend, passes, lowerings, kernels, models)."""
    roots = {Path(importlib.import_module(m).__file__).parent
             for m in ("dsv41", "dsv41.passes", "dsv41.lowerings", "dsv41.kernels", "dsv41.models")}
    h = hashlib.sha256()
    for path in sorted(p for root in roots for p in root.glob("*.py")):
        h.update(f"{path.name} {hashlib.sha256(path.read_bytes()).hexdigest()}".encode())
    return h.hexdigest()


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
