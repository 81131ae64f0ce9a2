"""Reading a graph-diff recording: `dsv41 graphdiff show | compare | check` (text and JSON; HTML in
`graphdiff_html`). Every input problem (a missing or corrupt file, an unknown pass) raises `GraphdiffError`,
which the CLI prints as one line and turns into exit code 2.
"""

from __future__ import annotations

import ast
import collections
import difflib
import hashlib
import json
import os
import re
import sys
from pathlib import Path

from dsv41.tools.graphdiff import FORMAT

_NODE_RE = re.compile(r"^%([A-Za-z0-9_]+)")
_REF_RE = re.compile(r"%([A-Za-z0-9_]+)")
CONTEXT = 3  # graph lines shown on each side of an anchor or blocking node
WIDTH = 200  # longest graph line in the terminal views


class GraphdiffError(Exception):
    """A usage or input error (exit code 2)."""


# ----------------------------------------------------------------------------------------------------------------
# a recording on disk
# ----------------------------------------------------------------------------------------------------------------


def _read_json(path: Path, what: str):
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GraphdiffError(f"{path}: missing ({what})") from None
    except OSError as e:
        raise GraphdiffError(f"{path}: cannot be read ({what}): {e.strerror or e}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise GraphdiffError(f"{path}: corrupt ({what}): not valid JSON: {e}") from None


class Recording:
    """A recording directory (the layout is described in `dsv41.tools.graphdiff`)."""

    def __init__(self, root):
        self.root = Path(root)
        if not self.root.exists():
            raise GraphdiffError(f"{root}: no such directory")
        if not self.root.is_dir():
            raise GraphdiffError(f"{root}: not a directory")
        summary = self.root / "summary.json"
        if not summary.exists():
            ranks = sorted(p.name for p in self.root.glob("rank_*") if (p / "summary.json").is_file())
            if ranks:
                raise GraphdiffError(f"{root}: holds one recording per rank ({', '.join(ranks)}); pass one of them")
            raise GraphdiffError(f"{root}: no summary.json, so not a graph-diff recording (record one with "
                                 "dsv41.tools.graphdiff.record(DIR) or Dsv41Config(dump_dir=DIR))")
        data = _read_json(summary, "the recording's summary")
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("graphs"), list):
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise GraphdiffError(f"{summary}: corrupt or of another format (expected format {FORMAT!r}, found {found!r})")
        self.graphs: list[dict] = data["graphs"]
        for g in self.graphs:
            if not isinstance(g, dict) or not {"graph", "dir", "passes"} <= set(g) or not isinstance(g["passes"], list):
                raise GraphdiffError(f"{summary}: corrupt: a graph entry lacks graph/dir/passes")
            for p in g["passes"]:
                if not isinstance(p, dict) or not {"index", "name", "file", "changed", "matches"} <= set(p):
                    raise GraphdiffError(f"{summary}: corrupt: a pass entry of graph {g['graph']} lacks index/name/file")
        self._records: dict = {}
        self._lines: dict = {}

    def pass_names(self) -> list[str]:
        names: list[str] = []
        for g in self.graphs:
            for p in g["passes"]:
                if p["name"] not in names:
                    names.append(p["name"])
        return names

    def select_graphs(self, graph: int | None) -> list[dict]:
        if graph is None:
            return self.graphs
        for g in self.graphs:
            if g["graph"] == graph:
                return [g]
        raise GraphdiffError(f"{self.root}: no graph {graph} (recorded: {', '.join(str(g['graph']) for g in self.graphs) or 'none'})")

    def find_pass(self, g: dict, name: str) -> dict | None:
        """The summary entry of pass `name` (a name, an index `5`, or `05_qkv_norm`) in graph `g`."""
        for p in g["passes"]:
            if name in (p["name"], str(p["index"]), f"{p['index']:02d}", f"{p['index']:02d}_{p['name']}"):
                return p
        return None

    def require_pass(self, name: str) -> None:
        if not any(self.find_pass(g, name) for g in self.graphs):
            raise GraphdiffError(f"no pass {name!r} in {self.root} (recorded: {', '.join(self.pass_names()) or 'none'})")

    def record(self, g: dict, p: dict) -> dict:
        key = (g["dir"], p["file"])
        if key not in self._records:
            rec = _read_json(self.root / g["dir"] / p["file"], f"pass {p['name']}")
            if not isinstance(rec, dict) or "groups" not in rec:
                raise GraphdiffError(f"{self.root / g['dir'] / p['file']}: corrupt: not a pass record")
            self._records[key] = rec
        return self._records[key]

    def lines(self, g: dict, name: str | None) -> list[str]:
        if not name:
            return []
        key = (g["dir"], name)
        if key not in self._lines:
            path = self.root / g["dir"] / name
            try:
                self._lines[key] = path.read_text(encoding="utf-8").splitlines()
            except OSError as e:
                raise GraphdiffError(f"{path}: missing or unreadable graph code ({e.strerror or e})") from None
        return self._lines[key]


