"""A disk cache of the pass manager's rewritten graphs, so that a warm start skips the passes.

Inductor's FX graph cache keys on the graph the passes leave, so before this cache a warm start reran every pass to
find that key (on the H200 a 40-layer warm start spent most of its 203 s there, with 226 of 226 FX graphs hit).

key   = sha256 of the pass manager's fingerprint (`PassManager.fingerprint`: dsv41's sources, the config, torch's
        version) and the ATen graph the AOT step hands the passes: its Python code and every placeholder's and
        get_attr's value metadata (shape, stride, dtype, device), and the value of a 0-d tensor constant (a literal
        the normalisation writes into the graph as its number).
entry = the rewritten graph as plain data, one record per node (op, name, target by qualified name, args and kwargs
        with nodes by name, the side-stream and low-precision-barrier annotations), and the report's matches, declined, near misses, unrelated anchors, narrowed sites and notes.

On a hit the graph is rebuilt in place of the original's nodes, its fake values propagated from the original
placeholders' (`FakeTensorProp` under their fake mode), and the report restored with `cache = "hit"`. A graph with a
symbolic shape, or whose rewritten form holds a value this format cannot name (a local function, a tensor
constant), or that cannot be written (the directory, the disk), is not cached (`cache = "off: <reason>"`); an entry
that cannot be read or rebuilt is a miss (and is rewritten). Entries are written to a temporary file and renamed into place, so a reader never sees half of one.

Location: `<Inductor's cache dir>/dsv41_passes/` (TORCHINDUCTOR_CACHE_DIR), beside the FX graph cache it fronts:
clearing one clears both, and a process with its own Inductor cache has its own pass cache.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import pickle
import tempfile
from pathlib import Path

import torch
import torch.fx as fx

from dsv41.passes.decompose import PRECISION_BARRIER
from dsv41.passes.normalize import held_scalar
from dsv41.passes.streams import STREAM

log = logging.getLogger("dsv41")

FORMAT = 2  # bump to invalidate every entry
_KEPT_META = (STREAM, PRECISION_BARRIER)  # node annotations the rewritten graph keeps: side streams, rounding points
_REPORT_FIELDS = ("matches", "declined", "near_misses", "unrelated", "narrowed", "notes")
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class Uncacheable(Exception):
    """The graph holds something this cache cannot key or name."""


def cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return Path(inductor_cache_dir()) / "dsv41_passes"


def graph_key(gm: fx.GraphModule, fingerprint: str) -> str:
    """The entry key of `gm` (before the passes) under a pass manager's `fingerprint`; Uncacheable if symbolic."""
    h = hashlib.sha256(f"{FORMAT} {fingerprint}".encode())
    h.update(gm.graph.python_code(root_module="self").src.encode())
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            h.update(f"{n.op} {n.name} {_value_meta(n)}".encode())
        if n.op == "get_attr":
            h.update(_literal_value(gm, n).encode())
    return h.hexdigest()[:32]


def _literal_value(gm: fx.GraphModule, n: fx.Node) -> str:
    """The value of a 0-d tensor constant that get_attr `n` reads (`normalize.held_scalar`: a `torch.tensor(v)`
    literal of the program, which the normalisation writes into the graph as the number), else ''."""
    value = held_scalar(gm, n)
    return "" if value is None else f" = {value!r}"


def _value_meta(n: fx.Node) -> str:
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        layout = (tuple(val.shape), val.stride(), val.storage_offset())
        if not all(isinstance(d, int) for d in (*layout[0], *layout[1], layout[2])):
            raise Uncacheable(f"%{n.name} has a symbolic shape")
        return f"{val.dtype} {val.device} {layout}"
    if isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise Uncacheable(f"%{n.name} is a symbolic scalar")
    return repr(val)


def load(key: str, gm: fx.GraphModule, report) -> bool:
    """Replace `gm`'s graph by the cached rewrite of `key` and fill `report`; False (graph untouched) on a miss."""
    try:
        path = cache_dir() / f"{key}.pkl"
        if not path.exists():
            return False
        entry = pickle.loads(path.read_bytes())
        graph = _rebuild(entry["nodes"], gm)
    except Exception as e:  # a stale or damaged entry (or directory) is a miss, never an error
        log.warning("dsv41: pass cache entry %s unusable (%s: %s); running the passes", key, type(e).__name__, e)
        return False
    gm.graph = graph
    for name in _REPORT_FIELDS:
        setattr(report, name, entry["report"][name])
    return True


