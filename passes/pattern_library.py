"""The fusions' traced patterns on disk: the structural traces every compile matches against, traced once per
dsv41 version and machine instead of once per process.

A fusion's formulations are traced at small example shapes (`matcher.Pattern.trace`: make_fx with Inductor's
decompositions, then the normalisation), about 28 ms each on a CPU core and 244 of them: seconds that every process
paid before its first fusion ran, for graphs that depend on nothing the user compiles. Inductor does the same for its
own patterns (`torch/_inductor/fx_passes/serialized_patterns/`, generated once and loaded instead of traced).

key   = sha256 of FORMAT, the fusion pass's class and model constants, dsv41's sources (`manager.sources_digest`)
        and torch's version; one file per fusion pass.
entry = per formulation, per example-input builder, the trace as plain data (`dsv41.pass_cache`'s node records).
Loading rebuilds each graph and propagates fake values from the builder's example inputs (`FakeTensorProp`), which
is several times cheaper than tracing. A trace whose graph holds something the records cannot name (a tensor
constant) is traced on every load, a file that cannot be read is traced anew and rewritten, and one that cannot be
written only costs the next process its traces: the library never decides a match, only how soon it is ready.

Location: `$DSV41_PATTERN_CACHE_DIR`, default `~/.cache/dsv41/patterns`; `DSV41_PATTERN_CACHE_DIR=off` traces in
every process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

log = logging.getLogger("dsv41")

FORMAT = 1  # bump to invalidate every entry


def library_dir() -> Path | None:
    """Where the library lives; None when turned off (`DSV41_PATTERN_CACHE_DIR=off`)."""
    setting = os.environ.get("DSV41_PATTERN_CACHE_DIR")
    if setting == "off":
        return None
    return Path(setting) if setting else Path.home() / ".cache" / "dsv41" / "patterns"


def entry_key(fusion_pass) -> str:
    """The entry key of a fusion pass's patterns: its class's qualified name, its model constants, dsv41's sources
    and torch's version."""
    from dsv41.passes.manager import sources_digest

    owner = f"{type(fusion_pass).__module__}.{type(fusion_pass).__qualname__}"
    constants = sorted(fusion_pass.config.constants().items())
    text = f"{FORMAT} {owner} {constants} {sources_digest()} {torch.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def warm(config) -> dict:
    """Every fusion pass's patterns of `config` in the library (traced where missing): {"dir", "entries" (fusion
    passes), "missing" (entries that were not on disk), "seconds"}; the process then forgets them
    (`fusion.forget_pattern_sets`), so its next compile reads them as a new process would."""
    import time

    from dsv41.passes import build_passes
    from dsv41.passes.fusion import FusionPass, forget_pattern_sets

    t0 = time.perf_counter()
    fusions = [p for p in build_passes(config) if isinstance(p, FusionPass)]
    directory = library_dir()
    missing = [p.name for p in fusions if directory is None or not (directory / f"{entry_key(p)}.pkl").exists()]
    forget_pattern_sets()
    for p in fusions:
        p.pattern_set()
    forget_pattern_sets()
    return {"dir": None if directory is None else str(directory), "entries": len(fusions), "missing": missing,
            "seconds": round(time.perf_counter() - t0, 2)}


def structural_traces(patterns: Sequence, key: str | None) -> dict[str, list[fx.GraphModule]]:
    """{pattern name: [its trace at each example-input builder (`inputs`, then `variants`)]}, from the library
    entry `key` where it holds them, else traced (and the entry written). `key` None: traced, nothing stored."""
    builders = {p.name: (p.inputs, *p.variants) for p in patterns}
    directory = library_dir() if key is not None else None
    path = directory / f"{key}.pkl" if directory is not None else None
    records = _read(path) if path is not None else None
    traces, fresh = {}, {}
    for p in patterns:
        stored = (records or {}).get(p.name)
        if stored is not None and len(stored) == len(builders[p.name]):
            try:
                traces[p.name] = [_trace_or_rebuild(p, build, r) for build, r in zip(builders[p.name], stored)]
                continue
            except (LookupError, RuntimeError, TypeError, ValueError) as e:  # a stale or damaged entry
                log.info("dsv41: pattern library entry %s of %s rebuilt: %s", key, p.name, e)
        traces[p.name] = [p.trace(build()) for build in builders[p.name]]
        fresh[p.name] = [_record(gm) for gm in traces[p.name]]
    if path is not None and (records is None or fresh):
        _write(path, {**(records or {}), **fresh})
    return traces


def _trace_or_rebuild(pattern, build: Callable, record: list | None) -> fx.GraphModule:
    return pattern.trace(build()) if record is None else _rebuild(record, build())


def _record(gm: fx.GraphModule) -> list | None:
    """The trace as node records, or None where it holds something they cannot name (then traced at each load)."""
    from dsv41 import pass_cache

    if any(n.op == "get_attr" for n in gm.graph.nodes):
        return None
    try:
        return [pass_cache.node_record(n) for n in gm.graph.nodes]
    except pass_cache.Uncacheable:
        return None


def _rebuild(records: list, inputs: Sequence) -> fx.GraphModule:
    """The trace of `records`, its placeholders' fake values those of the example `inputs`, propagated to all."""
    from dsv41 import pass_cache

    graph = pass_cache.graph_of_records(records)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in inputs]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(fake):
        raise LookupError(f"the entry has {len(placeholders)} inputs, the builder gives {len(fake)}")
    FakeTensorProp(gm, mode=mode).propagate_dont_convert_inputs(*fake)
    for n, value in zip(placeholders, fake):
        n.meta["val"] = value
    graph.output_node().meta.pop("val", None)  # as a trace leaves it
    return gm


def _read(path: Path) -> dict | None:
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
        return entry if isinstance(entry, dict) else None
    except FileNotFoundError:
        return None
    except Exception as e:  # a damaged file is traced anew and rewritten
        log.info("dsv41: pattern library entry %s unreadable (%s): traced anew", path, e)
        return None


def _write(path: Path, entry: dict) -> None:
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        log.info("dsv41: pattern library not written to %s: %s", path, e)
