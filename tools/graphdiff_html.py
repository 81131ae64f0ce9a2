"""The static HTML report of a graph-diff recording (`dsv41 graphdiff show DIR --format html [--out PATH]`).

`index.html` lists every graph and pass (changed or not, counts, matches per layer, declined candidates, stream
lanes) and links a page per pass: its matches with the erased and created nodes and their provenance, every
candidate that did not match with the graph around its anchor and blocking node, a side-by-side diff, and, when
the graph carries a stream schedule, one swimlane per stream. A pass page also lists the sites fused by a narrower
formulation and the anchors that are another computation. Everything is inline (CSS and a few lines of JS,
no external resource); the JS only adds a layer filter, and reports its own errors into the page
(`#js-errors`), so a headless browser's `--dump-dom` shows whether the page ran cleanly.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from dsv41.passes.manager import differing_op_groups
from dsv41.tools.graphdiff_view import Recording, _candidates, why_data

_STREAM_RE = re.compile(r"\s+@stream(\d+)$")
_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
MAX_MAIN_RUN = 8  # consecutive main-stream-only rows shown in a swimlane before they are folded

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1d1d1f; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; } h3 { font-size: 1em; }
table { border-collapse: collapse; margin: .5em 0; }
th, td { border: 1px solid #d0d0d7; padding: 2px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f6; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.unchanged td { color: #888; }
code, pre, .code { font: 12px/1.35 ui-monospace, SFMono-Regular, Menlo, monospace; }
pre { background: #f7f7fa; padding: .5em; overflow-x: auto; margin: .3em 0; }
.changed { color: #126b2b; font-weight: 600; } .declined { color: #9a5b00; } .muted { color: #888; }
nav a { margin-right: 1em; }
details { margin: .3em 0; } summary { cursor: pointer; }
.focus { background: #fff3b0; }
table.diff { width: 100%; table-layout: fixed; }
table.diff td { border: none; white-space: pre-wrap; word-break: break-all; padding: 0 6px; }
table.diff td.ln { width: 3.5em; color: #999; text-align: right; user-select: none; }
table.diff td.del { background: #ffe9e9; } table.diff td.ins { background: #e6ffed; }
table.diff td.empty { background: #f4f4f4; } table.diff tr.sep td { background: #eef1ff; color: #557; }
table.lanes td { font: 11px/1.3 ui-monospace, monospace; white-space: nowrap; max-width: 34em; overflow: hidden;
                 text-overflow: ellipsis; }
table.lanes td.pos { color: #999; text-align: right; }
table.lanes td.node.s0 { background: #eef2ff; } table.lanes td.node.s1 { background: #e8f8ec; }
table.lanes td.node.s2 { background: #fff1e0; } table.lanes td.node.s3 { background: #f6e8ff; }
table.lanes td.node.marker { font-weight: 700; }
table.lanes tr.fold td { color: #888; font-style: italic; background: #fafafa; }
#js-errors:not(:empty) { border: 2px solid #c00; padding: .5em; color: #c00; }
"""

JS = """
(function () {
  var errors = document.getElementById('js-errors');
  window.addEventListener('error', function (e) {
    errors.textContent += 'JS error: ' + e.message + '\\n';
    document.body.setAttribute('data-js-errors', 'yes');
  });
  var select = document.getElementById('layer-filter');
  if (select) {
    select.addEventListener('change', function () {
      var want = select.value;
      var items = document.querySelectorAll('[data-layer]');
      for (var i = 0; i < items.length; i++) {
        var show = want === '' || items[i].getAttribute('data-layer') === want;
        items[i].style.display = show ? '' : 'none';
      }
    });
  }
  document.body.setAttribute('data-ready', 'yes');
})();
"""


def _e(s) -> str:
    return html.escape("" if s is None else str(s), quote=True)


def _page(title: str, body: list[str]) -> str:
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title>", f"<style>{CSS}</style>",
        # window.onerror first, so that an error anywhere below is reported into the page
        "<script>window.onerror = function (m) { var d = document.getElementById('js-errors');"
        " if (d) { d.textContent += 'JS error: ' + m + '\\n'; } };</script>",
        "</head>", "<body>", '<div id="js-errors"></div>', *body, f"<script>{JS}</script>", "</body>", "</html>", ""])


