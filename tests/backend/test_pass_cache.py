"""The pass cache (`dsv41.pass_cache`): a warm start gets the passes' rewritten graph and report from disk.

The tiny model (layer 2 alone: an indexer layer, every per-layer fusion) is compiled in `fx` mode three times, each time
after `torch._dynamo.reset()` with a fresh backend, as a new process would: the first run misses and stores, the
second hits (no pass runs: `report.passes` stays empty) and must give bit-identical logits and the same report
counts; a damaged entry is a miss that is rewritten. Unit tests cover the key (config and graph sensitivity) and the
graphs the cache declines to store. The suite itself runs with the cache off (tests/conftest.py), so that no test
is ever served a rewrite from an earlier run; these tests turn it on in a directory of their own.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx

from dsv41 import pass_cache
from dsv41.backend import make_backend
from dsv41.models import TINY, DSV41Model
from dsv41.passes.manager import CompileReport, PassManager
from dsv41.config import Dsv41Config

LAYERS = [2]
cold_entries: list = []  # the entries the default config's compile stored


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = DSV41Model(TINY, LAYERS, max_batch=3, max_context=256)
    with torch.no_grad():
        m(torch.randint(0, TINY.vocab_size, (3,)), torch.tensor([6, 21, 63]))
    return m


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("inductor_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(root))
        mp.setenv("DSV41_PASS_CACHE", "1")
        yield root


def compile_once(model, **overrides):
    """A fresh backend and Dynamo state (as a new process): (logits of one decode step, the backend's reports)."""
    torch._dynamo.reset()
    backend = make_backend(mode="fx", **overrides)
    compiled = torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True)
    with torch.no_grad():
        logits = compiled(torch.tensor([1, 2, 3]), torch.tensor([7, 22, 64]))
    return logits, backend.reports


@pytest.fixture(scope="module")
def cold_and_warm(model, cache_root):
    from torch._dynamo.utils import counters

    cold = compile_once(model)
    cold_entries.extend(sorted((cache_root / "dsv41_passes").glob("*.pkl")))
    hits = counters["dsv41"]["pass_cache_hit"]
    warm = compile_once(model)
    assert counters["dsv41"]["pass_cache_hit"] - hits == len(warm[1])  # what bench decode's cache_counters report
    return cold, warm


def test_cache_on_in_this_module_only(cache_root):
    assert make_backend().config.pass_cache
    assert Dsv41Config().with_env({"DSV41_PASS_CACHE": "0"}).pass_cache is False


def test_warm_start_hits_and_is_exact(cold_and_warm, cache_root):
    (cold_logits, cold), (warm_logits, warm) = cold_and_warm
    assert [r.cache for r in cold] == ["miss"] * len(cold)
    assert [r.cache for r in warm] == ["hit"] * len(warm)
    assert all(r.passes == [] for r in warm) and all(r.passes for r in cold)  # no pass ran on the hit
    for c, w in zip(cold, warm):
        assert (c.matches, c.declined, c.near_misses, c.notes) == (w.matches, w.declined, w.near_misses, w.notes)
    assert sum(cold[0].matches.values()) > 0
    assert torch.equal(cold_logits, warm_logits)
    assert len(cold_entries) == len(cold)


def test_config_change_misses(model, cold_and_warm, cache_root):
    _, reports = compile_once(model, fusions=Dsv41Config().fusions - {"wo_a"})
    assert [r.cache for r in reports] == ["miss"] * len(reports)
    assert all(r.matches.get("wo_a") is None for r in reports)


def test_damaged_entry_is_a_miss_and_is_rewritten(model, cold_and_warm, cache_root, caplog):
    (cold_logits, _), _ = cold_and_warm
    entries = list(cold_entries)
    for entry in entries:
        entry.write_bytes(b"not a pickle")
    logits, reports = compile_once(model)
    assert [r.cache for r in reports] == ["miss"] * len(reports)
    assert "unusable" in caplog.text
    assert torch.equal(logits, cold_logits)
    for entry in entries:  # rewritten whole
        assert pass_cache.pickle.loads(entry.read_bytes())["report"]["matches"]


def _graph_module(fn, *args) -> fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*args)


def test_key_follows_graph_and_fingerprint():
    gm_a = _graph_module(lambda x: x * 2, torch.ones(4))
    gm_b = _graph_module(lambda x: x * 3, torch.ones(4))
    gm_c = _graph_module(lambda x: x * 2, torch.ones(5))
    keys = {pass_cache.graph_key(gm, "f") for gm in (gm_a, gm_b, gm_c)} | {pass_cache.graph_key(gm_a, "g")}
    assert len(keys) == 4
    assert pass_cache.graph_key(gm_a, "f") == pass_cache.graph_key(_graph_module(lambda x: x * 2, torch.ones(4)), "f")


def test_key_follows_a_tensor_literal_value():
    """A `torch.tensor(v)` literal traces to a get_attr constant that the code names alike for every v, and the
    normalisation writes v into the rewritten graph (`normalize._tensor_literal`): its value is in the key."""
    def clamped(limit):
        return lambda x: torch.clamp(x, max=torch.tensor(limit))

    gm_10, gm_7 = (make_fx_real(clamped(v), torch.ones(4)) for v in (10.0, 7.0))
    assert [n.op for n in gm_10.graph.nodes].count("get_attr") == 1
    assert gm_10.code == gm_7.code
    assert pass_cache.graph_key(gm_10, "f") != pass_cache.graph_key(gm_7, "f")
    assert pass_cache.graph_key(gm_10, "f") == pass_cache.graph_key(make_fx_real(clamped(10.0), torch.ones(4)), "f")


def make_fx_real(fn, *args) -> fx.GraphModule:
    """fn traced with real tensors (its constants are held as real tensors, as in the graphs the backend gets)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*args)


def test_fingerprint_follows_config():
    prints = {PassManager(c).fingerprint() for c in (Dsv41Config(), Dsv41Config(max_tokens=8),
                                                      Dsv41Config(fusions=Dsv41Config().fusions - {"wo_a"}))}
    assert len(prints) == 3
    assert PassManager(Dsv41Config()).fingerprint() == PassManager(Dsv41Config()).fingerprint()


def test_unnamed_target_is_not_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    gm = _graph_module(lambda x: x + 1, torch.ones(4))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.target = lambda x, y: x + y  # a local function: no importable name
    reason = pass_cache.store("k", gm, CompileReport(graph_id=0))
    assert reason is not None and "no importable name" in reason
    assert not (tmp_path / "dsv41_passes" / "k.pkl").exists()


def test_symbolic_shape_is_not_keyed():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: x * 2, tracing_mode="symbolic")(torch.ones(4))
    with pytest.raises(pass_cache.Uncacheable, match="symbolic"):
        pass_cache.graph_key(gm, "f")


def test_unwritable_cache_is_a_reason_not_an_error(tmp_path, monkeypatch):
    gm = _graph_module(lambda x: x + 1, torch.ones(4))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker))
    reason = pass_cache.store("k", gm, CompileReport(graph_id=0))
    assert reason is not None and reason.startswith("cannot write")
    assert not pass_cache.load("k", gm, CompileReport(graph_id=0))  # a miss, the graph untouched
