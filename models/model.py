"""An eager, plain-PyTorch DeepSeek-V4.1 decode step (spec sections 1-2).

One call of `DSV41Model.forward(tokens, positions)` decodes one token per request (S = 1, T = B): it reads and
updates the caches in place and returns fp32 logits [B, vocab]. Shapes are static for a given batch size, caches
are preallocated for `max_batch` requests of `max_context` tokens, and nothing syncs with the host, so the step is
traceable by `torch.compile(fullgraph=True)` and capturable in a CUDA graph.

Choices where the spec leaves room (documented in the README):
- index scores are computed in fp32 (HF) rather than bf16 (the reference);
- the indexer is replicated under TP (vLLM), so there is no all-reduce of the index scores;
- embedding and head are replicated under TP;
- weights (`weights=`): "bf16" (default) holds them dequantized in bf16 (fp32 where the reference promotes: mHC,
  sink, router bias, ratio-2 compressor, head); "checkpoint" holds the FP8 / FP4 GEMM weights as the checkpoint
  stores them (spec 1.3: e4m3 + E8M0 per 32x32 block; packed e2m1 + E8M0 per 32 along K) and the head in bf16,
  and dequantises them right before each GEMM (`fn.dequant_fp8_blocks`, `fn.dequant_fp4`). Both draw the same
  random values: the bf16 model holds exactly the dequantised checkpoint values, so the two give identical logits;
- FP8/FP4 GEMM inputs go through the FP8 per-32 fake quantisation when `fake_quant` is on;
- `wq_a` and `wkv` are held merged as `wqkv_a` (one GEMM, as vLLM's fused_wqa_wkv), likewise w1|w3 as `w13`;
- a selected index is valid iff it is below N_c and not masked by the candidate blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dsv41.models import functional as fn
from dsv41.models.config import ModelConfig, yarn_inv_freq
from dsv41.models.formats import quantize_fp4, quantize_fp8

WEIGHTS = ("bf16", "checkpoint")  # DSV41Model(weights=...): how the FP8 / FP4 / head weights are held


def _tp() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(x: Tensor) -> Tensor:
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", dist.group.WORLD)


_DRAW_CHUNK = 1 << 24  # fp32 values drawn at once for a stack of experts (64 MB)


class _Params:
    """Deterministic random initialisation: every tensor draws from its own seed (a hash of its name), so a
    model built from a subset of layers, or a TP shard, holds exactly the values of the full model.

    The checkpoint's FP8 / FP4 weights are drawn once in fp32 and quantised (`fp8`, `fp4_stack`): weights="checkpoint"
    holds the stored formats, "bf16" their dequantised values, so both hold the same numbers. The head is drawn in
    fp32 and rounded to bf16 (the checkpoint's dtype); "bf16" holds it in fp32."""

    def __init__(self, seed: int, device, dtype, weights: str = "bf16"):
        self.seed, self.device, self.dtype = seed, torch.device(device), dtype
        self.checkpoint = weights == "checkpoint"

    def _gen(self, name: str) -> torch.Generator:
        g = torch.Generator(device=self.device)
        h = 0
        for ch in name:
            h = (h * 131 + ord(ch)) % (2**61 - 1)
        g.manual_seed((self.seed * 1_000_003 + h) % (2**63 - 1))
        return g

    def _draw(self, name, shape, std, mean=0.0) -> Tensor:
        return torch.randn(shape, generator=self._gen(name), device=self.device, dtype=torch.float32) * std + mean

    def normal(self, name, shape, std, mean=0.0, dtype=None, shard=None) -> nn.Parameter:
        t = _shard(self._draw(name, shape, std, mean), shard)
        return nn.Parameter(t.to(dtype or self.dtype), requires_grad=False)

    def fp8(self, name, shape, std, shard=None) -> tuple[nn.Parameter, nn.Parameter | None]:
        """An FP8 weight (spec 1.3): (e4m3 [N, K], E8M0 scale [N/32, K/32]) with weights="checkpoint", else
        (its dequantised values in self.dtype, None). The full tensor is quantised, then sliced for TP."""
        q, s = quantize_fp8(self._draw(name, shape, std))
        if shard is not None and q.shape[shard[0]] % (32 * shard[2]):
            raise ValueError(f"{name}: TP slices of {list(q.shape)} along dim {shard[0]} are not whole 32x32 blocks")
        q, s = _shard(q, shard), _shard(s, shard)
        if self.checkpoint:
            return nn.Parameter(q, requires_grad=False), nn.Parameter(s, requires_grad=False)
        return nn.Parameter(fn.dequant_fp8_blocks(q, s, self.dtype), requires_grad=False), None

    def fp8_linear(self, name, out_f, in_f, shard=None):
        return self.fp8(name, (out_f, in_f), 1.0 / math.sqrt(in_f), shard=shard)

    def fp4_stack(self, name, n_experts, shape, fan_in, rank, world) -> tuple[nn.Parameter, nn.Parameter | None]:
        """[n_experts/world, *shape] FP4 weights of this rank's experts (expert e always draws the same values), drawn
        and quantised one expert at a time: (packed uint8 [.., N, K/2], E8M0 [.., N, K/32]) with
        weights="checkpoint", else (the dequantised values in self.dtype, None)."""
        per = n_experts // world
        n, k = shape
        if self.checkpoint:
            out = torch.empty((per, n, k // 2), dtype=torch.uint8, device=self.device)
            scale = torch.empty((per, n, k // 32), dtype=torch.float8_e8m0fnu, device=self.device)
        else:
            out, scale = torch.empty((per, n, k), dtype=self.dtype, device=self.device), None
        chunk = max(1, _DRAW_CHUNK // (n * k))  # experts drawn and quantised together (one at Flash sizes)
        for i in range(0, per, chunk):
            ids = range(rank * per + i, rank * per + min(per, i + chunk))
            w = torch.cat([self._draw(f"{name}.{e}", shape, 1.0 / math.sqrt(fan_in)) for e in ids])
            packed, s = quantize_fp4(w)  # per row along K: the experts' rows quantise independently
            packed, s = packed.view(torch.uint8).view(len(ids), n, k // 2), s.view(len(ids), n, k // 32)
            if self.checkpoint:
                out[i : i + len(ids)], scale[i : i + len(ids)] = packed, s
            else:
                out[i : i + len(ids)] = fn.dequant_fp4(packed, s, self.dtype)
        return nn.Parameter(out, requires_grad=False), scale if scale is None else nn.Parameter(scale, requires_grad=False)

    def head(self, name, out_f, in_f) -> nn.Parameter:
        """The head: bf16 values (the checkpoint's dtype), held in bf16 with weights="checkpoint", else in fp32."""
        t = self._draw(name, (out_f, in_f), 1.0 / math.sqrt(in_f)).bfloat16()
        return nn.Parameter(t if self.checkpoint else t.float(), requires_grad=False)

    def linear(self, name, out_f, in_f, dtype=None, shard=None) -> nn.Parameter:
        return self.normal(name, (out_f, in_f), 1.0 / math.sqrt(in_f), dtype=dtype, shard=shard)

    def norm(self, name, n) -> nn.Parameter:
        return self.normal(name, (n,), 0.1, mean=1.0)


def _shard(t: Tensor, shard) -> Tensor:
    if shard is None:
        return t
    dim, rank, world = shard
    return t.chunk(world, dim)[rank].contiguous()


def _set_fp8(module: nn.Module, attr: str, pair: tuple[nn.Parameter, nn.Parameter | None]) -> None:
    """module.<attr> = the weight, module.<attr>_scale = its E8M0 block scales (None: held dequantised)."""
    setattr(module, attr, pair[0])
    module.register_parameter(attr + "_scale", pair[1])


def _fp8_weight(w: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The GEMM's weight: held dequantised (scale None) or dequantised here from e4m3 + E8M0 blocks."""
    return w if scale is None else fn.dequant_fp8_blocks(w, scale, dtype)


def _fp4_weight(w: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The grouped GEMM's expert stack: held dequantised (scale None) or dequantised here from packed e2m1 + E8M0."""
    return w if scale is None else fn.dequant_fp4(w, scale, dtype)


class Compressor(nn.Module):
    """The kv source's compressor (spec 2.4) plus the index-key projection. Owns the compressed KV cache
    [max_batch, max_context/r, head_dim] and the index-key cache [.., index_head_dim]."""

    def __init__(self, cfg: ModelConfig, layer: int, p: _Params, max_batch: int, max_context: int):
        super().__init__()
        self.cfg, self.ratio = cfg, cfg.ratio(layer)
        pre = f"layers.{layer}.attn.compressor."
        d, hd, ihd = cfg.dim, cfg.head_dim, cfg.index_head_dim
        wdtype = torch.float32 if self.ratio == 2 else None
        self.wkv = p.linear(pre + "wkv", hd, d, dtype=wdtype)
        if self.ratio == 2:
            self.wgate = p.linear(pre + "wgate", hd, d, dtype=wdtype)
        self.norm = p.norm(pre + "norm.weight", hd)
        ipre = f"layers.{layer}.attn.indexer."
        self.wk = p.linear(ipre + "wk", ihd, hd)
        self.k_norm = p.norm(ipre + "k_norm.weight", ihd)
        n_cap = max_context // self.ratio
        dev = p.device
        self.register_buffer("compress_kv", torch.zeros(max_batch, n_cap, hd, dtype=p.dtype, device=dev), persistent=False)
        self.register_buffer("index_k", torch.zeros(max_batch, n_cap, ihd, dtype=p.dtype, device=dev), persistent=False)
        if self.ratio == 2:
            self.register_buffer("kv_state", torch.zeros(max_batch, 2, hd, device=dev), persistent=False)
            self.register_buffer("score_state", torch.full((max_batch, 2, hd), -math.inf, device=dev), persistent=False)

    def reset(self):
        self.compress_kv.zero_()
        self.index_k.zero_()
        if self.ratio == 2:
            self.kv_state.zero_()
            self.score_state.fill_(-math.inf)

    def forward(self, h: Tensor, pos: Tensor, bidx: Tensor, inv_freq: Tensor) -> None:
        cfg, r = self.cfg, self.ratio
        if r == 1:
            latent = fn.rms_norm(F.linear(h, self.wkv), self.norm, cfg.norm_eps)
            complete = torch.ones_like(pos, dtype=torch.bool)
            gpos = pos
        else:
            hf = h.float()
            slot = pos % 2
            self.kv_state.index_put_((bidx, slot), F.linear(hf, self.wkv))
            self.score_state.index_put_((bidx, slot), F.linear(hf, self.wgate))
            n = h.shape[0]
            pooled = (self.kv_state[:n] * torch.softmax(self.score_state[:n], dim=1)).sum(dim=1)
            latent = fn.rms_norm(pooled.to(h.dtype), self.norm, cfg.norm_eps)
            complete = (pos + 1) % 2 == 0
            gpos = pos - 1
        angle = gpos.float().unsqueeze(-1) * inv_freq
        cos, sin = angle.cos(), angle.sin()
        entry = pos // r
        k = fn.rms_norm(F.linear(latent, self.wk), self.k_norm, cfg.norm_eps)
        k = fn.fp4_fake_quant(fn.apply_rope_tail(k, cos, sin), 32, e4m3_scale=False)
        kv = fn.fp4_fake_quant(fn.apply_rope_tail(latent, cos, sin), 16, e4m3_scale=True)
        keep = complete.unsqueeze(-1)
        self.index_k.index_put_((bidx, entry), torch.where(keep, k, self.index_k[bidx, entry]))
        self.compress_kv.index_put_((bidx, entry), torch.where(keep, kv, self.compress_kv[bidx, entry]))


class Indexer(nn.Module):
    """Index scores and top-k selection (spec 2.4) of an index-source layer."""

    def __init__(self, cfg: ModelConfig, layer: int, p: _Params):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        pre = f"layers.{layer}.attn.indexer."
        _set_fp8(self, "wq_b", p.fp8_linear(pre + "wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank))
        self.weights_proj = p.linear(pre + "weights_proj", cfg.index_n_heads, cfg.dim)
        self.is_candidate_source = layer == cfg.candidate_source_layer
        self.is_reindex = cfg.is_reindex(layer)

    def forward(self, qr, h, keys, n_c, cos, sin, shared) -> Tensor:
        """qr [T, q_lora], h [T, D] bf16, keys [T, Ncap, ihd], n_c [T] -> idx [T, min(topk, Ncap)] int64
        (offset by the window size; -1 where invalid)."""
        cfg = self.cfg
        t, n_cap = keys.shape[0], keys.shape[1]
        x = fn.fp8_fake_quant(qr) if cfg.fake_quant else qr
        q = F.linear(x, _fp8_weight(self.wq_b, self.wq_b_scale, x.dtype)).view(t, cfg.index_n_heads, cfg.index_head_dim)
        q = fn.fp4_fake_quant(fn.apply_rope_tail(q, cos, sin), 32, e4m3_scale=False)
        w = F.linear(h, self.weights_proj).float() * (cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
        s = (torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu() * w.unsqueeze(-1)).sum(dim=1)
        visible = torch.arange(n_cap, device=s.device) < n_c.unsqueeze(-1)
        s = s.masked_fill(~visible, -math.inf)
        if self.is_candidate_source:
            shared["candidates"] = select_candidate_blocks(s, n_c, cfg.candidate_block_size, cfg.candidate_topk_blocks)
        elif self.is_reindex:
            s = s.masked_fill(~shared["candidates"], -math.inf)
        sel = torch.topk(s, min(cfg.index_topk, n_cap), dim=-1, sorted=False).indices
        sel = torch.sort(sel, dim=-1).values
        valid = s.gather(-1, sel) > -math.inf
        return torch.where(valid, sel + cfg.window_size, -1)


def select_candidate_blocks(s: Tensor, n_c: Tensor, block: int, topk_blocks: int) -> Tensor:
    """Layer 20's candidate blocks: bs[j] = max of s over block j (-inf padded), the newest block pinned to +inf,
    keep the top-min(topk_blocks, n_blocks) blocks with bs > -inf. s [T, Ncap] -> cand [T, Ncap] bool."""
    t, n_cap = s.shape
    n_blocks = -(-n_cap // block)
    bs = F.pad(s, (0, n_blocks * block - n_cap), value=-math.inf).view(t, n_blocks, block).amax(-1)
    newest = (n_c - 1).div(block, rounding_mode="floor")
    pin = (torch.arange(n_blocks, device=s.device) == newest.unsqueeze(-1)) & (n_c > 0).unsqueeze(-1)
    bs = bs.masked_fill(pin, math.inf)
    top = torch.topk(bs, min(topk_blocks, n_blocks), dim=-1)
    keep = torch.zeros_like(bs, dtype=torch.bool).scatter(1, top.indices, top.values > -math.inf)
    return keep.repeat_interleave(block, dim=1)[:, :n_cap]


def sparse_attention(q: Tensor, window: Tensor, compressed: Tensor | None, idx: Tensor, sink: Tensor, scale: float) -> Tensor:
    """Attention with a per-head sink over the selected KV rows (spec 2.5; K == V).

    q [T, H, hd] bf16; window [T, W, hd]; compressed [T, Ncap, hd] or None; idx [T, K] int64 into
    [window ; compressed], -1 = invalid; sink [H] fp32. A row with no valid index gives 0. -> o [T, H, hd] bf16.
    """
    t, w = window.shape[0], window.shape[1]
    b = torch.arange(t, device=q.device).unsqueeze(-1)
    kv = window[b, idx.clamp(0, w - 1)]
    if compressed is not None:
        from_comp = compressed[b, (idx - w).clamp(0, compressed.shape[1] - 1)]
        kv = torch.where((idx >= w).unsqueeze(-1), from_comp, kv)
    kvf = kv.float()
    logits = torch.einsum("thd,tkd->thk", q.float(), kvf) * scale
    logits = logits.masked_fill((idx < 0).unsqueeze(1), -math.inf)
    m = torch.maximum(logits.amax(-1), sink)
    p = torch.exp(logits - m.unsqueeze(-1))
    denom = p.sum(-1) + torch.exp(sink - m)
    return torch.einsum("thk,tkd->thd", p / denom.unsqueeze(-1), kvf).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, p: _Params, max_batch: int, max_context: int, tp: tuple[int, int]):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        rank, world = tp
        self.world = world
        pre = f"layers.{layer}.attn."
        d, hd, ql = cfg.dim, cfg.head_dim, cfg.q_lora_rank
        self.n_local_heads = cfg.n_heads // world
        self.n_local_groups = cfg.o_groups // world
        heads_per_group = cfg.n_heads // cfg.o_groups
        _set_fp8(self, "wqkv_a", p.fp8_linear(pre + "wqkv_a", ql + hd, d))
        self.q_norm = p.norm(pre + "q_norm.weight", ql)
        self.kv_norm = p.norm(pre + "kv_norm.weight", hd)
        _set_fp8(self, "wq_b", p.fp8_linear(pre + "wq_b", cfg.n_heads * hd, ql, shard=(0, rank, world)))
        _set_fp8(self, "wo_a", p.fp8_linear(pre + "wo_a", cfg.o_groups * cfg.o_lora_rank, heads_per_group * hd, shard=(0, rank, world)))
        _set_fp8(self, "wo_b", p.fp8_linear(pre + "wo_b", d, cfg.o_groups * cfg.o_lora_rank, shard=(1, rank, world)))
        self.attn_sink = p.normal(pre + "attn_sink", (cfg.n_heads,), 1.0, dtype=torch.float32, shard=(0, rank, world))
        self.ratio = cfg.ratio(layer)
        self.compressor = Compressor(cfg, layer, p, max_batch, max_context) if layer in cfg.kv_source_layers else None
        self.indexer = Indexer(cfg, layer, p) if layer in cfg.index_source_layers else None
        self.register_buffer("window_kv", torch.zeros(max_batch, cfg.window_size, hd, dtype=p.dtype, device=p.device), persistent=False)

    def forward(self, h: Tensor, pos: Tensor, bidx: Tensor, rope: dict, shared: dict) -> Tensor:
        cfg = self.cfg
        t, ql, hd, w = h.shape[0], cfg.q_lora_rank, cfg.head_dim, cfg.window_size
        cos, sin = rope["comp" if self.ratio else "main"]
        x = fn.fp8_fake_quant(h) if cfg.fake_quant else h
        qkv = F.linear(x, _fp8_weight(self.wqkv_a, self.wqkv_a_scale, x.dtype))
        qr = fn.rms_norm(qkv[:, :ql], self.q_norm, cfg.norm_eps)
        kv = fn.rms_norm(qkv[:, ql:], self.kv_norm, cfg.norm_eps)
        xq = fn.fp8_fake_quant(qr) if cfg.fake_quant else qr
        q = fn.apply_rope_tail(F.linear(xq, _fp8_weight(self.wq_b, self.wq_b_scale, xq.dtype)).view(t, self.n_local_heads, hd), cos, sin)
        kv = fn.fp8_fake_quant(fn.apply_rope_tail(kv, cos, sin), cfg.fp8_block)
        self.window_kv.index_put_((bidx, pos % w), kv)
        window_idx = (pos.unsqueeze(-1) + 1 + torch.arange(w, device=pos.device)) % w
        idx = torch.where(window_idx <= pos.unsqueeze(-1), window_idx, -1)
        compressed = None
        if self.ratio:
            if self.compressor is not None:
                self.compressor(h, pos, bidx, rope["comp_inv_freq"])
                shared["compressor"] = self.compressor
            comp = shared["compressor"]
            compressed = comp.compress_kv[:t]
            if self.indexer is not None:
                n_c = (pos + 1).div(self.ratio, rounding_mode="floor")
                shared["topk"] = self.indexer(qr, h, comp.index_k[:t], n_c, cos, sin, shared)
            idx = torch.cat((idx, shared["topk"]), dim=-1)
        o = sparse_attention(q, self.window_kv[:t], compressed, idx, self.attn_sink, hd**-0.5)
        o = fn.apply_rope_tail(o, cos, sin, inverse=True)
        g = self.n_local_groups
        wo_a = _fp8_weight(self.wo_a, self.wo_a_scale, o.dtype)
        z = torch.einsum("tgd,grd->tgr", o.view(t, g, -1), wo_a.view(g, cfg.o_lora_rank, -1)).flatten(1)
        xz = fn.fp8_fake_quant(z) if cfg.fake_quant else z
        y = F.linear(xz, _fp8_weight(self.wo_b, self.wo_b_scale, xz.dtype))
        if self.world > 1:
            y = _all_reduce(y.float()).to(h.dtype)
        return y


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, p: _Params, tp: tuple[int, int], routed_experts: "MoE | None" = None):
        super().__init__()
        self.cfg = cfg
        rank, world = tp
        self.world = world
        pre = f"layers.{layer}.ffn."
        d, e, inter = cfg.dim, cfg.n_routed_experts, cfg.moe_inter_dim
        self.gate = p.linear(pre + "gate.weight", e, d)
        self.gate_bias = p.normal(pre + "gate.bias", (e,), 0.1, dtype=torch.float32)
        self.n_local = e // world
        self.expert_start = rank * self.n_local
        if routed_experts is not None:  # benchmark memory saver: share expert weights, not the routing
            self.w13, self.w2 = routed_experts.w13, routed_experts.w2
            self.w13_scale, self.w2_scale = routed_experts.w13_scale, routed_experts.w2_scale
        else:
            self.w13, w13_scale = p.fp4_stack(pre + "experts.w13", e, (2 * inter, d), d, rank, world)
            self.w2, w2_scale = p.fp4_stack(pre + "experts.w2", e, (d, inter), inter, rank, world)
            self.register_parameter("w13_scale", w13_scale)
            self.register_parameter("w2_scale", w2_scale)
        _set_fp8(self, "shared_w13", p.fp8_linear(pre + "shared_experts.w13", 2 * inter, d))
        _set_fp8(self, "shared_w2", p.fp8_linear(pre + "shared_experts.w2", d, inter))

    def forward(self, h: Tensor) -> Tensor:
        cfg = self.cfg
        t, k, inter = h.shape[0], cfg.n_activated_experts, cfg.moe_inter_dim
        weights, experts = fn.route(h, self.gate, self.gate_bias, k, cfg.route_scale, cfg.gate_temp)
        x = fn.fp8_fake_quant(h) if cfg.fake_quant else h
        flat_e, flat_w = experts.flatten(), weights.flatten()
        if self.world > 1:  # pairs routed to other ranks run on local expert 0 with weight 0
            local = (flat_e >= self.expert_start) & (flat_e < self.expert_start + self.n_local)
            flat_e = torch.where(local, flat_e - self.expert_start, 0)
            flat_w = torch.where(local, flat_w, 0.0)
        order = torch.argsort(flat_e, stable=True)
        token = order.div(k, rounding_mode="floor")
        counts = torch.zeros(self.n_local, dtype=torch.int32, device=h.device).scatter_add_(0, flat_e, torch.ones_like(flat_e, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        w13 = _fp4_weight(self.w13, self.w13_scale, x.dtype)
        gu = torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offs)
        a = fn.swiglu_clamped(gu[:, :inter], gu[:, inter:], cfg.swiglu_limit) * flat_w[order].unsqueeze(-1)
        a = a.to(h.dtype)
        a = fn.fp8_fake_quant(a) if cfg.fake_quant else a
        out = torch._grouped_mm(a, _fp4_weight(self.w2, self.w2_scale, a.dtype).transpose(1, 2), offs=offs)
        y = torch.zeros(t, cfg.dim, dtype=torch.float32, device=h.device).index_add_(0, token, out.float())
        if self.world > 1:
            y = _all_reduce(y)
        return (y + self.shared_expert(h, x).float()).to(h.dtype)

    def shared_expert(self, h: Tensor, x: Tensor) -> Tensor:
        inter = self.cfg.moe_inter_dim
        gu = F.linear(x, _fp8_weight(self.shared_w13, self.shared_w13_scale, x.dtype))
        a = fn.swiglu_clamped(gu[:, :inter], gu[:, inter:], self.cfg.swiglu_limit).to(h.dtype)
        a = fn.fp8_fake_quant(a) if self.cfg.fake_quant else a
        return F.linear(a, _fp8_weight(self.shared_w2, self.shared_w2_scale, a.dtype))


class Block(nn.Module):
    """One decoder layer with delayed-pre mHC (spec 2.1)."""

    def __init__(self, cfg: ModelConfig, layer: int, p: _Params, max_batch, max_context, tp, routed_experts=None):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        pre = f"layers.{layer}."
        d, hc = cfg.dim, cfg.hc_mult
        n_mix = (2 + hc) * hc
        self.attn = Attention(cfg, layer, p, max_batch, max_context, tp)
        self.ffn = MoE(cfg, layer, p, tp, routed_experts)
        self.attn_norm = p.norm(pre + "attn_norm.weight", d)
        self.ffn_norm = p.norm(pre + "ffn_norm.weight", d)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", p.normal(f"{pre}hc_{site}_fn", (n_mix, hc * d), 1.0 / math.sqrt(hc * d), dtype=torch.float32))
            setattr(self, f"hc_{site}_base", p.normal(f"{pre}hc_{site}_base", (n_mix,), 0.5, dtype=torch.float32))
            setattr(self, f"hc_{site}_scale", p.normal(f"{pre}hc_{site}_scale", (3,), 0.1, mean=1.0, dtype=torch.float32))

    def _mixes(self, x: Tensor, site: str):
        cfg = self.cfg
        return fn.hc_mixes(x, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"), getattr(self, f"hc_{site}_scale"),
                           cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)

    def forward(self, x: Tensor, pre_mix: Tensor, pos: Tensor, bidx: Tensor, rope: dict, shared: dict):
        eps = self.cfg.norm_eps
        pre_a, post_a, comb_a = self._mixes(x, "attn")
        h = fn.rms_norm(fn.hc_collapse(x, pre_mix), self.attn_norm, eps)
        x = fn.hc_post(self.attn(h, pos, bidx, rope, shared), x, post_a, comb_a)
        pre_f, post_f, comb_f = self._mixes(x, "ffn")
        h = fn.rms_norm(fn.hc_collapse(x, pre_a), self.ffn_norm, eps)
        x = fn.hc_post(self.ffn(h), x, post_f, comb_f)
        return x, pre_f


class DSV41Model(nn.Module):
    """The decode step of DeepSeek-V4.1 over `layer_ids` (all layers by default).

    forward(tokens [B] int64|int32, positions [B] int64|int32) -> logits [B, vocab] fp32, with 1 <= B <= max_batch,
    0 <= tokens < vocab_size and 0 <= positions < max_context; request b reads and writes cache row b.

    weights: "bf16" (default) holds every weight as values (bf16; fp32 head, mHC, sink, router bias, ratio-2
    compressor); "checkpoint" holds the FP8 GEMM weights (wqkv_a, wq_b, wo_a, wo_b, the indexer's wq_b, the shared
    expert) as float8_e4m3fn with `<name>_scale` [N/32, K/32] float8_e8m0fnu, the routed experts (w13, w2) as
    packed e2m1 uint8 [E, N, K/2] with `<name>_scale` [E, N, K/32] float8_e8m0fnu, and the head in bf16; the
    forward dequantises them before each GEMM. Same seed, same values: the two give identical logits. (A
    checkpoint-held model is moved with `.to(device)`; `.to(dtype)` would cast its e4m3 / E8M0 tensors too.)

    Bad input, checked where it costs no device->host sync:
    - types, dtypes, shapes, devices and B: at trace time (TypeError / ValueError naming the argument). Under
      `torch.compile(fullgraph=True)` Dynamo reports that error as `Unsupported: Observed exception`, with the
      message; without fullgraph it is raised as is.
    - token and position values: on the host in eager calls (ValueError naming the argument and the limit), where
      the values already are there: `value_checks="cpu"` (default) checks CPU inputs only, "always" also device
      inputs (one sync per step), "never" none. `dsv41.cuda_graphs.DecodeGraphRunner` checks them before it copies
      host inputs into its buffers.
    - inside a compiled or captured step (no host check possible): out-of-range tokens and positions are clamped
      into range, so every index stays inside the request's own cache row and no other request's row is touched,
      and the row's bit (INPUT_ERRORS) is set in `input_errors` [max_batch] int32, which the host reads when it
      chooses (`pop_input_errors()`). That row's logits are meaningless.
    """

    def __init__(self, cfg: ModelConfig, layer_ids: Sequence[int] | None = None, *, max_batch: int = 8,
                 max_context: int = 256, device="cpu", dtype=torch.bfloat16, seed: int = 0,
                 share_routed_experts: bool = False, value_checks: str = "cpu", weights: str = "bf16"):
        super().__init__()
        layer_ids = list(range(cfg.n_layers)) if layer_ids is None else sorted(layer_ids)
        _check_layer_subset(cfg, layer_ids)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context % 2 or max_context < cfg.window_size:
            raise ValueError(f"max_context={max_context!r} must be an even int >= window_size={cfg.window_size}")
        if value_checks not in VALUE_CHECKS:
            raise ValueError(f"value_checks must be one of {VALUE_CHECKS}, got {value_checks!r}")
        if not isinstance(weights, str) or weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        self.value_checks, self.weights = value_checks, weights
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r}: CUDA is not available on this machine")
        self.cfg, self.layer_ids = cfg, layer_ids
        self.max_batch, self.max_context = max_batch, max_context
        tp = _tp()
        self.tp_rank, self.tp_size = tp
        if cfg.n_heads % tp[1] or cfg.o_groups % tp[1] or cfg.n_routed_experts % tp[1]:
            raise ValueError(f"TP size {tp[1]} must divide n_heads, o_groups and n_routed_experts")
        p = _Params(seed, device, dtype, weights)
        self.embed = p.normal("embed.weight", (cfg.vocab_size, cfg.dim), 1.0)
        self.head = p.head("head.weight", cfg.vocab_size, cfg.dim)
        self.norm = p.norm("norm.weight", cfg.dim)
        self.layers = nn.ModuleDict()
        first = None
        for layer in layer_ids:
            block = Block(cfg, layer, p, max_batch, max_context, tp, first.ffn if (share_routed_experts and first) else None)
            first = first or block
            self.layers[str(layer)] = block
        self.register_buffer("inv_freq_main", torch.tensor(yarn_inv_freq(cfg, False), dtype=torch.float32, device=p.device), persistent=False)
        self.register_buffer("inv_freq_comp", torch.tensor(yarn_inv_freq(cfg, True), dtype=torch.float32, device=p.device), persistent=False)
        # Not a buffer: named_buffers() lists the caches and RoPE tables; _apply moves this along with them.
        self.input_errors = torch.zeros(max_batch, dtype=torch.int32, device=p.device)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.input_errors = fn(self.input_errors)
        return self

    def reset_caches(self):
        for block in self.layers.values():
            block.attn.window_kv.zero_()
            if block.attn.compressor is not None:
                block.attn.compressor.reset()
        self.input_errors.zero_()

    def pop_input_errors(self) -> dict[int, list[str]]:
        """{cache row: the arguments ("tokens", "positions") that were out of range and clamped} since the last
        call, which clears them. Reads the device flags: a device->host sync, at the caller's choice."""
        flags = self.input_errors.tolist()
        self.input_errors.zero_()
        return {row: [name for name, bit in INPUT_ERRORS.items() if f & bit] for row, f in enumerate(flags) if f}

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        cfg = self.cfg
        check_decode_inputs(tokens, positions, max_batch=self.max_batch, device=self.embed.device)
        if not torch.compiler.is_compiling() and (self.value_checks == "always" or (
                self.value_checks == "cpu" and tokens.device.type == "cpu")):
            check_decode_values(tokens, positions, vocab_size=cfg.vocab_size, max_context=self.max_context)
        tokens, positions = self._clamp_inputs(tokens, positions)
        t = tokens.shape[0]
        x = F.embedding(tokens, self.embed).unsqueeze(1).expand(t, cfg.hc_mult, cfg.dim).contiguous()
        pre_mix = (torch.arange(cfg.hc_mult, device=tokens.device) == 0).float().expand(t, cfg.hc_mult)
        pos = positions
        bidx = torch.arange(t, device=tokens.device)
        rope = {"comp_inv_freq": self.inv_freq_comp}
        for name, inv in (("main", self.inv_freq_main), ("comp", self.inv_freq_comp)):
            angle = pos.float().unsqueeze(-1) * inv
            rope[name] = (angle.cos(), angle.sin())
        shared: dict = {}
        for block in self.layers.values():
            x, pre_mix = block(x, pre_mix, pos, bidx, rope, shared)
        u = fn.rms_norm(fn.hc_collapse(x, pre_mix), self.norm, cfg.norm_eps)
        if self.weights == "checkpoint":  # a bf16 head, its GEMM in fp32 on the bf16 values
            return u.float() @ self.head.float().T
        return F.linear(u.float(), self.head)

    def _clamp_inputs(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The in-graph guard (no host sync): tokens into [0, vocab), positions into [0, max_context) as int64,
        with each clamped row's INPUT_ERRORS bits OR-ed into input_errors."""
        bad_tokens = (tokens < 0) | (tokens >= self.cfg.vocab_size)
        bad_positions = (positions < 0) | (positions >= self.max_context)
        flags = bad_tokens.int() * INPUT_ERRORS["tokens"] + bad_positions.int() * INPUT_ERRORS["positions"]
        self.input_errors[: tokens.shape[0]] |= flags
        return tokens.clamp(0, self.cfg.vocab_size - 1), positions.clamp(0, self.max_context - 1).long()


VALUE_CHECKS = ("cpu", "always", "never")
INPUT_ERRORS = {"tokens": 1, "positions": 2}  # bits of DSV41Model.input_errors
INDEX_DTYPES = (torch.int64, torch.int32)


def check_decode_inputs(tokens, positions, *, max_batch: int, device: torch.device) -> None:
    """Types, dtypes, shapes and devices of a decode step's inputs (metadata only: free, and static under tracing)."""
    for name, t in (("tokens", tokens), ("positions", positions)):
        if not isinstance(t, Tensor):
            raise TypeError(f"DSV41Model: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"DSV41Model: {name} must be torch.int64 or torch.int32, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"DSV41Model: {name} must be 1-D [B] (one token per request), got shape {list(t.shape)}")
        if t.device != device:
            raise ValueError(f"DSV41Model: {name} is on {t.device}, the model on {device}")
    if tokens.shape[0] != positions.shape[0]:
        raise ValueError(f"DSV41Model: tokens and positions must have the same length B, got {tokens.shape[0]} and "
                         f"{positions.shape[0]}")
    if not 1 <= tokens.shape[0] <= max_batch:
        raise ValueError(f"DSV41Model: the batch B = {tokens.shape[0]} (the length of tokens and positions) must be "
                         f"in [1, max_batch = {max_batch}]")


def check_decode_values(tokens: Tensor, positions: Tensor, *, vocab_size: int, max_context: int,
                        caller: str = "DSV41Model") -> None:
    """0 <= tokens < vocab_size and 0 <= positions < max_context, or a ValueError naming the first bad entry.
    Reads the values: call it only where they are on the host (or a sync is acceptable), never under tracing."""
    for name, t, limit, what in (("tokens", tokens, vocab_size, "vocab_size"), ("positions", positions, max_context, "max_context")):
        bad = ((t < 0) | (t >= limit)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"{caller}: {name}[{i}] = {int(t[i])} is outside [0, {what} = {limit})")


def _check_layer_subset(cfg: ModelConfig, layer_ids: list[int]) -> None:
    if not layer_ids:
        raise ValueError("layer_ids is empty")
    for layer in layer_ids:
        if not 0 <= layer < cfg.n_layers:
            raise ValueError(f"layer_ids: layer {layer} is outside 0..{cfg.n_layers - 1}")
        for what, src in (("kv source", cfg.kv_source(layer)), ("index source", cfg.index_source(layer))):
            if src is not None and src not in layer_ids:
                raise ValueError(f"layer_ids: layer {layer} reads the {what} layer {src}, which is not in {layer_ids}")
        if cfg.is_reindex(layer) and cfg.candidate_source_layer not in layer_ids:
            raise ValueError(f"layer_ids: re-index layer {layer} needs the candidate source layer {cfg.candidate_source_layer}")
