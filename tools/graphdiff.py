"""The graph-diff tool: what every dsv41 pass did to every compiled graph, where in the model, and why not.

Capture (in-process)::

    from dsv41.tools.graphdiff import record
    with record("gd/"):                  # every backend compiled while this is active reports to it
        compiled(tokens, positions)      # the call that compiles (not the torch.compile call)

or `Dsv41Config(dump_dir="gd/")` / `DSV41_DUMP_DIR=gd/` for one backend. Nothing is captured while neither is
on: the pass manager then takes no snapshot at all.

Layout of a recording (every file deterministic: identical runs give byte-identical directories)::

    gd/summary.json                        per graph and pass: changed?, counts, matches per layer, files
    gd/graph_000/input.txt                 normalised graph code (passes.printing.graph_code) the passes got
    gd/graph_000/NN_<pass>.json            the pass: matches grouped with erased/created nodes and their
                                           provenance (module path, layer, file:line), declined candidates,
                                           near misses and anchors of another computation (kind, reason,
                                           blocking node, the pattern op and graph op that differ), sites
                                           fused by a narrower formulation, op-count delta, nodes per
                                           stream, and which code files hold the graph before/after
    gd/graph_000/NN_<pass>.after.txt       the graph after the pass      } only when the pass changed the
    gd/graph_000/NN_<pass>.diff            unified diff before -> after  } graph ("unchanged" otherwise)
    gd/graph_000/NN_<pass>.streams.txt     the side-stream lanes, when the graph carries a stream schedule

A node on a side stream (`node.meta["dsv41_stream"]` = K != 0) ends its code line with `  @streamK` (as
`graph_code` prints it), so a stream move shows in the diff and the lanes can be rebuilt from the code. Under torch.distributed with several ranks each rank writes `rank_<r>/`.

While recording, the snapshots also go to PyTorch's structured trace (`torch._logging.trace_structured`:
`graph_dump` "dsv41_post_grad.<NN>.<pass>" and a JSON `artifact` "dsv41_pass.<NN>.<pass>", so tlparse shows
them) and through `lazy_format_graph_code` on the `graph_code` logging artifact (the hook depyf patches).

CLI (`dsv41 graphdiff ...`): `show`, `compare`, `check`; see `main` and `dsv41.tools.graphdiff_view`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import difflib
import functools
import json
import os
import re
import logging
import shutil
import sys
from pathlib import Path

from dsv41.passes.printing import module_path

FORMAT = "dsv41-graphdiff/1"
STREAM_KEY = "dsv41_stream"
log = logging.getLogger("dsv41.graphdiff")

__all__ = ["FORMAT", "Recorder", "record", "main"]


# ----------------------------------------------------------------------------------------------------------------
# provenance: module path, layer index, file:line (paths made relative, so recordings are machine-independent)
# ----------------------------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$')


@functools.lru_cache(maxsize=1)
def _roots() -> tuple[str, ...]:
    """Directories a source path is made relative to, most specific first: the repository (the parent of the
    `dsv41` package directory), then every sys.path entry."""
    import dsv41

    repo = os.path.dirname(os.path.dirname(os.path.abspath(dsv41.__file__)))
    others = {os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)} - {repo}
    return (repo, *sorted(others, key=lambda p: (-len(p), p)))


@functools.lru_cache(maxsize=4096)
def rel_path(path: str) -> str:
    """`path` relative to the repository or to the sys.path entry holding it; the base name otherwise."""
    p = os.path.abspath(path)
    for root in _roots():
        if p.startswith(root + os.sep):
            return p[len(root) + 1:].replace(os.sep, "/")
    return os.path.basename(p)


@functools.lru_cache(maxsize=4096)
def parse_stack_trace(stack_trace: str | None) -> tuple[dict, ...]:
    """node.meta['stack_trace'] -> frames (outermost first) as {"file", "line", "func", "code"}, paths relative."""
    if not stack_trace:
        return ()
    frames: list[dict] = []
    lines = stack_trace.splitlines()
    for i, line in enumerate(lines):
        m = _FRAME_RE.match(line)
        if not m:
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME_RE.match(lines[i + 1]) else ""
        frames.append({"file": rel_path(m["file"]), "line": int(m["line"]), "func": m["func"], "code": code})
    return tuple(frames)


def layer_of(module: str | None) -> int | None:
    m = _LAYER_RE.search(module or "")
    return int(m.group(1)) if m else None


def _source(frames) -> str | None:
    return f"{frames[-1]['file']}:{frames[-1]['line']}" if frames else None


# ----------------------------------------------------------------------------------------------------------------
# snapshots
# ----------------------------------------------------------------------------------------------------------------


class Snapshot:
    """The graph as a pass saw it: normalised code lines (with the stream annotation), node names, ops, and the
    provenance metadata by node name."""

    __slots__ = ("lines", "names", "ops", "meta", "streams", "has_streams", "_positions")

    def __init__(self, graph):
        from dsv41.passes.printing import graph_code, node_line, op_name

        nodes = list(graph.nodes)
        lines = graph_code(graph).split("\n")[:-1]
        if len(lines) != len(nodes):  # an argument printed over several lines: one line per node again
            lines = [node_line(n).replace("\n", "\\n") for n in nodes]
        self.names = [n.name for n in nodes]
        self.ops = [op_name(n.target) if n.op == "call_function" else None for n in nodes]
        self.streams = [n.meta.get(STREAM_KEY) for n in nodes]
        self.has_streams = any(s is not None for s in self.streams)
        self.lines = [line + (f"  @stream{s}" if s and not line.endswith(f"@stream{s}") else "")
                      for line, s in zip(lines, self.streams)]
        self.meta = {n.name: (n.meta.get("stack_trace"), n.meta.get("nn_module_stack")) for n in nodes}
        self._positions = None

    def node(self, name: str) -> dict:
        """{"name", "code", "module", "layer", "source"} of a node of this snapshot."""
        stack, nn_stack = self.meta.get(name, (None, None))
        module = module_path(nn_stack)
        rec = {"name": name, "code": self.code_of(name), "module": module, "layer": layer_of(module),
               "source": _source(parse_stack_trace(stack))}
        return rec

    def code_of(self, name: str) -> str | None:
        if self._positions is None:
            self._positions = {n: i for i, n in enumerate(self.names)}
        index = self._positions.get(name)
        return None if index is None else self.lines[index]


# ----------------------------------------------------------------------------------------------------------------
# the recorder
# ----------------------------------------------------------------------------------------------------------------


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "pass"


def _json(obj) -> str:
    return json.dumps(obj, indent=1, ensure_ascii=False) + "\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def _failure(f, snap: Snapshot) -> dict:
    """A MatchFailure as JSON, with the provenance of its anchor and blocking node."""
    rec = {"pattern": f.pattern, "anchor": f.anchor, "progress": f.progress, "total": f.total, "kind": f.kind,
           "reason": f.reason, "blocking": f.blocking, "expected": getattr(f, "expected", None),
           "found": getattr(f, "found", None)}
    a = snap.node(f.anchor)
    rec.update({"module": a["module"], "layer": a["layer"], "source": a["source"]})
    if f.blocking:
        b = snap.node(f.blocking)
        rec.update({"blocking_module": b["module"], "blocking_source": b["source"]})
    return rec


class Recorder:
    """Writes a recording to `out_dir` (see the module docstring). Attach it as `PassManager.recorder`, or make
    it active with `record(out_dir)`; the pass manager calls `begin_graph`, then per pass `capture` (before),
    the pass, `capture` (after) and `snapshot`."""

    def __init__(self, out_dir):
        self.out_dir = Path(out_dir)
        self.graphs: list[dict] = []
        self._root: Path | None = None
        self._cur: dict | None = None
        self._state: Snapshot | None = None  # the graph as last recorded (input or after the last pass)
        self._state_file: str | None = None
        self._phase = "before"
        self._index = 0
        self._passes: list[str] = []
        self.failed: str | None = None  # why the recording stopped (an I/O error, ...)

    # -- the pass manager's hooks: a failing dump never breaks compilation; it stops the recording ------------
    def begin_graph(self, graph_id: int, passes) -> None:
        self._guarded(self._begin_graph, graph_id, passes)

    def capture(self, graph) -> Snapshot | None:
        return self._guarded(self._capture, graph)

    def snapshot(self, graph_id: int, index: int, p, before: Snapshot | None, after: Snapshot | None, result) -> None:
        if before is not None and after is not None:
            self._guarded(self._snapshot, graph_id, index, p, before, after, result)

    def _guarded(self, fn, *args):
        if self.failed is not None:
            return None
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("dsv41 graphdiff: recording to %s stopped: %s", self.out_dir, self.failed, exc_info=True)
            return None

    def _begin_graph(self, graph_id: int, passes) -> None:
        root = self._prepare()
        seq = len(self.graphs)
        self._passes = [p.name for p in passes]
        self._cur = {"graph": seq, "graph_id": graph_id, "dir": f"graph_{seq:03d}", "complete": False,
                     "nodes_in": None, "nodes_out": None, "layers": [], "passes_planned": list(self._passes),
                     "input": "input.txt", "passes": []}
        self.graphs.append(self._cur)
        self._state, self._state_file = None, None
        self._phase, self._index = "before", 0
        (root / self._cur["dir"]).mkdir(parents=True, exist_ok=True)

    def _capture(self, graph) -> Snapshot:
        snap = Snapshot(graph)
        cur = self._cur
        if cur is not None and self._phase == "before":
            if self._state is None:  # the graph the pass manager was given
                _write(self._gdir() / "input.txt", "\n".join(snap.lines) + "\n")
                cur["nodes_in"] = len(snap.names)
                layers = {layer_of(module_path(nn)) for _, nn in snap.meta.values()}
                cur["layers"] = sorted(x for x in layers if x is not None)
                self._state, self._state_file = snap, "input.txt"
                _emit_structured("artifact", "dsv41_input_graph", lambda: "\n".join(snap.lines) + "\n", "string")
            elif snap.lines != self._state.lines:  # changed between passes: keep that state too
                name = f"{self._index:02d}_{_safe(self._pass_name())}.before.txt"
                _write(self._gdir() / name, "\n".join(snap.lines) + "\n")
                self._state, self._state_file = snap, name
            _emit_lazy(graph, f"dsv41.post_grad.{self._index}.{self._pass_name()}.before")
            self._phase = "after"
        elif cur is not None:
            _emit_lazy(graph, f"dsv41.post_grad.{self._index}.{self._pass_name()}.after")
        return snap

    def _snapshot(self, graph_id: int, index: int, p, before: Snapshot, after: Snapshot, result) -> None:
        if self._cur is None:  # used without begin_graph (an older pass manager): start a graph here
            self._begin_graph(graph_id, [p])
        cur = self._cur
        stem = f"{index:02d}_{_safe(p.name)}"
        before_file = self._state_file if (self._state is not None and self._state.lines == before.lines) else None
        if before_file is None:
            before_file = f"{stem}.before.txt"
            _write(self._gdir() / before_file, "\n".join(before.lines) + "\n")
        changed = before.lines != after.lines
        after_file, diff_file = before_file, None
        if changed:
            after_file, diff_file = f"{stem}.after.txt", f"{stem}.diff"
            _write(self._gdir() / after_file, "\n".join(after.lines) + "\n")
            diff = difflib.unified_diff(before.lines, after.lines, f"{cur['dir']}/{before_file}",
                                        f"{cur['dir']}/{after_file}", n=3, lineterm="")
            _write(self._gdir() / diff_file, "\n".join(diff) + "\n")
        rec = build_pass_record(cur["graph"], index, p.name, before, after, result)
        rec.update({"before": before_file, "after": after_file, "diff": diff_file})
        streams_file = None
        if changed and after.has_streams and any(after.streams):
            streams_file = f"{stem}.streams.txt"
            _write(self._gdir() / streams_file, lanes_text(after))
        rec["streams_file"] = streams_file
        _write(self._gdir() / f"{stem}.json", _json(rec))
        cur["passes"].append({k: rec[k] for k in ("index", "name", "changed", "matches", "declined", "attempts",
                                                   "nodes_before", "nodes_after", "matches_by_layer", "streams")}
                             | {"file": f"{stem}.json"})
        cur["nodes_out"] = len(after.names)
        cur["complete"] = [q["name"] for q in cur["passes"]] == cur["passes_planned"]
        self._state, self._state_file = after, after_file
        self._write_summary()
        _emit_structured("graph_dump", f"dsv41_post_grad.{index:02d}.{p.name}", lambda: "\n".join(after.lines) + "\n")
        _emit_structured("artifact", f"dsv41_pass.{index:02d}.{p.name}", lambda: _json(rec), "json")
        self._phase, self._index = "before", index + 1

    # -- the context manager's end ---------------------------------------------------------------------------
    def close(self) -> None:
        self._guarded(lambda: self._write_summary())

    # -- helpers ---------------------------------------------------------------------------------------------
    def _pass_name(self) -> str:
        return self._passes[self._index] if self._index < len(self._passes) else f"pass{self._index}"

    def _gdir(self) -> Path:
        return self._prepare() / self._cur["dir"]

    def _prepare(self) -> Path:
        """The output directory, made on first use; a previous recording there is replaced."""
        if self._root is None:
            root = self.out_dir
            try:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                    root = root / f"rank_{dist.get_rank()}"
            except Exception:  # noqa: BLE001  (no usable torch.distributed: one rank)
                pass
            _clear_previous(root)
            root.mkdir(parents=True, exist_ok=True)
            self._root = root
        return self._root

    def _write_summary(self) -> None:
        _write(self._prepare() / "summary.json", _json({"format": FORMAT, "graphs": self.graphs}))


def _clear_previous(root: Path) -> None:
    """Remove what an earlier recording wrote to `root` (only when its summary.json says it is one)."""
    summary = root / "summary.json"
    if not summary.is_file():
        return
    try:
        if json.loads(summary.read_text(encoding="utf-8")).get("format") != FORMAT:
            return
    except (OSError, ValueError, AttributeError):
        return
    for child in root.iterdir():
        if child.is_dir() and (re.fullmatch(r"graph_\d+", child.name) or child.name == "html"):
            shutil.rmtree(child)
    summary.unlink()


def build_pass_record(graph_seq: int, index: int, name: str, before: Snapshot, after: Snapshot, result) -> dict:
    """The JSON record of one pass (without the file references)."""
    before_set, after_set = set(before.names), set(after.names)
    before_lines, after_lines = dict(zip(before.names, before.lines)), dict(zip(after.names, after.lines))
    erased = [n for n in before.names if n not in after_set]
    created = [n for n in after.names if n not in before_set]
    modified = [n for n in after.names if n in before_set and before_lines[n] != after_lines[n]]

    groups, claimed = [], set()
    for rep in getattr(result, "replaced", None) or []:
        g_erased = [n for n in rep.get("erased", []) if n in before_set]
        g_created = [n for n in rep.get("created", []) if n in after_set]
        g_moved = [n for n in rep.get("moved", []) if n in after_set]
        frames = parse_stack_trace(rep.get("stack_trace"))
        module = rep.get("module")
        if module is None:  # take it from the pattern's last node
            probe = [after.node(n) for n in reversed(g_moved + g_created)] + [before.node(n) for n in reversed(g_erased)]
            module = next((r["module"] for r in probe if r["module"]), None)
        group = {"pattern": rep.get("pattern"), "module": module, "layer": layer_of(module), "source": _source(frames),
                 "frames": [f"{f['file']}:{f['line']} in {f['func']}" for f in frames],
                 "erased": [before.node(n) for n in g_erased], "created": [after.node(n) for n in g_created]}
        if g_moved:
            group["moved"] = [after.node(n) for n in g_moved]
        if "stream" in rep:
            group["stream"] = rep["stream"]
        claimed.update(g_erased, g_created, g_moved)
        groups.append(group)
    # nodes that no match accounts for (normalisation, defunctionalisation, ...): grouped by module
    other: dict = collections.OrderedDict()
    for n, snap, key in [(n, before, "erased") for n in erased if n not in claimed] + \
                        [(n, after, "created") for n in created if n not in claimed]:
        r = snap.node(n)
        g = other.setdefault(r["module"], {"pattern": None, "module": r["module"], "layer": r["layer"], "source": None,
                                           "frames": [], "erased": [], "created": []})
        g[key].append(r)
    groups += sorted(other.values(), key=lambda g: (g["layer"] is None, g["layer"] or 0, g["module"] or ""))

    by_layer: dict = {}
    for g in groups:
        if g["pattern"] is not None:
            key = "?" if g["layer"] is None else str(g["layer"])
            by_layer[key] = by_layer.get(key, 0) + 1
    by_layer = dict(sorted(by_layer.items(), key=lambda kv: (kv[0] == "?", int(kv[0]) if kv[0] != "?" else 0)))

    ops_before = collections.Counter(o for o in before.ops if o)
    ops_after = collections.Counter(o for o in after.ops if o)
    op_delta = {op: ops_after[op] - ops_before[op] for op in sorted(set(ops_before) | set(ops_after))
                if ops_after[op] != ops_before[op]}

    streams = None
    if after.has_streams:
        counts = collections.Counter(s or 0 for s in after.streams)
        streams = {str(k): counts[k] for k in sorted(counts)}
    return {
        "graph": graph_seq, "index": index, "name": name,
        "changed": before.lines != after.lines,
        "matches": int(getattr(result, "matches", 0) or 0),
        "declined": len(getattr(result, "declined", []) or []),
        "attempts": len(getattr(result, "attempts", []) or []),
        "nodes_before": len(before.names), "nodes_after": len(after.names),
        "erased_count": len(erased), "created_count": len(created), "modified_count": len(modified),
        "matches_by_layer": by_layer,
        "op_delta": op_delta,
        "streams": streams,
        "groups": groups,
        "modified": [after.node(n) for n in modified if n not in claimed],
        "declined_candidates": [_failure(f, before) for f in getattr(result, "declined", []) or []],
        "attempt_candidates": [_failure(f, before) for f in getattr(result, "attempts", []) or []],
        # anchors that are another computation, and sites fused by a narrower formulation (the wider one's failure)
        "unrelated_candidates": [_failure(f, before) for f in getattr(result, "unrelated", []) or []],
        "narrowed_sites": [dict(_failure(f, before), fused=narrow) for narrow, f in getattr(result, "narrowed", []) or []],
    }


def lanes_text(snap: Snapshot) -> str:
    """The stream schedule as text: a count per lane, then every side-stream node with its graph position."""
    counts = collections.Counter(s or 0 for s in snap.streams)
    out = [f"lanes: {len(counts)} stream(s); position = line in the graph code"]
    for s in sorted(counts):
        out.append(f"stream {s}{' (main)' if s == 0 else ''}: {counts[s]} nodes")
    for s in sorted(counts):
        if s == 0:
            continue
        out.append("")
        out.append(f"stream {s}:")
        for i, (line, st) in enumerate(zip(snap.lines, snap.streams)):
            if (st or 0) == s:
                out.append(f"  {i + 1:6d}  {line}")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# PyTorch's own hooks (only called while recording)
# ----------------------------------------------------------------------------------------------------------------


def _emit_structured(kind: str, name: str, payload_fn, encoding: str | None = None) -> None:
    """tlparse: a `graph_dump` (name) or an `artifact` (name, encoding); the payload is built only when
    structured tracing is on (TORCH_TRACE)."""
    try:
        from torch._logging import trace_structured

        meta = {"name": name} if kind == "graph_dump" else {"name": name, "encoding": encoding}
        trace_structured(kind, metadata_fn=lambda: meta, payload_fn=payload_fn, expect_trace_id=False)
    except Exception:  # noqa: BLE001  (a debug dump never breaks compilation)
        pass


_LAST_LAZY: list = [None]


def _emit_lazy(graph, name: str) -> None:
    """depyf / TORCH_LOGS=graph_code: `lazy_format_graph_code(name, gm)` logged on the graph_code artifact
    (once per graph state, however many recorders are active)."""
    gm = getattr(graph, "owning_module", None)
    key = (id(graph), name, len(graph.nodes))
    if gm is None or _LAST_LAZY[0] == key:
        return
    _LAST_LAZY[0] = key
    try:
        import torch
        import torch._dynamo.utils as dynamo_utils

        lazy = dynamo_utils.lazy_format_graph_code(name, gm, colored=False)
        torch._logging.getArtifactLogger(__name__, "graph_code").debug("%s", lazy)
    except Exception:  # noqa: BLE001
        pass


# ----------------------------------------------------------------------------------------------------------------
# record(out_dir)
# ----------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def record(out_dir):
    """Record every graph compiled by any dsv41 backend while the block runs into `out_dir` (replacing an
    earlier recording there). Yields the Recorder. Compile inside the block: a graph Dynamo already compiled
    (a cache hit) runs no pass and records nothing; `torch._dynamo.reset()` first if needed."""
    from dsv41.passes.manager import ACTIVE_RECORDERS

    rec = Recorder(out_dir)
    ACTIVE_RECORDERS.append(rec)
    try:
        yield rec
    finally:
        ACTIVE_RECORDERS.remove(rec)
        rec.close()


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------

EXPECT_HELP = """\
expectations file (JSON): {"matches": {PASS: SPEC, ...}, "declined": {PASS: SPEC, ...}, "layers": L, "graph": G}
or simply {PASS: SPEC, ...} (= "matches"). SPEC is an integer, an expression of integers, L, + and * such as
"2*L" or "L+1" (L = "layers" if given, else the number of distinct model layers in the recording), or
{"each_layer": K}: every layer of the recording has exactly K matches. Counts are summed over the recorded
graphs unless "graph" picks one."""


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit code 2 through main's return value, with one line on stderr
        raise _UsageError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dsv41 graphdiff", description="Show, compare and check pass-by-pass graph diffs "
                     "recorded by dsv41.tools.graphdiff.record(DIR) or Dsv41Config(dump_dir=DIR).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    show = sub.add_parser("show", help="the per-pass view of a recording")
    show.add_argument("dir", metavar="DIR")
    show.add_argument("--pass", dest="pass_name", metavar="NAME", help="details of one pass: matches, declines, diff")
    show.add_argument("--layer", type=int, metavar="N", help="only what concerns model layer N")
    show.add_argument("--format", choices=("text", "json", "html"), default="text")
    show.add_argument("--why", metavar="FUSION", help="every candidate anchor of FUSION: how far it matched, what stopped it")
    show.add_argument("--graph", type=int, metavar="G", help="only recorded graph G (default: all)")
    show.add_argument("--out", metavar="PATH", help="the HTML report's directory (default: DIR/html)")
    show.add_argument("--color", choices=("auto", "always", "never"), default="auto", help="colour (auto: only on a tty)")
    compare = sub.add_parser("compare", help="the same graphs from two recordings, aligned by graph and pass; exit 1 if they differ")
    compare.add_argument("dir_a", metavar="DIR_A")
    compare.add_argument("dir_b", metavar="DIR_B")
    compare.add_argument("--pass", dest="pass_name", metavar="NAME", help="also diff the graphs after this pass, A -> B")
    compare.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    check = sub.add_parser("check", help="compare match counts with expectations: exit 0 when all hold, 1 otherwise",
                           epilog=EXPECT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("dir", metavar="DIR")
    check.add_argument("--expect", metavar="FILE", required=True, help="expectations (JSON; see below)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`dsv41 graphdiff show|compare|check ...`: 0 ok, 1 a difference (compare, check), 2 usage or input error."""
    from dsv41.tools import graphdiff_view as view

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    try:
        if not argv:
            parser.print_help(sys.stderr)
            return 2
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
    except _UsageError as e:
        print(f"{e}\n(dsv41 graphdiff {argv[0] if argv and argv[0] in ('show', 'compare', 'check') else ''} --help "
              "for usage)".replace("  ", " "), file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    try:
        if args.command == "show":
            return view.cmd_show(args)
        if args.command == "compare":
            return view.cmd_compare(args)
        return view.cmd_check(args)
    except view.GraphdiffError as e:
        print(f"dsv41 graphdiff: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
