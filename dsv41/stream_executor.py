"""Running a stream-scheduled graph: segments compiled separately, stitched with streams and events.

The stream pass leaves a graph whose nodes carry `meta["dsv41_stream"]` and whose fork/join points are explicit
`record_event` / `wait_event` marker nodes. Inductor does not keep explicit stream switches (it reorders and
fuses across them), so the executor cuts the graph into *segments* — maximal runs of nodes on one stream between
markers — with `split_module`, compiles each segment on its own (Inductor in `inductor` mode, the plain
GraphModule in `fx` mode) and replays the schedule: each segment is launched on its stream, each marker records
or waits for its event on its stream. Launches are asynchronous, so a side segment runs on the GPU while the
main segments after it are launched.

The main stream is `torch.cuda.current_stream()` at call time, so under `torch.cuda.graph` the capture stream is
the main stream and every fork is joined inside the capture. Inputs of a side segment stay referenced until
the main stream has waited for that segment's join event, so the caching allocator cannot hand their memory to
main-stream work that would overwrite it while the side stream still reads it. On a CPU the markers are no-ops
and the segments run in order; so they do on a GPU inside ``serialized_streams()``, which runs the same compiled
segments without the concurrency (the control that tells a stream race from a codegen difference).
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.split_module import split_module

from dsv41.passes.streams import MAIN, MARKERS, STREAM, record_event

_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}
_serialized = False


@contextlib.contextmanager
def serialized_streams():
    """Within this context every stream schedule runs its segments in schedule order on the current stream, events
    skipped: the same kernels as with side streams, one after another (what a race check compares against; a CUDA
    graph captured inside it is a single chain)."""
    global _serialized
    previous, _serialized = _serialized, True
    try:
        yield
    finally:
        _serialized = previous


def side_stream(device: torch.device, stream_id: int) -> torch.cuda.Stream:
    """One process-wide side stream per (device, stream id)."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), stream_id)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key[0])
    return _SIDE_STREAMS[key]


def has_schedule(graph: fx.Graph) -> bool:
    return any(n.target in MARKERS for n in graph.nodes)


class StreamExecutor:
    """Boxed callable (`fn(list_of_inputs)`) running `gm`'s stream schedule; `compile_segment(gm, fake_inputs)`
    turns a segment GraphModule into a boxed callable."""

    _boxed_call = True

    def __init__(self, gm: fx.GraphModule, compile_segment):
        graph = gm.graph
        segment_of: dict[fx.Node, int] = {}
        self.plan: list[tuple] = []  # ("run", segment, stream) | ("record"|"wait", event, stream)
        current, seg = None, -1
        for n in list(graph.nodes):
            if n.op in ("placeholder", "output"):
                continue
            stream = n.meta.get(STREAM, MAIN)
            if n.target in MARKERS:
                self.plan.append(("record" if n.target is record_event else "wait", n.args[0], stream))
                current = None
                graph.erase_node(n)
                continue
            if current != stream:
                seg += 1
                current = stream
                self.plan.append(("run", seg, stream))
            segment_of[n] = seg
        gm.recompile()
        fake_inputs = [n.meta["val"] for n in graph.nodes if n.op == "placeholder"]
        self.parent = split_module(gm, None, lambda n: segment_of[n], keep_original_order=True)
        mode = detect_fake_mode(fake_inputs)
        with mode:
            FakeTensorProp(self.parent, mode).propagate_dont_convert_inputs(*fake_inputs)
        self.segment_stream = {s: st for kind, s, st in self.plan if kind == "run"}
        self.calls: dict[int, fx.Node] = {}
        self.compiled: dict[int, object] = {}
        self.single: set[int] = set()  # segments with one output, returned bare by split_module
        for node in self.parent.graph.nodes:
            if node.op == "call_module":
                idx = int(node.target.removeprefix("submod_"))
                self.calls[idx] = node
                sub = getattr(self.parent, node.target)
                out = next(n for n in sub.graph.nodes if n.op == "output")
                if not isinstance(out.args[0], (tuple, list)):
                    out.args = ((out.args[0],),)
                    sub.recompile()
                    self.single.add(idx)
                fake = [a.meta["val"] if isinstance(a, fx.Node) else a for a in node.args]
                with torch._guards.tracing(torch._guards.TracingContext(mode)):  # per-segment output strides
                    self.compiled[idx] = compile_segment(sub, fake)
        self.placeholders = [n for n in self.parent.graph.nodes if n.op == "placeholder"]
        # a constant the graph holds (a tensor literal of the user's code) that split_module passes to a segment
        self.constants = {n: operator.attrgetter(n.target)(self.parent) for n in self.parent.graph.nodes
                          if n.op == "get_attr"}
        self.output = next(n for n in self.parent.graph.nodes if n.op == "output")
        self.getitems = {}
        for node in self.parent.graph.nodes:
            if node.op == "call_function" and node.target is operator.getitem:
                self.getitems.setdefault(node.args[0], []).append(node)
        self._events: dict[int, torch.cuda.Event] = {}

    def __call__(self, args: list):
        env = {**self.constants, **dict(zip(self.placeholders, args))}
        args.clear()
        cuda = not _serialized and any(isinstance(v, torch.Tensor) and v.is_cuda for v in env.values())
        main = torch.cuda.current_stream() if cuda else None
        device = main.device if cuda else None
        held: dict[int, list] = {}  # join event -> inputs kept alive until the main stream waits for it
        side_inputs: list = []
        for kind, key, stream_id in self.plan:
            stream = None
            if cuda:
                stream = main if stream_id == MAIN else side_stream(device, stream_id)
            if kind == "run":
                call = self.calls[key]
                inputs = [env[a] if isinstance(a, fx.Node) else a for a in call.args]
                if stream_id != MAIN:
                    side_inputs.extend(inputs)
                if stream is not None:
                    with torch.cuda.stream(stream):
                        out = self.compiled[key](list(inputs))
                else:
                    out = self.compiled[key](list(inputs))
                env[call] = out[0] if key in self.single else out
                for g in self.getitems.get(call, []):
                    env[g] = out[g.args[1]]
            elif kind == "record":
                if stream_id != MAIN:
                    held[key], side_inputs = side_inputs, []
                if stream is not None:
                    self._event(key).record(stream)
            else:
                if stream is not None:
                    stream.wait_event(self._event(key))
                held.pop(key, None)
        result = self.output.args[0]
        return tuple(env[r] if isinstance(r, fx.Node) else r for r in result)

    def _event(self, key: int) -> torch.cuda.Event:
        if key not in self._events:
            self._events[key] = torch.cuda.Event()
        return self._events[key]