def pass_page_name(g: dict, p: dict) -> str:
    return f"g{g['graph']:03d}_{p['index']:02d}_{re.sub(r'[^A-Za-z0-9_.-]', '_', p['name'])}.html"


def _where(module, layer, source) -> str:
    parts = [f"<code>{_e(module or '(no module)')}</code>"]
    if layer is not None:
        parts.append(f"layer {_e(layer)}")
    if source:
        parts.append(f"<code>{_e(source)}</code>")
    return " · ".join(parts)


# ----------------------------------------------------------------------------------------------------------------
# index
# ----------------------------------------------------------------------------------------------------------------


def _index(rec: Recording, graphs: list[dict]) -> str:
    body = ["<h1>dsv41 graph diff</h1>"]
    if not graphs:
        body.append("<p>No graph was compiled while recording (a graph Dynamo had already compiled runs no pass: "
                    "call <code>torch._dynamo.reset()</code> before recording).</p>")
    for g in graphs:
        passes = g["passes"]
        changed = sum(1 for p in passes if p["changed"])
        layers = ", ".join(str(x) for x in g.get("layers") or []) or "none"
        body.append(f'<h2 id="graph-{g["graph"]}">Graph {_e(g["graph"])}</h2>')
        body.append(f"<p>{_e(g.get('nodes_in'))} nodes in, {_e(g.get('nodes_out'))} out; layers {_e(layers)}; "
                    f"{len(passes)} passes, {changed} changed.</p>")
        if not g.get("complete", True):
            body.append('<p class="declined">Incomplete: the pass manager stopped early (the backend fell back to plain Inductor).</p>')
        body.append('<table class="passes"><thead><tr><th>#</th><th>pass</th><th>result</th><th>nodes</th><th>matches</th>'
                    "<th>declined</th><th>attempts</th><th>streams</th></tr></thead><tbody>")
        for p in passes:
            nodes = f"{p['nodes_before']} → {p['nodes_after']}" if p["changed"] else str(p["nodes_before"])
            streams = ", ".join(f"{k}: {v}" for k, v in (p.get("streams") or {}).items())
            result = '<span class="changed">changed</span>' if p["changed"] else "unchanged"
            body.append(f'<tr class="{"row-changed" if p["changed"] else "unchanged"}" data-pass="{_e(p["name"])}">'
                        f'<td class="num">{p["index"]:02d}</td><td><a href="{_e(pass_page_name(g, p))}">{_e(p["name"])}</a></td>'
                        f"<td>{result}</td><td class=\"num\">{_e(nodes)}</td><td class=\"num\">{_e(p['matches'])}</td>"
                        f"<td class=\"num\">{_e(p['declined'])}</td><td class=\"num\">{_e(p['attempts'])}</td><td>{_e(streams)}</td></tr>")
        body.append("</tbody></table>")
        with_layers = [p for p in passes if p.get("matches_by_layer")]
        if with_layers:
            keys = [str(x) for x in g.get("layers") or []]
            for p in with_layers:
                keys += [k for k in p["matches_by_layer"] if k not in keys]
            body.append("<h3>Matches per layer</h3>")
            body.append("<table><thead><tr><th>pass</th>" + "".join(f"<th>layer {_e(k)}</th>" for k in keys) + "</tr></thead><tbody>")
            for p in with_layers:
                body.append(f"<tr><td>{_e(p['name'])}</td>" + "".join(f'<td class="num">{_e(p["matches_by_layer"].get(k, 0))}</td>'
                                                                      for k in keys) + "</tr>")
            body.append("</tbody></table>")
        declined = [(p, c) for p in passes for c in rec.record(g, p)["declined_candidates"]]
        if declined:
            body.append(f"<h3>Declined candidates ({len(declined)})</h3><ul>")
            for p, c in declined:
                block = f" blocking <code>%{_e(c['blocking'])}</code>" if c.get("blocking") else ""
                body.append(f'<li class="declined"><a href="{_e(pass_page_name(g, p))}#candidates">{_e(p["name"])}</a>: '
                            f"{_e(c['pattern'])} at <code>%{_e(c['anchor'])}</code> ({_where(c.get('module'), c.get('layer'), c.get('source'))}): "
                            f"{_e(c['kind'])}: {_e(c['reason'])}{block}</li>")
            body.append("</ul>")
    return _page("dsv41 graph diff", body)


