"""`dsv41 bench kernels`: time each CuTe DSL kernel against its reference subgraph, eager and Inductor-compiled.

For every op and token count T, each variant -- ``dsv41`` (the kernel), ``inductor`` (the reference functions of
``dsv41.models.functional``, or the op's reference for ``qkv_norm``, ``moe_experts``, ``moe_metadata`` and
``moe_finalize``, under
``torch.compile(mode="max-autotune-no-cudagraphs", fullgraph=True)``, in the
default mode for ``moe_experts`` and ``indexer_topk``: see their ops) and
``eager`` (the same functions, uncompiled) -- is captured in one CUDA graph that calls it once per input set, round
robin over enough sets that they exceed 2.5x the L2 cache (so every call reads its inputs, weights included, from
HBM as in a decode step); the graph is replayed many times and the median replay time divided by the number of
calls is reported. The memory floor is the op's compulsory bytes (inputs read once, outputs written once; for
``moe_experts`` the weights of the distinct experts each input set's routing selects, averaged over the sets) over
the device-to-device copy bandwidth measured in the same run; ``pct_copy_bandwidth`` = 100 * floor / time.

The kernels launch with programmatic dependent launch (PDL), so in this back-to-back chain each call's launch and
weight loads overlap the previous call; the ``dsv41`` rows also carry ``us_no_pdl``, the same kernel launched
plainly (what it costs after a predecessor that does not trigger PDL).

``indexer_topk`` is timed per context length (``--columns``, the key cache's Ncap; ``--visible`` the share of its
rows below n_c, default all) at Flash's indexer sizes (32 heads x 128, top-512); its floor is the visible bf16 keys
read once (plus q, w and the indices), and its
Inductor variant compiles the reference in the default mode (the autotuning modes take minutes per width). Its extra
variants: ``select`` (the kernel's exact top-512 alone, on the score kernel's scores; above 4096 columns the
sampled path), ``select_cluster`` (the same on the path without the sample: one cluster a row) and ``torch_topk``
(``torch.topk(s, 512, sorted=False)`` on the same scores), all three with the scores' read as their floor, and
``dsv41_blocks`` (the kernel in layer 20's candidate-block mode).

Writes ``kernels.json`` ({"gpu", "torch", ..., "rows": [{"op", "tokens", "variant", "us", "floor_us", ...}]}) and
``kernels.png`` under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import functools
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dsv41.cuda_graphs import copy_bandwidth, replay_us
from dsv41.models import FLASH, functional

VARIANTS = ("dsv41", "eager", "inductor")  # measured in this order (Inductor last: its autotuning is slow)
MAX_INPUT_BYTES = 16 * 2**30  # an (op, T) whose input sets would take more is skipped (the indexer at 2^20 x T=8)


@dataclass
class Op:
    """One benchmarked op: its inputs for T tokens, compulsory bytes, reference subgraph and kernel (which takes
    ``pdl``, programmatic dependent launch). ``set_bytes``: the compulsory bytes of one input set where they depend
    on its values (the distinct experts a routing selects); the floor is then their mean over the sets and
    ``nbytes`` only sizes the number of sets."""

    name: str
    make_inputs: Callable[[int, torch.Generator], list[torch.Tensor]]
    nbytes: Callable[[int], int]
    reference: Callable
    kernel: Callable
    set_bytes: Callable[[list[torch.Tensor]], int] | None = None
    # the memory one more input set allocates, where the sets share tensors (the routed experts' weights): it
    # decides whether the sets fit (MAX_INPUT_BYTES); default nbytes
    owned_bytes: Callable[[int], int] | None = None
    columns: int | None = None  # the context length of an op timed per width (--columns)
    inductor_mode: str = "max-autotune-no-cudagraphs"
    # further variants: name -> (prepare(input set) -> the variant's inputs, made before timing; fn(*those))
    extra: dict[str, tuple[Callable, Callable]] = field(default_factory=dict)


def _coeffs_op(cfg) -> Op:
    from dsv41.kernels.mhc_coeffs import mhc_coeffs

    d, k = cfg.dim, cfg.hc_mult * cfg.dim
    n_mix = (2 + cfg.hc_mult) * cfg.hc_mult
    eps = dict(norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters)

    def make_inputs(t, g):
        x = (3 * torch.randn(t, cfg.hc_mult, d, generator=g)).bfloat16()
        return [x, torch.randn(n_mix, k, generator=g) / k**0.5, 0.5 * torch.randn(n_mix, generator=g),
                1 + 0.1 * torch.randn(3, generator=g)]

    return Op(
        name="mhc_coeffs",
        make_inputs=make_inputs,
        nbytes=lambda t: t * k * 2 + n_mix * k * 4 + (n_mix + 3) * 4 + t * n_mix * 4,
        reference=lambda x, fn, base, scale: functional.hc_mixes(x, fn, base, scale, eps["norm_eps"], eps["hc_eps"],
                                                                  eps["iters"]),
        kernel=lambda x, fn, base, scale, pdl=True: mhc_coeffs(x, fn, base, scale, **eps, pdl=pdl),
    )


def _post_pre_op(cfg) -> Op:
    from dsv41.kernels.mhc_post_pre import mhc_post_pre

    d, hc = cfg.dim, cfg.hc_mult

    def make_inputs(t, g):
        return [torch.randn(t, d, generator=g).bfloat16(), (2 * torch.randn(t, hc, d, generator=g)).bfloat16(),
                2 * torch.sigmoid(torch.randn(t, hc, generator=g)),
                torch.softmax(torch.randn(t, hc, hc, generator=g), dim=-1),
                torch.sigmoid(torch.randn(t, hc, generator=g)), (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()]

    def reference(y, x, post, comb, pre, w):
        x_new = functional.hc_post(y, x, post, comb)
        return x_new, functional.rms_norm(functional.hc_collapse(x_new, pre), w, cfg.norm_eps)

    return Op(
        name="mhc_post_pre",
        make_inputs=make_inputs,
        # read y, X, post/comb/pre, w; write X', h
        nbytes=lambda t: t * d * 2 + t * hc * d * 2 + t * (2 * hc + hc * hc) * 4 + d * 2 + t * hc * d * 2 + t * d * 2,
        reference=reference,
        kernel=lambda y, x, post, comb, pre, w, pdl=True, cluster_n=None: mhc_post_pre(
            y, x, post, comb, pre, w, eps=cfg.norm_eps, pdl=pdl, cluster_n=cluster_n),
    )


def _qkv_norm_op(cfg) -> Op:
    """The q and kv norms of one layer as the decode has them: the KV RoPE on the trailing rd dims and the FP8 fake
    quantisation per fp8_block; the Inductor and eager variants are the op's reference (the model's functions)."""
    from dsv41.kernels.qkv_norm import qkv_norm
    from dsv41.lowerings.qkv_norm import reference

    q_dim, kv_dim, rd = cfg.q_lora_rank, cfg.head_dim, cfg.rope_head_dim
    scalars = dict(eps=cfg.norm_eps, quant_block=cfg.fp8_block)

    def make_inputs(t, g):
        angle = torch.rand(t, rd // 2, generator=g) * 6.283
        return [(3 * torch.randn(t, q_dim + kv_dim, generator=g)).bfloat16(),
                (1 + 0.1 * torch.randn(q_dim, generator=g)).bfloat16(),
                (1 + 0.1 * torch.randn(kv_dim, generator=g)).bfloat16(), angle.cos(), angle.sin()]

    return Op(
        name="qkv_norm",
        make_inputs=make_inputs,
        # read qkv, both weights, cos and sin; write qr and kv
        nbytes=lambda t: t * (q_dim + kv_dim) * 2 + (q_dim + kv_dim) * 2 + t * rd * 4 + t * (q_dim + kv_dim) * 2,
        reference=lambda qkv, qw, kvw, cos, sin: reference(qkv, qw, kvw, cos, sin, **scalars),
        kernel=lambda qkv, qw, kvw, cos, sin, pdl=True: qkv_norm(qkv, qw, kvw, cos, sin, **scalars, pdl=pdl),
    )


def _route_op(cfg) -> Op:
    from dsv41.kernels.moe_route import moe_route

    d, e, k = cfg.dim, cfg.n_routed_experts, cfg.n_activated_experts
    scalars = dict(topk=k, route_scale=cfg.route_scale, gate_temp=cfg.gate_temp)

    def make_inputs(t, g):
        return [torch.randn(t, d, generator=g).bfloat16(), (torch.randn(e, d, generator=g) / d**0.5).bfloat16(),
                0.1 * torch.randn(e, generator=g)]

    return Op(
        name="moe_route",
        make_inputs=make_inputs,
        # read h, the gate weight and the bias; write the weights (fp32) and the expert ids (int64)
        nbytes=lambda t: t * d * 2 + e * d * 2 + e * 4 + t * k * (4 + 8),
        reference=lambda h, w, bias: functional.route(h, w, bias, k, cfg.route_scale, cfg.gate_temp),
        kernel=lambda h, w, bias, pdl=True: moe_route(h, w, bias, **scalars, pdl=pdl),
    )


def _experts_op(cfg, device="cuda") -> Op:
    """The routed experts on all of cfg's experts (bf16; 27 GB at Flash sizes, made once on ``device`` and shared by
    every input set); each set draws a uniform routing (each token's k experts distinct), so the expert bytes differ
    per set."""
    from dsv41.kernels.moe_experts import moe_experts
    from dsv41.lowerings.moe_experts import reference

    d, inter, e, k = cfg.dim, cfg.moe_inter_dim, cfg.n_routed_experts, cfg.n_activated_experts
    scalars = dict(swiglu_limit=cfg.swiglu_limit, quant_block=cfg.fp8_block)
    expert_bytes = 3 * inter * d * 2  # w1, w3 and w2 rows of one expert, bf16

    @functools.cache
    def weights():
        g = torch.Generator(device=device).manual_seed(0)
        # drawn in bf16 (no fp32 copy: 27 GB more at peak, which did not fit beside a decode benchmark's 90 GB)
        return [torch.empty(e, 2 * inter, d, dtype=torch.bfloat16, device=device).normal_(0, d**-0.5, generator=g),
                torch.empty(e, d, inter, dtype=torch.bfloat16, device=device).normal_(0, inter**-0.5, generator=g)]

    def make_inputs(t, g):
        experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).flatten()
        order = torch.argsort(experts, stable=True)
        offsets = torch.cumsum(torch.bincount(experts, minlength=e), 0).to(torch.int32)
        x = functional.fp8_fake_quant(torch.randn(t, d, generator=g).bfloat16())
        row_weights = 1.5 * torch.rand(t * k, generator=g) / k
        return [x, order // k, row_weights, offsets, *weights()]

    def set_bytes(inputs):
        x, token, _, offsets, *_ = inputs
        distinct = int((offsets.diff(prepend=offsets.new_zeros(1)) > 0).sum())
        # the distinct experts' weights, x, the row metadata and the output rows (a stays on chip when fused)
        return distinct * expert_bytes + x.numel() * 2 + token.numel() * (8 + 4) + e * 4 + token.numel() * d * 2

    return Op(
        name="moe_experts",
        make_inputs=make_inputs,
        nbytes=lambda t: round(e * (1 - (1 - k / e) ** t)) * expert_bytes,  # uniform routing's expectation (spec 4)
        owned_bytes=lambda t: t * d * 2 + t * k * (8 + 4) + e * 4,  # x, token, row weights, offsets: weights shared
        reference=lambda *inputs: reference(*inputs, **scalars),
        kernel=lambda *inputs, pdl=True: moe_experts(*inputs, **scalars, pdl=pdl),
        set_bytes=set_bytes,
        # not max-autotune: it times _grouped_mm's choices on random int32 offsets, which trip the op's
        # offset <= rows assert on the device (the H200, 2026-12-01) and with it the whole process
        inductor_mode="default",
    )


def _metadata_op(cfg) -> Op:
    """The routing metadata of one layer: each input set a routing as moe_route makes it (each token's k experts
    distinct), flattened; the Inductor and eager variants are the op's reference, the model's own ops."""
    from dsv41.kernels.moe_metadata import moe_metadata
    from dsv41.lowerings.moe_metadata import reference

    e, k = cfg.n_routed_experts, cfg.n_activated_experts

    def make_inputs(t, g):
        experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).flatten()
        return [experts, 1.5 * torch.rand(t * k, generator=g) / k]

    return Op(
        name="moe_metadata",
        make_inputs=make_inputs,
        # read the ids (int64) and weights (fp32); write token (int64), row_weights (fp32) and the offsets (int32)
        nbytes=lambda t: t * k * (8 + 4 + 8 + 4) + e * 4,
        reference=lambda flat_e, flat_w: reference(flat_e, flat_w, k, e),
        kernel=lambda flat_e, flat_w, pdl=True: moe_metadata(flat_e, flat_w, topk=k, num_experts=e, pdl=pdl),
    )


def _finalize_op(cfg) -> Op:
    """The combine of one layer as the decode has it: T * k expert rows (already weighted), each token's k rows at
    the positions a routing sorts them to, + the shared expert, rounded to bf16; the Inductor and eager variants
    are the op's reference (an index_add_)."""
    from dsv41.kernels.moe_finalize import moe_finalize
    from dsv41.lowerings.moe_finalize import reference

    d, e, k = cfg.dim, cfg.n_routed_experts, cfg.n_activated_experts

    def make_inputs(t, g):
        experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).flatten()
        token = torch.argsort(experts, stable=True) // k
        return [torch.randn(t * k, d, generator=g).bfloat16(), token, torch.randn(t, d, generator=g).bfloat16()]

    return Op(
        name="moe_finalize",
        make_inputs=make_inputs,
        # read the rows (bf16), token (int64) and shared (bf16); write y (bf16)
        nbytes=lambda t: t * k * (d * 2 + 8) + 2 * t * d * 2,
        reference=lambda rows, token, shared: reference(rows, token, shared, shared.shape[0]),
        kernel=lambda rows, token, shared, pdl=True: moe_finalize(rows, token, shared, num_tokens=shared.shape[0],
                                                                  pdl=pdl),
    )


