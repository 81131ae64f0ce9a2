"""Side-stream scheduling, after all fusions: independent decode work moves to side streams.

Branches (spec 2.1, 3d): each is the *exclusive producer cone* of a root node — the root, its getitems, and
every ancestor whose users all lie inside the cone (graph inputs and collectives excluded):

| kind | root | stream | runs beside |
|---|---|---|---|
| `mhc_coeffs` | `dsv41::mhc_coeffs` | 2 | the whole sublayer, until the post that consumes post/comb |
| `shared_expert` | the shared-expert output feeding `dsv41::moe_finalize` | 1 | the router and the routed experts |
| `indexer` | `dsv41::indexer_topk` (with its q/w projections) | 1 | the main q/kv path, until sparse attention |

`Dsv41Config.stream_branches` selects the kinds that move (all by default).

For each branch the pass moves the cone right after its last input (the fork) and makes the schedule explicit
in the graph: `record_event(e)` on the main stream, `wait_event(e)` on the side stream, the cone on the side
stream, `record_event(j)` on the side stream, and `wait_event(j)` on the main stream just before the first
consumer (the join). Every node carries `meta["dsv41_stream"]` (0 = main); event ids are unique per fork.
Collectives never leave the main stream, every fork is joined before the graph's outputs, and the pass applies
only up to `stream_max_tokens` tokens. `dsv41.stream_executor` runs such a graph as stream segments.

When a branch moved, the pass also hoists each write-back of a mutated graph input (`copy_(input, new)`, which
functionalisation emits at the end of the graph) to right after the producer of `new` (`hoist_write_backs`): the
executor compiles each segment as its own Inductor graph, and only with the write-back in the producer's segment
does Inductor turn the functional cache update (a full copy of the cache plus a scatter) back into an in-place
scatter. Left at the end, the caches were copied whole twice per step (measured on the H200, layers 2,3,20,24:
about 260 us of a 2.8 ms batch-1 step, growing with the cache's batch rows).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dsv41.config import STREAM_BRANCHES
from dsv41.passes.fusion import GraphPass, PassResult

STREAM = "dsv41_stream"
MAIN = 0


def record_event(event: int) -> None:
    """Marker: record event `event` on the node's stream (executed by the stream executor, a no-op otherwise)."""


def wait_event(event: int) -> None:
    """Marker: make the node's stream wait for event `event`."""


fx.node.has_side_effect(record_event)
fx.node.has_side_effect(wait_event)
MARKERS = (record_event, wait_event)


def _has_collective(node: fx.Node) -> bool:
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    return t.namespace in ("_c10d_functional", "c10d") or (t.namespace == "dsv41" and t._schema.name.endswith("allreduce_mhc"))


def branch_roots(graph: fx.Graph) -> list[tuple[fx.Node, int, str]]:
    """(root, stream, kind) of every branch candidate, in graph order."""
    dsv41 = torch.ops.dsv41
    roots = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is dsv41.mhc_coeffs.default:
            roots.append((n, 2, "mhc_coeffs"))
        elif n.target is dsv41.indexer_topk.default:
            roots.append((n, 1, "indexer"))
        elif n.target is dsv41.moe_finalize.default and len(n.args) > 2 and isinstance(n.args[2], fx.Node):
            roots.append((n.args[2], 1, "shared_expert"))
    return roots


def exclusive_cone(root: fx.Node) -> list[fx.Node]:
    """The root, its getitem users, and every ancestor all of whose users are in the cone; graph order."""
    cone = {root} | {u for u in root.users if u.target is operator.getitem}
    changed = True
    while changed:
        changed = False
        for n in list(cone):
            for a in n.all_input_nodes:
                if a in cone or a.op != "call_function" or _has_collective(a):
                    continue
                if all(u in cone for u in a.users):
                    cone.add(a)
                    changed = True
    return [n for n in root.graph.nodes if n in cone]