# ----------------------------------------------------------------------------------------------------------------
# pass pages
# ----------------------------------------------------------------------------------------------------------------


def _side_by_side(diff: list[str]) -> list[str]:
    """A unified diff as a 4-column table: deletions and insertions paired row by row, GitHub-style."""
    rows = ['<table class="diff"><colgroup><col style="width:3.5em"><col><col style="width:3.5em"><col></colgroup><tbody>']
    old_no = new_no = 0
    dels: list[tuple[int, str]] = []
    ins: list[tuple[int, str]] = []

    def flush():
        for i in range(max(len(dels), len(ins))):
            left = dels[i] if i < len(dels) else None
            right = ins[i] if i < len(ins) else None
            cells = []
            for side, cls in ((left, "del"), (right, "ins")):
                if side is None:
                    cells.append('<td class="ln"></td><td class="empty"></td>')
                else:
                    cells.append(f'<td class="ln">{side[0]}</td><td class="{cls}">{_e(side[1])}</td>')
            rows.append("<tr>" + "".join(cells) + "</tr>")
        dels.clear()
        ins.clear()

    for line in diff:
        if line.startswith(("---", "+++")):
            continue
        m = _HUNK_RE.match(line)
        if m:
            flush()
            old_no, new_no = int(m.group(1)), int(m.group(3))
            rows.append(f'<tr class="sep"><td colspan="4">{_e(line)}</td></tr>')
        elif line.startswith("-"):
            dels.append((old_no, line[1:]))
            old_no += 1
        elif line.startswith("+"):
            ins.append((new_no, line[1:]))
            new_no += 1
        elif line.startswith(" "):
            flush()
            text = _e(line[1:])
            rows.append(f'<tr><td class="ln">{old_no}</td><td>{text}</td><td class="ln">{new_no}</td><td>{text}</td></tr>')
            old_no += 1
            new_no += 1
    flush()
    rows.append("</tbody></table>")
    return rows


def _swimlanes(lines: list[str]) -> list[str]:
    """One column (lane) per stream id, one row per node in graph order; long main-only runs folded."""
    nodes = []
    for i, line in enumerate(lines):
        m = _STREAM_RE.search(line)
        stream = int(m.group(1)) if m else 0
        nodes.append((i + 1, stream, line[: m.start()] if m else line))
    streams = sorted({s for _, s, _ in nodes} | {0})
    out = [f'<p>{len(streams)} lanes: ' + ", ".join(f"stream {s}: {sum(1 for _, x, _ in nodes if x == s)} nodes" for s in streams) + "</p>",
           '<table class="lanes"><thead><tr><th>#</th>'
           + "".join(f'<th class="lane" data-stream="{s}">stream {s}{" (main)" if s == 0 else ""}</th>' for s in streams)
           + "</tr></thead><tbody>"]
    # fold runs of main-stream rows between side-stream activity
    side_rows = [k for k, (_, s, _) in enumerate(nodes) if s != 0]
    near = set()
    for k in side_rows:
        near.update(range(max(0, k - 2), min(len(nodes), k + 3)))
    run: list[int] = []

    def emit_run():
        if len(run) > MAX_MAIN_RUN:
            shown = run[:2] + [None] + run[-2:]
        else:
            shown = list(run)
        for k in shown:
            if k is None:
                hidden = len(run) - 4
                out.append(f'<tr class="fold"><td></td><td colspan="{len(streams)}">⋯ {hidden} nodes on stream 0 ⋯</td></tr>')
            else:
                row(k)
        run.clear()

    def row(k):
        pos, s, text = nodes[k]
        marker = " marker" if re.search(r"= (record_event|wait_event)\(", text) else ""
        cells = "".join(f'<td class="node s{s % 4}{marker}" title="{_e(text)}">{_e(text)}</td>' if x == s else "<td></td>"
                        for x in streams)
        out.append(f'<tr data-stream="{s}"><td class="pos">{pos}</td>{cells}</tr>')

    for k, (_, s, _) in enumerate(nodes):
        if s == 0 and k not in near:
            run.append(k)
            continue
        emit_run()
        row(k)
    emit_run()
    out.append("</tbody></table>")
    return out