def _indexer_op(cfg, columns: int, visible: float = 1.0) -> Op:
    """dsv41::indexer_topk (index form) over a key cache of ``columns`` rows per token, the first
    ceil(visible * columns) of them visible (n_c); its floor reads the visible keys only."""
    from dsv41.kernels.indexer_topk import index_scores, indexer_topk, topk_indices
    from dsv41.lowerings.indexer_topk import reference

    heads, dim, k, offset = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.window_size
    scalars = dict(topk=k, offset=offset, cand_block=cfg.candidate_block_size, cand_topk_blocks=0)
    blocks = dict(scalars, cand_topk_blocks=cfg.candidate_topk_blocks)
    n_c = math.ceil(visible * columns)

    def make_inputs(t, g):  # made on the GPU: a CPU draw of 2^20 x 128 keys per set takes seconds
        gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(2**31, (1,), generator=g)))
        return [torch.randn(t, heads, dim, generator=gen, device="cuda").bfloat16(),
                torch.randn(t, heads, generator=gen, device="cuda") / heads**0.5,
                torch.randn(t, columns, dim, generator=gen, device="cuda").bfloat16(),
                torch.full((t,), n_c, dtype=torch.int64, device="cuda")]

    def scores(q, w, keys, n_c):
        return [index_scores(q, w, keys, n_c)[0]]

    return Op(
        name="indexer_topk",
        make_inputs=make_inputs,
        # read q, w, the keys and n_c; write the indices
        nbytes=lambda t: t * (heads * dim * 2 + heads * 4 + n_c * dim * 2 + 8 + min(k, columns) * 8),
        reference=lambda q, w, keys, n_c: reference(q, w, keys, n_c, None, **scalars)[0],
        kernel=lambda q, w, keys, n_c, pdl=True: indexer_topk(q, w, keys, n_c, None, **scalars, pdl=pdl)[0],
        columns=columns,
        inductor_mode="default",
        extra={"select": (scores, lambda s: topk_indices(s, min(k, columns), offset)),
               "select_cluster": (scores, lambda s: topk_indices(s, min(k, columns), offset, path="cluster")),
               "torch_topk": (scores, lambda s: torch.topk(s, min(k, columns), dim=-1, sorted=False).indices),
               "dsv41_blocks": (lambda *inputs: list(inputs), lambda q, w, keys, n_c: indexer_topk(
                   q, w, keys, n_c, None, **blocks)[1])},
    )


