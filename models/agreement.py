"""Does a compiled decode step compute what the eager model computes? A check that works at any depth and can fail.

Random weights make the eager model a poor yardstick for a compile: the step is full of discrete decisions (the
router's top-6, the indexer's top-512, layer 20's candidate blocks) whose margins are as small as bf16 rounding, so
another summation order flips a decision and random weights carry the flip through the layers (measured on the
H200: plain Inductor at rel L2 0.09-0.36 from eager at 4 layers, 0.97 at 40). The check therefore runs on a
*conditioned* state of the same model, written in place into its parameters and caches (so the very graph that is
timed, CUDA-graph replays included, is the one checked) and restored afterwards. In it every discrete decision has
a margin far above rounding noise and a mistake moves the result:
   - router: gate weights x `GATE_SCALE`, so scores differ by ~1e-3 between experts, and biases spaced
     `BIAS_SPACING` apart (a fresh random order per layer): the top-k is decided by the bias alone;
   - indexer and candidate blocks: the check decodes at positions p < index_topk (`check_positions`), so every
     visible compressed entry (N_c <= index_topk) and every candidate block is selected: no top-k boundary;
   - activations small (`ACT_SCALE`): the embedding scales the residual streams, wqkv_a and the compressor's wkv
     and wk the other RMSNorm inputs, so mean(x^2) ~ 1e-6 and a wrong norm eps (1e-6, V4's value, for V4.1's
     1e-20) moves the result by tens of percent;
   - RMSNorm weights drawn in 1 +- `NORM_SPREAD` (not 1 +- 0.1): a weight applied to the wrong tensor (q_norm's
     on kv) moves its output by ~40%;
   - sublayers move the residual streams by ~`BRANCH_GAIN` of their size (the mHC post gate, through its base):
     with random weights at full gain a rounding difference grows through the layers like any other perturbation;
   - Sinkhorn logits far from doubly stochastic (the comb base an upper-triangular +-`SINKHORN_BASE` pattern), so
     Sinkhorn converges slowly and its 20th iteration still moves comb by >= 4e-3.

Three tiers:
1. end to end, the timed graph against eager: logits within `AGREE_REL_L2` relative L2, no NaN.
2. per fused op, against its reference on the same inputs (`dsv41.lowerings._kernels.checking`): teacher forcing
   at op granularity, in a direct call of the timed step. An error there cannot compound, and one too small to
   show elsewhere (a Sinkhorn iteration too few: ~1e-3 on comb) is caught at any depth.
3. per layer, teacher forced (`layers`, a `CompiledLayers`): layer i, compiled by the same backend and variant, is
   run on eager's input of layer i (x, pre_mix, positions, RoPE tables and what earlier layers hand on: the
   compressor, top-k, candidate blocks), and its output (x, pre_mix) must be within `LAYER_REL_L2` of eager's
   output of layer i, and the selection it hands on equal to eager's (as index sets; the conditioned state has no
   top-k boundary, so nothing less than equal is right). Rounding cannot accumulate over depth, and a bug shows at
   its layer.

Tier 3's design. How a layer is compiled: `layer_step(block, ...)` is compiled once per check target with the
variant's own `torch.compile` settings, the Block passed as an argument. Dynamo keeps one graph per layer kind
(guards on the layer's attributes such as `attn.ratio`, on which modules exist and on the keys of what earlier
layers hand on; parameters and buffers are graph inputs), so 40 Flash layers cost 7 compiles (window-only, the
first ratio-2 source, the later ones, ratio-2 consumer, ratio-1 source with candidate indexer, re-index, ratio-1
consumer), counted in `CompiledLayers.graphs`; TINY's 8 layers cost 6. Caches: the eager step
runs first and leaves every cache as it wrote it; layer i writes only this step's slots of its own caches
(window-KV row, compressor state and entry) and reads them after writing, and reads earlier layers' caches, so that
state is layer i's eager input state; layer i's caches are saved before its compiled run and restored after it,
so every later layer reads eager's writes. Why tier 3 is the gate at depth and tier 1 is not: in the conditioned
state rounding still enters every layer through the FP8/FP4 fake quantisation (a 1-ulp difference flips a
quantisation bucket, one flip moves an element by a whole FP8 step, ~6-12%), and it accumulates with depth:
measured on the H200, tier 1 at 4 layers 0.017-0.034 (every compiled variant, plain Inductor included) and at 40
layers 0.12-0.16 > AGREE_REL_L2, the window-KV distance (`layer_rel_l2`) growing steadily from 0.03-0.04 at
layer 0. A bound loose enough for 40 layers of that would pass a wrong eps, so with a per-layer step given tier 1
gates only steps of up to `TIER1_GATE_LAYERS` layers; beyond that its distance is recorded, NaN still fails, and
tier 3 (with tier 2) decides. Tier 1 stays on the timed graph because only it sees what the whole-graph compile
does beyond each layer's (cross-layer scheduling, side streams, CUDA-graph capture); without a per-layer step
tier 1 gates at any depth, as before. The per-layer noise of a correct compile was emulated on the CPU, because no
GPU has run tier 3 yet: relative noise 2e-3 on every F.linear output before its rounding (another accumulation
order), which reproduces the H200's 40-layer figures (tier 1 0.13-0.21, the window-KV distance growing to
0.16-0.22), gives per-layer distances of median 0.005-0.012 and at most 0.032 over 5 x 40 tiny layers; the planted
bugs give 0.10-0.21 at their worst layer, or a different selection (tests/models/test_agreement.py). With FP8/FP4
fake quantisation a sublayer's output carries ~10% of such noise, so no per-layer bound near 0.02 holds on x.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# The most relative L2 distance of compiled from eager logits in the conditioned state. Measured on the H200 at layers
# 2,3,20,24 (context 4096-524288, batch 1 and 8): plain Inductor 0.020-0.034, dsv41 0.017-0.031, from FP8/FP4
# fake-quantisation buckets that a 1-ulp difference flips (one flip moves an element by a whole FP8 step); the
# planted bugs of tests/models/test_agreement.py move the logits by 0.14-0.21 on the CPU (a dropped Sinkhorn
# iteration by 0.03-0.04, which tier 2 catches). At 40 layers the H200 measured 0.12-0.16: see TIER1_GATE_LAYERS.
AGREE_REL_L2 = 0.05
TIER1_GATE_LAYERS = 4  # tier 1 gates steps of up to this many layers when tier 3 runs (see the docstring)
# The most relative L2 distance of a layer's output (x, pre_mix), run by the compiled variant on eager's inputs of that
# layer, from eager's output (tier 3). Not measured on a GPU yet: set between the emulated rounding noise of a
# correct compile (at most 0.032 over 5 x 40 tiny layers, median 0.005-0.012) and the planted bugs' largest layer
# (0.10-0.21 on the CPU over two runs; tests/models/test_agreement.py), a factor 1.7-1.9 from each.
LAYER_REL_L2 = 0.06
ACT_SCALE = 1e-3
GATE_SCALE = 1e-2
BIAS_SPACING = 0.05
SINKHORN_BASE = 8.0
BRANCH_GAIN = 0.1
NORM_SPREAD = 0.5
POST_GATE_OFFSET = math.log(ACT_SCALE * BRANCH_GAIN)  # post = 2 sigmoid(m + base - 9.2) ~ 2e-4, streams ~ 1e-3
CACHE_SUFFIXES = ("window_kv", "compress_kv", "index_k", "kv_state", "score_state")


def caches(model) -> dict[str, torch.Tensor]:
    return {name: buf for name, buf in model.named_buffers() if name.endswith(CACHE_SUFFIXES)}


def check_positions(cfg, batch: int, max_context: int, device) -> torch.Tensor:
    """Positions at which no selection has a boundary: the window is full (p >= window - 1) and every compressed
    layer sees at most index_topk entries (p + 1 <= index_topk * smallest ratio), spread over the batch."""
    ratios = [r for r in cfg.compress_ratios if r]
    hi = min(cfg.index_topk * min(ratios, default=1), max_context) - 1
    lo = min(cfg.window_size - 1, hi)
    return torch.linspace(hi, lo, batch, device=device).round().long()


def _unique_params(model, suffixes) -> list[tuple[str, torch.nn.Parameter]]:
    seen, out = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        if name.endswith(suffixes) and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def condition(model, gen: torch.Generator) -> Callable[[], None]:
    """Write the conditioned state into `model` (parameters and caches, in place); returns `restore()`, which
    puts the previous values back."""
    cfg = model.cfg
    saved = {}

    def keep(name, t):
        saved[name] = (t, t.detach().clone())

    with torch.no_grad():
        for name, p in _unique_params(model, ("embed", "attn.wqkv_a", "compressor.wkv", "compressor.wk")):
            keep(name, p)
            p.mul_(ACT_SCALE)
        for name, p in _unique_params(model, ("norm",)):  # q/kv, attn/ffn, compressor, index-key and final RMSNorm weights
            keep(name, p)
            u = torch.rand(p.shape, generator=gen, device=gen.device, dtype=torch.float32).to(p.device)
            p.copy_(1 + NORM_SPREAD * (2 * u - 1))
        for name, p in _unique_params(model, ("ffn.gate",)):
            keep(name, p)
            p.mul_(GATE_SCALE)
        for name, p in _unique_params(model, ("ffn.gate_bias",)):
            keep(name, p)
            order = torch.randperm(p.numel(), generator=gen, device=gen.device).to(p.device, torch.float32)
            p.copy_((order - order.mean()) * BIAS_SPACING)
        hc = cfg.hc_mult
        triangle = torch.ones(hc, hc).triu() * 2 - 1
        for name, p in _unique_params(model, ("_base",)):  # hc_{attn,ffn}_base: [pre | post | comb]
            keep(name, p)
            p[hc:2 * hc] += POST_GATE_OFFSET
            p[2 * hc:] = (SINKHORN_BASE * triangle).flatten().to(p.device)
        for name, p in _unique_params(model, ("_scale",)):
            if name.rsplit(".", 1)[-1].startswith("hc_"):
                keep(name, p)
                p[2] = 1.0
        for name, buf in caches(model).items():
            keep(name, buf)
            noise = torch.randn(buf.shape, generator=gen, device=gen.device, dtype=torch.float32).to(buf.device)
            buf.copy_(noise * ACT_SCALE if name.endswith("kv_state") else noise)

    def restore():
        with torch.no_grad():
            for t, value in saved.values():
                t.copy_(value)

    return restore


def layer_step(block, x, pre_mix, pos, bidx, rope, shared):
    """One decoder layer, the unit the per-layer tier compiles: `Block.forward` on a copy of `shared` (the
    compressor, top-k and candidate blocks that earlier layers hand on). -> (x [T, hc, D], pre_mix [T, hc], the
    top-k [T, K] and candidate mask [T, Ncap] this layer hands on (None before the first index source), and whether
    it ran traced: `torch.compiler.is_compiling()` is a constant True in a compiled graph)."""
    shared = dict(shared)
    x, pre_mix = block(x, pre_mix, pos, bidx, rope, shared)
    return x, pre_mix, shared.get("topk"), shared.get("candidates"), torch.compiler.is_compiling()


class CompiledLayers:
    """`layer_step` compiled by `compile` (e.g. `lambda f: torch.compile(f, backend=b, fullgraph=True,
    dynamic=False)`), called once per layer with a `Block` as its first argument. Dynamo keeps one graph per
    layer kind (window-only, ratio-2 source, ratio-2 consumer, ratio-1 source with the candidate indexer, re-index,
    ratio-1 consumer, and whether earlier layers hand on a compressor, top-k, candidates: 6 graphs for TINY, 7 for
    Flash's 40 layers; `graphs` counts them), since with inlined nn modules the parameters and buffers are graph
    inputs and its guards are on the layer's attributes and the hand-on dict's keys, not the layer's identity. Each
    instance compiles its own copy of `layer_step` (a fresh code object, so another backend's graphs do not count
    towards Dynamo's recompile limit), and a call that would fall back to eager raises instead."""

    def __init__(self, compile: Callable[[Callable], Callable]):
        fresh = types.FunctionType(layer_step.__code__.replace(), layer_step.__globals__, "layer_step")
        self._step = compile(fresh)
        self.graphs = 0

    def __call__(self, block, *args):
        from torch._dynamo.utils import counters

        before = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            *out, traced = self._step(block, *args)
        self.graphs += counters["stats"]["unique_graphs"] - before
        if not traced:
            raise RuntimeError(f"layer {block.layer} ran eagerly: the per-layer step was not compiled")
        return tuple(out)


@dataclass
class Agreement:
    """The verdict. Tier 1 (the timed graph end to end): `rel_l2` of the compiled logits from eager (replayed
    graph, or the direct call when there is no replay), `direct_rel_l2`, top-1 agreement, per-layer window-KV
    distances `layer_rel_l2`; `tier1_gate`: whether tier 1 is a pass/fail gate here. Tier 2: the fused-op calls
    checked against their references and the mismatches among them. Tier 3 (per layer, teacher forced; empty when
    no per-layer step was given): `forced_rel_l2` per layer, its maximum `forced_max` at `forced_layer`, and the
    layers whose hand-on selection differs (`selection_mismatches`). `ok` and, when not, `reason`."""

    rel_l2: float
    direct_rel_l2: float
    top1: float
    kernel_calls: int
    kernel_mismatches: list[str] = field(default_factory=list)
    layer_rel_l2: dict[str, float] = field(default_factory=dict)
    forced_rel_l2: dict[str, float] = field(default_factory=dict)
    forced_max: float | None = None
    forced_layer: str | None = None
    selection_mismatches: list[str] = field(default_factory=list)
    bound: float = AGREE_REL_L2
    forced_bound: float = LAYER_REL_L2
    tier1_gate: bool = True
    ok: bool = False
    reason: str | None = None

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in (
            "ok", "reason", "bound", "rel_l2", "direct_rel_l2", "top1", "tier1_gate", "kernel_calls",
            "kernel_mismatches", "forced_bound", "forced_max", "forced_layer", "forced_rel_l2",
            "selection_mismatches", "layer_rel_l2")}


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in fp64; NaN when either has a NaN."""
    got, want = got.double(), want.double()
    if got.isnan().any() or want.isnan().any():
        return math.nan
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def _window_rows(model, positions) -> dict[str, torch.Tensor]:
    rows = torch.arange(positions.shape[0], device=positions.device)
    return {name: block.attn.window_kv[rows, positions % model.cfg.window_size].float()
            for name, block in model.layers.items()}


def _eager_step(model, tokens, positions) -> tuple[torch.Tensor, dict[str, dict]]:
    """The eager step's logits and, per layer, what went in (the `Block.forward` arguments, `shared` copied as it
    was) and what came out (x, pre_mix and the selection handed on), recorded by hooks that are removed after."""
    record: dict[str, dict] = {}
    hooks = []
    for name, block in model.layers.items():
        def before(mod, args, name=name):  # x and pre_mix contiguous: layer 0's pre_mix is an expanded one-hot
            record[name] = {"args": (args[0].contiguous(), args[1].contiguous(), *args[2:5], dict(args[5]))}

        def after(mod, args, out, name=name):
            record[name].update(x=out[0], pre_mix=out[1], topk=args[5].get("topk"), candidates=args[5].get("candidates"))
        hooks += [block.register_forward_pre_hook(before), block.register_forward_hook(after)]
    try:
        logits = model(tokens, positions).float()
    finally:
        for hook in hooks:
            hook.remove()
    return logits, record


def _same_selection(got: torch.Tensor | None, want: torch.Tensor | None) -> bool:
    """Equal selections: both absent, or per row the same index set (top-k, -1 = none) / the same mask."""
    if got is None or want is None:
        return got is None and want is None
    if got.dtype == torch.bool:
        return torch.equal(got, want)
    return torch.equal(got.sort(-1).values, want.sort(-1).values)


def _forced_layers(model, layers: Callable, record: dict[str, dict]) -> tuple[dict[str, float], list[str]]:
    """Tier 3: each layer run by `layers` on the eager inputs of that layer, against eager's outputs of that layer.
    Called with the caches as the eager step left them: a layer overwrites only this step's slots of its own
    caches (which it then reads), so that state is its eager input state too; its caches are restored after it,
    so every later layer reads eager's writes. -> per layer max(rel L2 of x, of pre_mix); layers whose selection
    differs."""
    distances, mismatches = {}, []
    for name, block in model.layers.items():
        r = record[name]
        saved = {k: v.clone() for k, v in caches(block).items()}
        try:
            x, pre_mix, topk, candidates = layers(block, *r["args"])
        finally:
            for k, v in caches(block).items():
                v.copy_(saved[k])
        distances[name] = round(max(rel_l2(x, r["x"]), rel_l2(pre_mix, r["pre_mix"])), 6)
        for what, got, want in (("top-k", topk, r["topk"]), ("candidate blocks", candidates, r["candidates"])):
            if not _same_selection(got, want):
                mismatches.append(f"layer {name}: {what}")
    return distances, mismatches


def check(model, step: Callable, tokens: torch.Tensor, positions: torch.Tensor | None = None,
          replay: Callable | None = None, layers: Callable | None = None, seed: int = 0) -> Agreement:
    """Run the checks on `step` (a compiled `model`, sharing its parameters and caches); `replay(tokens, positions)`
    is its captured form (e.g. a `DecodeGraphRunner`), checked end to end too when given; `layers` the per-layer
    step of the same compile (a `CompiledLayers`, or anything with `layer_step`'s arguments returning its first
    four results), which runs tier 3 and makes tier 1 a gate only up to `TIER1_GATE_LAYERS` layers. Positions
    default to `check_positions`. The model's parameters and caches are as before when this returns."""
    from dsv41.lowerings import _kernels

    device = tokens.device
    if positions is None:
        positions = check_positions(model.cfg, tokens.shape[0], model.max_context, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    restore = condition(model, gen)
    forced, selection_mismatches = {}, []
    try:
        start = {k: v.clone() for k, v in caches(model).items()}

        def reset():
            for k, v in caches(model).items():
                v.copy_(start[k])

        with torch.no_grad():
            want, record = _eager_step(model, tokens, positions)
            want_rows = _window_rows(model, positions)
            if layers is not None:
                forced, selection_mismatches = _forced_layers(model, layers, record)
            reset()
            with _kernels.checking() as calls:
                direct = step(tokens, positions).float()
            got_rows = _window_rows(model, positions)
            got = direct
            if replay is not None:
                reset()
                got = replay(tokens, positions).float()
    finally:
        restore()
    result = Agreement(rel_l2=rel_l2(got, want), direct_rel_l2=rel_l2(direct, want),
                       top1=(got.argmax(-1) == want.argmax(-1)).float().mean().item(), kernel_calls=len(calls),
                       kernel_mismatches=[f"{c.op} ({c.kernel}): {c.mismatch}" for c in calls if c.mismatch],
                       layer_rel_l2={k: round(rel_l2(got_rows[k], w), 6) for k, w in want_rows.items()},
                       forced_rel_l2=forced, selection_mismatches=selection_mismatches,
                       tier1_gate=layers is None or len(model.layers) <= TIER1_GATE_LAYERS)
    if forced:
        # NaN first: max() over floats with a NaN is order-dependent
        result.forced_layer = next((k for k, v in forced.items() if math.isnan(v)), max(forced, key=forced.get))
        result.forced_max = forced[result.forced_layer]
    worst = max(result.rel_l2, result.direct_rel_l2)
    if result.kernel_mismatches:
        result.reason = f"{len(result.kernel_mismatches)} of {len(calls)} fused-op calls differ from their references: " \
                        f"{result.kernel_mismatches[0]}"
    elif selection_mismatches:
        result.reason = f"the selection a layer hands on differs from eager's: {', '.join(selection_mismatches)}"
    elif forced and not result.forced_max <= LAYER_REL_L2:  # NaN fails here too
        result.reason = (f"layer {result.forced_layer}, run on eager's inputs, differs from eager's output by rel L2 "
                         f"{result.forced_max:.3g} > {LAYER_REL_L2}")
    elif math.isnan(worst) or (result.tier1_gate and not worst <= AGREE_REL_L2):
        first = next((k for k, v in result.layer_rel_l2.items() if not v <= AGREE_REL_L2), None)
        result.reason = (f"logits differ from eager by rel L2 {worst:.3g} > {AGREE_REL_L2}"
                         + (f"; the first layer whose window-KV write differs that much is {first}" if first else ""))
    result.ok = result.reason is None
    return result
