"""Tensor parallelism (spec 2.8) on CPU: TP=2 with gloo, two spawned processes.

Each rank builds `DSV41Model(TINY, LAYERS)` inside the process group; the model reads torch.distributed and
shards itself (heads / o-groups / wo_b columns / sink by rank, routed experts 16/2 per rank, all-reduce of the
wo_b output and of the routed MoE sum in fp32). The logits are compared with a single-process model of the
same seed built outside any process group.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv41.models import TINY, DSV41Model

# window-only (0), ratio-2 kv/index source (2) + consumer (3), ratio-1 source with candidates (4), re-index (6);
# every layer has an MoE.
LAYERS = [0, 2, 3, 4, 6]
# One window-only layer with its MoE: both TP collectives (the wo_b all-reduce and the routed-MoE all-reduce)
# go through the compiled graph. Cold compile + step per rank, both ranks sharing the 2 cores: ~26 s for [0];
# 48-104 s (depending on machine load) for [0, 2], over the 90 s budget. The compressor and indexer are
# replicated under TP and compiled in test_compile.py.
COMPILE_LAYERS = [0]
N_STEPS = 3
WORLD = 2


def _inputs(step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, TINY.vocab_size, (2,), generator=g)
    return tokens, torch.tensor([step, step + 5])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str, phase: str):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # two ranks share the 2 CPU cores
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        with torch.no_grad():
            result = _eager_phase(rank) if phase == "eager" else _compile_phase()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _eager_phase(rank: int) -> dict:
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = DSV41Model(TINY, LAYERS, max_batch=2, max_context=32, dtype=dtype)
        assert (model.tp_rank, model.tp_size) == (rank, WORLD)
        attn, moe = model.layers["2"].attn, model.layers["2"].ffn
        assert attn.n_local_heads == TINY.n_heads // WORLD
        assert attn.wq_b.shape[0] == TINY.n_heads // WORLD * TINY.head_dim
        assert attn.attn_sink.shape == (TINY.n_heads // WORLD,)
        assert moe.w13.shape[0] == TINY.n_routed_experts // WORLD
        result[dtype] = [model(*_inputs(s)) for s in range(N_STEPS)]
    return result


def _compile_phase() -> dict:
    eager = DSV41Model(TINY, COMPILE_LAYERS, max_batch=2, max_context=32)
    target = DSV41Model(TINY, COMPILE_LAYERS, max_batch=2, max_context=32)
    for s in range(N_STEPS - 1):
        eager(*_inputs(s))
        target(*_inputs(s))
    compiled = torch.compile(target, backend="inductor", fullgraph=True)
    t0 = time.perf_counter()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        out = compiled(*_inputs(N_STEPS - 1))
    result = {"compiled": out, "compile_s": time.perf_counter() - t0, "eager": eager(*_inputs(N_STEPS - 1))}
    bufs = dict(target.named_buffers())
    result["caches_equal"] = all(torch.equal(b, bufs[n]) for n, b in eager.named_buffers())
    return result


def _run_tp(tmp_path, phase: str):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), phase), nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


@torch.no_grad()
def _single_process(layers, n_steps, dtype=torch.bfloat16):
    assert not (dist.is_available() and dist.is_initialized())
    model = DSV41Model(TINY, layers, max_batch=2, max_context=32, dtype=dtype)
    assert model.tp_size == 1
    return [model(*_inputs(s)) for s in range(n_steps)]


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_tp2_matches_single_process(tmp_path):
    """3 eager decode steps under TP=2 (fake quant on) against one process.

    fp32 model (weights and activations fp32, fake quant still on): the sharding and the all-reduces are the
    only difference, and TP matches one process to ~2e-6 (measured); asserted with atol = rtol = 1e-4.

    bf16 model: each rank rounds its wo_b partial sum to bf16 before the fp32 all-reduce, where one process
    rounds the full sum once, so the attention output differs by 1 bf16 ulp in ~40% of its elements. Top-k
    (router, indexer, candidates) and the FP8/FP4 fake-quant grids amplify that: measured max |diff| 0.34-0.42
    on logits of magnitude ~3.3 over these 5 layers (relative L2 ~0.1), and still ~0.1 max with
    `fake_quant=False` -- so a bf16-ulp tolerance is not attainable with or without fake quant. The same
    amplification makes the one-process bf16 model differ from its fp32 twin by a relative L2 of 0.1-0.25.
    The bf16 TP run is therefore bounded by that intrinsic noise (rel. L2 <= 2 x noise + 0.02) and the
    ranks must be bit-identical; the semantics are pinned by the fp32 run.
    """
    r0, r1 = _run_tp(tmp_path, "eager")
    ref32 = _single_process(LAYERS, N_STEPS, torch.float32)
    ref16 = _single_process(LAYERS, N_STEPS, torch.bfloat16)
    for s in range(N_STEPS):
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(r0[dtype][s], r1[dtype][s])  # replicated after the all-reduces
        torch.testing.assert_close(r0[torch.float32][s], ref32[s], atol=1e-4, rtol=1e-4)
        # bf16: TP may move the logits no more than bf16 itself does (one process, bf16 vs fp32)
        noise = _rel_l2(ref16[s], ref32[s])
        assert _rel_l2(r0[torch.bfloat16][s], ref16[s]) <= 2 * noise + 0.02, (s, noise)
    print("bf16 rel-L2 vs one process:", [round(_rel_l2(r0[torch.bfloat16][s], ref16[s]), 4) for s in range(N_STEPS)],
          "bf16-vs-fp32 noise:", [round(_rel_l2(ref16[s], ref32[s]), 4) for s in range(N_STEPS)],
          "fp32 TP max|diff|:", max((r0[torch.float32][s] - ref32[s]).abs().max().item() for s in range(N_STEPS)))


def test_tp2_compiled_step_matches_eager_tp(tmp_path):
    """One TP=2 decode step through torch.compile(inductor, fullgraph) with emulate_precision_casts (see
    test_compile.py for why): identical caches and logits (atol = rtol = 1e-2; bit-exact here) to the eager
    TP=2 step after the same two eager warm-up steps, and within the bf16 noise of one process."""
    r0, r1 = _run_tp(tmp_path, "compile")
    assert r0["caches_equal"] and r1["caches_equal"]
    assert torch.equal(r0["compiled"], r1["compiled"])
    for r in (r0, r1):
        torch.testing.assert_close(r["compiled"], r["eager"], atol=1e-2, rtol=1e-2)
    ref16 = _single_process(COMPILE_LAYERS, N_STEPS)[-1]
    noise = _rel_l2(ref16, _single_process(COMPILE_LAYERS, N_STEPS, torch.float32)[-1])
    assert _rel_l2(r0["compiled"], ref16) <= 2 * noise + 0.02
    print(f"TP=2 compile + first step: {r0['compile_s']:.1f} s; compiled vs eager TP max|diff|:",
          (r0["compiled"] - r0["eager"]).abs().max().item())
