"""A tiny two-sublayer DeepSeek-V4.1 decode block written from the spec (/work/shared/spec/dsv41_decode.md §2) the
way a Megatron-Core / TransformerEngine port would write it (our own code, a seventh style beside the model and the
other blocks here), with the spellings those do not use:

- sequence-first activations `[S=1, B, ...]` (the unit dim first), `hidden.view(-1, D)` before the MoE;
- parallel-linear modules that return `(output, bias)` tuples (`q, _ = self.linear_q_up_proj(x)`), computing
  `F.linear(x, weight)` with `[out, in]` weights, the merged `linear_qkv_down_proj` split by `torch.split(sizes,
  dim=-1)`, the FP8 input step as a blockwise quantiser (`view(*shape[:-1], -1, 32)` blocks, in-place `clamp_`,
  `ceil_` and `mul_`);
- an `RMSNorm` module computing in fp32, `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`, then the
  weight multiplied in place (`mul_`, promoted to fp32) and `.to(dtype)`;
- the mHC coefficients at `[S, B, ...]` with `F.linear(...).mul_(rsqrt)`, the scales by `chunk(3)`, in-place
  `add_`/`mul_` on the gates, the Sinkhorn by in-place `div_`; the collapse by `torch.bmm` on `[S * B, 1, hc]` x
  `[S * B, hc, D]` views, the post by `torch.bmm` of the transposed comb plus `addcmul(..., post, y)`;
- RoPE as Megatron's `_apply_rotary_pos_emb_bshd` with `rotary_interleaved=True`: the angles `torch.outer`ed from
  the positions inside the step and repeated per pair by `torch.stack((f.view(-1, 1), f.view(-1, 1)), -1)`, cos
  and sin taken of the repeated angles, `_rotate_half` on the interleaved pairs by `x[..., ::2]` / `x[..., 1::2]`
  and `stack((-x2, x1), -1).view(...)`; the rotary part split off by `torch.split` (MLA's `q_pos_emb`); the inverse
  with the sin negated;
- the index scores by `torch.bmm` of `[B, ...]`-transposed views (`q.transpose(0, 1)`, `keys.transpose(1, 2)`),
  `relu_`, `mul_` by the head weights, visibility by `masked_fill_`, validity by `masked_fill_` of the offset ids;
- a `TopKRouter`: logits by `F.linear` in fp32, the score function, `torch.topk` on the biased scores, the probs
  gathered then normalised and scaled, the dense `routing_map` [T, E] built by `scatter`;
- the token permutation of Megatron-Core's `permute(tokens, indices)`: `torch.argsort(indices.view(-1),
  stable=True)`, tokens by `sorted_indices // topk` and `index_select`, `tokens_per_expert = routing_map.sum(0)`,
  the permuted probs by `torch.gather` on the flat probs;
- `torch._grouped_mm` experts on Megatron's `GroupedMLP` weights (flat parameters viewed `[E, D, 2I]` /
  `[E, I, D]`), a `swiglu` helper that `torch.chunk`s the fused fc1 output, the probs multiplied in before fc2
  (the weighted SwiGLU); the unpermute by `scatter_add_` into fp32 zeros, the shared expert (fused fc1 chunked too)
  added after.
Attention itself is reduced to q + kv (a single visible key, whose softmax weight is 1); its sites are the ones
around it.

forward(x [1, B, hc, D] bf16, pre_mix [1, B, hc] fp32, positions [B] int64, keys [B, N, ihd] bf16, n_c [B] int64)
  -> (h [1, B, D] bf16, x_new [1, B, hc, D] bf16, idx [1, B, k] int64)

Sites (each a fusion when the backend finds it): mhc_coeffs x2, qkv_norm, indexer_topk, wo_a, mhc_post_pre x2,
moe_route, moe_metadata, moe_experts, moe_finalize.

Measured when the block was written (fx mode, CPU, 3 requests): 3 of the 11 sites fused (indexer_topk, moe_route,
moe_finalize). The misses, and the general fixes that made them fuse:
- moe_experts: the swiglu's `torch.chunk(fc1.float(), 2, -1)` halves a value cast up, where the patterns cast the
  halves (near miss "expected convert_element_type, found slice"); now a widening cast that only slices read moves
  below them (`normalize._cast_after_slice`). Then GroupedMLP's flat weights viewed `[E, D, 2I]` stopped it
  ("expected permute, found view"): the matcher bound a weight stored transposed only when it was a graph input
  itself; now also a view of one (`matcher._view_of_input`), read in place.
- moe_metadata: `tokens_per_expert = routing_map.sum(dim=0)` ("expected scatter_add, found sum"); the column sums
  of a map scattered from top-k ids (distinct per row) are now the counts of the flat ids
  (`normalize._routing_map_counts`); then the probs by `torch.gather` on the flat probs, a 1-D gather, which is
  now the lookup `x[i]` (`normalize._gather_1d`).
- mhc_coeffs x2, mhc_post_pre x2, and qkv_norm and wo_a in part: the sequence-first layout. The graph inputs x
  [1, B, hc, D] and pre_mix [1, B, hc] put the unit dim first, and the normalisation sank only non-leading unit dims
  (it takes the leading dim for the token dim), so these regions ran at [1, B, ...] and `F.linear`'s view to
  [B, hc * D] stood between the fp32 cast and the GEMM ("expected convert_element_type, found view"). A leading
  unit dim cannot be told from the token dim by shape ([1, hc, D] at T = 1 is batch-first with one token); now,
  where the graph runs a linear layer on [1, B, K] activations (a view to [B, K], the mm, a view back to
  [1, B, N]: `normalize._seq_first_batches`), the leading unit of its [1, B, ...] inputs, GEMM outputs and
  values viewed so sinks as the others do, and the matcher binds such an input without it.
- qkv_norm, wo_a: Megatron's interleaved rotary repeats each angle by `stack((f.view(-1, 1), f.view(-1, 1)), -1)`
  and takes cos/sin of the repeated angles, which the GPT-J rule (a `repeat_interleave` of cos) did not read
  ("expected view, found add"). Now a cat of copies of one value is its repeat (`_copies_as_repeat`), cos, sin and
  neg of a repeat are the repeat of cos, sin and neg (`_pointwise_above_repeat`), and the pair repeat may be viewed
  into rows of any even length.
After: all 11 fused, qkv_norm with the window KV's FP8 step (`q_kv_norm_rope_fp8`), outputs equal to eager
(test_megatron_style.py).
`MaskedSelectDispatchBlock` keeps Megatron-Core's own `permute` by `masked_select` (data-dependent sizes): Dynamo
breaks the graph there; the router's note names the break, no graph has the metadata's sort, the experts and the
combine fuse after it, and the last graph (FFN post, collapse, final norm), which runs no linear layer, shows no
evidence of the sequence-first layout, so its mhc_post_pre site stays a near miss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .params import param_factory

EPS, HC_EPS, SINKHORN_ITERS, ROUTE_SCALE, SWIGLU_LIMIT, WINDOW, FP8_BLOCK = 1e-20, 1e-6, 20, 1.5, 10.0, 8, 32
T_SITES = {"mhc_coeffs": 2, "qkv_norm": 1, "indexer_topk": 1, "wo_a": 1, "mhc_post_pre": 2, "moe_route": 1,
           "moe_metadata": 1, "moe_experts": 1, "moe_finalize": 1}


def fp8_blockwise_qdq(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 e4m3 quantise-dequantise per block of 32 along the last dim, power-of-two scales (spec §2.3)."""
    shape = x.shape
    blocks = x.float().view(*shape[:-1], shape[-1] // block, block)
    amax = torch.amax(torch.abs(blocks), dim=-1, keepdim=True).clamp_(min=1e-4)
    scale = torch.exp2(torch.log2(amax / 448.0).ceil_())
    q = torch.clamp(blocks / scale, min=-448.0, max=448.0).to(torch.float8_e4m3fn)
    return q.to(torch.float32).mul_(scale).view(shape).to(x.dtype)


class ParallelLinear(nn.Module):
    """Megatron's Column/RowParallelLinear at TP = 1: forward returns (output, bias), bias None; the input FP8-rounded
    first where the layer runs an FP8 GEMM."""

    def __init__(self, p, input_size, output_size, fp8=False, dtype=torch.bfloat16):
        super().__init__()
        self.weight = p(output_size, input_size, dtype=dtype)
        self.fp8 = fp8

    def forward(self, x):
        if self.fp8:
            x = fp8_blockwise_qdq(x)
        return F.linear(x, self.weight), None


class RMSNorm(nn.Module):
    def __init__(self, weight, eps=EPS):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.mul_(self.weight).to(dtype)


def _rotate_half(x):
    """Megatron's `_rotate_half` with rotary_interleaved=True."""
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    x_new = torch.stack((-x2, x1), dim=-1)
    return x_new.view(*x_new.shape[:-2], -1)


def apply_rotary_pos_emb(t, freqs, inverse=False):
    """Megatron's `_apply_rotary_pos_emb_bshd` on t's trailing rd = freqs.shape[-1] dims, in fp32, back in t's dtype;
    t [S, B, ..., d], freqs [S, B, 1, rd] (each angle twice, interleaved)."""
    rot_dim = freqs.shape[-1]
    t_pass, t_rot = torch.split(t, [t.shape[-1] - rot_dim, rot_dim], dim=-1)
    t_rot = t_rot.float()
    if t_rot.dim() == 3:
        freqs = freqs.squeeze(2)
    cos_ = torch.cos(freqs).to(t_rot.dtype)
    sin_ = torch.sin(freqs).to(t_rot.dtype)
    if inverse:
        sin_ = -sin_
    t_rot = (t_rot * cos_) + (_rotate_half(t_rot) * sin_)
    return torch.cat((t_pass, t_rot.to(t.dtype)), dim=-1)


class RotaryEmbedding(nn.Module):
    """Megatron's RotaryEmbedding (rotary_interleaved=True) at the decode positions: [1, B, 1, rd] angles."""

    def __init__(self, rotary_dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions):
        freqs = torch.outer(positions.float(), self.inv_freq)
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[None, :, None, :]


class HyperConnection(nn.Module):
    """One mHC site (spec §2.2) at [S, B, ...]: coefficients, collapse, post."""

    def __init__(self, p, hc, hidden):
        super().__init__()
        self.hc = hc
        self.mapping_proj = p((2 + hc) * hc, hc * hidden, dtype=torch.float32)
        self.mapping_bias = p((2 + hc) * hc, scale=0.5, dtype=torch.float32)
        self.mapping_scale = p(3, scale=0.1, mean=1.0, dtype=torch.float32)

    def coefficients(self, hidden_states):
        """pre [S, B, hc], post [S, B, hc], comb [S, B, hc, hc] of hidden_states [S, B, hc, D]."""
        s, b, hc = hidden_states.shape[0], hidden_states.shape[1], self.hc
        x = hidden_states.flatten(2).float()
        mixes = F.linear(x, self.mapping_proj).mul_(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))
        m_pre, m_post, m_res = torch.split(mixes, [hc, hc, hc * hc], dim=-1)
        b_pre, b_post, b_res = torch.split(self.mapping_bias, [hc, hc, hc * hc], dim=-1)
        alpha_pre, alpha_post, alpha_res = self.mapping_scale.chunk(3)
        pre = torch.sigmoid(m_pre * alpha_pre + b_pre).add_(HC_EPS)
        post = torch.sigmoid(m_post * alpha_post + b_post).mul_(2.0)
        comb = torch.softmax((m_res * alpha_res + b_res).view(s, b, hc, hc), dim=-1).add_(HC_EPS)
        comb.div_(comb.sum(dim=-2, keepdim=True) + HC_EPS)
        for _ in range(SINKHORN_ITERS - 1):
            comb.div_(comb.sum(dim=-1, keepdim=True) + HC_EPS)
            comb.div_(comb.sum(dim=-2, keepdim=True) + HC_EPS)
        return pre, post, comb

    def collapse(self, hidden_states, pre):
        """sum_j pre_j x_j in fp32, rounded once: [S, B, hc, D], [S, B, hc] -> [S, B, D]."""
        s, b, hc, d = hidden_states.shape
        out = torch.bmm(pre.reshape(-1, 1, hc), hidden_states.reshape(-1, hc, d).float())
        return out.view(s, b, d).to(hidden_states.dtype)

    def post(self, output, hidden_states, post, comb):
        """x'_k = sum_j comb[j, k] x_j + post_k y in fp32, rounded once -> [S, B, hc, D]."""
        s, b, hc, d = hidden_states.shape
        mixed = torch.bmm(comb.reshape(-1, hc, hc).transpose(1, 2), hidden_states.reshape(-1, hc, d).float())
        mixed = torch.addcmul(mixed.view(s, b, hc, d), post.unsqueeze(-1), output.float().unsqueeze(-2))
        return mixed.to(hidden_states.dtype)


