"""A DeepSeek-V4.1 decode block (one ratio-1 index-source layer: attention with its indexer, then the MoE) written
from the spec alone, as an engineer of TensorRT-LLM's PyTorch backend would write it
(`tensorrt_llm/_torch/models/modeling_deepseekv3.py` habits), in plain torch (no `torch.ops`).

Habits: the model is a tree of modules (`Linear`, `RMSNorm`, `RotaryEmbedding`, `HyperConnection`, `Indexer`,
`DeepseekV41Attention`, `DeepseekV41Gate`, `GatedMLP`, `FusedMoE`, `DeepseekV41MoE`, the decoder layer); a `Linear`
holds one (possibly fused) weight `[out, in]` and quantises its input the way the FP8 block-scale path does
(DeepGEMM's per-token-group cast: amax floored at 1e-4, `ceil_to_ue8m0` = `2 ** ceil(log2(amax / 448))`, the values
multiplied by the scale's reciprocal and cast to float8_e4m3fn, then dequantised); the merged `fused_a` projection
(wq_a ; wkv) is split with `split([q_rank, head_dim], dim=-1)`; q/k are split into their nope and rope parts, the
rope part rotated out of place (interleaved pairs as `x[..., 0::2]` / `x[..., 1::2]`, `stack(...).flatten(-2)`,
from a `rotary_cos_sin` cache `[max_position, 2, rd / 2]` read by position) and concatenated back; the attention
sink is an extra logit column appended before the softmax and dropped after; the grouped `wo_a` is a `bmm` over
groups; mHC mixes are `bmm`s with the comb / pre matrices; the router (`DeepseekV41Gate`) returns
(topk_weights fp32, topk_ids int32); the MoE permutes the (token, k) rows by expert (`torch.sort` of the flattened
ids, as `moe_permute` does: `permuted_row_to_unpermuted_row` and its inverse), runs the experts on gathered weights
(`w3_w1_weight` = [w3 ; w1], up first, as TRT-LLM's fused MoE holds it, and `w2_weight`) with fp32 outputs, and the
finalize gathers each token's k rows back from their permuted positions, scales them by the routing weights (after
w2, as TRT-LLM's finalize does; spec 6.5 allows it) and adds the shared expert. Caches are contiguous per request
(`[B, rows, dim]`), the window ring written with `index_put_` at `position % window`; lengths (`kv_lens`) are int32.

Numerics are the spec's (sections 2.2-2.6, 2.9): bf16 activations, fp32 mHC (Sinkhorn: softmax + eps, one column
normalisation, then 19 row/column pairs), norms (eps 1e-20, fp32 interior, the weight multiplied in fp32, one rounding),
router (sqrt-softplus in fp32 on the fp32 cast of the bf16 gate weight, bias for selection only, divisor floor
1e-20, x1.5), SwiGLU clamped at 10 in fp32, expert GEMMs and combine in fp32, attention softmax in fp32 with the
sink; FP8 (per 32, ue8m0) round trips of every FP8 GEMM input and of the window KV (all head dims, after RoPE), FP4
(per 32, ue8m0, e2m1 half to even) round trip of the index queries; index scores in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .params import param_factory

RMS_EPS, HC_EPS, HC_SINKHORN_ITERS = 1e-20, 1e-6, 20
ROUTED_SCALING_FACTOR, SWIGLU_LIMIT, NORM_TOPK_EPS = 1.5, 10.0, 1e-20
FP8_MAX, FP8_AMAX_MIN, FP4_MAX, QUANT_GROUP = 448.0, 1e-4, 6.0, 32
ROPE_THETA, YARN_FACTOR, YARN_BETA_FAST, YARN_BETA_SLOW, YARN_ORIGINAL_MAX_POSITION = 160000.0, 16.0, 32, 1, 65536


# ---- fp8_utils-style quantisation helpers ----
def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, torch.ceil(torch.log2(x.abs())))


def per_token_group_cast_to_fp8(x: torch.Tensor, group_size: int = QUANT_GROUP):
    """(fp8 values [..., K], fp32 ue8m0 scales [..., K / group_size])."""
    x_view = x.view(*x.shape[:-1], -1, group_size)
    x_amax = x_view.abs().float().amax(dim=-1, keepdim=True).clamp(FP8_AMAX_MIN)
    sf = ceil_to_ue8m0(x_amax / FP8_MAX)
    return (x_view * (1.0 / sf)).to(torch.float8_e4m3fn).view(x.shape), sf.squeeze(-1)


def fp8_quant_dequant(x: torch.Tensor, group_size: int = QUANT_GROUP) -> torch.Tensor:
    x_fp8, sf = per_token_group_cast_to_fp8(x, group_size)
    out = x_fp8.view(*x.shape[:-1], -1, group_size).float() * sf.unsqueeze(-1)
    return out.view(x.shape).to(x.dtype)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """|v| <= 6 rounded to the nearest e2m1 magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6), ties to the even mantissa: the grid
    spacing is 0.5 below 2, 1 below 4 and 2 up to 6, and torch.round rounds half to even on the spacing's multiples."""
    a = v.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)


