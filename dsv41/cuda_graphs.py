"""CUDA-graph capture of compiled decode steps: one graph per batch-size bucket.

`DecodeGraphRunner(step, batch_sizes)` wraps `step(tokens [B], positions [B]) -> logits [B, V]` (eager, Inductor
or dsv41-compiled). For each bucket it allocates static input buffers, warms the step up on a side stream,
captures it with `torch.cuda.graph` into one memory pool shared by all buckets, and keeps the static output. A
call copies its inputs into the smallest bucket that fits (padding rows decode token 0 at position 0 in cache
rows B..bucket-1, which must not belong to live requests), replays, and returns the first B output rows.

Inputs are checked on the host before they are copied: equal 1-D integer shapes, a batch that fits a bucket, and
for host (CPU) inputs the values, 0 <= tokens < vocab_size and 0 <= positions < max_context (ValueError naming
the argument and the limit; the limits are read from the step when it is, or wraps, a DSV41Model). Device inputs
are not read back (that would sync): the captured step itself clamps and flags them (see DSV41Model).

Side streams inside the step are captured correctly: the stream executor takes the capture stream as its main
stream and joins every fork before the step returns. Do not also use Inductor's `reduce-overhead` mode.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable, Sequence

import torch

from dsv41.models.model import INDEX_DTYPES, DSV41Model, check_decode_values


class DecodeGraphRunner:
    def __init__(self, step: Callable, batch_sizes: Sequence[int], device: torch.device | str = "cuda", warmup: int = 3,
                 *, vocab_size: int | None = None, max_context: int | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("DecodeGraphRunner needs CUDA")
        if not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
            raise ValueError(f"batch_sizes must be positive ints, got {list(batch_sizes)}")
        self.step, self.device, self.warmup = step, torch.device(device), warmup
        model = getattr(step, "_orig_mod", step)  # a torch.compile'd module wraps the model
        if isinstance(model, DSV41Model):
            vocab_size = model.cfg.vocab_size if vocab_size is None else vocab_size
            max_context = model.max_context if max_context is None else max_context
        self.vocab_size, self.max_context = vocab_size, max_context
        self.buckets = sorted(set(batch_sizes))
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def capture(self, positions: torch.Tensor | None = None) -> None:
        """Capture every bucket (largest first, so smaller graphs reuse the pool). `positions` [max bucket]
        are the warm-up positions (default 0); warm-up runs the step, so it writes the caches of those rows."""
        for b in reversed(self.buckets):
            tokens = torch.zeros(b, dtype=torch.int64, device=self.device)
            pos = torch.zeros(b, dtype=torch.int64, device=self.device) if positions is None else positions[:b].clone()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(self.warmup):
                    self.step(tokens, pos)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            gc_collect, gc.collect = gc.collect, (lambda *a, **k: 0)  # no gc pause per capture
            try:
                with torch.cuda.graph(graph, pool=self.pool), torch.no_grad():
                    out = self.step(tokens, pos)
            finally:
                gc.collect = gc_collect
            self.graphs[b] = (graph, tokens, pos, out)

    def bucket(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"batch {batch} exceeds the largest captured batch size {self.buckets[-1]}")

    def check_inputs(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Shapes and dtypes; the values too where they are on the host and the limits are known."""
        for name, t in (("tokens", tokens), ("positions", positions)):
            if not isinstance(t, torch.Tensor) or t.dtype not in INDEX_DTYPES:
                got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"DecodeGraphRunner: {name} must be a torch.int64 or torch.int32 tensor, got {got}")
        if tokens.shape != positions.shape or tokens.dim() != 1 or tokens.shape[0] < 1:
            raise ValueError(f"DecodeGraphRunner: tokens {list(tokens.shape)} and positions {list(positions.shape)} "
                             "must be equal non-empty 1-D shapes [B]")
        if tokens.device.type == "cpu" and positions.device.type == "cpu" and None not in (self.vocab_size, self.max_context):
            check_decode_values(tokens, positions, vocab_size=self.vocab_size, max_context=self.max_context,
                                caller="DecodeGraphRunner")

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.check_inputs(tokens, positions)
        batch = tokens.shape[0]
        b = self.bucket(batch)
        if b not in self.graphs:
            raise RuntimeError(f"bucket {b} is not captured; call capture() first")
        graph, static_tokens, static_pos, out = self.graphs[b]
        static_tokens[:batch].copy_(tokens)
        static_pos[:batch].copy_(positions)
        if batch < b:
            static_tokens[batch:].zero_()
            static_pos[batch:].zero_()
        graph.replay()
        return out[:batch]


def replay_us(graph: torch.cuda.CUDAGraph, replays: int, before: Callable[[int], None] | None = None) -> list[float]:
    """Microseconds of each of `replays` replays of `graph`, timed with CUDA events; `before(i)` runs ahead of
    replay i, outside the timed region (e.g. to rotate inputs)."""
    times = []
    for i in range(replays):
        if before is not None:
            before(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return times


def copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of reps)."""
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * nbytes / statistics.median(times)


def time_step(step: Callable, tokens: torch.Tensor, positions: torch.Tensor, replays: int = 50, warmup: int = 5) -> float:
    """Median microseconds of one decode step replayed in a CUDA graph (inputs fixed)."""
    runner = DecodeGraphRunner(step, [tokens.shape[0]], device=tokens.device)
    runner.capture(positions)
    graph = runner.graphs[tokens.shape[0]][0]
    replay_us(graph, warmup)
    return statistics.median(replay_us(graph, replays))