class TopKRouter(nn.Module):
    def __init__(self, p, hidden, num_experts, topk):
        super().__init__()
        self.topk = topk
        self.weight = p(num_experts, hidden)
        self.expert_bias = p(num_experts, scale=0.1, dtype=torch.float32)

    def forward(self, hidden):
        """(probs [T, k] fp32, routing map [T, E] bool, top indices [T, k])."""
        logits = F.linear(hidden.float(), self.weight.float())
        scores = torch.sqrt(F.softplus(logits))
        _, top_indices = torch.topk(scores + self.expert_bias, k=self.topk, dim=1)
        probs = torch.gather(scores, dim=1, index=top_indices).type_as(logits)
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        probs = probs * ROUTE_SCALE
        routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
        return probs, routing_map, top_indices


def swiglu(y):
    """The clamped SwiGLU of a fused fc1 output [.., 2I] in fp32."""
    y_1, y_2 = torch.chunk(y.float(), 2, dim=-1)
    return F.silu(y_1.clamp(max=SWIGLU_LIMIT)) * y_2.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)


class MegatronStyleBlock(nn.Module):
    def __init__(self, hidden=64, hc=4, q_lora=32, n_heads=4, head_dim=64, rope_dim=16, o_groups=2, o_rank=16,
                 num_experts=8, topk=2, ffn_hidden=32, index_heads=2, index_dim=32, index_topk=4, seed=0):
        super().__init__()
        p = param_factory(seed)
        self.hc, self.q_lora, self.n_heads, self.head_dim, self.rope_dim = hc, q_lora, n_heads, head_dim, rope_dim
        self.o_groups, self.o_rank, self.num_experts, self.topk, self.ffn_hidden = (
            o_groups, o_rank, num_experts, topk, ffn_hidden)
        self.index_heads, self.index_dim, self.index_topk = index_heads, index_dim, index_topk
        self.hc_attn, self.hc_ffn = HyperConnection(p, hc, hidden), HyperConnection(p, hc, hidden)
        self.input_layernorm, self.pre_mlp_layernorm, self.final_layernorm = (
            RMSNorm(p(hidden, scale=0.1, mean=1.0)) for _ in range(3))
        self.rotary_pos_emb = RotaryEmbedding(rope_dim)
        self.linear_qkv_down_proj = ParallelLinear(p, hidden, q_lora + head_dim, fp8=True)
        self.q_layernorm, self.kv_layernorm = RMSNorm(p(q_lora, scale=0.1, mean=1.0)), RMSNorm(p(head_dim, scale=0.1, mean=1.0))
        self.linear_q_up_proj = ParallelLinear(p, q_lora, n_heads * head_dim, fp8=True)
        self.linear_index_q = ParallelLinear(p, q_lora, index_heads * index_dim, fp8=True)
        self.linear_index_weights = ParallelLinear(p, hidden, index_heads)
        self.linear_o_down = ParallelLinear(p, n_heads // o_groups * head_dim, o_groups * o_rank)
        self.linear_proj = ParallelLinear(p, o_groups * o_rank, hidden, fp8=True)
        self.router = TopKRouter(p, hidden, num_experts, topk)
        # GroupedMLP's flat weights, viewed [E, D, 2I] / [E, I, D] for the grouped GEMMs
        self.weight1 = p(hidden, num_experts * 2 * ffn_hidden, scale=hidden ** -0.5)
        self.weight2 = p(num_experts * ffn_hidden, hidden, scale=ffn_hidden ** -0.5)
        self.shared_fc1 = ParallelLinear(p, hidden, 2 * ffn_hidden, fp8=True)
        self.shared_fc2 = ParallelLinear(p, ffn_hidden, hidden, fp8=True)

    def self_attention(self, hidden_states, rotary_pos_emb, keys, n_c):
        s, b, _ = hidden_states.shape
        qkv, _ = self.linear_qkv_down_proj(hidden_states)
        q_compressed, kv_compressed = torch.split(qkv, [self.q_lora, self.head_dim], dim=-1)
        q_compressed = self.q_layernorm(q_compressed)
        kv = fp8_blockwise_qdq(apply_rotary_pos_emb(self.kv_layernorm(kv_compressed), rotary_pos_emb))
        q, _ = self.linear_q_up_proj(q_compressed)
        q = apply_rotary_pos_emb(q.view(s, b, self.n_heads, self.head_dim), rotary_pos_emb)
        # the indexer (spec §2.4): scores in fp32 by bmm over the batch
        index_q, _ = self.linear_index_q(q_compressed)
        index_q = index_q.view(s, b, self.index_heads, self.index_dim).transpose(0, 1).reshape(b, -1, self.index_dim)
        index_w, _ = self.linear_index_weights(hidden_states)
        index_w = index_w.float() * (self.index_dim ** -0.5 * self.index_heads ** -0.5)
        logits = torch.bmm(index_q.float(), keys.float().transpose(1, 2)).view(b, s, self.index_heads, -1).relu_()
        index_scores = logits.mul_(index_w.transpose(0, 1).unsqueeze(-1)).sum(dim=2)
        invisible = torch.arange(keys.shape[1], device=keys.device).view(1, 1, -1) >= n_c.view(-1, 1, 1)
        index_scores.masked_fill_(invisible, float("-inf"))
        topk_indices = torch.topk(index_scores, min(self.index_topk, keys.shape[1]), dim=-1)[1]
        topk_indices, _ = torch.sort(topk_indices, dim=-1)
        idx = (topk_indices + WINDOW).masked_fill_(topk_indices >= n_c.view(-1, 1, 1), -1).transpose(0, 1)
        # core attention over one visible key (kv): every head reads kv; q added so the q path stays live
        core = q + kv.unsqueeze(2)
        core = apply_rotary_pos_emb(core, rotary_pos_emb, inverse=True)
        g = self.o_groups
        w = self.linear_o_down.weight.view(g, self.o_rank, -1)
        z = torch.bmm(core.reshape(s * b, g, -1).transpose(0, 1), w.transpose(1, 2))
        output, _ = self.linear_proj(z.transpose(0, 1).reshape(s, b, -1))
        return output, idx

    def permute(self, probs, routing_map, top_indices):
        """Megatron-Core's `permute(tokens, indices)`: (the token of each expert-sorted row, its prob)."""
        sorted_indices = torch.argsort(top_indices.view(-1), stable=True)
        return sorted_indices // self.topk, torch.gather(probs.view(-1), 0, sorted_indices)

    def mlp(self, hidden_states):
        s, b, d = hidden_states.shape
        hidden = hidden_states.view(-1, d)
        num_tokens, k, e = hidden.shape[0], self.topk, self.num_experts
        probs, routing_map, top_indices = self.router(hidden)
        tokens_per_expert = routing_map.sum(dim=0)
        token_ids, permuted_probs = self.permute(probs, routing_map, top_indices)
        permuted_input = fp8_blockwise_qdq(hidden).index_select(0, token_ids)
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        # GroupedMLP
        fc1 = torch._grouped_mm(permuted_input, self.weight1.view(e, d, -1), offs=offsets)
        intermediate = (swiglu(fc1) * permuted_probs.unsqueeze(-1)).to(hidden.dtype)
        fc2 = torch._grouped_mm(fp8_blockwise_qdq(intermediate), self.weight2.view(e, -1, d), offs=offsets)
        # unpermute into fp32 zeros, then the shared expert
        output = torch.zeros(num_tokens, d, dtype=torch.float32, device=hidden.device)
        output.scatter_add_(0, token_ids.unsqueeze(1).expand(-1, d), fc2.float())
        shared_fc1, _ = self.shared_fc1(hidden)
        shared, _ = self.shared_fc2(swiglu(shared_fc1).to(hidden.dtype))
        return (output + shared.float()).to(hidden.dtype).view(s, b, d)

    def forward(self, x, pre_mix, positions, keys, n_c):
        rotary_pos_emb = self.rotary_pos_emb(positions)
        pre_a, post_a, comb_a = self.hc_attn.coefficients(x)
        h = self.input_layernorm(self.hc_attn.collapse(x, pre_mix))
        y, idx = self.self_attention(h, rotary_pos_emb, keys, n_c)
        x = self.hc_attn.post(y, x, post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_ffn.coefficients(x)
        h = self.pre_mlp_layernorm(self.hc_ffn.collapse(x, pre_a))
        x = self.hc_ffn.post(self.mlp(h), x, post_f, comb_f)
        return self.final_layernorm(self.hc_ffn.collapse(x, pre_f)), x, idx


class MaskedSelectDispatchBlock(MegatronStyleBlock):
    """The block with Megatron-Core's `permute(tokens, routing_map)` as it is written: the rows by
    `token_indices.masked_select(routing_map.T)` and the probs of the dense [T, E] map by `masked_select` (data-
    dependent sizes, so Dynamo breaks the graph there)."""

    def permute(self, probs, routing_map, top_indices):
        num_tokens, num_experts = routing_map.shape
        routing_map = routing_map.T.contiguous()
        token_indices = torch.arange(num_tokens, device=probs.device).unsqueeze(0).expand(num_experts, -1)
        routing_probs = torch.zeros(num_tokens, num_experts, device=probs.device).scatter(1, top_indices, probs)
        return token_indices.masked_select(routing_map), routing_probs.T.contiguous().masked_select(routing_map)