def fp4_quant_dequant(x: torch.Tensor, group_size: int = QUANT_GROUP) -> torch.Tensor:
    x_view = x.view(*x.shape[:-1], -1, group_size).float()
    x_amax = x_view.abs().amax(dim=-1, keepdim=True).clamp(FP4_MAX * 2.0**-126)
    sf = ceil_to_ue8m0(x_amax / FP4_MAX)
    q = round_to_e2m1((x_view * (1.0 / sf)).clamp(-FP4_MAX, FP4_MAX))
    return (q * sf).view(x.shape).to(x.dtype)


# ---- modules ----
class Linear(nn.Module):
    """y = x @ W^T with W [out, in] (the checkpoint's FP8 block-scale weight, held here dequantised in bf16); the input
    goes through the FP8 per-32 activation quantisation unless `quant_input` is off; `out_dtype` fp32 runs the GEMM
    with fp32 output (bf16 values, fp32 accumulation and result)."""

    def __init__(self, weight: nn.Parameter, quant_input: bool = True, out_dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = weight
        self.quant_input = quant_input
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_input:
            x = fp8_quant_dequant(x)
        if self.out_dtype == torch.float32:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float = RMS_EPS):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)


def yarn_inv_freq(rotary_dim: int) -> torch.Tensor:
    """The compress table's frequencies: theta 1.6e5 with YaRN (factor 16, beta_fast 32, beta_slow 1, original 65536),
    no mscale."""
    inv_freq = ROPE_THETA ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)

    def correction_dim(num_rotations):
        return rotary_dim * math.log(YARN_ORIGINAL_MAX_POSITION / (num_rotations * 2 * math.pi)) / (
            2 * math.log(ROPE_THETA))

    low = max(math.floor(correction_dim(YARN_BETA_FAST)), 0)
    high = min(math.ceil(correction_dim(YARN_BETA_SLOW)), rotary_dim - 1)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    smooth = 1 - ramp
    return inv_freq / YARN_FACTOR * (1 - smooth) + inv_freq * smooth


class RotaryEmbedding(nn.Module):
    """Interleaved (GPT-J, is_neox=False) RoPE from a [max_position, 2, rd / 2] (cos, sin) cache."""

    def __init__(self, rotary_dim: int, max_position: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), yarn_inv_freq(rotary_dim))
        self.register_buffer("rotary_cos_sin", torch.stack([freqs.cos(), freqs.sin()], dim=1), persistent=False)

    def cos_sin(self, position_ids: torch.Tensor):
        cos_sin = self.rotary_cos_sin[position_ids]
        return cos_sin[:, 0], cos_sin[:, 1]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [T, ..., rd]; cos / sin [T, rd / 2] fp32; the rotated x in x's dtype."""
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if inverse:
            sin = -sin
        xf = x.float()
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        return torch.stack((o1, o2), dim=-1).flatten(-2).to(x.dtype)