# ----------------------------------------------------------------------------------------------------------------
# styling
# ----------------------------------------------------------------------------------------------------------------


class Style:
    CODES = {"green": "32", "red": "31", "yellow": "33", "cyan": "36", "dim": "2", "bold": "1"}

    def __init__(self, enabled: bool):
        self.enabled = enabled

    @staticmethod
    def for_stream(stream, mode: str = "auto") -> "Style":
        if mode == "always":
            return Style(True)
        if mode == "never" or os.environ.get("NO_COLOR"):
            return Style(False)
        try:
            return Style(stream.isatty())
        except (AttributeError, ValueError):
            return Style(False)

    def __getattr__(self, name):
        code = Style.CODES.get(name)
        if code is None:
            raise AttributeError(name)
        return lambda s: f"\x1b[{code}m{s}\x1b[0m" if self.enabled and s else s

    def diff_line(self, line: str) -> str:
        if line.startswith(("+++", "---")):
            return self.bold(line)
        if line.startswith("+"):
            return self.green(line)
        if line.startswith("-"):
            return self.red(line)
        if line.startswith("@@"):
            return self.cyan(line)
        return line


PLAIN = Style(False)


def _clip(s: str, width: int = WIDTH) -> str:
    return s if len(s) <= width else s[: width - 1] + "…"