class StreamSchedulePass(GraphPass):
    name = "streams"

    def __call__(self, graph: fx.Graph) -> PassResult:
        result = PassResult(self.name)
        if not self.config.streams:
            return result
        vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
        if not any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in vals):
            return result  # streams exist on CUDA only
        return schedule_streams(graph, self.config.stream_max_tokens, result, self.config.stream_branches)


def schedule_streams(graph: fx.Graph, max_tokens: int, result: PassResult | None = None,
                     branches=STREAM_BRANCHES) -> PassResult:
    """Annotate and reorder `graph` in place (see the module docstring), moving the branches of the kinds in
    `branches`. Device-independent, for tests too."""
    from dsv41.passes.matcher import MatchFailure

    result = result or PassResult(StreamSchedulePass.name)
    for n in graph.nodes:
        n.meta.setdefault(STREAM, MAIN)
    event = 0
    for root, stream, kind in branch_roots(graph):
        if kind not in branches:
            continue
        t = _tokens(root)
        if not isinstance(t, int) or t > max_tokens:
            result.declined.append(MatchFailure(kind, root.name, 0, 1, "token limit", f"T={t} > stream_max_tokens={max_tokens}"))
            continue
        cone = exclusive_cone(root)
        if any(n.meta.get(STREAM, MAIN) != MAIN for n in cone):
            continue
        position = {n: i for i, n in enumerate(graph.nodes)}
        inputs = {a for n in cone for a in n.all_input_nodes if a not in cone}
        consumers = [u for n in cone for u in n.users if u not in cone]
        if not consumers or not inputs:
            continue
        fork_after = max(inputs, key=position.__getitem__)
        if fork_after.op == "placeholder":  # keep the graph's inputs first
            fork_after = [n for n in graph.nodes if n.op == "placeholder"][-1]
        first_use = min(consumers, key=position.__getitem__)
        main_between = [n for n in graph.nodes if position[fork_after] < position[n] < position[first_use]
                        and n not in cone and n.op == "call_function"]
        if not main_between:
            result.declined.append(MatchFailure(kind, root.name, 1, 1, "check", "nothing to overlap: the first consumer follows the branch's inputs"))
            continue
        fork, join = event, event + 1
        event += 2
        with graph.inserting_after(fork_after):
            rec = graph.call_function(record_event, (fork,))
        rec.meta.update({STREAM: MAIN, "val": None})
        last = rec
        with graph.inserting_after(last):
            wait = graph.call_function(wait_event, (fork,))
        wait.meta.update({STREAM: stream, "val": None})
        last = wait
        for n in cone:
            last.append(n)
            n.meta[STREAM] = stream
            last = n
        with graph.inserting_after(last):
            done = graph.call_function(record_event, (join,))
        done.meta.update({STREAM: stream, "val": None})
        with graph.inserting_before(first_use):
            back = graph.call_function(wait_event, (join,))
        back.meta.update({STREAM: MAIN, "val": None})
        result.matches += 1
        result.replaced.append({"pattern": kind, "erased": [], "created": [rec.name, wait.name, done.name, back.name],
                                "moved": [n.name for n in cone], "stream": stream, "stack_trace": root.meta.get("stack_trace"),
                                "module": None})
    if result.matches:
        hoist_write_backs(graph, result)
    return result


