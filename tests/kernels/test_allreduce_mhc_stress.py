"""CUDA-graph stress of the one-shot all-reduce protocol (dsv41.kernels.allreduce_mhc) on 2 GPUs (and, marked gpu,
with one rank on one GPU: its own buffer, generations and re-arming without a peer).

Each rank captures GRAPHS: CUDA graphs of back-to-back kernel calls of different sizes (bf16 attention and fp32 +
y_add MoE calls alternating), each call preceded on one rank by a GPU sleep of a length set by the call, so the ranks
reach every call skewed. Both ranks replay the graphs in one seeded random order (the protocol needs the same call
sequence on every rank); each rank also sleeps on the host now and then (its own seed), so the GPUs drift apart by up
to a few replays. Nothing is read back per replay:

- every graph starts by incrementing a device replay counter; the inputs of call j are made on the GPU from it:
  y_p[t, c] = (tag * W + p + 1) * 2^(c % 8 - t % 4) with tag = (counter * 16 + j) % 64 (W <= 2: sums of at most
  4 * 63 + 3 (+ 1), integers up to 256 times a power of two, all exact in bf16), y_add = 2^(c % 8 - t % 4) for the MoE calls; so every word encodes its
  rank, its replay and its call;
- the streams are chosen so the output shows the sum itself: x = 0, comb = 0, post = 1, pre = (1, 0, 0, 0), w = 1,
  hence x_new[t, k] = ys[t] exactly and h = rms_norm(ys);
- the outputs are poisoned with NaN before each call, and after it a captured comparison adds to a device counter
  every element of x_new that is not the exact expected sum (a stale word, a word of another rank, replay or call, or
  an unwritten one) and every element of h beyond 2^-6 relative of rms_norm(expected) = rms_norm(2^(c % 8 - t % 4))
  (precomputed; the kernel's rsqrt is approximate).

DSV41_ALLREDUCE_STRESS_REPLAYS sets the replay count (default 2,000 here; benchmarks/run_h200_x2_allreduce.sh runs
1,000,000); DSV41_ALLREDUCE_STRESS_JSON, if set, is a path prefix for each rank's counts (<prefix>.rank<r>.json).
The bad-word count must be 0.
"""

import json
import os
import random
import time

import pytest
import torch

from tests.kernels.support import require_cute_dsl

require_cute_dsl()

from dsv41.models import functional  # noqa: E402
from tests.kernels.test_allreduce_mhc import DIM, EPS, WORLDS, spawn  # noqa: E402

REPLAYS = int(os.environ.get("DSV41_ALLREDUCE_STRESS_REPLAYS", "2000"))
GRAPHS = [[1, 64, 5], [16, 2, 64, 1], [64, 64], [3], [33, 8, 1, 1, 17]]  # token counts of each graph's calls
SEED = 20261201