def _table(rows: list[list[str]], right: set[int] = frozenset(), indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append((indent + "  ".join(cells)).rstrip())
    return out


def _where(module, layer, source) -> str:
    parts = [module or "(no module)"]
    if layer is not None:
        parts.append(f"(layer {layer})")
    if source:
        parts.append(source)
    return "  ".join(parts)


def _wrap_names(names: list[str], indent: str, width: int = 110) -> list[str]:
    out, line = [], indent
    for n in names:
        tok = f"%{n}"
        if len(line) + len(tok) + 1 > width and line.strip():
            out.append(line.rstrip())
            line = indent
        line += tok + " "
    if line.strip():
        out.append(line.rstrip())
    return out


# ----------------------------------------------------------------------------------------------------------------
# show: the summary
# ----------------------------------------------------------------------------------------------------------------


def _layer_key(layer) -> str:
    return "?" if layer is None else str(layer)


def render_summary(rec: Recording, graphs: list[dict], layer: int | None = None, style: Style = PLAIN) -> str:
    if not graphs:
        return ("no graph was compiled while recording (a graph Dynamo had already compiled runs no pass: call "
                "torch._dynamo.reset() before recording)\n")
    out: list[str] = []
    for g in graphs:
        passes = g["passes"]
        changed = sum(1 for p in passes if p["changed"])
        layers = ", ".join(str(x) for x in g.get("layers") or []) or "none"
        out.append(style.bold(f"graph {g['graph']}: {g.get('nodes_in')} nodes in, {g.get('nodes_out')} out; "
                              f"layers {layers}; {len(passes)} passes, {changed} changed"
                              + (f"; showing layer {layer}" if layer is not None else "")))
        if not g.get("complete", True):
            planned = g.get("passes_planned") or []
            out.append(style.yellow(f"  incomplete: {len(passes)} of {len(planned)} passes recorded (the pass after "
                                    f"{passes[-1]['name'] if passes else 'the start'} failed; the backend fell back to plain Inductor)"))
        rows = [["#", "pass", "result", "nodes", "matches", "declined", "attempts"]]
        records = [rec.record(g, p) for p in passes]
        for p, r in zip(passes, records):
            nodes = f"{p['nodes_before']} -> {p['nodes_after']}" if p["changed"] else f"{p['nodes_before']}"
            if layer is None:
                matches, declined, attempts = p["matches"], p["declined"], p["attempts"]
            else:
                matches = (p.get("matches_by_layer") or {}).get(str(layer), 0)
                declined = sum(1 for c in r["declined_candidates"] if c.get("layer") == layer)
                attempts = sum(1 for c in r["attempt_candidates"] if c.get("layer") == layer)
            rows.append([f"{p['index']:02d}", p["name"], "changed" if p["changed"] else "unchanged", nodes,
                         str(matches), str(declined), str(attempts)])
        lines = _table(rows, right={4, 5, 6})
        out.append(style.dim(lines[0]))
        for line, p in zip(lines[1:], passes):
            out.append(line if p["changed"] else style.dim(line))
        # matches per layer
        with_layers = [p for p in passes if p.get("matches_by_layer")]
        if with_layers:
            keys = [str(x) for x in g.get("layers") or []]
            for p in with_layers:
                keys += [k for k in p["matches_by_layer"] if k not in keys]
            if layer is not None:
                keys = [str(layer)]
            out.append("")
            rows = [["matches per layer"] + [f"L{k}" for k in keys]]
            for p in with_layers:
                rows.append([p["name"]] + [str(p["matches_by_layer"].get(k, 0)) for k in keys])
            out += _table(rows, right=set(range(1, len(keys) + 1)))
        # stream lanes
        for p in passes:
            if p.get("streams") and p["changed"] and len(p["streams"]) > 1:
                lanes = ", ".join(f"stream {k}: {v}" for k, v in p["streams"].items())
                out.append("")
                out.append(f"  nodes per stream after {p['name']}: {lanes}")
        # declined candidates
        declined = [(p, c) for p, r in zip(passes, records) for c in r["declined_candidates"]
                    if layer is None or c.get("layer") == layer]
        if declined:
            out.append("")
            out.append(style.yellow(f"  declined ({len(declined)}):"))
            for p, c in declined:
                block = f"  [blocking %{c['blocking']}]" if c.get("blocking") else ""
                out.append(f"    {p['name']}: {c['pattern']} at %{c['anchor']} ({c.get('module') or '?'}): "
                           f"{c['kind']}: {_clip(c['reason'], 160)}{block}")
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------------
# show --pass: one pass in detail
# ----------------------------------------------------------------------------------------------------------------


def _filter_diff(lines: list[str], keep_nodes: set[str] | None) -> list[str]:
    """The unified diff, restricted to hunks that add or remove a node in `keep_nodes` (all when None)."""
    if keep_nodes is None:
        return lines
    out, hunk = [], []

    def flush():
        if hunk and any(_line_node(h[1:]) in keep_nodes for h in hunk[1:] if h[:1] in "+-"):
            out.extend(hunk)

    for line in lines:
        if line.startswith("@@"):
            flush()
            hunk = [line]
        elif hunk:
            hunk.append(line)
        else:
            out.append(line)
    flush()
    return out


def _line_node(line: str) -> str | None:
    m = _NODE_RE.match(line)
    return m.group(1) if m else ("output" if line.startswith("return ") else None)


def render_pass(rec: Recording, graphs: list[dict], name: str, layer: int | None = None, style: Style = PLAIN) -> str:
    rec.require_pass(name)
    out: list[str] = []
    for g in graphs:
        p = rec.find_pass(g, name)
        if p is None:
            continue
        r = rec.record(g, p)
        delta = r["nodes_after"] - r["nodes_before"]
        head = (f"graph {g['graph']}, pass {r['index']:02d} {r['name']}: "
                + (f"changed, {r['nodes_before']} -> {r['nodes_after']} nodes ({delta:+d})" if r["changed"]
                   else f"unchanged, {r['nodes_before']} nodes")
                + f"; {r['matches']} matches, {r['declined']} declined, {r['attempts']} attempts"
                + (f"; showing layer {layer}" if layer is not None else ""))
        out.append(style.bold(head))
        if r["op_delta"]:
            ops = ", ".join(f"{op} {d:+d}" for op, d in r["op_delta"].items())
            out.append(f"  op delta: {ops}")
        if r.get("streams"):
            out.append("  nodes per stream: " + ", ".join(f"stream {k}: {v}" for k, v in r["streams"].items()))
        out.append(f"  graph before: {g['dir']}/{r['before']}" + (f"   after: {g['dir']}/{r['after']}   diff: {g['dir']}/{r['diff']}"
                                                                  if r["changed"] else ""))
        groups = [x for x in r["groups"] if layer is None or x["layer"] == layer]
        matched = [x for x in groups if x["pattern"] is not None]
        for i, m in enumerate(matched, 1):
            out.append("")
            stream = f"  -> stream {m['stream']}" if "stream" in m else ""
            out.append(style.green(f"  match {i}/{len(matched)}: {m['pattern']}") + f"  {_where(m['module'], m['layer'], m['source'])}{stream}")
            if m["erased"]:
                out.append(f"    erased {len(m['erased'])}:")
                out += _wrap_names([n["name"] for n in m["erased"]], "      ")
            if m.get("moved"):
                out.append(f"    moved {len(m['moved'])}:")
                out += _wrap_names([n["name"] for n in m["moved"]], "      ")
            if m["created"]:
                out.append(f"    created {len(m['created'])}:")
                out += [f"      {_clip(n['code'] or '%' + n['name'])}" for n in m["created"]]
        others = [x for x in groups if x["pattern"] is None]
        if others:
            out.append("")
            out.append("  changes outside any match, by module:")
            for x in others:
                out.append(f"    {x['module'] or '(no module)'}: erased {len(x['erased'])}, created {len(x['created'])}")
                if x["erased"]:
                    out += _wrap_names([n["name"] for n in x["erased"]], "      - ")
                if x["created"]:
                    out += _wrap_names([n["name"] for n in x["created"]], "      + ")
        modified = [x for x in r["modified"] if layer is None or x["layer"] == layer]
        if modified:
            out.append(f"  rewired (same node, new arguments or stream): {len(modified)}")
        cands = [c for c in _candidates(r) if layer is None or c.get("layer") == layer]
        if cands:
            out.append("")
            out.append(style.yellow(f"  candidates that did not match ({len(cands)}; `--why {r['name']}` shows the graph around them):"))
            for c in cands:
                tag = "declined" if c["declined"] else "attempt"
                block = f" [blocking %{c['blocking']}]" if c.get("blocking") else ""
                out.append(f"    {tag:8s} {c['pattern']} at %{c['anchor']} ({c.get('module') or '?'}): {c['progress']}/{c['total']} "
                           f"{c['kind']}: {_clip(c['reason'], 160)}{block}")
        if r["changed"] and r["diff"]:
            keep = None
            if layer is not None:
                keep = {n["name"] for x in groups for k in ("erased", "created", "moved") for n in x.get(k, [])}
                keep |= {n["name"] for n in modified}
            diff = _filter_diff(rec.lines(g, r["diff"]), keep)
            out.append("")
            out.append(f"  diff ({g['dir']}/{r['diff']}" + (f", hunks touching layer {layer}" if layer is not None else "") + "):")
            out += ["    " + style.diff_line(_clip(line)) for line in diff]
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------------
# show --why: every candidate anchor of a fusion
# ----------------------------------------------------------------------------------------------------------------


def _candidates(r: dict) -> list[dict]:
    """PassResult.declined and .attempts merged (one entry per anchor and failure), in anchor order."""
    merged: dict = {}
    for key, flag in (("declined_candidates", "declined"), ("attempt_candidates", "attempt")):
        for c in r.get(key, []):
            k = (c["pattern"], c["anchor"], c["kind"], c["reason"])
            entry = merged.setdefault(k, dict(c, declined=False, attempt=False))
            entry[flag] = True
    return list(merged.values())


def _context(lines: list[str], index: int | None) -> list[dict]:
    if index is None:
        return []
    lo, hi = max(0, index - CONTEXT), min(len(lines), index + CONTEXT + 1)
    return [{"line": i + 1, "code": lines[i], "focus": i == index} for i in range(lo, hi)]


def why_data(rec: Recording, graphs: list[dict], fusion: str, layer: int | None = None) -> dict:
    rec.require_pass(fusion)
    result = {"fusion": fusion, "layer": layer, "graphs": []}
    for g in graphs:
        p = rec.find_pass(g, fusion)
        if p is None:
            continue
        r = rec.record(g, p)
        lines = rec.lines(g, r["before"])
        position = {}
        for i, line in enumerate(lines):
            n = _line_node(line)
            if n is not None:
                position.setdefault(n, i)
        matched = [{"pattern": x["pattern"], "module": x["module"], "layer": x["layer"], "source": x["source"]}
                   for x in r["groups"] if x["pattern"] is not None and (layer is None or x["layer"] == layer)]
        cands = []
        for c in _candidates(r):
            if layer is not None and c.get("layer") != layer:
                continue
            blocking, inferred = c.get("blocking"), False
            if not blocking:  # e.g. a scalar mismatch names its node in the reason
                blocking = next((n for n in _REF_RE.findall(c["reason"]) if n in position and n != c["anchor"]), None)
                inferred = blocking is not None
            entry = dict(c)
            entry.update({"blocking_node": blocking, "blocking_named_in_reason": inferred,
                          "anchor_context": _context(lines, position.get(c["anchor"])),
                          "blocking_context": _context(lines, position.get(blocking)) if blocking else [],
                          "blocking_code": lines[position[blocking]] if blocking in position else None})
            cands.append(entry)
        # the sites a user asks about first: declined candidates (the whole pattern matched, a check said no), then
        # near misses by how much of their pattern matched, then in graph order
        cands.sort(key=lambda c: (not c["declined"], -c["progress"] / max(c["total"], 1), position.get(c["anchor"], 1 << 30)))
        in_layer = lambda c: layer is None or c.get("layer") == layer  # noqa: E731
        result["graphs"].append({"graph": g["graph"], "pass": {k: r[k] for k in ("index", "name", "changed", "matches", "declined", "attempts")},
                                 "before": f"{g['dir']}/{r['before']}", "matched": matched, "candidates": cands,
                                 "unrelated": [c for c in r.get("unrelated_candidates", []) if in_layer(c)],
                                 "narrowed": [c for c in r.get("narrowed_sites", []) if in_layer(c)]})
    return result


def render_why(data: dict, style: Style = PLAIN) -> str:
    from dsv41.passes.manager import differing_op_groups

    out: list[str] = []
    fusion = data["fusion"]
    for gd in data["graphs"]:
        p = gd["pass"]
        n = len(gd["candidates"])
        out.append(style.bold(f"why not {fusion}: graph {gd['graph']}, pass {p['index']:02d} ({p['matches']} matched, "
                              f"{n} candidate{'' if n == 1 else 's'} did not match)"
                              + (f"; layer {data['layer']}" if data["layer"] is not None else "")))
        out.append(f"  graph as the pass saw it: {gd['before']}")
        if gd["matched"]:
            where = ", ".join(f"{m['module'] or '?'} ({m['pattern']})" for m in gd["matched"])
            out.append(style.green(f"  matched ({len(gd['matched'])}): ") + where)
        if gd["narrowed"]:
            out.append(f"  fused by a narrower formulation ({len(gd['narrowed'])}):")
            for c in gd["narrowed"]:
                out.append(f"    %{c['anchor']}  {_where(c.get('module'), c.get('layer'), c.get('source'))}: fused as "
                           f"{c['fused']}; the wider {c['pattern']} was not accepted: {c['kind']} after {c['progress']} "
                           f"of {c['total']} pattern ops: {_clip(c['reason'], 240)}")
        if not gd["candidates"]:
            out.append("  no other candidate: " + ("the other anchors are another computation (below)" if gd["unrelated"]
                                                   else "every anchor with the fusion's distinctive op was fused"))
        if gd["unrelated"]:
            out.append(f"  another computation ({len(gd['unrelated'])} anchors, each differing within its first "
                       f"pattern ops):")
            for (pattern, kind, expected, found), cs in differing_op_groups(gd["unrelated"], dict.get).items():
                where = ", ".join(f"%{c['anchor']} ({c.get('module') or '?'})" for c in cs)
                differs = f"pattern op {expected}, graph op {found or 'none'}" if expected else _clip(cs[0]["reason"])
                out.append(f"    {where}: {pattern}: {kind}: {differs}")
        for i, c in enumerate(gd["candidates"], 1):
            out.append("")
            tag = "declined" if c["declined"] else "near miss"
            out.append(style.yellow(f"  {i}. %{c['anchor']}") + f"  {_where(c.get('module'), c.get('layer'), c.get('source'))}  [{tag}]")
            out.append(f"     pattern {c['pattern']}: matched {c['progress']} of {c['total']} pattern nodes, then")
            out.append(f"     {style.red(c['kind'])}: {c['reason']}")
            if c["blocking_node"]:
                how = "node named in the reason" if c["blocking_named_in_reason"] else "blocking node"
                src = c.get("blocking_source") or ""
                out.append(f"     {how}: %{c['blocking_node']}" + (f"  {c.get('blocking_module') or ''}  {src}" if src else ""))
            sections = [("graph around the anchor", c["anchor_context"])]
            if c["blocking_context"]:
                sections.append(("graph around the blocking node" if not c["blocking_named_in_reason"]
                                 else "graph around the node named in the reason", c["blocking_context"]))
            for title, ctx in sections:
                out.append(f"     {title}:")
                for x in ctx:
                    mark = ">" if x["focus"] else " "
                    text = f"     {mark} {x['line']:6d}  {_clip(x['code'])}"
                    out.append(style.bold(text) if x["focus"] else text)
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------------------------------------


def structural_keys(lines: list[str]) -> list[str]:
    """Each graph-code line with node names replaced by structural ids, so that two graphs that differ only in
    node names (`%getitem_127` vs `%getitem_95`) give equal keys. A node's id is a hash of its line with its
    operands' ids in place of their names, plus its rank among the nodes of equal hash (inputs: their order)."""
    ids: dict[str, str] = {}
    rank: collections.Counter = collections.Counter()
    keys = []
    for line in lines:
        m = _NODE_RE.match(line)
        body = _REF_RE.sub(lambda r: "%" + ids.get(r.group(1), r.group(1)), line[m.end():] if m else line)
        if m:
            digest = hashlib.sha1(body.encode()).hexdigest()[:16]
            rank[digest] += 1
            ids[m.group(1)] = f"{digest}.{rank[digest]}"
        keys.append(body)
    return keys


def structural_diff(lines_a: list[str], lines_b: list[str], label_a: str, label_b: str, n: int = 3) -> list[str]:
    """A unified diff of two graphs aligned by `structural_keys` (renamed nodes are equal), shown with the real
    lines: A's for removed ones, B's for added and context ones."""
    matcher = difflib.SequenceMatcher(None, structural_keys(lines_a), structural_keys(lines_b), autojunk=False)
    out: list[str] = []
    for group in matcher.get_grouped_opcodes(n):
        if not out:
            out += [f"--- {label_a}", f"+++ {label_b}"]
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@")
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                out += [" " + line for line in lines_b[b1:b2]]
            else:
                out += ["-" + line for line in lines_a[a1:a2]] + ["+" + line for line in lines_b[b1:b2]]
    return out


def compare(a: Recording, b: Recording, pass_name: str | None = None, style: Style = PLAIN) -> tuple[str, bool]:
    """The two recordings aligned by graph and pass: (text, whether anything differs). Graphs are compared by
    structure (`structural_keys`), so nodes that were only renamed are not reported."""
    if pass_name is not None:
        if not any(x.find_pass(g, pass_name) for x in (a, b) for g in x.graphs):
            raise GraphdiffError(f"no pass {pass_name!r} in either recording (A: {', '.join(a.pass_names()) or 'none'}; "
                                 f"B: {', '.join(b.pass_names()) or 'none'})")
    out: list[str] = [f"A: {a.root}", f"B: {b.root}"]
    differs = False
    by_a, by_b = {g["graph"]: g for g in a.graphs}, {g["graph"]: g for g in b.graphs}
    for seq in sorted(set(by_a) | set(by_b)):
        ga, gb = by_a.get(seq), by_b.get(seq)
        out.append("")
        if ga is None or gb is None:
            differs = True
            out.append(style.yellow(f"graph {seq}: only in {'B' if ga is None else 'A'}"))
            continue
        out.append(style.bold(f"graph {seq}: A {ga.get('nodes_in')} -> {ga.get('nodes_out')} nodes, "
                              f"B {gb.get('nodes_in')} -> {gb.get('nodes_out')} nodes"))
        names = [p["name"] for p in ga["passes"]] + [p["name"] for p in gb["passes"] if not a.find_pass(ga, p["name"])]
        rows = [["pass", "A", "B", ""]]
        for name in names:
            pa, pb = a.find_pass(ga, name), b.find_pass(gb, name)

            def cell(p):
                if p is None:
                    return "-"
                return f"{'changed' if p['changed'] else 'unchanged'} {p['matches']}m {p['declined']}d {p['nodes_after']}n"

            notes = []
            if pa is None or pb is None:
                notes.append(f"only in {'B' if pa is None else 'A'}")
            else:
                for key, label in (("matches", "matches"), ("declined", "declined"), ("attempts", "attempts"),
                                   ("changed", "changed"), ("nodes_after", "nodes")):
                    if pa[key] != pb[key]:
                        notes.append(f"{label} {pa[key]} -> {pb[key]}")
                ra, rb = a.record(ga, pa), b.record(gb, pb)
                if structural_keys(a.lines(ga, ra["after"])) != structural_keys(b.lines(gb, rb["after"])):
                    notes.append("graph after differs")
                if ra.get("matches_by_layer") != rb.get("matches_by_layer") and pa["matches"] == pb["matches"]:
                    notes.append("matches per layer differ")
            differs |= bool(notes)
            rows.append([name, cell(pa), cell(pb), "; ".join(notes) if notes else "same"])
        lines = _table(rows)
        out.append(style.dim(lines[0]))
        for line, row in zip(lines[1:], rows[1:]):
            out.append(line if row[3] == "same" else style.yellow(line))
        if pass_name is not None:
            pa, pb = a.find_pass(ga, pass_name), b.find_pass(gb, pass_name)
            la = a.lines(ga, a.record(ga, pa)["after"]) if pa else []
            lb = b.lines(gb, b.record(gb, pb)["after"]) if pb else []
            diff = structural_diff(la, lb, f"A/{ga['dir']}/after {pass_name}", f"B/{gb['dir']}/after {pass_name}")
            out.append("")
            out.append(f"  graph after {pass_name}, A -> B:" + ("" if diff else " identical"))
            out += ["    " + style.diff_line(_clip(line)) for line in diff]
    out.append("")
    out.append(style.yellow("the recordings differ") if differs else "the recordings agree")
    return "\n".join(out) + "\n", differs


# ----------------------------------------------------------------------------------------------------------------
# check
# ----------------------------------------------------------------------------------------------------------------


def _eval_spec(spec, n_layers: int, where: str) -> int:
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise GraphdiffError(f"{where}: expected an integer or an expression such as \"2*L\", found {spec!r}")
    if isinstance(spec, int):
        return spec
    try:
        tree = ast.parse(spec.strip(), mode="eval")
    except SyntaxError:
        raise GraphdiffError(f"{where}: {spec!r} is not an expression of integers, L, + - *") from None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name) and node.id in ("L", "layers"):
            return n_layers
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            x, y = ev(node.left), ev(node.right)
            return x + y if isinstance(node.op, ast.Add) else x - y if isinstance(node.op, ast.Sub) else x * y
        raise GraphdiffError(f"{where}: {spec!r} is not an expression of integers, L, + - *")

    return ev(tree)