OPS = {"mhc_coeffs": _coeffs_op, "mhc_post_pre": _post_pre_op, "qkv_norm": _qkv_norm_op, "moe_route": _route_op,
       "moe_experts": _experts_op, "moe_metadata": _metadata_op, "moe_finalize": _finalize_op,
       "indexer_topk": _indexer_op}
COLUMN_OPS = ("indexer_topk",)  # built per --columns width
DEFAULT_COLUMNS = "4096,65536,524288,1048576"


def time_in_graph(fn: Callable, input_sets: list[list[torch.Tensor]], replays: int) -> float:
    """Median microseconds per call of ``fn`` over ``replays`` replays of one CUDA graph that calls it once per
    input set."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: compiles, autotunes, allocates workspaces
        for inputs in input_sets[:2]:
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for inputs in input_sets:
            fn(*inputs)
    graph.replay()
    times = [us / len(input_sets) for us in replay_us(graph, replays)]
    del graph
    return statistics.median(times)


def _compiled(reference: Callable, mode: str) -> Callable:
    return torch.compile(reference, mode=mode, fullgraph=True, dynamic=False)


def _built_ops(ops: list[str], columns: list[int], visible: float = 1.0) -> list[Op]:
    return [OPS[name](FLASH, n, visible) if name in COLUMN_OPS else OPS[name](FLASH) for name in ops
            for n in (columns if name in COLUMN_OPS else [None])]


def launch_for_profiler(ops: list[str], tokens: list[int], columns: list[int]) -> None:
    """Each op's kernel (all its launches) once per T inside ``cudaProfilerStart``/``Stop``, after a warm-up call
    outside them that compiles it and allocates its workspaces: for ``ncu --profile-from-start off``
    (``benchmarks/ncu_kernels.sh``), which then sees only those launches (at the op's decode sizes, L2 flushed)."""
    cudart = torch.cuda.cudart()
    for op in _built_ops(ops, columns):
        for t in tokens:
            inputs = [a.cuda() for a in op.make_inputs(t, torch.Generator().manual_seed(t))]
            op.kernel(*inputs)
            torch.cuda.synchronize()
            cudart.cudaProfilerStart()
            op.kernel(*inputs)
            torch.cuda.synchronize()
            cudart.cudaProfilerStop()
            print(f"  {op.name}{'' if op.columns is None else f' N={op.columns}'} T={t}: launched", flush=True)
            del inputs


def run(ops: list[str], tokens: list[int], variants: list[str], replays: int, budget_s: float | None,
        out: Path, columns: list[int] | None = None, visible: float = 1.0) -> dict:
    """Measure every (op, T, variant) (and width of the ops timed per ``columns``); the JSON under ``out`` is
    rewritten after each row, so a run cut short keeps what it measured."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    props = torch.cuda.get_device_properties(0)
    bandwidth = copy_bandwidth()
    result = {"gpu": props.name, "torch": torch.__version__, "l2_bytes": props.L2_cache_size,
              "copy_gbps": bandwidth / 1e9, "config": "flash", "rows": []}
    started = time.monotonic()
    for op in _built_ops(ops, columns or [int(n) for n in DEFAULT_COLUMNS.split(",")], visible):
        name = op.name
        where = name if op.columns is None else f"{name} N={op.columns}"
        for t in tokens:
            nbytes = op.nbytes(t)
            n_sets = min(4096, max(8, math.ceil(2.5 * props.L2_cache_size / nbytes)))
            owned = n_sets * (op.owned_bytes or op.nbytes)(t)
            if owned > MAX_INPUT_BYTES:
                print(f"  {where} T={t}: skipped ({n_sets} input sets would take {owned / 1e9:.0f} GB)", flush=True)
                continue
            g = torch.Generator().manual_seed(t)
            input_sets = [[a.cuda() for a in op.make_inputs(t, g)] for _ in range(n_sets)]
            if op.set_bytes is not None:
                nbytes = round(statistics.mean(op.set_bytes(s) for s in input_sets))
            extra = {v: op.extra[v] for v in op.extra if "dsv41" in variants}
            for variant in [*variants, *extra]:
                if variant == "inductor" and budget_s is not None and time.monotonic() - started > budget_s:
                    print(f"  {where} T={t} inductor: skipped (time budget of {budget_s:.0f} s spent)", flush=True)
                    continue
                sets, set_bytes, fn = input_sets, nbytes, None
                if variant in extra:
                    prepare, fn = extra[variant]
                    sets = [prepare(*s) for s in input_sets]
                    if variant != "dsv41_blocks":  # the select variants: their floor is the scores' read
                        set_bytes = sum(a.numel() * a.element_size() for a in sets[0])
                else:
                    fn = {"dsv41": op.kernel, "eager": op.reference,
                          "inductor": _compiled(op.reference, op.inductor_mode) if variant == "inductor" else None
                          }[variant]
                row = {"op": name, "tokens": t, "variant": variant, "us": time_in_graph(fn, sets, replays),
                       "floor_us": set_bytes / bandwidth * 1e6, "bytes": set_bytes, "calls_per_graph": n_sets}
                if op.columns is not None:
                    row["columns"] = op.columns
                    row["visible"] = visible
                row["pct_copy_bandwidth"] = 100 * row["floor_us"] / row["us"]
                if variant == "dsv41":  # the same kernel launched without programmatic dependent launch
                    row["us_no_pdl"] = time_in_graph(functools.partial(op.kernel, pdl=False), input_sets, replays)
                result["rows"].append(row)
                print(f"  {where} T={t} {variant}: {row['us']:.2f} us", flush=True)
                (out / "kernels.json").write_text(json.dumps(result, indent=1) + "\n")
                del sets
            del input_sets
            torch.cuda.empty_cache()
    return result


def post_pre_layouts(tokens: list[int], replays: int, out: Path) -> dict:
    """Time ``mhc_post_pre`` at Flash dimensions in every launch layout (CTAs per token) the kernel accepts, at each
    T, with PDL as the entry point launches it; writes ``post_pre_layouts.json``. This is the measurement behind
    ``mhc_post_pre.cluster_for``."""
    from dsv41.kernels import mhc_post_pre as kernel

    op = _post_pre_op(FLASH)
    props = torch.cuda.get_device_properties(0)
    layouts = [n for n in range(1, kernel._MAX_CLUSTER + 1) if kernel._config(FLASH.dim, n) is not None]
    result = {"gpu": props.name, "torch": torch.__version__, "dim": FLASH.dim, "rows": []}
    for t in tokens:
        n_sets = min(4096, max(8, math.ceil(2.5 * props.L2_cache_size / op.nbytes(t))))
        g = torch.Generator().manual_seed(t)
        input_sets = [[a.cuda() for a in op.make_inputs(t, g)] for _ in range(n_sets)]
        for n in layouts:
            us = time_in_graph(functools.partial(op.kernel, cluster_n=n), input_sets, replays)
            result["rows"].append({"tokens": t, "cluster_n": n, "warps_per_cta": kernel._config(FLASH.dim, n)[1],
                                   "us": us})
            print(f"  mhc_post_pre T={t} {n} CTA/token: {us:.2f} us", flush=True)
        del input_sets
    (out / "post_pre_layouts.json").write_text(json.dumps(result, indent=1) + "\n")
    by = {(r["tokens"], r["cluster_n"]): r["us"] for r in result["rows"]}
    print("mhc_post_pre, us per call by CTAs per token (* = cluster_for's choice)")
    print(f"{'T':>4}" + "".join(f"{n:>9}" for n in layouts))
    for t in tokens:
        print(f"{t:>4}" + "".join(f"{by[(t, n)]:>8.2f}{'*' if kernel.cluster_for(FLASH.dim, t) == n else ' '}"
                                  for n in layouts))
    return result


def merge(parts: list[dict]) -> dict:
    """One result from the kernels.json files of processes that timed different ops at the same time, one per GPU
    of a machine; each row keeps the floor its own process computed, and ``copy_gbps_by_op`` the bandwidth."""
    for part in parts[1:]:
        if (part["gpu"], part["torch"]) != (parts[0]["gpu"], parts[0]["torch"]):
            raise ValueError("cannot merge results from different GPUs or torch versions")
    ops = [{r["op"] for r in p["rows"]} for p in parts]
    if len(set().union(*ops)) != sum(map(len, ops)):
        raise ValueError(f"merged results must cover disjoint ops, got {[sorted(o) for o in ops]}")
    return {**parts[0], "copy_gbps": min(p["copy_gbps"] for p in parts),
            "copy_gbps_by_op": {op: p["copy_gbps"] for p, names in zip(parts, ops) for op in sorted(names)},
            "rows": [r for p in parts for r in p["rows"]]}


def table(result: dict) -> str:
    """One line per (op, width, T): each variant's time, the floor, and the kernel's speedups and distance to the
    floor; then one line per extra variant (``Op.extra``) with its own floor."""
    rows = {(r["op"], r.get("columns"), r["tokens"], r["variant"]): r for r in result["rows"]}
    keys = sorted({(r["op"], r.get("columns") or 0, r["tokens"]) for r in result["rows"]})
    keys = [(op, n or None, t) for op, n, t in keys]
    lines = [f"{result['gpu']}, torch {result['torch']}, copy {result['copy_gbps']:.0f} GB/s; "
             "us per call under CUDA graphs",
             f"{'op':<14}{'N':>8}{'T':>4}{'dsv41':>9}{'no-pdl':>8}{'inductor':>10}{'eager':>9}{'floor':>8}{'x ind':>8}"
             f"{'x eager':>9}{'/floor':>8}{'%copy bw':>10}"]
    extra = []
    for op, n, t in keys:
        us = {v: rows[(op, n, t, v)]["us"] if (op, n, t, v) in rows else float("nan") for v in VARIANTS}
        base = [rows[(op, n, t, v)] for v in VARIANTS if (op, n, t, v) in rows]
        no_pdl = rows[(op, n, t, "dsv41")].get("us_no_pdl", float("nan")) if (op, n, t, "dsv41") in rows else math.nan
        if base:
            floor = base[0]["floor_us"]
            lines.append(f"{op:<14}{n or '':>8}{t:>4}{us['dsv41']:>9.2f}{no_pdl:>8.2f}{us['inductor']:>10.2f}"
                         f"{us['eager']:>9.2f}{floor:>8.2f}{us['inductor'] / us['dsv41']:>8.1f}"
                         f"{us['eager'] / us['dsv41']:>9.1f}{us['dsv41'] / floor:>8.1f}"
                         f"{100 * floor / us['dsv41']:>10.1f}")
        extra += [f"{op:<14}{n or '':>8}{t:>4}  {r['variant']:<14}{r['us']:>9.2f} us, floor {r['floor_us']:.2f} us"
                  for (o, c, tt, v), r in rows.items() if (o, c, tt) == (op, n, t) and v not in VARIANTS]
    return "\n".join(lines + (["further variants:"] + extra if extra else []))


def plot(result: dict, path: Path) -> bool:
    """A log-log plot of us vs T per op (one panel each; vs the width N for ops timed per width); False when
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ops = sorted({r["op"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [r for r in result["rows"] if r["op"] == op]
        x_of = (lambda r: r["columns"]) if "columns" in rows[0] else (lambda r: r["tokens"])
        for variant in sorted({r["variant"] for r in rows}, key=lambda v: (v not in VARIANTS, v)):
            pts = sorted((x_of(r), r["us"]) for r in rows if r["variant"] == variant)
            ax.plot(*zip(*pts), marker="o", label=variant)
        floor = sorted({(x_of(r), r["floor_us"]) for r in rows if r["variant"] in VARIANTS})
        ax.plot(*zip(*floor), "k--", label="memory floor")
        xlabel = "columns N (T = {})".format(rows[0]["tokens"]) if "columns" in rows[0] else "tokens T"
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="us per call (CUDA graph)", title=op)
        ax.set_xticks([r for r, _ in floor], [str(r) for r, _ in floor])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['gpu']}: dsv41 kernels vs the reference subgraph (Flash dims)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _allreduce_mhc_rank(rank: int, world: int, port: int, tokens: list[int], replays: int, out: Path):
    """One rank of `allreduce_mhc`: at each T and form, the fused kernel and NCCL all-reduce + the mhc_post_pre
    kernel, each timed as ``time_in_graph`` times a kernel (both ranks run the same graphs in the same order)."""
    import torch.distributed as dist

    from dsv41.kernels.allreduce_mhc import allreduce_mhc
    from dsv41.kernels.mhc_post_pre import mhc_post_pre
    from dsv41.lowerings.allreduce_mhc import enable_symmetric_memory, reduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD.group_name
    enable_symmetric_memory(group)
    op, eps = _post_pre_op(FLASH), FLASH.norm_eps
    variants = {"dsv41": lambda y, y_add, *s: allreduce_mhc(y, y_add, *s, eps=eps, group_name=group),
                "nccl+mhc_post_pre": lambda y, y_add, *s: mhc_post_pre(reduce(y, y_add, group), *s, eps=eps)}
    props = torch.cuda.get_device_properties(rank)
    result = {"gpu": props.name, "torch": torch.__version__, "world": world, "rows": []}
    for t in tokens:
        for form in ("attention", "moe"):
            nbytes = op.nbytes(t) + t * FLASH.dim * (4 if form == "moe" else 0)
            n_sets = min(4096, max(8, math.ceil(2.5 * props.L2_cache_size / nbytes)))
            g, gy = torch.Generator().manual_seed(t), torch.Generator().manual_seed(1000 * t + rank)
            sets = []
            for _ in range(n_sets):
                y, *streams = op.make_inputs(t, g)  # the streams alike on every rank, y this rank's partial
                y = torch.randn(t, FLASH.dim, generator=gy)
                y_add = torch.randn(t, FLASH.dim, generator=g).bfloat16() if form == "moe" else None
                sets.append([None if a is None else a.cuda() for a in
                             (y if form == "moe" else y.bfloat16(), y_add, *streams)])
            for variant, fn in variants.items():
                us = time_in_graph(fn, sets, replays)
                result["rows"].append({"op": "allreduce_mhc", "form": form, "tokens": t, "variant": variant,
                                       "us": us, "calls_per_graph": n_sets})
                if rank == 0:
                    print(f"  allreduce_mhc {form} T={t} {variant}: {us:.2f} us", flush=True)
            del sets
            torch.cuda.empty_cache()
    (out / f"allreduce_mhc.rank{rank}.json").write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


def allreduce_mhc_bench(tokens: list[int], replays: int, out: Path, world: int = 2) -> int:
    """`--op allreduce_mhc`: the TP=2 fused kernel against NCCL + mhc_post_pre on two GPUs (one process each);
    writes allreduce_mhc.json (rank 0's rows, rank 1's time as ``us_rank1``) and prints the speedups."""
    import socket

    import torch.multiprocessing as mp

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < world:
        print(f"dsv41 bench kernels --op allreduce_mhc: needs {world} CUDA devices (one TP rank each), found {found}")
        return 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_allreduce_mhc_rank, args=(world, port, tokens, replays, out), nprocs=world, join=True)
    ranks = [json.loads((out / f"allreduce_mhc.rank{r}.json").read_text()) for r in range(world)]
    result = ranks[0]
    for row, other in zip(result["rows"], ranks[1]["rows"], strict=True):
        row["us_rank1"] = other["us"]
    (out / "allreduce_mhc.json").write_text(json.dumps(result, indent=1) + "\n")
    us = {(r["form"], r["tokens"], r["variant"]): r["us"] for r in result["rows"]}
    print(f"{result['gpu']} x{world}, us per call under CUDA graphs (rank 0)")
    print(f"{'form':<10}{'T':>4}{'dsv41':>9}{'nccl+post_pre':>15}{'speedup':>9}")
    for form, t in sorted({(f, t) for f, t, _ in us}):
        fused, nccl = us[(form, t, "dsv41")], us[(form, t, "nccl+mhc_post_pre")]
        print(f"{form:<10}{t:>4}{fused:>9.2f}{nccl:>15.2f}{nccl / fused:>9.2f}")
    print(f"wrote {out / 'allreduce_mhc.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv41 bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=sorted(OPS) + ["allreduce_mhc"],
                        help="one op (default: all one-GPU ops; allreduce_mhc needs 2 GPUs and runs only when named)")
    parser.add_argument("--tokens", default=None,
                        help="comma-separated token counts (default 1,2,4,8,16,32,64; 1 for --op indexer_topk)")
    parser.add_argument("--columns", default=DEFAULT_COLUMNS,
                        help="comma-separated widths (key-cache rows Ncap) of " + ", ".join(COLUMN_OPS))
    parser.add_argument("--visible", type=float, default=1.0,
                        help="the share of each key cache's rows visible (n_c = ceil(share * Ncap)) for "
                             + ", ".join(COLUMN_OPS) + "; in (0, 1]")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--replays", type=int, default=20, help="graph replays per measurement (median)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip Inductor variants (slow to autotune) once this many seconds have passed")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="instead: merge kernels.json files of one run split over GPUs (disjoint ops) into --out")
    parser.add_argument("--profiler-launches", action="store_true",
                        help="instead: launch each kernel once per T between cudaProfilerStart/Stop, for ncu "
                             "--profile-from-start off (benchmarks/ncu_kernels.sh)")
    parser.add_argument("--post-pre-layouts", action="store_true",
                        help="instead: time mhc_post_pre in each launch layout (CTAs per token) at each T")
    args = parser.parse_args(argv)
    if args.merge:
        result = merge([json.loads(path.read_text()) for path in args.merge])
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels.json").write_text(json.dumps(result, indent=1) + "\n")
        plot(result, args.out / "kernels.png")
        print(table(result))
        return 0
    tokens_text = args.tokens or ("1" if args.op in COLUMN_OPS else "1,2,4,8,16,32,64")
    if not all(t.strip().isdecimal() and int(t) >= 1 for t in tokens_text.split(",")):
        parser.error(f"--tokens must be comma-separated token counts >= 1, got {tokens_text!r}")
    tokens = [int(t) for t in tokens_text.split(",")]
    if not 0.0 < args.visible <= 1.0:
        parser.error(f"--visible must be in (0, 1], got {args.visible}")
    if args.op == "allreduce_mhc":
        args.out.mkdir(parents=True, exist_ok=True)
        return allreduce_mhc_bench(tokens, args.replays, args.out)
    if not torch.cuda.is_available():
        print("dsv41 bench kernels: error: needs a CUDA device", file=sys.stderr)
        return 1
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.post_pre_layouts:
        post_pre_layouts(tokens, args.replays, args.out)
        return 0
    ops = [args.op] if args.op else sorted(OPS, reverse=True)
    columns = [int(n) for n in args.columns.split(",")]
    if args.profiler_launches:
        launch_for_profiler(ops, tokens, columns)
        return 0
    result = run(ops, tokens, variants, args.replays, args.budget_s, args.out, columns, args.visible)
    plotted = plot(result, args.out / "kernels.png")
    print(table(result))
    print(f"wrote {args.out / 'kernels.json'}" + (f" and {args.out / 'kernels.png'}" if plotted else ""))
    return 0
