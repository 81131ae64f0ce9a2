"""Side streams under CUDA-graph capture on the GPU, under a stress loop of 10,000 replays with fresh inputs over every
captured batch size (buckets 1, 2, 4, 8, and the padded sizes between them).

Three captures of the same model per codegen mode:
- ``on``: the backend with streams;
- ``serial``: the same compile as ``on`` (identical graphs: Inductor's FX graph cache returns the same code), captured
  inside ``serialized_streams()``, so the same kernels run one after another on the capture stream;
- ``off``: the backend with streams off.

``on`` must equal ``serial`` bit for bit in every replay in both modes: the only difference is the concurrency, so
any mismatch is a stream race. ``on`` must equal ``off`` bit for bit in ``fx`` mode, where both run the same ops.
In ``inductor`` mode streams on compiles each stream segment as its own Inductor graph and streams off the whole
graph, so fusion and reduction codegen differ between them (measured on the H200: every replay differed); there the
test reports the distance to ``off`` and bounds it by the agreement every compiled variant must meet against eager
in the decode benchmark.

Bit-identity needs deterministic kernels: deterministic algorithms are switched on (index_add) and the fused ops run
their references (`kernel="reference"`): the CuTe DSL `mhc_coeffs` kernel accumulates its split-K partial sums with
fp32 atomics, whose order varies from run to run.
"""

import copy

import pytest
import torch

from dsv41.backend import make_backend
from dsv41.cuda_graphs import DecodeGraphRunner
from dsv41.models import TINY, DSV41Model
from dsv41.stream_executor import serialized_streams

BUCKETS = [1, 2, 4, 8]
REPLAYS = 10_000
OFF_REL_L2 = 0.5  # inductor mode, streams on vs off (tools/bench_decode.AGREE_REL_L2)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fx", "inductor"])
def test_streams_bit_identical_under_replay_stress(mode, monkeypatch):
    # three models x one compile per bucket of the same forward: more than Dynamo's default recompile limit
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 3 * len(BUCKETS) + 1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    base = DSV41Model(TINY, [0, 2, 3], max_batch=max(BUCKETS), max_context=256, device="cuda")
    models, runners, backends = {}, {}, {}
    for name in ("on", "serial", "off"):
        models[name] = copy.deepcopy(base)
        backends[name] = make_backend(mode=mode, streams=name != "off", stream_max_tokens=max(BUCKETS),
                                      kernel="reference")
        step = torch.compile(models[name], backend=backends[name], fullgraph=True, dynamic=False)
        runners[name] = DecodeGraphRunner(step, BUCKETS)
        if name == "serial":
            with serialized_streams():
                runners[name].capture()
        else:
            runners[name].capture()
    for name in ("on", "serial"):
        scheduled = [p for r in backends[name].reports for p in r.passes if p.name == "streams"]
        assert len(scheduled) == len(BUCKETS) and all(p.matches > 0 for p in scheduled), \
            f"{name}: a bucket's compile scheduled no side-stream branch"
    assert all(p.matches == 0 for r in backends["off"].reports for p in r.passes if p.name == "streams")
    assert all(r.fallback is None for b in backends.values() for r in b.reports)
    g = torch.Generator(device="cuda").manual_seed(1)
    races = torch.zeros((), dtype=torch.int64, device="cuda")
    off_differs = torch.zeros((), dtype=torch.int64, device="cuda")
    off_rel = torch.zeros((), device="cuda")
    nans = torch.zeros((), dtype=torch.int64, device="cuda")
    for i in range(REPLAYS):
        batch = BUCKETS[i % len(BUCKETS)] - (i // len(BUCKETS)) % 2 * (BUCKETS[i % len(BUCKETS)] > 1)
        tokens = torch.randint(0, TINY.vocab_size, (batch,), generator=g, device="cuda")
        positions = torch.randint(0, 255, (batch,), generator=g, device="cuda")
        on, serial, off = (runners[name](tokens, positions) for name in ("on", "serial", "off"))
        races += (on != serial).any()  # every replay compared, on the device (no sync per replay)
        off_differs += (on != off).any()
        off_rel = torch.maximum(off_rel, (on.float() - off.float()).norm() / off.float().norm())
        nans += torch.isnan(on).any() | torch.isnan(off).any()
    assert nans.item() == 0, f"{nans.item()} replays produced NaN"
    assert races.item() == 0, f"{races.item()} of {REPLAYS} replays differ between side streams and the same " \
                              "kernels serialised: a stream race"
    for (n1, b1), (n2, b2) in zip(models["on"].named_buffers(), models["serial"].named_buffers()):
        assert torch.equal(b1, b2), f"cache {n1} diverged between streams and serialised"
    print(f"{mode}: streams on vs off: {off_differs.item()} of {REPLAYS} replays differ, "
          f"max relative L2 {off_rel.item():.3g}")
    if mode == "fx":
        assert off_differs.item() == 0, f"{off_differs.item()} of {REPLAYS} replays differ between streams on and off"
        for (n1, b1), (n2, b2) in zip(models["on"].named_buffers(), models["off"].named_buffers()):
            assert torch.equal(b1, b2), f"cache {n1} diverged between streams on and off"
    else:
        assert off_rel.item() <= OFF_REL_L2, f"streams on vs off: relative L2 up to {off_rel.item():.3g}"
    torch.use_deterministic_algorithms(False)