def load_expectations(path) -> dict:
    path = Path(path)
    data = _read_json(path, "expectations")
    if not isinstance(data, dict):
        raise GraphdiffError(f"{path}: expectations must be a JSON object, found {type(data).__name__}")
    sections = {"matches", "declined", "layers", "graph"}
    if not (set(data) & {"matches", "declined"}):
        data = {"matches": data}
    unknown = set(data) - sections
    if unknown:
        raise GraphdiffError(f"{path}: unknown key(s) {sorted(unknown)}; an expectations file has "
                             f"'matches', 'declined', 'layers', 'graph' (or is a plain {{pass: count}} object)")
    for key in ("matches", "declined"):
        if key in data and not isinstance(data[key], dict):
            raise GraphdiffError(f"{path}: '{key}' must be an object {{pass: count}}")
    for key in ("layers", "graph"):
        if key in data and (isinstance(data[key], bool) or not isinstance(data[key], int)):
            raise GraphdiffError(f"{path}: '{key}' must be an integer")
    return data


def check(rec: Recording, expect_path) -> tuple[str, bool]:
    """(report text, all expectations hold)."""
    from dsv41.config import FUSIONS

    exp = load_expectations(expect_path)
    graphs = rec.select_graphs(exp.get("graph"))
    if not graphs:
        raise GraphdiffError(f"{rec.root}: the recording holds no compiled graph, so there is nothing to check")
    layers = sorted({x for g in graphs for x in g.get("layers") or []})
    n_layers = exp.get("layers", len(layers))
    known = set(FUSIONS) | {"normalize", "streams", "defunctionalize"} | set(rec.pass_names())
    out, ok_all = [], True
    for section in ("matches", "declined"):
        for name, spec in exp.get(section, {}).items():
            where = f"{expect_path}: {section}.{name}"
            if name not in known:
                raise GraphdiffError(f"{where}: unknown pass {name!r} (recorded: {', '.join(rec.pass_names())})")
            entries = [(g, rec.find_pass(g, name)) for g in graphs]
            entries = [(g, p) for g, p in entries if p is not None]
            if not entries:
                ok_all = False
                out.append(f"FAIL  {section} {name}: the pass did not run in this recording")
                continue
            total = sum(p[section] for _, p in entries)
            if isinstance(spec, dict):
                if set(spec) - {"each_layer"} or "each_layer" not in spec:
                    raise GraphdiffError(f"{where}: an object spec is {{\"each_layer\": K}}, found {spec!r}")
                if section != "matches":
                    raise GraphdiffError(f"{where}: each_layer applies to matches only")
                want = _eval_spec(spec["each_layer"], n_layers, where)
                by_layer: dict = {}
                for _, p in entries:
                    for k, v in (p.get("matches_by_layer") or {}).items():
                        by_layer[k] = by_layer.get(k, 0) + v
                bad = [f"layer {x}: {by_layer.get(str(x), 0)}" for x in layers if by_layer.get(str(x), 0) != want]
                bad += [f"layer {k}: {v}" for k, v in by_layer.items() if k not in {str(x) for x in layers}]
                ok = not bad
                text = f"{section} {name}: {want} in each of layers {', '.join(map(str, layers))}"
                text += "" if ok else f"; found {', '.join(bad)}"
            else:
                want = _eval_spec(spec, n_layers, where)
                ok = total == want
                shown = f"{spec} = {want}" if isinstance(spec, str) and spec.strip() != str(want) else str(want)
                text = f"{section} {name}: {total} {'==' if ok else '!='} {shown}"
                if not ok and section == "matches":
                    per = {}
                    for _, p in entries:
                        for k, v in (p.get("matches_by_layer") or {}).items():
                            per[k] = per.get(k, 0) + v
                    if per:
                        text += " (per layer: " + ", ".join(f"{k}: {v}" for k, v in per.items()) + ")"
            ok_all &= ok
            out.append(f"{'ok  ' if ok else 'FAIL'}  {text}")
    if not out:
        raise GraphdiffError(f"{expect_path}: no expectations (give 'matches' and/or 'declined')")
    n_fail = sum(1 for line in out if line.startswith("FAIL"))
    out.append(f"L = {n_layers}; {len(out) - n_fail} expectation(s) hold, {n_fail} fail")
    return "\n".join(out) + "\n", ok_all