def _write_backs(graph: fx.Graph) -> list[fx.Node]:
    """`copy_(input, value)` nodes: functionalisation's write-back of a mutated graph input."""
    return [n for n in graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
            if isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"]


def hoist_write_backs(graph: fx.Graph, result: PassResult) -> None:
    """Move each write-back `copy_(input, value)` to right after `value`'s producer, when that producer is on the
    main stream and every other reader of the input (its old value) is a main-stream node before the producer, so
    the move changes no value read. Each move counts as a match of the pass (pattern "write-back"), after the
    branch matches."""
    for copy in _write_backs(graph):
        target, value = copy.args[0], copy.args[1]
        if not isinstance(value, fx.Node) or value.op != "call_function" or value.meta.get(STREAM, MAIN) != MAIN:
            continue
        position = {n: i for i, n in enumerate(graph.nodes)}
        readers = [u for u in target.users if u is not copy]
        if any(u.meta.get(STREAM, MAIN) != MAIN or position[u] > position[value] for u in readers):
            continue
        if copy.prev is value:
            continue
        value.append(copy)
        for key in ("nn_module_stack", "stack_trace"):  # provenance: the module whose update this writes back
            if key in value.meta:
                copy.meta[key] = value.meta[key]
        result.matches += 1
        result.replaced.append({"pattern": "write-back", "erased": [], "created": [], "moved": [copy.name],
                                "stream": MAIN, "stack_trace": value.meta.get("stack_trace"), "module": None})


def _tokens(node: fx.Node):
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[0]
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() > 0 else None


def check_schedule(graph: fx.Graph) -> list[str]:
    """Violations of the schedule invariants (empty when the schedule is sound):
    every cross-stream edge is covered by a record on the producer's stream after the producer and a wait on the
    consumer's stream before the consumer; every recorded event is waited for; no collective off the main
    stream; every side-stream node precedes a join before the graph output; every reader of a mutated graph input
    precedes its write-back, and one on another stream is joined to the write-back's stream before it."""
    problems = []
    order = list(graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    records = {n.args[0]: n for n in order if n.target is record_event}
    waits: dict[int, list[fx.Node]] = {}
    for n in order:
        if n.target is wait_event:
            waits.setdefault(n.args[0], []).append(n)
    for e, r in records.items():
        if e not in waits:
            problems.append(f"event {e} recorded by %{r.name} is never waited for")
    for n in order:
        s = n.meta.get(STREAM, MAIN)
        if s != MAIN and _has_collective(n):
            problems.append(f"collective %{n.name} on side stream {s}")
        for a in n.all_input_nodes:
            sa = a.meta.get(STREAM, MAIN)
            if sa == s or a.op == "placeholder":
                continue
            if not _joined(a, n, records, waits, pos):
                problems.append(f"edge %{a.name} (stream {sa}) -> %{n.name} (stream {s}) has no record -> wait")
    for copy in _write_backs(graph):
        s = copy.meta.get(STREAM, MAIN)
        for u in copy.args[0].users:
            if u is copy:
                continue
            if pos[u] > pos[copy]:
                problems.append(f"%{u.name} reads input %{copy.args[0].name} after its write-back %{copy.name}")
            elif u.meta.get(STREAM, MAIN) != s and not _joined(u, copy, records, waits, pos):
                problems.append(f"%{u.name} (stream {u.meta.get(STREAM, MAIN)}) reads input %{copy.args[0].name} "
                                f"while its write-back %{copy.name} (stream {s}) may run")
    out = next(n for n in reversed(order) if n.op == "output")
    for e, r in records.items():
        if r.meta.get(STREAM, MAIN) != MAIN and not any(w.meta.get(STREAM, MAIN) == MAIN and pos[w] < pos[out] for w in waits.get(e, [])):
            problems.append(f"side-stream event {e} is not joined on the main stream before the output")
    return problems


def _joined(a: fx.Node, n: fx.Node, records: dict, waits: dict, pos: dict) -> bool:
    """Whether `n` is ordered after `a` across streams: an event recorded on `a`'s stream after `a` is waited for
    on `n`'s stream between that record and `n`."""
    sa, s = a.meta.get(STREAM, MAIN), n.meta.get(STREAM, MAIN)
    return any(r.meta.get(STREAM, MAIN) == sa and pos[r] > pos[a]
               and any(w.meta.get(STREAM, MAIN) == s and pos[r] < pos[w] < pos[n] for w in waits.get(e, []))
               for e, r in records.items())