def store(key: str, gm: fx.GraphModule, report) -> str | None:
    """Write the rewritten `gm` and `report` under `key`; the reason when the graph cannot be stored."""
    try:
        nodes = [node_record(n) for n in gm.graph.nodes]
    except Uncacheable as e:
        return str(e)
    entry = {"nodes": nodes, "report": {name: getattr(report, name) for name in _REPORT_FIELDS}}
    directory, tmp = "the pass cache", None
    try:  # a cache that cannot be written costs the next start its passes, never this compile
        directory = cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, directory / f"{key}.pkl")
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        return f"cannot write {directory}: {e}"
    return None


def node_record(n: fx.Node) -> tuple:
    target = n.target if n.op in ("placeholder", "get_attr", "output") else _target_name(n.target)
    return (n.op, n.name, target, _encode(n.args), _encode(n.kwargs), {k: n.meta[k] for k in _KEPT_META if k in n.meta})


def _target_name(target) -> tuple:
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target.namespace, target._schema.name.split("::")[1], target._overloadname)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return ("hop", target.name())
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if module is None or "<" in qualname or _resolve(module, qualname) is not target:
        raise Uncacheable(f"call target {target!r} has no importable name")
    return ("py", module, qualname)


def _resolve(module: str, qualname: str):
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError):
        return None


def _target(ref):
    kind = ref[0]
    if kind == "op":
        packet = getattr(getattr(torch.ops, ref[1]), ref[2])
        return getattr(packet, ref[3] or "default")
    if kind == "hop":
        return getattr(torch.ops.higher_order, ref[1])
    target = _resolve(ref[1], ref[2])
    if target is None:
        raise LookupError(f"{ref[1]}.{ref[2]} is gone")
    return target


def _encode(a):
    if isinstance(a, fx.Node):
        return ("node", a.name)
    if isinstance(a, (list, tuple)):
        return ("list" if isinstance(a, list) else "tuple", [_encode(x) for x in a])
    if isinstance(a, dict):
        return ("dict", [(k, _encode(v)) for k, v in a.items()])
    if isinstance(a, slice):
        return ("slice", [_encode(a.start), _encode(a.stop), _encode(a.step)])
    if isinstance(a, _PLAIN):
        return ("value", a)
    raise Uncacheable(f"argument {a!r} ({type(a).__name__}) has no plain form")


def _decode(a, env: dict):
    kind, v = a
    if kind == "node":
        return env[v]
    if kind == "list":
        return [_decode(x, env) for x in v]
    if kind == "tuple":
        return tuple(_decode(x, env) for x in v)
    if kind == "dict":
        return {k: _decode(x, env) for k, x in v}
    if kind == "slice":
        return slice(*(_decode(x, env) for x in v))
    return v


def graph_of_records(records: list, owning_module: fx.GraphModule | None = None) -> fx.Graph:
    """The graph of `node_record`s (no values): LookupError where a target is gone or a name comes back changed."""
    graph, env = fx.Graph(owning_module=owning_module), {}
    for op, name, target, args, kwargs, kept in records:
        if op == "placeholder":
            node = graph.placeholder(target)
        elif op == "output":
            node = graph.output(_decode(args, env)[0])
        else:
            ref = target if op == "get_attr" else _target(target)
            node = graph.create_node(op, ref, _decode(args, env), _decode(kwargs, env), name=name)
        if node.name != name:
            raise LookupError(f"node {name!r} came back as {node.name!r}")
        node.meta.update(kept)
        env[name] = node
    return graph


def _rebuild(records: list, gm: fx.GraphModule) -> fx.Graph:
    """A new graph from `records` whose placeholders carry `gm`'s placeholders' values, with fake values for all."""
    old = [n for n in gm.graph.nodes if n.op == "placeholder"]
    graph = graph_of_records(records, gm)
    new = [n for n in graph.nodes if n.op == "placeholder"]
    if len(new) != len(old):
        raise LookupError(f"the entry has {len(new)} placeholders, the graph {len(old)}")
    for node, original in zip(new, old):
        if original.target != node.target:
            raise LookupError(f"placeholder {node.target!r} where the graph has {original.target!r}")
        node.meta["val"] = original.meta.get("val")
    _propagate_fake_values(gm, graph, [n.meta.get("val") for n in old])
    return graph


def _propagate_fake_values(gm: fx.GraphModule, graph: fx.Graph, inputs: list) -> None:
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = detect_fake_mode(inputs)
    if mode is None:
        raise LookupError("the graph's placeholders carry no fake values")
    probe = fx.GraphModule(gm, graph)
    FakeTensorProp(probe, mode=mode).propagate_dont_convert_inputs(*inputs)