# ----------------------------------------------------------------------------------------------------------------
# commands
# ----------------------------------------------------------------------------------------------------------------


def _print(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def cmd_show(args) -> int:
    rec = Recording(args.dir)
    graphs = rec.select_graphs(args.graph)
    if args.layer is not None:
        layers = sorted({x for g in graphs for x in g.get("layers") or []})
        if args.layer not in layers:
            raise GraphdiffError(f"--layer {args.layer}: no such layer in {rec.root} (recorded layers: "
                                 f"{', '.join(map(str, layers)) or 'none'})")
    if args.why and args.pass_name:
        raise GraphdiffError("--why and --pass cannot be combined (--why FUSION already picks the pass)")
    if args.out and args.format != "html":
        raise GraphdiffError("--out applies to --format html only")
    style = Style.for_stream(sys.stdout, args.color)
    if args.format == "html":
        from dsv41.tools.graphdiff_html import pass_page_name, write_report

        if args.layer is not None:
            raise GraphdiffError("--layer applies to text and json; every HTML pass page has a layer filter")
        out = Path(args.out) if args.out else rec.root / "html"
        focus = args.why or args.pass_name
        if focus:
            rec.require_pass(focus)
        index = write_report(rec, out, graphs)
        _print(f"wrote {index}")
        for g in graphs if focus else []:
            p = rec.find_pass(g, focus)
            if p is not None:
                _print(f"  {focus}: {out / pass_page_name(g, p)}" + ("#candidates" if args.why else ""))
        return 0
    if args.why:
        data = why_data(rec, graphs, args.why, args.layer)
        _print(json.dumps(data, indent=1) if args.format == "json" else render_why(data, style))
        return 0
    if args.pass_name:
        if args.format == "json":
            rec.require_pass(args.pass_name)
            recs = [rec.record(g, p) for g in graphs for p in [rec.find_pass(g, args.pass_name)] if p]
            if args.layer is not None:
                recs = [_filter_record(r, args.layer) for r in recs]
            _print(json.dumps(recs, indent=1))
        else:
            _print(render_pass(rec, graphs, args.pass_name, args.layer, style))
        return 0
    if args.format == "json":
        payload = {"format": FORMAT, "graphs": graphs}
        if args.layer is not None:
            payload["layer"] = args.layer
        _print(json.dumps(payload, indent=1))
    else:
        _print(render_summary(rec, graphs, args.layer, style))
    return 0


def _filter_record(r: dict, layer: int) -> dict:
    r = dict(r)
    for key in ("groups", "modified", "declined_candidates", "attempt_candidates", "unrelated_candidates",
                "narrowed_sites"):
        r[key] = [x for x in r.get(key, []) if x.get("layer") == layer]
    r["layer"] = layer
    return r


def cmd_compare(args) -> int:
    a, b = Recording(args.dir_a), Recording(args.dir_b)
    text, differs = compare(a, b, args.pass_name, Style.for_stream(sys.stdout, args.color))
    _print(text)
    return 1 if differs else 0


def cmd_check(args) -> int:
    rec = Recording(args.dir)
    text, ok = check(rec, args.expect)
    _print(text)
    return 0 if ok else 1
