"""A DeepSeek-V4.1 decode block (one ratio-1 index-source layer: attention with its indexer, then the MoE) written
from the spec alone, as a serving engine's model runner holds and runs it (vLLM / SGLang habits).

Habits: the KV caches are paged pools `[num_blocks, block_size, dim]` that the runner owns and hands to the layer;
a request's rows are addressed through its block table (`[B, max_blocks]` int32, unused entries padded with page 0),
the window ring's write through a host-computed slot mapping (`[B]` int64) with `index_copy_` into the flattened
pool; the indexer gathers each request's index keys through the block table, scores them, takes the top-k and
translates the selected rows through the block table into pool slots (`page * block_size + offset`, -1 where none);
the sparse attention gathers its rows from the flattened pools by slot. Serving weight layouts are merged
(`fused_qkv_a_proj` = wq_a ; wkv, `w13` = w1 ; w3 per expert, the shared expert's `gate_up_proj`); the router weight
is cast to fp32 once at load time and cached (`router_weight_fp32`, a buffer: the spec allows a cached cast); RoPE
reads a `cos_sin_cache` `[max_position, rd]` (cos | sin) by position and rotates the interleaved pairs as strided
slices, written back into the tensor's tail in place; activation quantisation is the engine's group quant (fp8
values and ue8m0 scales as the IEEE exponent rounded up by integer ops) followed by its dequantisation; lengths are
int32, expert ids int32 after the top-k, counts a `scatter_add_` of ones; outputs are preallocated where an engine
preallocates them (the attention output, the top-k buffers, the combine buffer filled by `index_add_`).

Numerics are the spec's (sections 2.2-2.6, 2.9): bf16 activations, fp32 mHC, norms (eps 1e-20, one rounding),
router (sqrt-softplus, bias for selection only, divisor floor 1e-20, x1.5), SwiGLU (clamped at 10), combine and
attention softmax with the sink, FP8 (per 32, power-of-two scale, amax floor 1e-4) round trips of every GEMM input
and the window KV, FP4 (per 32, power-of-two scale, e2m1 half to even) round trip of the index queries; index scores
in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .params import param_factory

BF16, F32, I32, I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
RMS_EPS, HC_EPS, SINKHORN_ITERS = 1e-20, 1e-6, 20
ROUTED_SCALING, SWIGLU_LIMIT, TOPK_FLOOR = 1.5, 10.0, 1e-20
FP8_MAX, FP8_AMAX_FLOOR, FP4_MAX, GROUP = 448.0, 1e-4, 6.0, 32
# e2m1 magnitudes and the decision boundaries between neighbours; a value on a boundary rounds to the neighbour
# whose mantissa bit is even: down at 0.25, 1.25, 2.5, 5 (bucketize's right=False puts it in the lower bucket),
# up at 0.75, 1.75, 3.5 (those boundaries are moved one fp32 ulp down, so the value lies above them)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TIES_UP = (0.75, 1.75, 3.5)
E2M1_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def ue8m0_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(v)) of positive normal fp32 v, from its bits: the biased exponent, plus one where the mantissa
    is not zero, shifted back into an otherwise empty fp32."""
    bits = v.view(I32)
    exponent = torch.bitwise_and(bits >> 23, 0xFF) + (torch.bitwise_and(bits, 0x7FFFFF) != 0).to(I32)
    return (exponent << 23).view(F32)