def _pass_page(rec: Recording, g: dict, p: dict, prev: dict | None, nxt: dict | None) -> str:
    r = rec.record(g, p)
    title = f"graph {g['graph']} · pass {r['index']:02d} {r['name']}"
    nav = ['<nav><a href="index.html">index</a>']
    if prev:
        nav.append(f'<a href="{_e(pass_page_name(g, prev))}">← {_e(prev["name"])}</a>')
    if nxt:
        nav.append(f'<a href="{_e(pass_page_name(g, nxt))}">{_e(nxt["name"])} →</a>')
    body = ["".join(nav) + "</nav>", f"<h1>{_e(title)}</h1>"]
    if r["changed"]:
        body.append(f'<p><span class="changed">changed</span>: {r["nodes_before"]} → {r["nodes_after"]} nodes; '
                    f"{r['erased_count']} erased, {r['created_count']} created, {r['modified_count']} rewired.</p>")
    else:
        body.append(f"<p>unchanged ({r['nodes_before']} nodes).</p>")
    body.append(f"<p>{r['matches']} matches, {r['declined']} declined, {r['attempts']} attempts. Graph before: "
                f"<code>{_e(g['dir'])}/{_e(r['before'])}</code>"
                + (f", after: <code>{_e(g['dir'])}/{_e(r['after'])}</code>, diff: <code>{_e(g['dir'])}/{_e(r['diff'])}</code>" if r["changed"] else "")
                + "</p>")
    layers = sorted({x["layer"] for x in r["groups"] + r["declined_candidates"] + r["attempt_candidates"] if x.get("layer") is not None})
    if layers:
        body.append('<p><label>Layer filter: <select id="layer-filter"><option value="">all layers</option>'
                    + "".join(f'<option value="{x}">layer {x}</option>' for x in layers) + "</select></label></p>")
    if r["op_delta"]:
        body.append("<h2>Op counts</h2><table><thead><tr><th>op</th><th>delta</th></tr></thead><tbody>")
        body += [f'<tr><td><code>{_e(op)}</code></td><td class="num">{d:+d}</td></tr>' for op, d in r["op_delta"].items()]
        body.append("</tbody></table>")
    matched = [x for x in r["groups"] if x["pattern"] is not None]
    others = [x for x in r["groups"] if x["pattern"] is None]
    body.append(f'<h2 id="matches">Matches ({len(matched)})</h2>')
    for i, m in enumerate(matched, 1):
        stream = f" → stream {_e(m['stream'])}" if "stream" in m else ""
        body.append(f'<details class="match" data-layer="{_e(m["layer"] if m["layer"] is not None else "")}"><summary>'
                    f"{i}. <b>{_e(m['pattern'])}</b> — {_where(m['module'], m['layer'], m['source'])}{stream} "
                    f"({len(m['erased'])} erased, {len(m['created'])} created)</summary>")
        if m["frames"]:
            body.append("<p>stack: " + " ← ".join(f"<code>{_e(f)}</code>" for f in reversed(m["frames"])) + "</p>")
        for key in ("erased", "moved", "created"):
            if m.get(key):
                body.append(f"<h3>{key} ({len(m[key])})</h3><pre>"
                            + "\n".join(_e(f"{n['code'] or '%' + n['name']}    # {n['source'] or ''}") for n in m[key]) + "</pre>")
        body.append("</details>")
    if others:
        body.append("<h2>Changes outside any match</h2>")
        for x in others:
            body.append(f'<details data-layer="{_e(x["layer"] if x["layer"] is not None else "")}"><summary><code>{_e(x["module"] or "(no module)")}</code>: '
                        f"{len(x['erased'])} erased, {len(x['created'])} created</summary><pre>"
                        + "\n".join(_e("- " + (n["code"] or n["name"])) for n in x["erased"])
                        + ("\n" if x["erased"] and x["created"] else "")
                        + "\n".join(_e("+ " + (n["code"] or n["name"])) for n in x["created"]) + "</pre></details>")
    # why not
    cands = _candidates(r)
    body.append(f'<h2 id="candidates">Candidates that did not match ({len(cands)})</h2>')
    if cands:
        data = why_data(rec, [g], p["name"])["graphs"][0]["candidates"]
        for i, c in enumerate(data, 1):
            tag = "declined" if c["declined"] else "near miss"
            body.append(f'<div class="candidate" data-layer="{_e(c.get("layer") if c.get("layer") is not None else "")}">'
                        f'<h3 class="declined">{i}. <code>%{_e(c["anchor"])}</code> — {_where(c.get("module"), c.get("layer"), c.get("source"))} [{tag}]</h3>'
                        f"<p>pattern <b>{_e(c['pattern'])}</b>: matched {c['progress']} of {c['total']} pattern nodes, then "
                        f"<b>{_e(c['kind'])}</b>: {_e(c['reason'])}</p>")
            if c["blocking_node"]:
                how = "node named in the reason" if c["blocking_named_in_reason"] else "blocking node"
                body.append(f"<p>{how}: <code>%{_e(c['blocking_node'])}</code></p>")
            for label, ctx in (("around the anchor", c["anchor_context"]), ("around the blocking node", c["blocking_context"])):
                if ctx:
                    body.append(f"<p class=\"muted\">graph {label}:</p><pre>" + "\n".join(
                        (f'<span class="focus">{x["line"]:6d}  {_e(x["code"])}</span>' if x["focus"] else f"{x['line']:6d}  {_e(x['code'])}")
                        for x in ctx) + "</pre>")
            body.append("</div>")
    else:
        body.append('<p class="muted">No other candidate: every anchor was fused or is another computation.</p>')
    narrowed, unrelated = r.get("narrowed_sites", []), r.get("unrelated_candidates", [])
    if narrowed:
        body.append(f"<h2>Fused by a narrower formulation ({len(narrowed)})</h2><ul>")
        for c in narrowed:
            body.append(f"<li><code>%{_e(c['anchor'])}</code> — {_e(c.get('module') or '(no module)')}: fused as "
                        f"<b>{_e(c['fused'])}</b>; the wider <b>{_e(c['pattern'])}</b> was not accepted: "
                        f"{_e(c['kind'])}: {_e(c['reason'])}</li>")
        body.append("</ul>")
    if unrelated:
        body.append(f"<h2>Another computation ({len(unrelated)} anchors)</h2><ul>")
        for (pattern, kind, expected, found), cs in differing_op_groups(unrelated, dict.get).items():
            where = ", ".join(f"%{c['anchor']} ({c.get('module') or '?'})" for c in cs)
            differs = f"pattern op {expected}, graph op {found or 'none'}" if expected else cs[0]["reason"]
            body.append(f"<li><code>{_e(where)}</code>: {_e(pattern)}: {_e(kind)}: {_e(differs)}</li>")
        body.append("</ul>")
    # streams
    if r.get("streams") and len(r["streams"]) > 1 and r["changed"]:
        body.append('<h2 id="streams">Streams</h2>')
        body += _swimlanes(rec.lines(g, r["after"]))
    elif r.get("streams") and len(r["streams"]) > 1:
        body.append(f'<h2 id="streams">Streams</h2><p>{len(r["streams"])} lanes, unchanged by this pass: '
                    + ", ".join(f"stream {k}: {v} nodes" for k, v in r["streams"].items()) + "</p>")
    # the diff
    body.append('<h2 id="diff">Diff</h2>')
    if r["changed"] and r["diff"]:
        body += _side_by_side(rec.lines(g, r["diff"]))
    else:
        body.append('<p class="muted">(no changes)</p>')
    return _page(title, body)


def write_report(rec: Recording, out, graphs: list[dict] | None = None) -> Path:
    """Write index.html and a page per pass to `out`; returns the index path."""
    out = Path(out)
    graphs = rec.graphs if graphs is None else graphs
    out.mkdir(parents=True, exist_ok=True)
    pages = {"index.html": _index(rec, graphs)}
    for g in graphs:
        passes = g["passes"]
        for i, p in enumerate(passes):
            pages[pass_page_name(g, p)] = _pass_page(rec, g, p, passes[i - 1] if i else None,
                                                     passes[i + 1] if i + 1 < len(passes) else None)
    for name, text in pages.items():
        with open(out / name, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
    return out / "index.html"
