"""Side streams under CUDA-graph capture on the GPU: bit-identical to the same backend with streams off.

Bit-identity needs deterministic kernels on both sides: deterministic algorithms are switched on (index_add) and
the fused ops run their references (`kernel="reference"`): the CuTe DSL `mhc_coeffs` kernel accumulates its
split-K partial sums with fp32 atomics, whose order varies from run to run.
"""

import copy

import pytest
import torch

from dsv41.backend import make_backend
from dsv41.cuda_graphs import DecodeGraphRunner
from dsv41.models import TINY, DSV41Model

BUCKETS = [1, 2, 4, 8]
REPLAYS = 10_000


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fx", "inductor"])
def test_streams_bit_identical_under_replay_stress(mode):
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    base = DSV41Model(TINY, [0, 2, 3], max_batch=max(BUCKETS), max_context=256, device="cuda")
    models, runners, backends = [], [], []
    for streams in (True, False):
        model = copy.deepcopy(base)
        backend = make_backend(mode=mode, streams=streams, stream_max_tokens=max(BUCKETS), kernel="reference")
        runner = DecodeGraphRunner(torch.compile(model, backend=backend, fullgraph=True, dynamic=False), BUCKETS)
        runner.capture()
        models.append(model)
        runners.append(runner)
        backends.append(backend)
    scheduled = [p for r in backends[0].reports for p in r.passes if p.name == "streams"]
    assert scheduled and all(p.matches > 0 for p in scheduled), "streams-on compiles scheduled no side-stream branch"
    assert all(p.matches == 0 for r in backends[1].reports for p in r.passes if p.name == "streams")
    assert all(r.fallback is None for b in backends for r in b.reports)
    g = torch.Generator(device="cuda").manual_seed(1)
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    nans = torch.zeros((), dtype=torch.int64, device="cuda")
    for i in range(REPLAYS):
        batch = BUCKETS[i % len(BUCKETS)] - (i // len(BUCKETS)) % 2 * (BUCKETS[i % len(BUCKETS)] > 1)
        tokens = torch.randint(0, TINY.vocab_size, (batch,), generator=g, device="cuda")
        positions = torch.randint(0, 255, (batch,), generator=g, device="cuda")
        on, off = runners[0](tokens, positions), runners[1](tokens, positions)
        mismatches += (on != off).any()  # every replay compared, on the device (no sync per replay)
        nans += torch.isnan(on).any()
    assert nans.item() == 0, f"{nans.item()} replays produced NaN"
    assert mismatches.item() == 0, f"{mismatches.item()} of {REPLAYS} replays differ between streams on and off"
    for (n1, b1), (n2, b2) in zip(models[0].named_buffers(), models[1].named_buffers()):
        assert torch.equal(b1, b2), f"cache {n1} diverged"
    torch.use_deterministic_algorithms(False)