class HyperConnection(nn.Module):
    """mHC of one sublayer: its fn [(2 + hc) * hc, hc * D], base and scale (fp32)."""

    def __init__(self, fn, base, scale, hc: int):
        super().__init__()
        self.fn, self.base, self.scale, self.hc = fn, base, scale, hc

    def compute_mixes(self, hidden_states: torch.Tensor):
        """hidden_states [T, hc, D] bf16 -> (pre [T, hc], post [T, hc], comb [T, hc(source), hc(target)]), fp32."""
        hc = self.hc
        x = hidden_states.flatten(1).float()
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        mixes = F.linear(x, self.fn) * rstd
        pre, post, comb = mixes.split([hc, hc, hc * hc], dim=-1)
        pre = torch.sigmoid(pre * self.scale[0] + self.base[:hc]) + HC_EPS
        post = 2.0 * torch.sigmoid(post * self.scale[1] + self.base[hc:2 * hc])
        comb = comb.view(-1, hc, hc) * self.scale[2] + self.base[2 * hc:].view(hc, hc)
        comb = torch.softmax(comb, dim=-1) + HC_EPS
        comb = comb / (comb.sum(dim=-2, keepdim=True) + HC_EPS)
        for _ in range(HC_SINKHORN_ITERS - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + HC_EPS)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + HC_EPS)
        return pre, post, comb

    @staticmethod
    def post_mix(y: torch.Tensor, hidden_states: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        """X'_k = post_k * y + sum_j comb[j, k] * X_j, fp32, stored bf16."""
        mixed = torch.bmm(comb.transpose(1, 2), hidden_states.float())
        return (mixed + post.unsqueeze(-1) * y.float().unsqueeze(1)).to(hidden_states.dtype)

    @staticmethod
    def collapse(hidden_states: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """u = sum_j pre_j * X_j, fp32, stored bf16."""
        return torch.bmm(pre.unsqueeze(1), hidden_states.float()).squeeze(1).to(hidden_states.dtype)


class Indexer(nn.Module):
    def __init__(self, p, hidden_size, q_lora_rank, n_heads, head_dim, rope_dim, index_topk):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim, self.index_topk = n_heads, head_dim, rope_dim, index_topk
        self.wq_b = Linear(p(n_heads * head_dim, q_lora_rank))
        self.weights_proj = Linear(p(n_heads, hidden_size), quant_input=False)  # a bf16 weight
        self.weight_scale = head_dim**-0.5 * n_heads**-0.5

    def forward(self, qr, hidden_states, cos, sin, index_k_cache, kv_lens):
        """-> the selected compressed rows [T, index_topk], ascending, -1 where none."""
        num_tokens = qr.shape[0]
        q = self.wq_b(qr).view(num_tokens, self.n_heads, self.head_dim)
        q_nope, q_pe = q.split([self.head_dim - self.rope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, RotaryEmbedding.apply(q_pe, cos, sin)], dim=-1)
        q = fp4_quant_dequant(q)
        weights = self.weights_proj(hidden_states).float() * self.weight_scale  # [T, n_heads]
        logits = torch.bmm(q.float(), index_k_cache.float().transpose(1, 2))  # [T, n_heads, rows]
        index_scores = (logits.relu() * weights.unsqueeze(-1)).sum(dim=1)  # [T, rows]
        rows = torch.arange(index_scores.shape[-1], device=index_scores.device)
        index_scores = index_scores.masked_fill(rows.unsqueeze(0) >= kv_lens.unsqueeze(1), float("-inf"))
        topk_indices = torch.topk(index_scores, self.index_topk, dim=-1, sorted=False).indices
        topk_indices = torch.sort(topk_indices, dim=-1).values
        return torch.where(topk_indices < kv_lens.unsqueeze(1), topk_indices, -1)


class DeepseekV41Attention(nn.Module):
    def __init__(self, p, hidden_size, num_heads, head_dim, rope_dim, q_lora_rank, o_groups, o_lora_rank, window,
                 index_n_heads, index_head_dim, index_topk, max_position):
        super().__init__()
        self.num_heads, self.head_dim, self.rope_dim, self.q_lora_rank = num_heads, head_dim, rope_dim, q_lora_rank
        self.o_groups, self.o_lora_rank, self.window = o_groups, o_lora_rank, window
        self.softmax_scale = head_dim**-0.5
        self.fused_a = Linear(p(q_lora_rank + head_dim, hidden_size))  # [wq_a ; wkv]
        self.q_a_layernorm = RMSNorm(p(q_lora_rank, scale=0.1, mean=1.0))
        self.kv_a_layernorm = RMSNorm(p(head_dim, scale=0.1, mean=1.0))
        self.q_b_proj = Linear(p(num_heads * head_dim, q_lora_rank))
        self.attn_sink = p(num_heads, scale=1.0, dtype=torch.float32)
        # wo_a: block-diagonal per group, held [o_groups * o_lora_rank, heads / o_groups * head_dim], bf16, no act quant
        self.o_a_proj = p(o_groups * o_lora_rank, num_heads // o_groups * head_dim)
        self.o_proj = Linear(p(hidden_size, o_groups * o_lora_rank))
        self.rotary_emb = RotaryEmbedding(rope_dim, max_position)
        self.indexer = Indexer(p, hidden_size, q_lora_rank, index_n_heads, index_head_dim, rope_dim, index_topk)

    def rope_tail(self, x, cos, sin, inverse=False):
        nope, pe = x.split([self.head_dim - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([nope, RotaryEmbedding.apply(pe, cos, sin, inverse)], dim=-1)

    def sparse_attn_with_sink(self, q, kv_all, kv_indices):
        """q [T, H, hd] bf16, kv_all [T, window + rows, hd] bf16, kv_indices [T, N] (-1 = none) -> o [T, H, hd] bf16."""
        valid = kv_indices >= 0
        kv = torch.gather(kv_all, 1, kv_indices.clamp(min=0).unsqueeze(-1).expand(-1, -1, self.head_dim)).float()
        scores = torch.bmm(q.float(), kv.transpose(1, 2)) * self.softmax_scale  # [T, H, N]
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        sinks = self.attn_sink.view(1, -1, 1).expand(scores.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        return torch.bmm(probs, kv).to(q.dtype)

    def forward(self, position_ids, hidden_states, window_kv_cache, kv_cache, index_k_cache, kv_lens):
        num_tokens = hidden_states.shape[0]
        cos, sin = self.rotary_emb.cos_sin(position_ids)
        q, kv = self.fused_a(hidden_states).split([self.q_lora_rank, self.head_dim], dim=-1)
        qr = self.q_a_layernorm(q)
        kv = self.kv_a_layernorm(kv)
        q = self.rope_tail(self.q_b_proj(qr).view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        kv = fp8_quant_dequant(self.rope_tail(kv, cos, sin))
        batch_idx = torch.arange(num_tokens, device=position_ids.device)
        window_kv_cache.index_put_((batch_idx, position_ids % self.window), kv)

        topk_indices = self.indexer(qr, hidden_states, cos, sin, index_k_cache, kv_lens)
        slots = torch.arange(self.window, device=position_ids.device).unsqueeze(0)
        window_indices = torch.where(slots <= position_ids.unsqueeze(1), slots, -1)
        compressed_indices = torch.where(topk_indices >= 0, topk_indices + self.window, -1)
        kv_indices = torch.cat([window_indices, compressed_indices], dim=-1)
        o = self.sparse_attn_with_sink(q, torch.cat([window_kv_cache, kv_cache], dim=1), kv_indices)

        o = self.rope_tail(o, cos, sin, inverse=True)
        o = o.view(num_tokens, self.o_groups, -1).transpose(0, 1)  # [G, T, heads / G * hd]
        w = self.o_a_proj.view(self.o_groups, self.o_lora_rank, -1)
        z = torch.bmm(o, w.transpose(1, 2)).transpose(0, 1).reshape(num_tokens, -1)
        return self.o_proj(z), topk_indices


class DeepseekV41Gate(nn.Module):
    def __init__(self, p, hidden_size, num_experts, top_k):
        super().__init__()
        self.weight = p(num_experts, hidden_size)
        self.e_score_correction_bias = p(num_experts, scale=0.1, dtype=torch.float32)
        self.top_k = top_k

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.float(), self.weight.float())
        scores = torch.sqrt(F.softplus(logits))
        _, topk_indices = torch.topk(scores + self.e_score_correction_bias, k=self.top_k, dim=-1, sorted=False)
        topk_values = scores.gather(1, topk_indices)
        topk_values = topk_values / (topk_values.sum(dim=-1, keepdim=True) + NORM_TOPK_EPS) * ROUTED_SCALING_FACTOR
        return topk_values, topk_indices.to(torch.int32)


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate.clamp(max=SWIGLU_LIMIT)) * up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)


class GatedMLP(nn.Module):
    """The shared expert: gate_up_proj = [w1 ; w3], the clamped SwiGLU in fp32, down_proj, fp32 GEMM outputs."""

    def __init__(self, p, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = Linear(p(2 * intermediate_size, hidden_size), out_dtype=torch.float32)
        self.down_proj = Linear(p(hidden_size, intermediate_size), out_dtype=torch.float32)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(swiglu_clamped(gate, up).to(x.dtype))


class FusedMoE(nn.Module):
    def __init__(self, p, hidden_size, intermediate_size, num_experts, top_k):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.w3_w1_weight = p(num_experts, 2 * intermediate_size, hidden_size)  # [w3 ; w1] per expert
        self.w2_weight = p(num_experts, hidden_size, intermediate_size)

    def forward(self, x, token_final_scales, token_selected_experts, shared_output):
        num_tokens = x.shape[0]
        # moe_permute: the (token, k) rows sorted by expert
        sorted_experts, permuted_row_to_unpermuted_row = torch.sort(token_selected_experts.flatten(), stable=True)
        unpermuted_row_to_permuted_row = torch.argsort(permuted_row_to_unpermuted_row)
        permuted_x = fp8_quant_dequant(x).index_select(0, permuted_row_to_unpermuted_row // self.top_k)
        # the experts on their gathered weights, fp32 out
        w3_w1 = self.w3_w1_weight.index_select(0, sorted_experts).float()
        up, gate = torch.bmm(w3_w1, permuted_x.float().unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        act = fp8_quant_dequant(swiglu_clamped(gate, up).to(x.dtype))
        w2 = self.w2_weight.index_select(0, sorted_experts).float()
        fc2 = torch.bmm(w2, act.float().unsqueeze(-1)).squeeze(-1)  # [T * k, D] fp32
        # finalize: each token's k rows from their permuted positions, scaled, summed, + shared
        rows = fc2.index_select(0, unpermuted_row_to_permuted_row).view(num_tokens, self.top_k, -1)
        out = (rows * token_final_scales.unsqueeze(-1)).sum(dim=1) + shared_output
        return out.to(x.dtype)


class DeepseekV41MoE(nn.Module):
    def __init__(self, p, hidden_size, intermediate_size, num_experts, top_k):
        super().__init__()
        self.gate = DeepseekV41Gate(p, hidden_size, num_experts, top_k)
        self.experts = FusedMoE(p, hidden_size, intermediate_size, num_experts, top_k)
        self.shared_experts = GatedMLP(p, hidden_size, intermediate_size)

    def forward(self, hidden_states):
        token_final_scales, token_selected_experts = self.gate(hidden_states)
        shared_output = self.shared_experts(hidden_states)
        return self.experts(hidden_states, token_final_scales, token_selected_experts, shared_output)


class TrtllmStyleBlock(nn.Module):
    """One decode layer on T requests (one token each; sizes as the tiny model's). forward(hidden_states, pre_mix,
    position_ids, window_kv_cache, kv_cache, index_k_cache, kv_lens):

    hidden_states [T, hc, D] bf16 streams, pre_mix [T, hc] fp32 (the carried collapse weights), position_ids [T] int64,
    window_kv_cache [T, window, hd] bf16 (the ring, written in place), kv_cache [T, rows, hd] / index_k_cache
    [T, rows, index_hd] bf16 (the compressed KV and index keys), kv_lens [T] int32 (N_c)
    -> (h [T, D] bf16: the next layer's normalised input, hidden_states [T, hc, D] bf16 after the FFN post, the
    selected compressed rows [T, index_topk] int64, ascending, -1 where none)."""

    def __init__(self, seed: int = 0, dim=128, hc=4, heads=8, head_dim=64, rope_dim=16, q_rank=64, groups=2,
                 o_rank=32, window=8, index_heads=4, index_dim=32, index_topk=8, experts=16, topk=6, inter=64,
                 max_position=256):
        super().__init__()
        p = param_factory(seed)
        self.dim, self.hc, self.head_dim, self.window = dim, hc, head_dim, window
        self.index_dim, self.index_topk = index_dim, index_topk
        mix = (2 + hc) * hc
        self.attn_hc = HyperConnection(p(mix, hc * dim, dtype=torch.float32), p(mix, scale=0.5, dtype=torch.float32),
                                       p(3, scale=0.2, mean=1.0, dtype=torch.float32), hc)
        self.ffn_hc = HyperConnection(p(mix, hc * dim, dtype=torch.float32), p(mix, scale=0.5, dtype=torch.float32),
                                      p(3, scale=0.2, mean=1.0, dtype=torch.float32), hc)
        self.input_layernorm = RMSNorm(p(dim, scale=0.1, mean=1.0))
        self.post_attention_layernorm = RMSNorm(p(dim, scale=0.1, mean=1.0))
        self.next_layer_layernorm = RMSNorm(p(dim, scale=0.1, mean=1.0))
        self.self_attn = DeepseekV41Attention(p, dim, heads, head_dim, rope_dim, q_rank, groups, o_rank, window,
                                              index_heads, index_dim, index_topk, max_position)
        self.mlp = DeepseekV41MoE(p, dim, inter, experts, topk)

    def forward(self, hidden_states, pre_mix, position_ids, window_kv_cache, kv_cache, index_k_cache, kv_lens):
        pre_attn, post_attn, comb_attn = self.attn_hc.compute_mixes(hidden_states)
        h = self.input_layernorm(HyperConnection.collapse(hidden_states, pre_mix))
        attn_out, topk_indices = self.self_attn(position_ids, h, window_kv_cache, kv_cache, index_k_cache, kv_lens)
        hidden_states = HyperConnection.post_mix(attn_out, hidden_states, post_attn, comb_attn)

        pre_ffn, post_ffn, comb_ffn = self.ffn_hc.compute_mixes(hidden_states)
        h = self.post_attention_layernorm(HyperConnection.collapse(hidden_states, pre_attn))
        hidden_states = HyperConnection.post_mix(self.mlp(h), hidden_states, post_ffn, comb_ffn)
        return self.next_layer_layernorm(HyperConnection.collapse(hidden_states, pre_ffn)), hidden_states, topk_indices


def inputs(seed: int, block: TrtllmStyleBlock, b: int = 3, max_rows: int = 24):
    """(hidden_states, pre_mix, position_ids, window_kv_cache, kv_cache, index_k_cache, kv_lens) for b requests of up
    to `max_rows` compressed rows: the requests see from fewer rows than the top-k (and a window not yet full) to
    all of them; rows past a request's length hold stale values, as a reused cache does."""
    g = torch.Generator().manual_seed(seed)
    hc, d, hd, w = block.hc, block.dim, block.head_dim, block.window
    hidden_states = torch.randn(b, hc, d, generator=g).to(torch.bfloat16)
    pre_mix = torch.rand(b, hc, generator=g) + 0.1
    kv_lens = torch.tensor([max_rows, block.index_topk // 2, max_rows - 5][:b] if b > 1 else [max_rows - 3],
                           dtype=torch.int32)
    position_ids = kv_lens.long() - 1  # ratio 1: N_c = p + 1
    window_kv_cache = torch.randn(b, w, hd, generator=g).to(torch.bfloat16)
    kv_cache = torch.randn(b, max_rows, hd, generator=g).to(torch.bfloat16)
    index_k_cache = torch.randn(b, max_rows, block.index_dim, generator=g).to(torch.bfloat16)
    return hidden_states, pre_mix, position_ids, window_kv_cache, kv_cache, index_k_cache, kv_lens
