"""The traced-pattern library (`dsv41.passes.pattern_library`): a pattern rebuilt from the library is its trace,
node for node (op, name, target, arguments) and value for value (shape, stride, dtype of every node's fake value),
for every formulation of every fusion; a damaged entry is traced anew and rewritten; turned off, nothing is
written."""

from __future__ import annotations

import pytest
import torch

from dsv41.config import Dsv41Config
from dsv41.passes import build_passes
from dsv41.passes import pattern_library as library
from dsv41.passes.fusion import FusionPass


def _fusion_passes():
    return [p for p in build_passes(Dsv41Config()) if isinstance(p, FusionPass)]


def _signature(gm) -> list:
    """Every node as (op, name, target, args, kwargs, and its value's shape, strides and dtype). The stride of a
    size-1 dim says nothing about the layout (no element is a step along it) and propagation may pick another one
    than the trace's decompositions did: it is left out."""
    def layout(t):
        return tuple(t.shape), tuple(st if size != 1 else None for size, st in zip(t.shape, t.stride())), t.dtype

    def value(n):
        v = n.meta.get("val")
        vals = v if isinstance(v, (tuple, list)) else (v,)
        return tuple(layout(t) if isinstance(t, torch.Tensor) else repr(t) for t in vals)
    return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs), value(n)) for n in gm.graph.nodes]


@pytest.mark.parametrize("fusion", [p.name for p in _fusion_passes()])
def test_a_pattern_rebuilt_from_the_library_is_its_trace(fusion, tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_PATTERN_CACHE_DIR", str(tmp_path))
    (p,) = [p for p in _fusion_passes() if p.name == fusion]
    patterns = p.patterns()
    traced = library.structural_traces(patterns, "k")  # traced, and written
    assert [f.name for f in tmp_path.iterdir()] == ["k.pkl"]
    rebuilt = library.structural_traces(patterns, "k")
    assert traced.keys() == rebuilt.keys() == {q.name for q in patterns}
    for name in traced:
        assert len(traced[name]) == len(rebuilt[name])
        for a, b in zip(traced[name], rebuilt[name]):
            assert a is not b and _signature(a) == _signature(b), name


def test_a_damaged_entry_is_traced_anew_and_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_PATTERN_CACHE_DIR", str(tmp_path))
    (p,) = [p for p in _fusion_passes() if p.name == "wo_a"]
    patterns = p.patterns()
    want = library.structural_traces(patterns, "k")
    (tmp_path / "k.pkl").write_bytes(b"not a pickle")
    got = library.structural_traces(patterns, "k")
    assert {n: [_signature(g) for g in gs] for n, gs in got.items()} == \
        {n: [_signature(g) for g in gs] for n, gs in want.items()}
    assert (tmp_path / "k.pkl").read_bytes() != b"not a pickle"


def test_turned_off_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_PATTERN_CACHE_DIR", "off")
    monkeypatch.setenv("HOME", str(tmp_path))
    (p,) = [p for p in _fusion_passes() if p.name == "moe_route"]
    assert library.library_dir() is None
    traces = library.structural_traces(p.patterns(), "k")
    assert traces and not any(tmp_path.rglob("*.pkl"))
