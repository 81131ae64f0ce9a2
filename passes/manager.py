"""The dsv41 pass manager: normalisation, the fusions (most specific first), the decomposition of what they wrote
(`dsv41.passes.decompose`), side-stream scheduling, and defunctionalisation last (nothing may remove "dead" nodes
after it).

It runs inside the backend's inference compiler, before code generation, so Inductor's FX graph cache keys on the
rewritten graph itself. `run_cached` puts `dsv41.pass_cache` in front: a warm start finds the rewritten graph and
the report on disk, keyed by the ATen graph and `fingerprint()`, and runs no pass. Snapshots of the graph before and
after every pass are taken only when a recorder is attached (the graph-diff tool); in debug mode every pass is
followed by invariant checks, and every node the passes created must be one Inductor lowers (`check_lowerable`).
The created nodes are marked as low-precision barriers where eager would round (`mark_precision_barriers`). Either turns the cache off, since both exist to watch the passes run.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from dsv41.passes.complex_arith import real_pairs
from dsv41.passes.decompose import mark_precision_barriers, unlowerable
from dsv41.passes.fusion import FusionPass, GraphPass, PassResult
from dsv41.passes.matcher import MatchFailure
from dsv41.passes.normalize import normalize_graph, restore_stable_sorts

# Recorders of `dsv41.tools.graphdiff.record(...)`: while one is active, every PassManager reports to it too.
ACTIVE_RECORDERS: list = []


@dataclass
class CompileReport:
    """One compiled graph: `matches[fusion]` = replacements made. Every site found by a fusion's distinctive op
    (its anchor) that was not fused has one entry, which names the anchor node (and its module path where known):
    `declined[fusion]` = the candidate subgraphs that matched but were not replaced (a check, the token limit, the
    semantic check, ...) and why; `near_misses[fusion]` = the sites that stopped matching past the first pattern ops
    (or at an input of the graph), each with the first differing op; `unrelated[fusion]` = the anchors that are another computation (they differ
    within the pattern's first ops), grouped by the pattern op and graph op that differ. `narrowed[fusion]` = the
    sites fused by a narrower formulation, each with why the wider one was not accepted there; `notes[fusion]` =
    "no candidate: ..." when the graph holds none of the fusion's distinctive ops or only other computations (or a
    graph-break note), `passes` = per-pass results in order, `fallback` = why the backend handed the graph to plain
    Inductor (None when it did not), `cache` = what the pass cache did (on a hit `passes` stays empty: no pass ran),
    `sizes` = the values of Dynamo's size symbols this compile of a symbolic graph is for (None: as Dynamo gave it),
    `seconds` = wall time by phase: "aot" (AOTAutograd's trace and decompositions), "passes" (this manager, or the
    pass cache's load), "codegen" (Inductor's compile of the rewritten graph or its stream segments; fx mode: none).
    CuTe kernels compile when a fused op first runs, after these (`dsv41.kernels.compile_cache.STATS.compile_s`)."""

    graph_id: int
    matches: dict[str, int] = field(default_factory=dict)
    declined: dict[str, list[str]] = field(default_factory=dict)
    near_misses: dict[str, list[str]] = field(default_factory=dict)
    unrelated: dict[str, list[str]] = field(default_factory=dict)
    narrowed: dict[str, list[str]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    passes: list[PassResult] = field(default_factory=list)
    fallback: str | None = None
    cache: str | None = None  # the pass cache: "hit", "miss" (stored), "off: <why>"
    sizes: dict[str, int] | None = None  # a graph with symbolic sizes compiled for these (`dsv41.size_specialization`)
    seconds: dict[str, float] = field(default_factory=dict)


class NormalizePass(GraphPass):
    """The normalisations (`dsv41.passes.normalize`) that let the fusions match other spellings. Not on a graph
    with symbolic sizes: the fusions need static shapes and decline there, and the rules are written and checked
    at static shapes."""

    name = "normalize"

    def __call__(self, graph: fx.Graph) -> PassResult:
        symbolic = next((n for n in graph.find_nodes(op="placeholder") if _symbolic_sizes(n)), None)
        if symbolic is not None:
            return PassResult(self.name, note=f"skipped: input {symbolic.name} has symbolic sizes")
        rewritten, left = real_pairs(graph)  # complex RoPE (DeepSeek's reference) as real pairs, first
        return PassResult(self.name, matches=rewritten + normalize_graph(graph), note="; ".join(left) or None)


class RestoreStableSortsPass(GraphPass):
    """After the fusions: a stable sort's first k that normalisation wrote as topk and no fused op took is that
    sort again (`normalize.restore_stable_sorts`), so the user's tie order stands wherever no op with its own tie
    rule computes it."""

    name = "restore_stable_sorts"

    def __call__(self, graph: fx.Graph) -> PassResult:
        return PassResult(self.name, matches=restore_stable_sorts(graph))


def _symbolic_sizes(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, torch.SymFloat)) or (
        isinstance(val, torch.Tensor) and not all(isinstance(d, int) for d in val.shape))


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
        return hashlib.sha256(f"{sources_digest()} {settings} {torch.__version__}".encode()).hexdigest()

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
        given = set(graph.nodes)
        for index, p in enumerate(self.passes):
            befores = [r.capture(graph) for r in recorders]
            anchors = [n.name for n in p.anchors(graph)] if self.config.debug and isinstance(p, FusionPass) else None
            t0 = time.perf_counter()
            result = p(graph)
            result.seconds = time.perf_counter() - t0
            report.passes.append(result)
            if p.name in self.config.fusions:
                report.matches[p.name] = result.matches
                report.declined[p.name] = [f"{d.pattern} at {_site(d)}: {d.kind}: {d.reason}" for d in result.declined]
                report.near_misses[p.name] = [f"{a.pattern} at {_site(a)}: {_stopped(a)}" for a in result.attempts]
                report.unrelated[p.name] = _unrelated(result.unrelated)
                report.narrowed[p.name] = [f"fused as {narrow} at {_site(w)}; the wider {w.pattern} was not accepted: "
                                           f"{_stopped(w)}" for narrow, w in result.narrowed]
                if result.note:
                    report.notes[p.name] = result.note
            for r, before in zip(recorders, befores):
                r.snapshot(report.graph_id, index, p, before, r.capture(graph), result)
            if self.config.debug:
                check_invariants(graph, p.name)
                if anchors is not None:
                    check_records(anchors, result)
        created = [n for n in graph.nodes if n not in given]
        mark_precision_barriers(created)
        if self.config.debug:
            check_lowerable(created)
        return report


def _site(f: MatchFailure) -> str:
    """A failure's site: its anchor node, and its module path where known."""
    return f"%{f.anchor}" + (f" ({f.module})" if f.module else "")