def per_token_group_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 values [..., K], fp32 ue8m0 scales [..., K / 32]): per group of 32 along K,
    s = ue8m0_ceil(max(amax, 1e-4) / 448), q = e4m3(clamp(x / s, +-448)) (spec 2.3 act_quant)."""
    groups = x.float().unflatten(-1, (-1, GROUP))
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    scale = ue8m0_ceil(amax / FP8_MAX)
    q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale.squeeze(-1)


def dequant_fp8(q: torch.Tensor, scale: torch.Tensor, dtype=BF16) -> torch.Tensor:
    """The group quant's values times their scales, in fp32, rounded to `dtype`."""
    return (q.float().unflatten(-1, (-1, GROUP)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def fp8_act(x: torch.Tensor) -> torch.Tensor:
    """x through the engine's FP8 activation quantisation and back, in x's dtype."""
    return dequant_fp8(*per_token_group_quant_fp8(x), dtype=x.dtype)


def fp4_act(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] through e2m1 per group of 32 and back (spec 2.3 fp4_act_quant, ue8m0 scales): s =
    ue8m0_ceil(max(amax, 6 * 2^-126) / 6), x <- e2m1_rne(clamp(x / s, +-6)) * s; the magnitude is looked up in the
    e2m1 grid by its bucket among the decision boundaries."""
    groups = x.float().unflatten(-1, (-1, GROUP))
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-126)
    scale = ue8m0_ceil(amax / FP4_MAX)
    v = (groups / scale).clamp(-FP4_MAX, FP4_MAX)
    boundaries = torch.tensor(E2M1_BOUNDARIES, dtype=F32, device=x.device)
    ties_up = torch.isin(boundaries, torch.tensor(E2M1_TIES_UP, dtype=F32, device=x.device))
    boundaries = torch.where(ties_up, torch.nextafter(boundaries, torch.zeros_like(boundaries)), boundaries)
    magnitude = torch.tensor(E2M1_VALUES, dtype=F32, device=x.device)[torch.bucketize(v.abs(), boundaries)]
    return (torch.copysign(magnitude, v) * scale).flatten(-2).to(x.dtype)


class RMSNorm(nn.Module):
    """The engine's RMSNorm.forward_native with the spec's rounding: fp32 interior, fp32 weight, one bf16 rounding."""

    def __init__(self, weight: nn.Parameter, eps: float = RMS_EPS):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        x = x.float()
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return (x * self.weight.float()).to(orig_dtype)


def rotate_interleaved_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The last rd = 2 * cos.shape[-1] dims of x rotated in place as adjacent pairs (x[2i], x[2i+1]) by the angle
    whose cos / sin broadcast against [..., rd/2] (pass -sin for the inverse rotation), in fp32, stored in x's
    dtype: the engine's native rotary path on a `[..., rope]` view, written back with `copy_`."""
    rd = 2 * cos.shape[-1]
    pe = x[..., x.shape[-1] - rd:]
    x1, x2 = pe[..., 0::2].float(), pe[..., 1::2].float()
    pe.copy_(torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2))


def yarn_cos_sin_cache(rd: int, max_position: int) -> torch.Tensor:
    """[max_position, rd] fp32: cos | sin of p * f_i for the compress table (spec 2.3: theta 1.6e5, YaRN factor 16,
    beta 32 / 1, original 65536, no mscale)."""
    theta, factor, original = 160000.0, 16.0, 65536
    inv_freq = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)

    def correction_dim(rotations):
        return rd * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(32)), 0)
    high = min(math.ceil(correction_dim(1)), rd - 1)
    ramp = ((torch.arange(rd // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
    keep = 1.0 - ramp
    inv_freq = (inv_freq / factor * (1 - keep) + inv_freq * keep).float()
    freqs = torch.outer(torch.arange(max_position, dtype=F32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class PagedStyleBlock(nn.Module):
    """One decode layer on B requests (sizes as the tiny model's). forward(hidden, pre_mix, positions, slot_mapping,
    window_pool, window_block_table, kv_pool, index_pool, block_table, compressed_lens):

    hidden [B, hc, D] bf16 streams, pre_mix [B, hc] fp32 (the carried collapse weights), positions [B] int64,
    slot_mapping [B] int64 (the window pool slot of each request's ring row p mod W), window_pool
    [num_window_blocks, bs, hd] bf16 (written in place), window_block_table [B, W / bs] int32, kv_pool / index_pool
    [num_blocks, bs, hd] / [num_blocks, bs, ihd] bf16 (the compressed KV and index keys), block_table [B, max_blocks]
    int32, compressed_lens [B] int32 (N_c)
    -> (h [B, D] bf16: the next layer's normalised input, hidden [B, hc, D] bf16 after the FFN post, the selected
    compressed rows' kv_pool slots [B, K] int64, ascending in row order, -1 where none)."""

    def __init__(self, seed: int = 0, dim=128, hc=4, heads=8, head_dim=64, rope_dim=16, q_rank=64, groups=2,
                 o_rank=32, window=8, block_size=4, index_heads=4, index_dim=32, index_topk=8, experts=16, topk=6,
                 inter=64, max_position=256):
        super().__init__()
        p = param_factory(seed)
        self.dim, self.hc, self.heads, self.head_dim, self.rope_dim = dim, hc, heads, head_dim, rope_dim
        self.q_rank, self.groups, self.o_rank, self.window, self.block_size = q_rank, groups, o_rank, window, block_size
        self.index_heads, self.index_dim, self.index_topk = index_heads, index_dim, index_topk
        self.experts, self.topk, self.inter = experts, topk, inter
        mix = (2 + hc) * hc
        # mHC parameters as the checkpoint names them, fp32
        self.hc_attn_fn, self.hc_ffn_fn = p(mix, hc * dim, dtype=F32), p(mix, hc * dim, dtype=F32)
        self.hc_attn_base, self.hc_ffn_base = p(mix, scale=0.5, dtype=F32), p(mix, scale=0.5, dtype=F32)
        self.hc_attn_scale = p(3, scale=0.2, mean=1.0, dtype=F32)
        self.hc_ffn_scale = p(3, scale=0.2, mean=1.0, dtype=F32)
        self.input_layernorm = RMSNorm(p(dim, scale=0.1, mean=1.0))
        self.post_attention_layernorm = RMSNorm(p(dim, scale=0.1, mean=1.0))
        self.next_input_layernorm = RMSNorm(p(dim, scale=0.1, mean=1.0))
        # attention: wq_a and wkv merged into one serving GEMM
        self.fused_qkv_a_proj = p(q_rank + head_dim, dim)
        self.q_a_layernorm = RMSNorm(p(q_rank, scale=0.1, mean=1.0))
        self.kv_a_layernorm = RMSNorm(p(head_dim, scale=0.1, mean=1.0))
        self.q_b_proj = p(heads * head_dim, q_rank)
        self.attn_sink = p(heads, scale=1.0, dtype=F32)
        self.wo_a = p(groups * o_rank, heads // groups * head_dim)
        self.o_proj = p(dim, groups * o_rank)
        self.indexer_wq_b = p(index_heads * index_dim, q_rank)
        self.indexer_weights_proj = p(index_heads, dim)
        # MoE: the router weight loaded in bf16, cached in fp32 for the fp32 router GEMM
        self.register_buffer("router_weight_fp32", p(experts, dim).detach().float(), persistent=False)
        self.e_score_correction_bias = p(experts, scale=0.1, dtype=F32)
        self.w13 = p(experts, 2 * inter, dim)
        self.w2 = p(experts, dim, inter)
        self.shared_gate_up_proj = p(2 * inter, dim)
        self.shared_down_proj = p(dim, inter)
        self.register_buffer("cos_sin_cache", yarn_cos_sin_cache(rope_dim, max_position), persistent=False)

    # ---- mHC (spec 2.2) ----
    def hc_pre(self, hidden, fn, base, scale):
        """(pre [B, hc], post [B, hc], comb [B, hc, hc]) fp32 of the streams hidden [B, hc, D]."""
        hc = self.hc
        flat = hidden.flatten(1).float()
        rstd = torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + RMS_EPS)
        mixes = F.linear(flat, fn) * rstd
        pre_logits, post_logits, comb_logits = torch.split(mixes, [hc, hc, hc * hc], dim=-1)
        pre_base, post_base, comb_base = torch.split(base, [hc, hc, hc * hc])
        pre = torch.sigmoid(pre_logits * scale[0] + pre_base) + HC_EPS
        post = 2 * torch.sigmoid(post_logits * scale[1] + post_base)
        comb = torch.softmax((comb_logits * scale[2] + comb_base).view(-1, hc, hc), dim=-1) + HC_EPS
        comb = comb / (comb.sum(dim=1, keepdim=True) + HC_EPS)
        for _ in range(SINKHORN_ITERS - 1):
            comb = comb / (comb.sum(dim=2, keepdim=True) + HC_EPS)
            comb = comb / (comb.sum(dim=1, keepdim=True) + HC_EPS)
        return pre, post, comb

    @staticmethod
    def hc_post(y, hidden, post, comb):
        """hidden'[:, k] = bf16(post[:, k] * y + sum_j comb[:, j, k] * hidden[:, j]), fp32 inside."""
        return (torch.einsum("bjk,bjd->bkd", comb, hidden.float()) + post[:, :, None] * y[:, None, :].float()).to(BF16)

    @staticmethod
    def hc_collapse(hidden, pre):
        """bf16(sum_j pre[:, j] * hidden[:, j]), fp32 inside."""
        return (pre[:, :, None] * hidden.float()).sum(dim=1).to(BF16)

    # ---- attention (spec 2.3-2.5) ----
    def indexer(self, qr, h, cos, sin, index_pool, block_table, compressed_lens):
        """The selected compressed rows' kv_pool slots [B, K] int64 (K = min(topk, rows in the table)), ascending in
        row order, -1 where the row is not visible: scores s[t] = sum_h w_h relu(q_h . k_t) in fp32 over the
        request's index keys gathered through the block table, -inf for t >= N_c; the top-K rows sorted; each row
        t -> block_table[b, t // bs] * bs + t % bs."""
        b, bs = qr.shape[0], self.block_size
        q = F.linear(fp8_act(qr), self.indexer_wq_b).view(b, self.index_heads, self.index_dim)
        rotate_interleaved_(q, cos[:, None], sin[:, None])
        q = fp4_act(q)
        weights = F.linear(h, self.indexer_weights_proj).float() * (self.index_dim ** -0.5 * self.index_heads ** -0.5)
        keys = index_pool[block_table].flatten(1, 2)  # [B, max_blocks * bs, ihd]
        logits = torch.einsum("bhd,btd->bht", q.float(), keys.float()).relu_()
        scores = (logits * weights[:, :, None]).sum(dim=1)
        row = torch.arange(keys.shape[1], device=qr.device)
        scores.masked_fill_(row[None, :] >= compressed_lens[:, None], float("-inf"))
        selected = scores.topk(min(self.index_topk, keys.shape[1]), dim=-1, sorted=False).indices
        selected, _ = selected.sort(dim=-1)
        pages = block_table.gather(1, selected // bs).long()
        slots = pages * bs + selected % bs
        return slots.masked_fill_(selected >= compressed_lens[:, None], -1)

    def sparse_attention(self, q, window_pool, window_block_table, kv_pool, positions, slots):
        """o [B, H, hd] bf16: softmax with the per-head sink over the request's window ring rows (ring slot j
        visible where j <= p) and its selected compressed rows (slot >= 0), K = V, fp32 inside."""
        bs, hd = self.block_size, self.head_dim
        ring = torch.arange(bs, device=q.device)
        window_slots = (window_block_table.long()[:, :, None] * bs + ring).flatten(1)  # [B, W] in ring order
        window_valid = torch.arange(self.window, device=q.device)[None, :] <= positions[:, None]
        window_rows = window_pool.view(-1, hd)[window_slots]
        compressed_rows = kv_pool.view(-1, hd)[slots.clamp(min=0)]
        kv = torch.cat((window_rows, compressed_rows), dim=1).float()
        valid = torch.cat((window_valid, slots >= 0), dim=1)
        logits = torch.einsum("bhd,bnd->bhn", q.float(), kv) * hd ** -0.5
        logits.masked_fill_(~valid[:, None, :], float("-inf"))
        row_max = torch.maximum(logits.amax(dim=-1), self.attn_sink[None, :])
        probs = torch.exp(logits - row_max[..., None])
        denominator = probs.sum(dim=-1) + torch.exp(self.attn_sink[None, :] - row_max)
        output = torch.empty(q.shape, dtype=BF16, device=q.device)
        output.copy_(torch.einsum("bhn,bnd->bhd", probs, kv) / denominator[..., None])
        return output

    def attention(self, h, positions, slot_mapping, window_pool, window_block_table, kv_pool, index_pool,
                  block_table, compressed_lens):
        """(y [B, D] bf16, the selected compressed slots [B, K]) of the normalised input h [B, D]; writes this
        step's window row into window_pool at slot_mapping."""
        b, hd, rd = h.shape[0], self.head_dim, self.rope_dim
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        qkv_a = F.linear(fp8_act(h), self.fused_qkv_a_proj)
        q_c, kv = qkv_a.split([self.q_rank, hd], dim=-1)
        qr = self.q_a_layernorm(q_c)
        kv = self.kv_a_layernorm(kv)
        rotate_interleaved_(kv, cos, sin)
        kv = fp8_act(kv)
        window_pool.view(-1, hd).index_copy_(0, slot_mapping, kv)
        q = F.linear(fp8_act(qr), self.q_b_proj).view(b, self.heads, hd)
        rotate_interleaved_(q, cos[:, None], sin[:, None])
        slots = self.indexer(qr, h, cos, sin, index_pool, block_table, compressed_lens)
        o = self.sparse_attention(q, window_pool, window_block_table, kv_pool, positions, slots)
        rotate_interleaved_(o, cos[:, None], -sin[:, None])
        per_group = self.heads // self.groups * hd
        o_grouped = o.view(b, self.groups, per_group).transpose(0, 1)  # [G, B, per_group]
        z = torch.bmm(o_grouped, self.wo_a.view(self.groups, self.o_rank, per_group).transpose(1, 2))
        z = z.transpose(0, 1).reshape(b, self.groups * self.o_rank)
        return F.linear(fp8_act(z), self.o_proj), slots

    # ---- MoE (spec 2.6) ----
    @staticmethod
    def swiglu(gate_up):
        """silu(min(g, 10)) * clamp(u, -10, 10) in fp32 of [..., 2I] = g | u."""
        gate, up = gate_up.float().chunk(2, dim=-1)
        return F.silu(gate.clamp(max=SWIGLU_LIMIT)) * up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)

    def select_experts(self, h):
        """(topk_weights [B, k] fp32, topk_ids [B, k] int32) into preallocated buffers: sqrt-softplus scores of the
        fp32 router GEMM on the cached fp32 weight, top-k of scores + bias, the scores' renormalised weights x 1.5."""
        b, k = h.shape[0], self.topk
        topk_weights = torch.empty(b, k, dtype=F32, device=h.device)
        topk_ids = torch.empty(b, k, dtype=I32, device=h.device)
        router_logits = F.linear(h.float(), self.router_weight_fp32)
        scores = F.softplus(router_logits).sqrt()
        _, ids = torch.topk(scores + self.e_score_correction_bias, k, dim=-1)
        weights = scores.gather(1, ids)
        topk_weights.copy_(weights / (weights.sum(dim=-1, keepdim=True) + TOPK_FLOOR) * ROUTED_SCALING)
        topk_ids.copy_(ids)
        return topk_weights, topk_ids

    def fused_experts(self, h, topk_weights, topk_ids):
        """sum_k w[t, k] W2_e(bf16(w * swiglu(W13_e fp8(h_t)))) over the pairs sorted by expert, under
        `_grouped_mm` by the counts' offsets, combined into a preallocated fp32 buffer with `index_add_`."""
        b, k = h.shape[0], self.topk
        flat_ids = topk_ids.flatten()
        sorted_ids, order = flat_ids.sort(stable=True)
        token_of_row = order // k
        counts = torch.zeros(self.experts, dtype=I32, device=h.device)
        counts.scatter_add_(0, flat_ids.long(), torch.ones_like(flat_ids))
        offsets = counts.cumsum(0, dtype=I32)
        rows = fp8_act(h)[token_of_row]
        gate_up = torch._grouped_mm(rows, self.w13.transpose(1, 2), offs=offsets)
        act = (self.swiglu(gate_up) * topk_weights.flatten()[order][:, None]).to(BF16)
        down = torch._grouped_mm(fp8_act(act), self.w2.transpose(1, 2), offs=offsets)
        out = torch.zeros(b, self.dim, dtype=F32, device=h.device)
        out.index_add_(0, token_of_row, down.float())
        return out

    def moe(self, h):
        """y [B, D] bf16: the routed experts + the shared expert, summed in fp32."""
        topk_weights, topk_ids = self.select_experts(h)
        routed = self.fused_experts(h, topk_weights, topk_ids)
        shared = F.linear(fp8_act(self.swiglu(F.linear(fp8_act(h), self.shared_gate_up_proj)).to(BF16)),
                          self.shared_down_proj)
        return (routed + shared.float()).to(BF16)

    def forward(self, hidden, pre_mix, positions, slot_mapping, window_pool, window_block_table, kv_pool, index_pool,
                block_table, compressed_lens):
        pre_a, post_a, comb_a = self.hc_pre(hidden, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        h = self.input_layernorm(self.hc_collapse(hidden, pre_mix))
        y, slots = self.attention(h, positions, slot_mapping, window_pool, window_block_table, kv_pool, index_pool,
                                  block_table, compressed_lens)
        hidden = self.hc_post(y, hidden, post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_pre(hidden, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        h = self.post_attention_layernorm(self.hc_collapse(hidden, pre_a))
        hidden = self.hc_post(self.moe(h), hidden, post_f, comb_f)
        return self.next_input_layernorm(self.hc_collapse(hidden, pre_f)), hidden, slots


def inputs(seed: int, block: PagedStyleBlock, b: int = 3, max_rows: int = 24):
    """(hidden, pre_mix, positions, slot_mapping, window_pool, window_block_table, kv_pool, index_pool, block_table,
    compressed_lens) for b requests of up to `max_rows` compressed rows (a table of max_rows / bs blocks each): the
    requests see from fewer rows than the top-k to all of them; their pages are a random permutation of the pools'
    (one spare page besides), the table's entries past a request's rows padded with page 0, as engines pad them."""
    g = torch.Generator().manual_seed(seed)
    hc, d, hd, w, bs = block.hc, block.dim, block.head_dim, block.window, block.block_size
    hidden = torch.randn(b, hc, d, generator=g).to(BF16)
    pre_mix = torch.rand(b, hc, generator=g) + 0.1
    compressed_lens = torch.tensor([max_rows, block.index_topk // 2, max_rows - 5][:b] if b > 1 else [max_rows - 3],
                                   dtype=I32)
    positions = compressed_lens.long() - 1  # ratio 1: N_c = p + 1

    window_pages = w // bs
    window_block_table = torch.randperm(b * window_pages + 1, generator=g)[: b * window_pages].view(b, window_pages)
    ring_slot = positions % w
    slot_mapping = window_block_table.gather(1, (ring_slot // bs)[:, None]).squeeze(1) * bs + ring_slot % bs
    window_pool = torch.randn(b * window_pages + 1, bs, hd, generator=g).to(BF16)

    max_blocks = max_rows // bs
    num_blocks = b * max_blocks + 1
    block_table = torch.randperm(num_blocks, generator=g)[: b * max_blocks].view(b, max_blocks)
    used = torch.arange(max_blocks)[None, :] < ((compressed_lens.long() + bs - 1) // bs)[:, None]
    block_table = torch.where(used, block_table, 0)
    kv_pool = torch.randn(num_blocks, bs, hd, generator=g).to(BF16)
    index_pool = torch.randn(num_blocks, bs, block.index_dim, generator=g).to(BF16)
    return (hidden, pre_mix, positions, slot_mapping, window_pool, window_block_table.to(I32), kv_pool, index_pool,
            block_table.to(I32), compressed_lens)
