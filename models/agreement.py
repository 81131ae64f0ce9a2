"""Does a compiled decode step compute what the eager model computes? A check that works at any depth and can fail.

Random weights make the eager model a poor yardstick for a compile: the step is full of discrete decisions (the
router's top-6, the indexer's top-512, layer 20's candidate blocks) whose margins are as small as bf16 rounding, so
another summation order flips a decision and random weights carry the flip through the layers (measured on the
H200: plain Inductor at rel L2 0.09-0.36 from eager at 4 layers, 0.97 at 40). The check therefore runs the compiled
step twice over, on a *conditioned* state of the same model, written in place into its parameters and caches (so
the very graph that is timed, CUDA-graph replays included, is the one checked) and restored afterwards:

1. end to end, against eager: logits within `AGREE_REL_L2` relative L2 of the eager model's, no NaN. In the
   conditioned state every discrete decision has a margin far above rounding noise, so nothing is left to flip:
   - router: gate weights x `GATE_SCALE`, so scores differ by ~1e-3 between experts, and biases spaced
     `BIAS_SPACING` apart (a fresh random order per layer): the top-k is decided by the bias alone;
   - indexer and candidate blocks: the check decodes at positions p < index_topk (`check_positions`), so every
     visible compressed entry (N_c <= index_topk) and every candidate block is selected: no top-k boundary;
   - activations small (`ACT_SCALE`): the embedding scales the residual streams, wqkv_a and the compressor's wkv
     and wk the other RMSNorm inputs, so mean(x^2) ~ 1e-6 and a wrong norm eps (1e-6, V4's value, for V4.1's
     1e-20) moves the result by tens of percent;
   - sublayers move the residual streams by ~`BRANCH_GAIN` of their size (the mHC post gate, through its base):
     with random weights at full gain a rounding difference grows through the layers like any other perturbation
     (measured on the CPU with 1e-6 relative noise on every RMSNorm output, 40 tiny layers: rel L2 0.037 at a
     post gate ~2x the streams, 0.0002 at ~0.2x), while a bug inside a sublayer still moves the logits by far
     more than the bound;
   - Sinkhorn logits far from doubly stochastic (the comb base an upper-triangular +-`SINKHORN_BASE` pattern), so
     Sinkhorn converges slowly and its 20th iteration still moves comb by >= 4e-3 (its sensitivity to 1e-5 of logit
     noise stays ~3e-6).
2. per fused op, against its reference on the same inputs (`dsv41.lowerings._kernels.checking`): teacher forcing
   at op granularity, in a direct call of the compiled step. An error there cannot compound, and one too small to
   show in the logits (a Sinkhorn iteration too few: ~1e-3 on comb) is caught at any depth.

What the check reports per layer (`layer_rel_l2`): the window-KV row each layer wrote, compiled against eager,
which shows where a difference enters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# The most relative L2 distance of compiled from eager logits in the conditioned state. Measured on the H200 at layers
# 2,3,20,24 (context 4096-524288, batch 1 and 8): plain Inductor 0.020-0.034, dsv41 0.017-0.031, from FP8/FP4
# fake-quantisation buckets that a 1-ulp difference flips (one flip moves an element by a whole FP8 step); the
# planted bugs of tests/models/test_agreement.py move the logits by 0.09-0.32 on the CPU.
AGREE_REL_L2 = 0.05
ACT_SCALE = 1e-3
GATE_SCALE = 1e-2
BIAS_SPACING = 0.05
SINKHORN_BASE = 8.0
BRANCH_GAIN = 0.1
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


@dataclass
class Agreement:
    """The verdict: `rel_l2` of the compiled logits from eager (replayed graph, or the direct call when there is
    no replay), `direct_rel_l2`, top-1 agreement, the fused-op calls checked against their references and the
    mismatches among them, per-layer window-KV distances; `ok` and, when not, `reason`."""

    rel_l2: float
    direct_rel_l2: float
    top1: float
    kernel_calls: int
    kernel_mismatches: list[str] = field(default_factory=list)
    layer_rel_l2: dict[str, float] = field(default_factory=dict)
    bound: float = AGREE_REL_L2
    ok: bool = False
    reason: str | None = None

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("ok", "reason", "bound", "rel_l2", "direct_rel_l2", "top1",
                                               "kernel_calls", "kernel_mismatches", "layer_rel_l2")}


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


def check(model, step: Callable, tokens: torch.Tensor, positions: torch.Tensor | None = None,
          replay: Callable | None = None, seed: int = 0) -> Agreement:
    """Run the checks on `step` (a compiled `model`, sharing its parameters and caches); `replay(tokens, positions)`
    is its captured form (e.g. a `DecodeGraphRunner`), checked end to end too when given. Positions default to
    `check_positions`. The model's parameters and caches are as before when this returns."""
    from dsv41.lowerings import _kernels

    device = tokens.device
    if positions is None:
        positions = check_positions(model.cfg, tokens.shape[0], model.max_context, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    restore = condition(model, gen)
    try:
        start = {k: v.clone() for k, v in caches(model).items()}

        def reset():
            for k, v in caches(model).items():
                v.copy_(start[k])

        with torch.no_grad():
            want = model(tokens, positions).float()
            want_rows = _window_rows(model, positions)
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
                       layer_rel_l2={k: round(rel_l2(got_rows[k], w), 6) for k, w in want_rows.items()})
    worst = max(result.rel_l2, result.direct_rel_l2)
    if result.kernel_mismatches:
        result.reason = f"{len(result.kernel_mismatches)} of {len(calls)} fused-op calls differ from their references: " \
                        f"{result.kernel_mismatches[0]}"
    elif not worst <= AGREE_REL_L2:  # NaN fails here too
        first = next((k for k, v in result.layer_rel_l2.items() if not v <= AGREE_REL_L2), None)
        result.reason = (f"logits differ from eager by rel L2 {worst:.3g} > {AGREE_REL_L2}"
                         + (f"; the first layer whose window-KV write differs that much is {first}" if first else ""))
    result.ok = result.reason is None
    return result