def _stopped(f: MatchFailure) -> str:
    return f"{f.kind} after {f.progress} of {f.total} pattern ops: {f.reason}"


def differing_op_groups(records: list, field=getattr) -> dict[tuple, list]:
    """Failure records (MatchFailures; or their JSON records with `field=dict.get`) by (pattern, kind, pattern op,
    graph op): the anchors that are another computation in one way, in first-seen order."""
    groups: dict[tuple, list] = {}
    for r in records:
        groups.setdefault(tuple(field(r, k) for k in ("pattern", "kind", "expected", "found")), []).append(r)
    return groups


def _unrelated(failures: list[MatchFailure]) -> list[str]:
    """One line per formulation and first differing op: the anchors that are another computation there."""
    lines = []
    for (pattern, kind, expected, found), fs in differing_op_groups(failures).items():
        differs = (f"pattern op {expected}, graph op {found or 'none'}" if expected is not None
                   else fs[0].reason + (f" (and {len(fs) - 1} more)" if len(fs) > 1 else ""))
        lines.append(f"another computation at {', '.join(map(_site, fs))}: {pattern} differs after at most "
                     f"{max(f.progress for f in fs)} of {fs[0].total} pattern ops ({kind}): {differs}")
    return lines


@functools.lru_cache(maxsize=1)
def sources_digest() -> str:
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


def check_lowerable(created: list[fx.Node]) -> None:
    """Every node the passes created is one Inductor lowers (`decompose.unlowerable`)."""
    bad = unlowerable(created)
    if bad:
        raise RuntimeError(f"the passes created nodes Inductor does not lower: {'; '.join(bad)}")


def check_records(anchors: list[str], result: PassResult) -> None:
    """The report's promise for one fusion pass: each of its `anchors` (node names, read before the pass ran) is
    either erased by one of its replacements or has exactly one record in `declined`, `attempts` or `unrelated`,
    and no other node has one."""
    erased = {name for r in result.replaced for name in r["erased"]}
    records = collections.Counter(f.anchor for f in (*result.declined, *result.attempts, *result.unrelated))
    wrong = [f"%{a} ({'replaced' if a in erased else 'not fused'}): {records[a]} records" for a in anchors
             if records[a] != (0 if a in erased else 1)]
    wrong += [f"%{a}: a record, not an anchor" for a in set(records) - set(anchors)]
    if wrong:
        raise RuntimeError(f"after pass {result.name!r}: anchors not fused and not recorded once: {'; '.join(wrong)}")


def _returns_value(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is None or len(schema.returns) > 0
