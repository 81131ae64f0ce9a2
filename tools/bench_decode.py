"""`dsv41 bench decode`: whole decode steps of Flash-dimension layers, side by side, in one run.

Variants, all in one process on the same weights and caches, each captured by `DecodeGraphRunner`: eager;
`inductor` (torch.compile); `dsv41`; `dsv41-nostreams`; `dsv41-streams=KIND+KIND`. Each variant is first checked
by `dsv41.models.agreement.check` in a conditioned state of the same weights in which no discrete decision is near a
tie: every fused-op call of the timed step against its reference, each layer compiled by the variant's own
`torch.compile` settings (one graph per layer kind) on eager's inputs of that layer against eager's output of it
(within `agreement.LAYER_REL_L2`), and the timed graph's logits against eager's (a gate within
`agreement.AGREE_REL_L2` up to `agreement.TIER1_GATE_LAYERS` layers, recorded beyond). A variant that disagrees
records why in its row and is timed all the same (the plot crosses it out), one that fails records why and the
others go on. Timing: median of `--replays`
graph replays after warm-up, the token inputs rotated between replays. Per step and per layer: the per-layer time
is the step less the part outside the layers (embedding, final norm, fp32 head: timed on its own, eager ops under a
CUDA graph) over the number of layers. The floor is the bytes the step reads — every dense weight once, the
distinct routed experts the real routing touched, the KV rows the attention and indexer read — over the
device-to-device copy bandwidth measured in the same run. Start time: from the first call of the compiled model to
its first replay (compile, warm-up, capture), with Inductor's FX-graph-cache counters; run a second process on the
same TORCHINDUCTOR_CACHE_DIR and DSV41_CACHE_DIR (`--start warm`) for a warm start. A torch.profiler breakdown of
the dsv41 step groups kernel time by model module. Writes a table, JSON and a plot under `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict

import torch

from dsv41.config import Dsv41Config


def _log(msg: str) -> None:
    print(f"[bench decode {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextlib.contextmanager
def progress(what: str, every_s: float = 30.0, log=None):
    """Log `what` now, then every `every_s` seconds until the block ends (long compiles show they are alive), by
    `log` (this bench's log line by default)."""
    log = log or _log
    t0, done = time.perf_counter(), threading.Event()

    def tick():
        while not done.wait(every_s):
            log(f"{what}: {time.perf_counter() - t0:.0f} s")

    log(what)
    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def fill_caches(model, context: int, gen: torch.Generator) -> None:
    """Caches as if `context` tokens had been decoded: random values of the model's scales in every slot."""
    from dsv41.models.agreement import caches

    for buf in caches(model).values():
        buf.copy_(torch.randn(buf.shape, generator=gen, device=buf.device, dtype=torch.float32).to(buf.dtype))


def step_bytes(model, tokens, positions) -> tuple[int, dict]:
    """Bytes one decode step must read: dense weights once, the distinct routed experts of the real routing,
    and the KV rows read (window + selected compressed entries + index keys scored)."""
    from dsv41.models import functional as fn

    cfg, t = model.cfg, tokens.shape[0]
    experts_seen: dict[str, set] = {}
    hooks = []
    for lname, block in model.layers.items():
        def hook(mod, args, lname=lname):
            _, e = fn.route(args[0], mod.gate, mod.gate_bias, cfg.n_activated_experts, cfg.route_scale, cfg.gate_temp)
            experts_seen[lname] = set(e.flatten().tolist())
        hooks.append(block.ffn.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(tokens, positions)
    for h in hooks:
        h.remove()
    seen_params = set()
    dense = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen_params or name.endswith(("ffn.w13", "ffn.w2")) or name == "embed":
            continue
        seen_params.add(id(p))
        dense += p.numel() * p.element_size()
    dense += t * cfg.dim * model.embed.element_size()
    routed = 0
    for lname, block in model.layers.items():
        per_expert = (block.ffn.w13[0].numel() + block.ffn.w2[0].numel()) * block.ffn.w13.element_size()
        routed += len(experts_seen[lname]) * per_expert
    kv = 0
    p_max = int(positions.max())
    for lname, block in model.layers.items():
        layer, hd = int(lname), cfg.head_dim
        kv += t * cfg.window_size * hd * 2
        if cfg.ratio(layer):
            n_c = (p_max + 1) // cfg.ratio(layer)
            kv += t * min(cfg.index_topk, n_c) * hd * 2
            if layer in cfg.index_source_layers:
                kv += t * n_c * cfg.index_head_dim * 2
    outside = sum(p.numel() * p.element_size() for p in (model.head, model.norm)) + t * cfg.dim * model.embed.element_size()
    parts = {"dense_weights": dense, "routed_experts": routed, "kv": kv, "outside_layers": outside,
             "distinct_experts": {k: len(v) for k, v in experts_seen.items()}}
    return dense + routed + kv, parts


def outside_layers_us(model, batch: int, replays: int = 50) -> float:
    """Median microseconds of the step's part outside the layers, eager ops under a CUDA graph: the embedding
    gather and its broadcast to the hc streams, the final collapse and RMSNorm, the fp32 head."""
    import torch.nn.functional as F

    from dsv41.cuda_graphs import replay_us
    from dsv41.models import functional as fn

    cfg, device = model.cfg, model.embed.device
    tokens = torch.randint(0, cfg.vocab_size, (batch,), device=device)
    x = torch.randn(batch, cfg.hc_mult, cfg.dim, device=device).to(model.embed.dtype)
    pre = torch.rand(batch, cfg.hc_mult, device=device)

    def part():
        e = F.embedding(tokens, model.embed).unsqueeze(1).expand(batch, cfg.hc_mult, cfg.dim).contiguous()
        u = fn.rms_norm(fn.hc_collapse(x, pre), model.norm, cfg.norm_eps)
        return e, F.linear(u.float(), model.head)

    with torch.no_grad():
        part()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            part()
    return statistics.median(replay_us(graph, replays + 5)[5:])


def timed_replays(runner, batch, tokens_pool, positions, replays) -> float:
    """Median step microseconds over `replays` replays (after 5 warm-up ones), the tokens rotated between them."""
    from dsv41.cuda_graphs import replay_us

    graph, static_tokens, static_pos, _ = runner.graphs[batch]
    static_pos.copy_(positions)
    times = replay_us(graph, replays + 5, before=lambda i: static_tokens.copy_(tokens_pool[i % len(tokens_pool)]))
    return statistics.median(times[5:])


def module_groups(model) -> dict[tuple, str]:
    """The (K, N) operand of each linear's GEMM -> module name, to attribute GEMM kernels: ``F.linear(x, W)`` with
    ``W`` [N, K] runs ``mm(x, W.t())``, whose second operand is [K, N]."""
    groups = {}
    for name, p in model.named_parameters():
        if p.dim() == 2 and name != "embed":  # the embedding is gathered, not multiplied (and has the head's shape)
            parts = name.split(".")
            groups.setdefault((p.shape[1], p.shape[0]), ".".join(parts[2:]) if parts[0] == "layers" else name)
    return groups


def stream_overlap(trace_path: str) -> dict:
    """From a chrome trace: kernels per stream, and the kernel time on non-default streams that overlaps a
    kernel running on another stream."""
    with open(trace_path) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    per_stream: dict = defaultdict(list)
    for e in events:
        per_stream[e.get("args", {}).get("stream", e.get("tid"))].append((e["ts"], e["ts"] + e["dur"]))
    overlap = 0.0
    streams = list(per_stream)
    main = max(streams, key=lambda s: len(per_stream[s])) if streams else None
    for s in streams:
        if s == main:
            continue
        for a0, a1 in per_stream[s]:
            for b0, b1 in per_stream[main]:
                overlap += max(0.0, min(a1, b1) - max(a0, b0))
    return {"kernels_per_stream": {str(s): len(v) for s, v in per_stream.items()}, "main_stream": str(main),
            "side_kernel_us_overlapping_main": round(overlap, 2)}


def variant_config(name: str) -> dict:
    """make_backend overrides of a dsv41 variant name (see ``--variants``)."""
    if name == "dsv41":
        return {}
    if name == "dsv41-nostreams":
        return {"streams": False}
    if name.startswith("dsv41-streams="):
        return {"stream_branches": frozenset(name.removeprefix("dsv41-streams=").split("+"))}
    raise ValueError(f"unknown variant {name!r}: eager, inductor, dsv41, dsv41-nostreams or dsv41-streams=KIND+...")


def replay_trace(graph, trace_path: str, replays: int = 5) -> None:
    """A chrome trace of ``replays`` replays of a captured decode step: the kernels as the graph runs them, on the
    streams they were captured on (a profile of direct calls is bound by Python launch overhead and shows side
    streams finishing long before the main stream's next launch)."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)


def op_group(key: str, input_shapes: list, weights: dict[tuple, str], on_device: bool) -> str | None:
    """The breakdown group of a profiled event, or None when its time is counted elsewhere.

    Counted: dsv41 ops by fusion name; a 2-D GEMM by the linear whose weight is its last operand (``weights`` from
    ``module_groups``; an activation of the same shape must not name it), other GEMMs by their last two operand
    shapes; the routed experts' grouped GEMM; Triton kernels (device events) as Inductor glue. Not counted: record
    ranges (``## ... ##``), kernels launched by an op (in that op's self device time), and the host-side record of
    a Triton launch (it carries the same kernel's device time as the kernel event)."""
    if key.startswith("##"):
        return None
    if "triton" in key:
        return "inductor glue kernels" if on_device else None
    if on_device:
        return None
    if key.startswith("dsv41::"):
        return key
    if key in ("aten::mm", "aten::addmm", "aten::bmm"):
        dims = [tuple(s) for s in input_shapes if s]
        if key != "aten::bmm" and dims and dims[-1] in weights:
            return f"gemm {weights[dims[-1]]}"
        return f"gemm {dims[-2:]}"
    if key == "aten::_grouped_mm":
        return "gemm routed experts"
    return key


# the op groups (`op_group`) whose kernels stream the weights that set the floor, besides each linear's GEMM
WEIGHT_STREAMING_OPS = ("dsv41::moe_experts", "dsv41::wo_a", "gemm routed experts")


def fixed_cost(totals: dict[str, float], weights: dict[tuple, str], n_layers: int) -> dict:
    """The step's kernel time outside the weight-streaming kernels, per layer: every group of `totals` (us per step,
    `op_group`'s groups) but the linears' GEMMs (`gemm <module>` of `weights`, the head's included) and
    `WEIGHT_STREAMING_OPS`, divided by the layers (what lies outside the layers, the embedding's gather and the final
    norm, is counted in with them)."""
    streaming = set(WEIGHT_STREAMING_OPS) | {f"gemm {name}" for name in weights.values()}
    weight_us = sum(us for g, us in totals.items() if g in streaming)
    other_us = sum(us for g, us in totals.items() if g not in streaming)
    return {"weight_streaming_us": round(weight_us, 2), "other_us": round(other_us, 2),
            "other_us_per_layer": round(other_us / n_layers, 2)}


def profile_breakdown(step, tokens, positions, model, n_layers: int, top=8) -> tuple[list[dict], dict]:
    """Self CUDA time of the dsv41 step's ops, grouped by model module (dsv41 ops by fusion name, GEMMs by the
    weight they read, Inductor kernels as glue), from direct calls (which keep the op that launched each
    kernel): the `top` groups, and the time outside the weight-streaming kernels (`fixed_cost`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    weights = module_groups(model)
    with torch.no_grad():
        for _ in range(3):
            step(tokens, positions)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(5):
                step(tokens, positions)
            torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages(group_by_input_shape=True):
        cuda_us = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0)
        if cuda_us <= 0:
            continue
        group = op_group(ev.key, ev.input_shapes, weights, on_device=ev.device_type == DeviceType.CUDA)
        if group is not None:
            totals[group] += cuda_us / 5
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    return [{"group": g, "us": round(us, 2)} for g, us in rows[:top]], fixed_cost(totals, weights, n_layers)


@contextlib.contextmanager
def gpu_turn(lock_path: str | None, shared: bool = False):
    """Hold the file lock `lock_path` (flock; nothing when None), shared by benchmark processes on one GPU: a
    process holds it exclusively to measure (copy bandwidth, capture, check, time, profile) and shared for any other
    GPU work (building the model, the first call that compiles and runs the step, the per-layer step's compile), so
    compiles still run side by side but no measurement shares the GPU with another process's work. (Until
    2026-12-02 the compiles held no lock: session 10's timings overlapped another process's per-layer check.) A
    process waiting to measure takes the gate ``<lock_path>.gate`` first, so later shared holders queue behind it
    rather than starve it."""
    if lock_path is None:
        yield
        return
    import fcntl

    with open(lock_path + ".gate", "a") as gate, open(lock_path, "a") as f:
        asked = time.perf_counter()
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        waited = time.perf_counter() - asked
        if waited > 1:
            _log(f"waited {waited:.0f} s for a {'shared' if shared else 'measuring'} GPU turn")
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cache_counters() -> dict:
    """Inductor's FX-graph-cache and AOTAutograd-cache counters so far (hits, misses, bypasses), and dsv41's pass
    cache's (pass_cache_hit / _miss / _off)."""
    from torch._dynamo.utils import counters

    return {**{k: v for k, v in counters["inductor"].items() if k.startswith(("fxgraph_cache", "autograd_cache"))},
            **counters["dsv41"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv41 bench decode", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,3,20,24", help="comma-separated layer ids, or 'all'")
    parser.add_argument("--batch", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=4096, help="tokens already decoded per request (<= 1048576)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16",))
    parser.add_argument("--config", default="flash", choices=("flash", "tiny"))
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--variants", default="eager,inductor,dsv41,dsv41-nostreams",
                        help="comma-separated: eager, inductor, dsv41, dsv41-nostreams, dsv41-streams=KIND+KIND (only "
                             "these side-stream branch kinds: mhc_coeffs, shared_expert, indexer)")
    parser.add_argument("--inductor-mode", default="default",
                        help="torch.compile mode of the inductor baseline ('default', or e.g. max-autotune-no-cudagraphs: "
                             "on torch 2.11 its benchmarking of _grouped_mm feeds random group offsets and trips a device "
                             "assert)")
    parser.add_argument("--start", choices=("cold", "warm"), default="cold",
                        help="what the start times of this process are: cold (the caller emptied TORCHINDUCTOR_CACHE_DIR "
                             "and DSV41_CACHE_DIR) or warm (a second process on the caches a first one filled)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler breakdown and replay traces")
    parser.add_argument("--gpu-lock", metavar="FILE",
                        help="a lock file shared by benchmark processes that run at once on one GPU: each holds it "
                             "exclusively to capture, check and time, and shared for its other GPU work (gpu_turn)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="decode")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="instead: merge result files of one run split over several processes (disjoint batch "
                             "sizes, or the same batches at other contexts) into <out>/<tag>.json and .png")
    args = parser.parse_args(argv)
    if args.merge:
        result = merge([json.load(open(path)) for path in args.merge])
        write_result(result, args.out, args.tag)
        print_table(result)
        return 0
    variants = args.variants.split(",")
    for name in variants:
        if name not in ("eager", "inductor"):
            try:
                Dsv41Config().replace(**variant_config(name))
            except ValueError as e:
                parser.error(f"--variants: {e}")
    if not 1 <= args.context <= 1 << 20:
        parser.error(f"--context must be in [1, 1048576], got {args.context}")
    if args.replays < 50:
        parser.error("--replays must be at least 50")
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        parser.error(f"--batch must be comma-separated integers, got {args.batch!r}")
    if args.layers != "all" and not all(x.strip().isdecimal() for x in args.layers.split(",")):
        parser.error(f"--layers must be comma-separated layer ids or 'all', got {args.layers!r}")
    if not torch.cuda.is_available():
        print("dsv41 bench decode: error: needs a CUDA device", file=sys.stderr, flush=True)
        return 2
    from dsv41.backend import make_backend
    from dsv41.cuda_graphs import DecodeGraphRunner, copy_bandwidth
    from dsv41.models import DSV41Model, agreement, get_config

    cfg = get_config(args.config)
    layers = list(range(cfg.n_layers)) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    device = torch.device("cuda")
    torch.manual_seed(0)
    max_context = args.context + 128
    max_context += max_context % 2
    with progress(f"building {args.config} layers {layers}, max batch {max(batches)}, context {args.context}"), \
            gpu_turn(args.gpu_lock, shared=True):
        model = DSV41Model(cfg, layers, max_batch=max(batches), max_context=max_context, device=device,
                           share_routed_experts=True)
        gen = torch.Generator(device=device)
        gen.manual_seed(1)
        fill_caches(model, args.context, gen)
    with gpu_turn(args.gpu_lock):
        bandwidth = copy_bandwidth(device)
    _log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")

    def compiler(name: str):
        """The variant's `torch.compile` of a function or module (None for eager): the timed step and the
        per-layer step of the agreement check are compiled alike."""
        if name == "eager":
            return None
        if name == "inductor":
            mode = None if args.inductor_mode == "default" else args.inductor_mode
            return lambda f: torch.compile(f, mode=mode, fullgraph=True, dynamic=False)
        return lambda f: torch.compile(f, backend=make_backend(**variant_config(name)), fullgraph=True, dynamic=False)

    rows, floors, breakdown, fixed, overlap = [], {}, {}, {}, {}

    def save() -> dict:
        """Write the JSON and plot so far (a long run that is cut short keeps what it measured)."""
        result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": layers, "context": args.context,
                  "config": args.config, "inductor_mode": args.inductor_mode, "start": args.start,
                  "agreement_bound": agreement.AGREE_REL_L2, "layer_bound": agreement.LAYER_REL_L2,
                  "tier1_gate_layers": agreement.TIER1_GATE_LAYERS, "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
                  "rows": rows, "floors": {str(k): v for k, v in floors.items()},
                  "breakdown": {str(k): v for k, v in breakdown.items()},
                  "fixed_cost": {str(k): v for k, v in fixed.items()},
                  "stream_overlap": {str(k): v for k, v in overlap.items()}}
        write_result(result, args.out, args.tag)
        return result

    n_layers = len(layers)
    for batch in batches:
        positions = torch.full((batch,), args.context, dtype=torch.int64, device=device)
        tokens_pool = [torch.randint(0, cfg.vocab_size, (batch,), generator=gen, device=device) for _ in range(8)]
        with gpu_turn(args.gpu_lock, shared=True):
            floor_bytes, parts = step_bytes(model, tokens_pool[0], positions)
        floor_us = floor_bytes / bandwidth * 1e6
        with gpu_turn(args.gpu_lock):
            outside_us = outside_layers_us(model, batch)
        layer_floor_us = (floor_bytes - parts["outside_layers"]) / bandwidth * 1e6 / n_layers
        floors[batch] = {"floor_us": round(floor_us, 2), "per_layer_floor_us": round(layer_floor_us, 2),
                         "outside_layers_us": round(outside_us, 2), **parts}
        _log(f"batch {batch}: floor {floor_us:.1f} us ({layer_floor_us:.1f} us per layer); outside the layers "
             f"{outside_us:.1f} us")
        for name in variants:
            row = {"batch": batch, "variant": name, "floor_us": round(floor_us, 2),
                   "per_layer_floor_us": round(layer_floor_us, 2), "floor_bytes": floor_bytes}
            rows.append(row)
            torch._dynamo.reset()
            before = cache_counters()
            try:
                t0 = time.perf_counter()
                compile_fn = compiler(name)
                step = model if compile_fn is None else compile_fn(model)
                with progress(f"batch {batch}: {name}: compiling ({args.start} start)"), torch.no_grad(), \
                        gpu_turn(args.gpu_lock, shared=True):
                    step(tokens_pool[0], positions)  # the first call compiles
                    torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                after = cache_counters()
                row["cache_counters"] = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
                layer_step = None if compile_fn is None else agreement.CompiledLayers(compile_fn)
                layer_failure = None
                if layer_step is not None:  # compile the per-layer graphs now, on a shared GPU turn (a check discarded)
                    try:
                        with progress(f"batch {batch}: {name}: compiling the per-layer step"), torch.no_grad(), \
                                gpu_turn(args.gpu_lock, shared=True):
                            agreement.check(model, step, tokens_pool[0], layers=layer_step)
                        row["layer_graphs"] = layer_step.graphs
                    except Exception as e:  # the step is still checked by the other tiers, timed, and marked
                        layer_failure = f"the per-layer step failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                        layer_step = None
                        _log(f"batch {batch}: {name}: {layer_failure}")
                with gpu_turn(args.gpu_lock):
                    t1 = time.perf_counter()
                    with progress(f"batch {batch}: {name}: capturing"):
                        runner = DecodeGraphRunner(step, [batch])
                        runner.capture(positions)
                        runner(tokens_pool[0], positions)
                        torch.cuda.synchronize()
                    row.update(compile_s=round(compile_s, 1), start_s=round(compile_s + time.perf_counter() - t1, 1))
                    with progress(f"batch {batch}: {name}: agreement check"):
                        check = agreement.check(model, step, tokens_pool[0], replay=runner, layers=layer_step)
                    row["check"] = check.as_dict()
                    row.update(layer_rel_l2_max=check.forced_max, layer_rel_l2_at=check.forced_layer)
                    reason = layer_failure or check.reason
                    row["status"] = "ok" if reason is None else f"disagrees: {reason}"
                    if reason is not None:
                        _log(f"batch {batch}: {name}: DISAGREES with eager ({reason}); timed all the same, "
                             "and left out of the plot")
                    us = timed_replays(runner, batch, tokens_pool, positions, args.replays)
                    row.update(step_us=round(us, 2), per_layer_us=round((us - outside_us) / n_layers, 2))
                    _log(f"batch {batch}: {name}: {us:.1f} us (floor {floor_us:.1f}), {row['per_layer_us']:.1f} us per "
                         f"layer (floor {layer_floor_us:.1f}); agreement: logits rel L2 {check.rel_l2:.2g} "
                         f"({'gate' if check.tier1_gate else 'recorded'}), per layer at most {check.forced_max} "
                         f"(layer {check.forced_layer}), {check.kernel_calls} fused-op calls checked; start "
                         f"{row['start_s']:.0f} s {row['cache_counters']}")
                    if name == "dsv41" and not args.no_profile:
                        breakdown[batch], fixed[batch] = profile_breakdown(step, tokens_pool[0], positions, model,
                                                                           n_layers)
                        if batch in (1, 8):
                            trace = os.path.join(args.out, f"{args.tag}_trace_b{batch}.json")
                            os.makedirs(args.out, exist_ok=True)
                            replay_trace(runner.graphs[batch][0], trace)
                            overlap[batch] = stream_overlap(trace)
            except Exception as e:  # a variant that fails is recorded and the others go on
                row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"
                _log(f"batch {batch}: {name}: FAILED ({row['status']})")
            finally:  # hand the variant's graphs and workspace back to the device, for the processes sharing it
                runner = step = layer_step = None
                gc.collect()
                torch.cuda.empty_cache()
            save()
    result = save()
    print_table(result)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


def write_result(result: dict, out: str, tag: str) -> None:
    """``<out>/<tag>.json`` and the plot ``<out>/<tag>.png``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{tag}.json"), "w") as f:
        json.dump(result, f, indent=1)
    _plot(result, os.path.join(out, f"{tag}.png"))


def merge(parts: list[dict]) -> dict:
    """One result from the files of processes that each ran some (batch, variant) pairs of the same benchmark (one
    per GPU of a machine, or several sharing one GPU through `--gpu-lock`): rows and per-batch entries are
    concatenated (a batch's floor entry from the first part that has it); each row keeps the floor its own process
    computed from the copy bandwidth it measured (``copy_bandwidth_GBps_by_part``)."""
    same = ("gpu", "torch", "layers", "context", "config", "inductor_mode", "start")
    for part in parts[1:]:
        diff = [k for k in same if part.get(k) != parts[0].get(k)]
        if diff:
            raise ValueError(f"cannot merge results that differ in {diff}")
    pairs = [(r["batch"], r["variant"]) for p in parts for r in p["rows"]]
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"merged results must cover disjoint (batch, variant) pairs, got {sorted(pairs)}")
    result = {k: parts[0].get(k) for k in same + ("agreement_bound", "layer_bound", "tier1_gate_layers")}
    result["copy_bandwidth_GBps"] = min(p["copy_bandwidth_GBps"] for p in parts)
    result["copy_bandwidth_GBps_by_part"] = [{"pairs": sorted({(r["batch"], r["variant"]) for r in p["rows"]}),
                                              "GBps": p["copy_bandwidth_GBps"]} for p in parts]
    result["rows"] = sorted((r for p in parts for r in p["rows"]), key=lambda r: r["batch"])
    for key in ("floors", "breakdown", "fixed_cost", "stream_overlap"):
        result[key] = {}
        for p in parts:
            for b, v in p.get(key, {}).items():
                result[key].setdefault(b, v)
    return result


def print_table(result: dict) -> None:
    """Per batch and variant: step and per-layer microseconds (or why the variant was not timed), the floors, the
    ratios of dsv41 to Inductor and to the floor, the agreement distance and the start time."""
    print(f"\nlayers {result['layers']}, context {result['context']}, {result['gpu']}, copy {result['copy_bandwidth_GBps']} "
          f"GB/s, {result.get('start', 'cold')} start, agreement bound rel L2 {result.get('agreement_bound')} (logits), "
          f"{result.get('layer_bound')} (per layer)")
    print(f"{'batch':>5} {'variant':>16} {'step us':>9} {'layer us':>9} {'floor':>8} {'l.floor':>8} {'rel L2':>8} "
          f"{'layer L2':>9} {'start s':>8}  status")
    timed = defaultdict(dict)
    for r in result["rows"]:
        check = r.get("check") or {}
        rel, layer_rel = check.get("rel_l2"), r.get("layer_rel_l2_max")
        print(f"{r['batch']:>5} {r['variant']:>16} {r.get('step_us', float('nan')):>9.1f} {r.get('per_layer_us', float('nan')):>9.1f} "
              f"{r['floor_us']:>8.1f} {r['per_layer_floor_us']:>8.1f} {rel if rel is not None else float('nan'):>8.2g} "
              f"{layer_rel if layer_rel is not None else float('nan'):>9.2g} "
              f"{r.get('start_s', float('nan')):>8.0f}  {r.get('status', 'not run')}")
        if "step_us" in r:
            timed[r["batch"]][r["variant"]] = r
    for b, v in sorted(timed.items()):
        if "dsv41" not in v:
            continue
        d = v["dsv41"]
        line = f"batch {b}: dsv41/floor {d['step_us'] / d['floor_us']:.2f} (step), {d['per_layer_us'] / d['per_layer_floor_us']:.2f} (per layer)"
        if "inductor" in v:
            i = v["inductor"]
            line += f"; dsv41/inductor {d['step_us'] / i['step_us']:.2f} (step), {d['per_layer_us'] / i['per_layer_us']:.2f} (per layer)"
        print(line)
    for b, rows in result["breakdown"].items():
        print(f"\ndsv41 step at batch {b}: top op groups (us per step)")
        for r in rows[:5]:
            print(f"  {r['us']:>9.1f}  {r['group']}")
        fixed = result.get("fixed_cost", {}).get(b)
        if fixed is not None:
            print(f"  outside the weight-streaming kernels: {fixed['other_us_per_layer']:.1f} us per layer")


def _plot(result: dict, path: str) -> None:
    """Step and per-layer time against batch for every timed variant, with the floors; a point whose variant
    disagreed with eager is crossed out, rows that were not timed (failed) are left out, and nothing is drawn when
    no row was timed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in result["rows"] if r.get("step_us", 0) > 0]
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, floor_key, label in ((axes[0], "step_us", "floor_us", "decode step"),
                                      (axes[1], "per_layer_us", "per_layer_floor_us", "per layer (no embed/head)")):
        by = defaultdict(list)
        floors = {}
        for r in rows:
            if r.get(key, 0) > 0:
                by[r["variant"]].append((r["batch"], r[key], r.get("status") == "ok"))
            floors[r["batch"]] = r[floor_key]
        for name, pts in sorted(by.items()):
            pts.sort()
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            bad = [p for p in pts if not p[2]]
            if bad:
                ax.plot([p[0] for p in bad], [p[1] for p in bad], "x", ms=12, color=line.get_color(),
                        label=f"{name}: disagrees with eager")
        fb = sorted(floors)
        ax.plot(fb, [floors[b] for b in fb], "k--", label="memory floor")
        if len(fb) > 1:
            ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (tokens per step)")
        ax.set_ylabel(f"{label} (us)")
        ax.legend(fontsize=8)
    n = len(result["layers"])
    fig.suptitle(f"DeepSeek-V4.1, {n} layers, context {result['context']}, {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
