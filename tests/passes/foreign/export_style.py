"""A DeepSeek-V4.1 decode block (one ratio-1 index-source layer: attention with its indexer, then the MoE) written
from the spec alone, in the habits of an engineer writing export-friendly code (ONNX / TensorRT / ExecuTorch).

Habits: nothing in place and no indexing by tensors: lookups are `index_select` / `torch.gather` with explicitly
expanded indices, writes are out-of-place `scatter` / `scatter_add`, masks are `torch.where` on explicitly
`expand`ed operands, the RoPE pairs are picked by `index_select` with `arange` indices, the power-of-two FP8 scale
is the IEEE exponent rounded up by integer ops on the fp32 bits, softmax, softplus and SiLU are written out,
counts are `F.one_hot(ids).sum(0)`, slices are `narrow`, the experts run under `_grouped_mm` or, where that
does not export, on each sorted row's gathered weights, every projection is `F.linear` / `torch.matmul` with
explicit `permute`s, every dtype change an explicit `.to(dtype)`, and tensors are reshaped / permuted, never
viewed (but for the scale's bitcast) or transposed. Activations are token-major `[B, ...]` (one token per request).

Numerics are the spec's (sections 2.2-2.6, 2.9): bf16 activations, fp32 mHC, norms, router, SwiGLU, combine and
attention softmax, FP8 (per 32, power-of-two scale) round trips of every GEMM input and the window KV, FP4 (per 32,
power-of-two scale) round trip of the index queries; index scores in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .params import param_factory

BF16, F32 = torch.bfloat16, torch.float32
EPS, HC_EPS, SINKHORN_ITERS = 1e-20, 1e-6, 20
GATE_TEMP, ROUTE_SCALE, SWIGLU_LIMIT, SOFTPLUS_THRESHOLD = 1.0, 1.5, 10.0, 20.0
FP8_MAX, FP4_MAX, QUANT_BLOCK = 448.0, 6.0, 32


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(v)) of positive normal fp32 v, exactly: adding a full mantissa to the bits carries into the
    exponent unless the mantissa is zero (v already a power of two); the exponent field then rebuilt alone."""
    bits = v.to(F32).view(torch.int32)
    exponent = torch.bitwise_right_shift(bits + 0x7FFFFF, 23)
    return torch.bitwise_left_shift(torch.bitwise_and(exponent, 0xFF), 23).view(F32)


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """Per block of 32 along the last dim: s = 2^ceil(log2(max(amax, 1e-4) / 448)), x <- e4m3(clamp(x / s,
    +-448)) * s in fp32, returned in x's dtype (spec 2.3 act_quant)."""
    shape = x.shape
    blocks = x.to(F32).reshape(-1, QUANT_BLOCK)
    amax = torch.clamp(blocks.abs().amax(dim=-1, keepdim=True), min=1e-4)
    scale = pow2_ceil(amax / FP8_MAX)
    q = torch.clamp(blocks / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(F32)
    return (q * scale).reshape(shape).to(x.dtype)


def fp4_round_trip(x: torch.Tensor) -> torch.Tensor:
    """Per block of 32 along the last dim: s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)), x <- e2m1(clamp(x / s,
    +-6)) * s, e2m1 rounding half to even on the grid 0, .5, 1, 1.5, 2, 3, 4, 6 (spec 2.3 fp4_act_quant): the
    magnitude is a sum of steps at the midpoints, a midpoint going to the neighbour of even mantissa."""
    shape = x.shape
    blocks = x.to(F32).reshape(-1, QUANT_BLOCK)
    amax = torch.clamp(blocks.abs().amax(dim=-1, keepdim=True), min=FP4_MAX * 2.0**-126)
    scale = pow2_ceil(amax / FP4_MAX)
    v = torch.clamp(blocks / scale, -FP4_MAX, FP4_MAX)
    a = v.abs()
    steps = ((a > 0.25).to(F32) + (a >= 0.75).to(F32) + (a > 1.25).to(F32) + (a >= 1.75).to(F32)) * 0.5
    steps = steps + (a > 2.5).to(F32) + (a >= 3.5).to(F32) + (a > 5.0).to(F32) * 2.0
    return (torch.sign(v) * steps * scale).reshape(shape).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16(w * x * rsqrt(mean(x^2) + eps)) over the last dim, all in fp32, one rounding (spec 2.2)."""
    x32 = x.to(F32)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS) * weight.to(F32)).to(BF16)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., d] with its last rd = 2 * cos.shape[-1] dims rotated as interleaved pairs (x[2i], x[2i+1]) by the
    angle (or minus it, `inverse`), in fp32, returned in x's dtype. cos / sin broadcast against [..., rd/2]."""
    d, rd = x.shape[-1], 2 * cos.shape[-1]
    tail = x.narrow(-1, d - rd, rd).to(F32)
    even = torch.index_select(tail, -1, torch.arange(0, rd, 2, device=x.device))
    odd = torch.index_select(tail, -1, torch.arange(1, rd, 2, device=x.device))
    cos, sin = cos.expand(even.shape), sin.expand(even.shape)
    if inverse:
        re, im = even * cos + odd * sin, odd * cos - even * sin
    else:
        re, im = even * cos - odd * sin, even * sin + odd * cos
    rotated = torch.stack([re, im], dim=-1).reshape(tail.shape).to(x.dtype)
    return torch.cat([x.narrow(-1, 0, d - rd), rotated], dim=-1)


def yarn_inverse_frequencies(rd: int) -> torch.Tensor:
    """The compress table's f_i (spec 2.3): theta 1.6e5 with the YaRN blend (factor 16, beta 32 / 1, original
    65536), fp64 -> fp32 [rd/2]."""
    theta, factor, original = 160000.0, 16.0, 65536
    f = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)

    def corr(rotations):
        return rd * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), rd - 1)
    s = 1.0 - torch.clamp((torch.arange(rd // 2, dtype=torch.float64) - low) / max(high - low, 1e-3), 0.0, 1.0)
    return (f / factor * (1 - s) + f * s).to(F32)


class ExportStyleBlock(nn.Module):
    """One decode layer on B requests (sizes as the tiny model's): x [B, hc, D] bf16 streams, carried pre [B, hc]
    fp32, positions [B] int64, the window ring [B, W, hd], the compressed KV [B, N, hd] and index keys [B, N, ihd]
    bf16, visible rows n_c [B] int64 -> (h [B, D] bf16: the next layer's normalised input, x [B, hc, D] bf16 after
    the FFN post, the compressed top-k indices [B, K] int64, offset by W, -1 where none)."""

    def __init__(self, seed: int = 0, dim=128, hc=4, heads=8, head_dim=64, rope_dim=16, q_rank=64, groups=2,
                 o_rank=32, window=8, index_heads=4, index_dim=32, index_topk=8, experts=16, topk=6, inter=64,
                 max_position=256, grouped_experts=True):
        super().__init__()
        self.grouped_experts = grouped_experts
        p = param_factory(seed)
        self.dim, self.hc, self.heads, self.head_dim, self.q_rank = dim, hc, heads, head_dim, q_rank
        self.groups, self.window, self.index_heads, self.index_dim = groups, window, index_heads, index_dim
        self.index_topk, self.experts, self.topk, self.inter = index_topk, experts, topk, inter
        mix = (2 + hc) * hc
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", p(mix, hc * dim, dtype=F32))
            setattr(self, f"hc_{site}_base", p(mix, scale=0.5, dtype=F32))
            setattr(self, f"hc_{site}_scale", p(3, scale=0.2, mean=1.0, dtype=F32))
        self.attn_norm = p(dim, scale=0.1, mean=1.0)
        self.ffn_norm = p(dim, scale=0.1, mean=1.0)
        self.next_attn_norm = p(dim, scale=0.1, mean=1.0)
        self.wqkv_a = p(q_rank + head_dim, dim)
        self.q_norm = p(q_rank, scale=0.1, mean=1.0)
        self.kv_norm = p(head_dim, scale=0.1, mean=1.0)
        self.wq_b = p(heads * head_dim, q_rank)
        self.attn_sink = p(heads, dtype=F32, scale=1.0)
        self.wo_a = p(groups * o_rank, heads // groups * head_dim)
        self.wo_b = p(dim, groups * o_rank)
        self.index_wq_b = p(index_heads * index_dim, q_rank)
        self.index_weights_proj = p(index_heads, dim)
        self.gate = p(experts, dim)
        self.gate_bias = p(experts, scale=0.1, dtype=F32)
        self.w13 = p(experts, 2 * inter, dim)
        self.w2 = p(experts, dim, inter)
        self.shared_w13 = p(2 * inter, dim)
        self.shared_w2 = p(dim, inter)
        angles = torch.arange(max_position, dtype=F32)[:, None] * yarn_inverse_frequencies(rope_dim)[None, :]
        self.register_buffer("cos_table", torch.cos(angles), persistent=False)
        self.register_buffer("sin_table", torch.sin(angles), persistent=False)

    # ---- mHC (spec 2.2) ----
    def hc_coefficients(self, x, fn, base, scale):
        """(pre [B, hc], post [B, hc], comb [B, hc, hc]) fp32 of the streams x."""
        b, hc = x.shape[0], self.hc
        flat = x.reshape(b, hc * self.dim).to(F32)
        mixes = torch.matmul(flat, fn.permute(1, 0)) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)
        pre = torch.sigmoid(mixes.narrow(-1, 0, hc) * scale.narrow(0, 0, 1) + base.narrow(0, 0, hc)) + HC_EPS
        post = 2.0 * torch.sigmoid(mixes.narrow(-1, hc, hc) * scale.narrow(0, 1, 1) + base.narrow(0, hc, hc))
        logits = (mixes.narrow(-1, 2 * hc, hc * hc) * scale.narrow(0, 2, 1)
                  + base.narrow(0, 2 * hc, hc * hc)).reshape(b, hc, hc)
        e = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        comb = e / e.sum(dim=-1, keepdim=True) + HC_EPS
        comb = comb / (comb.sum(dim=-2, keepdim=True) + HC_EPS)
        for _ in range(SINKHORN_ITERS - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + HC_EPS)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + HC_EPS)
        return pre, post, comb

    def hc_post(self, y, x, post, comb):
        """x'[:, k] = bf16(post[:, k] * y + sum_j comb[:, j, k] * x[:, j]) in fp32."""
        mixed = torch.matmul(comb.permute(0, 2, 1), x.to(F32))
        return (post.unsqueeze(-1) * y.unsqueeze(1).to(F32) + mixed).to(BF16)

    def hc_collapse(self, x, pre):
        """bf16(sum_j pre[:, j] * x[:, j]) in fp32."""
        return (pre.unsqueeze(-1).expand(x.shape).to(F32) * x.to(F32)).sum(dim=1).to(BF16)

    # ---- attention (spec 2.3-2.5) ----
    def index_selection(self, qr, h, keys, n_c, cos, sin):
        """The indexer (spec 2.4): top-k compressed rows [B, K] by fp32 index score, + W, -1 where not visible."""
        b, n = keys.shape[0], keys.shape[1]
        q = F.linear(qr, self.index_wq_b).reshape(b, self.index_heads, self.index_dim)
        q = fp4_round_trip(rope_tail(q, cos.unsqueeze(1), sin.unsqueeze(1)))
        w = F.linear(h.to(F32), self.index_weights_proj.to(F32)) * (self.index_dim ** -0.5 * self.index_heads ** -0.5)
        per_head = F.relu(torch.matmul(q.to(F32), keys.to(F32).permute(0, 2, 1)))
        s = (per_head * w.unsqueeze(-1).expand(per_head.shape)).sum(dim=1)
        rows = torch.arange(n, device=s.device).unsqueeze(0).expand(b, n)
        visible = rows < n_c.unsqueeze(1).expand(b, n)
        s = torch.where(visible, s, torch.full_like(s, -math.inf))
        picked = torch.topk(s, min(self.index_topk, n), dim=-1, sorted=False).indices
        picked = torch.sort(picked, dim=-1).values
        in_range = picked < n_c.unsqueeze(1).expand(picked.shape)
        return torch.where(in_range, picked + self.window, torch.full_like(picked, -1))

    def sparse_attention(self, q, kv_rows, idx):
        """o [B, H, hd] bf16: softmax with the per-head sink over the rows idx >= 0 of kv_rows (K = V), fp32."""
        b, n_idx, hd = idx.shape[0], idx.shape[1], self.head_dim
        rows = torch.gather(kv_rows, 1, torch.clamp(idx, min=0).unsqueeze(-1).expand(b, n_idx, hd)).to(F32)
        logits = torch.matmul(q.to(F32), rows.permute(0, 2, 1)) * hd ** -0.5
        valid = (idx >= 0).unsqueeze(1).expand(logits.shape)
        logits = torch.where(valid, logits, torch.full_like(logits, -math.inf))
        sink = self.attn_sink.reshape(1, self.heads).expand(b, self.heads)
        top = torch.maximum(logits.amax(dim=-1), sink)
        weights = torch.exp(logits - top.unsqueeze(-1))
        denominator = weights.sum(dim=-1) + torch.exp(sink - top)
        return (torch.matmul(weights, rows) / denominator.unsqueeze(-1)).to(BF16)

    def attention(self, h, positions, window_kv, compressed_kv, index_keys, n_c):
        """(y [B, D] bf16, the compressed top-k [B, K]) of the normalised input h [B, D]."""
        b, hd = h.shape[0], self.head_dim
        cos = torch.index_select(self.cos_table, 0, positions)
        sin = torch.index_select(self.sin_table, 0, positions)
        qkv = F.linear(fp8_round_trip(h), self.wqkv_a)
        qr = rms_norm(torch.narrow(qkv, -1, 0, self.q_rank), self.q_norm)
        kv = rms_norm(torch.narrow(qkv, -1, self.q_rank, hd), self.kv_norm)
        kv = fp8_round_trip(rope_tail(kv, cos, sin))
        qr = fp8_round_trip(qr)
        q = F.linear(qr, self.wq_b).reshape(b, self.heads, hd)
        q = rope_tail(q, cos.unsqueeze(1), sin.unsqueeze(1))
        idx = self.index_selection(qr, h, index_keys, n_c, cos, sin)
        slot = torch.remainder(positions, self.window).reshape(b, 1, 1).expand(b, 1, hd)
        ring = torch.scatter(window_kv, 1, slot, kv.reshape(b, 1, hd))
        slots = torch.arange(self.window, device=h.device).unsqueeze(0).expand(b, self.window)
        window_idx = torch.where(slots <= positions.unsqueeze(1).expand(b, self.window), slots, torch.full_like(slots, -1))
        o = self.sparse_attention(q, torch.cat([ring, compressed_kv], dim=1), torch.cat([window_idx, idx], dim=-1))
        o = rope_tail(o, cos.unsqueeze(1), sin.unsqueeze(1), inverse=True)
        per_group = self.heads // self.groups * hd
        o = o.reshape(b, self.groups, per_group).permute(1, 0, 2)
        wo_a = self.wo_a.reshape(self.groups, -1, per_group).permute(0, 2, 1)
        z = torch.matmul(o, wo_a).permute(1, 0, 2).reshape(b, -1)
        return F.linear(fp8_round_trip(z), self.wo_b), idx

    # ---- MoE (spec 2.6) ----
    def swiglu(self, gate_up):
        """silu(min(g, limit)) * clamp(u, -limit, limit) in fp32 of [..., 2I] = g | u (bf16)."""
        g = torch.clamp(torch.narrow(gate_up, -1, 0, self.inter).to(F32), max=SWIGLU_LIMIT)
        u = torch.clamp(torch.narrow(gate_up, -1, self.inter, self.inter).to(F32), min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
        return g * torch.sigmoid(g) * u

    def moe(self, h):
        """y [B, D] bf16: the routed experts (top-6 of 16, sqrt-softplus, noaux bias) + the shared expert. The pairs
        are sorted by expert; the sorted rows run under `_grouped_mm` by the counts' offsets (`grouped_experts`) or,
        where a grouped GEMM does not export, each under `matmul` with its expert's weights `index_select`ed."""
        b, k = h.shape[0], self.topk
        logits = F.linear(h.to(F32), self.gate.to(F32)) / GATE_TEMP
        scores = torch.sqrt(torch.where(logits > SOFTPLUS_THRESHOLD, logits, torch.log1p(torch.exp(logits))))
        ranked = torch.sort(scores + self.gate_bias.unsqueeze(0).expand(scores.shape), dim=-1, descending=True)
        expert_ids = ranked.indices.narrow(-1, 0, k)
        weights = torch.gather(scores, 1, expert_ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * ROUTE_SCALE

        flat_ids, flat_weights = expert_ids.reshape(-1), weights.reshape(-1)
        sorted_ids, order = torch.sort(flat_ids, stable=True)
        token = torch.div(order, k, rounding_mode="floor")
        row_weights = torch.gather(flat_weights, 0, order)
        hq = fp8_round_trip(h)
        rows = torch.index_select(hq, 0, token)
        if self.grouped_experts:
            offsets = torch.cumsum(F.one_hot(flat_ids, self.experts).sum(dim=0), dim=0).to(torch.int32)
            gate_up = torch._grouped_mm(rows, self.w13.permute(0, 2, 1), offs=offsets)
        else:
            gate_up = torch.matmul(rows.unsqueeze(1), torch.index_select(self.w13, 0, sorted_ids).permute(0, 2, 1))
            gate_up = gate_up.reshape(rows.shape[0], -1)
        act = fp8_round_trip((self.swiglu(gate_up) * row_weights.unsqueeze(-1)).to(BF16))
        if self.grouped_experts:
            out = torch._grouped_mm(act, self.w2.permute(0, 2, 1), offs=offsets)
        else:
            w2 = torch.index_select(self.w2, 0, sorted_ids).permute(0, 2, 1)
            out = torch.matmul(act.unsqueeze(1), w2).reshape(rows.shape[0], -1)

        shared_act = fp8_round_trip(self.swiglu(F.linear(hq, self.shared_w13)).to(BF16))
        shared = F.linear(shared_act, self.shared_w2)
        combined = torch.scatter_add(torch.zeros(b, self.dim, dtype=F32, device=h.device), 0,
                                     token.unsqueeze(-1).expand(out.shape), out.to(F32))
        return (combined + shared.to(F32)).to(BF16)

    def forward(self, x, pre_mix, positions, window_kv, compressed_kv, index_keys, n_c):
        pre_a, post_a, comb_a = self.hc_coefficients(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        h = rms_norm(self.hc_collapse(x, pre_mix), self.attn_norm)
        y, idx = self.attention(h, positions, window_kv, compressed_kv, index_keys, n_c)
        x = self.hc_post(y, x, post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_coefficients(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        h = rms_norm(self.hc_collapse(x, pre_a), self.ffn_norm)
        x = self.hc_post(self.moe(h), x, post_f, comb_f)
        return rms_norm(self.hc_collapse(x, pre_f), self.next_attn_norm), x, idx


def inputs(seed: int, block: ExportStyleBlock, b: int = 3, rows: int = 24):
    """(x, pre_mix, positions, window_kv, compressed_kv, index_keys, n_c) for b requests with `rows` compressed
    rows each; the requests see from fewer rows than the top-k (a window not yet full) to all of them."""
    g = torch.Generator().manual_seed(seed)
    hc, d, hd, w = block.hc, block.dim, block.head_dim, block.window
    x = torch.randn(b, hc, d, generator=g).to(BF16)
    pre_mix = torch.rand(b, hc, generator=g) + 0.1
    n_c = torch.tensor([rows, block.index_topk // 2, rows - 5][:b] if b > 1 else [rows - 3], dtype=torch.int64)
    positions = n_c - 1  # ratio 1: N_c = p + 1
    window_kv = torch.randn(b, w, hd, generator=g).to(BF16)
    compressed_kv = torch.randn(b, rows, hd, generator=g).to(BF16)
    index_keys = torch.randn(b, rows, block.index_dim, generator=g).to(BF16)
    return x, pre_mix, positions, window_kv, compressed_kv, index_keys, n_c
