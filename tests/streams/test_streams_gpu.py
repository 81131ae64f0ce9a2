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
graph, so fusion and rounding differ between them (measured on the H200: every replay differed). There an eager copy
of the model runs the same padded steps as the first EAGER_REPLAYS replays (an eager step costs ten times a replay),
and streams must move the logits less than compiling does: over those replays the mean relative L2 distance of
``on`` to ``off`` must not exceed that of ``off`` to eager.

Bit-identity needs deterministic kernels: deterministic algorithms are switched on (index_add) and the fused ops run
their references (`kernel="reference"`): the CuTe DSL `mhc_coeffs` kernel accumulates its split-K partial sums with
fp32 atomics, whose order varies from run to run.
"""

import copy
import os
import time

import pytest
import torch

from dsv41.backend import make_backend
from dsv41.cuda_graphs import DecodeGraphRunner
from dsv41.models import TINY, DSV41Model
from dsv41.stream_executor import serialized_streams

# DSV41_STRESS_BUCKETS splits the captured sizes over GPUs (benchmarks/run_h200_streams.sh: one process per part)
BUCKETS = [int(b) for b in os.environ.get("DSV41_STRESS_BUCKETS", "1,2,4,8").split(",")]
REPLAYS = 10_000
EAGER_REPLAYS = 256


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
    start = time.perf_counter()
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
        print(f"{mode}: {name}: buckets {BUCKETS} compiled and captured at {time.perf_counter() - start:.0f} s",
              flush=True)
    for name in ("on", "serial"):
        scheduled = [p for r in backends[name].reports for p in r.passes if p.name == "streams"]
        assert len(scheduled) == len(BUCKETS) and all(p.matches > 0 for p in scheduled), \
            f"{name}: a bucket's compile scheduled no side-stream branch"
    assert all(p.matches == 0 for r in backends["off"].reports for p in r.passes if p.name == "streams")
    assert all(r.fallback is None for b in backends.values() for r in b.reports)
    eager = copy.deepcopy(base) if mode == "inductor" else None
    with torch.no_grad():
        if eager is not None:  # the runners' warm-up: token 0 at position 0 in every row
            zeros = torch.zeros(max(BUCKETS), dtype=torch.int64, device="cuda")
            eager(zeros, zeros)
        g = torch.Generator(device="cuda").manual_seed(1)
        races, off_differs, nans = (torch.zeros((), dtype=torch.int64, device="cuda") for _ in range(3))
        on_off_rel = torch.zeros(REPLAYS, device="cuda")
        off_eager_rel = torch.zeros(EAGER_REPLAYS, device="cuda")
        for i in range(REPLAYS):
            bucket = BUCKETS[i % len(BUCKETS)]
            batch = bucket - (i // len(BUCKETS)) % 2 * (bucket > 1)
            tokens = torch.randint(0, TINY.vocab_size, (batch,), generator=g, device="cuda")
            positions = torch.randint(0, 255, (batch,), generator=g, device="cuda")
            on, serial, off = (runners[name](tokens, positions) for name in ("on", "serial", "off"))
            races += (on != serial).any()  # every replay compared, on the device (no sync per replay)
            off_differs += (on != off).any()
            on_off_rel[i] = (on.float() - off.float()).norm() / off.float().norm()
            nans += torch.isnan(on).any() | torch.isnan(off).any()
            if eager is not None and i < EAGER_REPLAYS:
                pad = bucket - batch  # the runner's padding: token 0 at position 0 in rows batch..bucket-1
                ref = eager(torch.nn.functional.pad(tokens, (0, pad)), torch.nn.functional.pad(positions, (0, pad)))
                off_eager_rel[i] = (off.float() - ref[:batch].float()).norm() / ref[:batch].float().norm()
    assert nans.item() == 0, f"{nans.item()} replays produced NaN"
    assert races.item() == 0, f"{races.item()} of {REPLAYS} replays differ between side streams and the same " \
                              "kernels serialised: a stream race"
    for (n1, b1), (n2, b2) in zip(models["on"].named_buffers(), models["serial"].named_buffers()):
        assert torch.equal(b1, b2), f"cache {n1} diverged between streams and serialised"
    print(f"{mode}: streams on vs off: {off_differs.item()} of {REPLAYS} replays differ, relative L2 "
          f"mean {on_off_rel.mean().item():.3g} max {on_off_rel.max().item():.3g}")
    if mode == "fx":
        assert off_differs.item() == 0, f"{off_differs.item()} of {REPLAYS} replays differ between streams on and off"
        for (n1, b1), (n2, b2) in zip(models["on"].named_buffers(), models["off"].named_buffers()):
            assert torch.equal(b1, b2), f"cache {n1} diverged between streams on and off"
    else:
        on_off = on_off_rel[:EAGER_REPLAYS].mean().item()
        print(f"{mode}: first {EAGER_REPLAYS} replays: relative L2 mean {on_off:.3g} streams on vs off, "
              f"{off_eager_rel.mean().item():.3g} streams off vs eager (max {off_eager_rel.max().item():.3g})")
        assert on_off <= off_eager_rel.mean().item(), \
            f"streams move the logits more than compiling does: relative L2 mean {on_off:.3g} (on vs off) > " \
            f"{off_eager_rel.mean().item():.3g} (off vs eager) over the first {EAGER_REPLAYS} replays"
    torch.use_deterministic_algorithms(False)
