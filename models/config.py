"""Model configurations of DeepSeek-V4.1 decode (spec section 1).

``flash`` holds the released dimensions; ``tiny`` keeps the same structure and every layer-schedule kind
(window-only, ratio-2 source and consumer, ratio-1 source with candidate indexer, re-index layer, ratio-1
consumer) at small sizes so that a decode step runs on a CPU in milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    route_scale: float = 1.5
    gate_temp: float = 1.0
    swiglu_limit: float = 10.0
    norm_eps: float = 1e-20
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    original_max_position: int = 65536
    fp8_block: int = 32
    fake_quant: bool = True

    def __post_init__(self):
        if len(self.compress_ratios) != self.n_layers:
            raise ValueError(f"compress_ratios has {len(self.compress_ratios)} entries for n_layers={self.n_layers}")
        if self.n_heads % self.o_groups:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by o_groups={self.o_groups}")
        if self.head_dim % self.fp8_block or self.index_head_dim % 32:
            raise ValueError("head_dim and index_head_dim must be multiples of the 32-wide quantisation blocks")

    # ---- per-layer schedule (spec section 1.2) ----
    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source(self, layer: int) -> int | None:
        """The layer whose compressor (and index-key cache) `layer` reads; None for window-only layers."""
        if self.ratio(layer) == 0:
            return None
        return max(s for s in self.kv_source_layers if s <= layer)

    def index_source(self, layer: int) -> int | None:
        """The layer whose top-k indices `layer` uses; None for window-only layers."""
        if self.ratio(layer) == 0:
            return None
        return max(s for s in self.index_source_layers if s <= layer)

    def is_reindex(self, layer: int) -> bool:
        """An index source without its own compressor: keys from the kv source, masked by the candidates."""
        return layer in self.index_source_layers and layer not in self.kv_source_layers

    def hc_dim(self) -> int:
        return self.hc_mult * self.dim

    def with_(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


FLASH = ModelConfig(
    vocab_size=129280,
    dim=5120,
    n_layers=40,
    n_heads=64,
    head_dim=512,
    rope_head_dim=64,
    q_lora_rank=1280,
    o_groups=8,
    o_lora_rank=1024,
    window_size=128,
    compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
    kv_source_layers=(2, 8, 14, 20),
    index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
    candidate_source_layer=20,
    candidate_topk_blocks=2048,
    candidate_block_size=8,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=512,
    n_routed_experts=384,
    n_activated_experts=6,
    moe_inter_dim=2304,
)

# Layers: 0 window-only, 1 window-only, 2 ratio-2 source+indexer, 3 ratio-2 consumer,
# 4 ratio-1 source + candidate indexer, 5 ratio-1 consumer, 6 re-index, 7 ratio-1 consumer.
TINY = ModelConfig(
    vocab_size=512,
    dim=128,
    n_layers=8,
    n_heads=8,
    head_dim=64,
    rope_head_dim=16,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    window_size=8,
    compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1),
    kv_source_layers=(2, 4),
    index_source_layers=(2, 4, 6),
    candidate_source_layer=4,
    candidate_topk_blocks=2,
    candidate_block_size=4,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=8,
    n_routed_experts=16,
    n_activated_experts=6,
    moe_inter_dim=64,
)

CONFIGS = {"flash": FLASH, "tiny": TINY}


def get_config(name: str) -> ModelConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model config {name!r}; known: {sorted(CONFIGS)}") from None


def yarn_inv_freq(cfg: ModelConfig, compressed: bool) -> list[float]:
    """Inverse frequencies f_i of the interleaved RoPE (spec section 2.3), fp64 host values.

    Main table (ratio-0 layers): theta = rope_theta, no YaRN. Compress table: theta = compress_rope_theta with
    the YaRN blend f_i <- f_i/factor*(1-s_i) + f_i*s_i, s_i = 1 - clamp((i-low)/(high-low), 0, 1); no mscale.
    """
    rd = cfg.rope_head_dim
    theta = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freqs = [theta ** (-(2 * i) / rd) for i in range(rd // 2)]
    if not compressed:
        return freqs

    def corr(rot):
        return rd * math.log(cfg.original_max_position / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(cfg.beta_fast)), 0)
    high = min(math.ceil(corr(cfg.beta_slow)), rd - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(freqs):
        s = 1.0 - min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / cfg.rope_factor * (1 - s) + f * s)
    return out