class Call:
    """The static tensors of one captured call of T tokens (index j in its graph); MoE calls take fp32 y + y_add."""

    def __init__(self, t: int, j: int, moe: bool, rank: int, world: int):
        dev = "cuda"
        self.t, self.j, self.moe, self.rank, self.world = t, j, moe, rank, world
        rows, cols = torch.arange(t, device=dev)[:, None], torch.arange(DIM, device=dev)[None, :]
        self.scale = torch.exp2((cols % 8 - rows % 4).float())  # [T, D] powers of two
        self.y = torch.empty(t, DIM, device=dev, dtype=torch.float32 if moe else torch.bfloat16)
        self.y_add = self.scale.bfloat16() if moe else None
        self.x = torch.zeros(t, 4, DIM, dtype=torch.bfloat16, device=dev)
        self.post = torch.ones(t, 4, device=dev)
        self.comb = torch.zeros(t, 4, 4, device=dev)
        self.pre = torch.tensor([1.0, 0.0, 0.0, 0.0], device=dev).expand(t, 4).contiguous()
        self.w = torch.ones(DIM, dtype=torch.bfloat16, device=dev)
        self.out = (torch.empty(t, 4, DIM, dtype=torch.bfloat16, device=dev),
                    torch.empty(t, DIM, dtype=torch.bfloat16, device=dev))
        # ys = a * scale with an integer a >= 3 (exact), so rms_norm(ys) = rms_norm(scale) up to rounding
        self.want_h = functional.rms_norm(self.scale, self.w, EPS).float()

    def run(self, counter: torch.Tensor, bad: torch.Tensor, group_name: str, sleep_cycles: int):
        """The captured body: inputs from the counter, the (delayed) kernel call, the check into ``bad``."""
        from dsv41.kernels import allreduce_mhc as K

        tag = ((counter * 16 + self.j) % 64).float()
        self.y.copy_((tag * self.world + self.rank + 1) * self.scale)
        for o in self.out:
            o.fill_(float("nan"))
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        K.allreduce_mhc(self.y, self.y_add, self.x, self.post, self.comb, self.pre, self.w, eps=EPS,
                        group_name=group_name, out=self.out)
        ranks_sum = tag * self.world * self.world + self.world * (self.world + 1) // 2
        want = ((ranks_sum + (1 if self.moe else 0)) * self.scale).bfloat16()
        x_new, h = self.out
        bad[0] += (x_new != want[:, None, :]).sum()
        bad[1] += ((h.float() - self.want_h).abs() > 2.0**-6 * self.want_h.abs() + 1e-5).sum() + h.isnan().sum()


def _stress(rank, world, group_name, replays, json_prefix):
    from dsv41.kernels import allreduce_mhc as K

    counter = torch.zeros((), dtype=torch.int64, device="cuda")
    bad = torch.zeros(2, dtype=torch.int64, device="cuda")
    graphs, words = [], []
    uid = 0
    for g, tokens in enumerate(GRAPHS):
        calls = []
        for j, t in enumerate(tokens):
            calls.append(Call(t, j, moe=(uid % 2 == 1), rank=rank, world=world))
            uid += 1
        # warm-up outside capture (compiles, the workspace), in the same order on both ranks
        for c in calls:
            K.allreduce_mhc(c.y.zero_(), c.y_add, c.x, c.post, c.comb, c.pre, c.w, eps=EPS, group_name=group_name)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            counter.add_(1)
            for c in calls:
                late = rank == (g + c.j) % world  # the delayed rank alternates by call and by graph
                c.run(counter, bad, group_name, sleep_cycles=2_000 * (1 + (g * 7 + c.j) % 5) if late else 0)
        graphs.append(graph)
        words.append(sum(5 * c.t * DIM for c in calls))  # x_new (4 streams) and h per call
    bad.zero_()
    counter.zero_()
    torch.cuda.synchronize()
    order = random.Random(SEED)  # the same on every rank
    skew = random.Random(SEED + 1 + rank)  # each rank's own host delays
    checked = calls_run = 0
    start = time.monotonic()
    for _ in range(replays):
        g = order.randrange(len(graphs))
        graphs[g].replay()
        checked += words[g]
        calls_run += len(GRAPHS[g])
        if skew.random() < 1e-3:
            time.sleep(skew.random() * 2e-3)
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    bad_x, bad_h = (int(v) for v in bad.tolist())
    result = {"rank": rank, "world": world, "replays": replays, "calls": calls_run, "words_checked": checked,
              "bad_x_new": bad_x, "bad_h": bad_h, "seconds": elapsed, "graphs": GRAPHS}
    print(f"allreduce_mhc stress rank {rank}: {json.dumps(result)}", flush=True)
    if json_prefix:
        with open(f"{json_prefix}.rank{rank}.json", "w") as f:
            json.dump(result, f, indent=1)
    assert bad_x == 0 and bad_h == 0, f"rank {rank}: {bad_x} bad x_new words, {bad_h} bad h words of {checked}"


@pytest.mark.parametrize("world", WORLDS)
def test_replays_in_random_order_with_skew(world):
    spawn(_stress, REPLAYS, os.environ.get("DSV41_ALLREDUCE_STRESS_JSON", ""), world=world,
          timeout_s=120 + 1e-3 * REPLAYS)
