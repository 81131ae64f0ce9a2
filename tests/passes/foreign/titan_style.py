"""A tiny two-sublayer DeepSeek-V4.1 decode block written from the spec (/work/shared/spec/dsv41_decode.md §2) the
way a TorchTitan port would write it (our own code in the habits of `torchtitan/models/moe.py` and its DeepSeek-V3
model), with the spellings the other blocks here do not use:

- `[bsz, seqlen, ...]` activations with seqlen = 1, a `ModelArgs` dataclass, a module per component, `nn.Linear`
  projections and `nn.RMSNorm` modules (torch's RMSNorm computes in fp32, multiplies the weight in fp32 and
  rounds once: the spec's), `nn.RMSNorm(elementwise_affine=False)` as the mHC statistic before its linear;
- linear layers converted to FP8 as a model converter would (`Float8Linear`, an `nn.Linear` whose forward fake-
  quantises its input per call, blocks of 32 by `unflatten`, an `exp2` power-of-two scale);
- RoPE as titan's DeepSeek-V3: a `precompute_freqs_cis` complex64 table by `torch.polar`, indexed by the positions,
  `apply_rotary_emb` by `view_as_complex` / `view_as_real(...).flatten(3)`, the rotary part split off by
  `torch.split([nope, rope])` and joined back by `torch.cat`; the inverse by `freqs_cis.conj()`;
- the index scores by `matmul` of `[B, 1, H, d]` q against `[B, 1, d, N]` keys, an attention mask "True = attend"
  applied by `masked_fill(~mask, -inf)`, `topk(sorted=False)`, validity by `torch.where`;
- the MoE as titan's `MoE`: a `TokenChoiceTopKRouter` (gate `nn.Linear`, the spec's sqrt-softplus score function,
  `torch.topk(scores + expert_bias, k, dim=1)`, `scores.gather`, `route_norm` then `route_scale`), a
  `TokenReorderer` (`num_tokens_per_expert = torch.histc(ids.view(-1), bins=E, min=0, max=E)` on the ids cast to
  float, `argsort(ids.view(-1), stable=True)`, the scores by `view(-1)[order]`, `order // top_k`), the routed input
  by `torch.gather(x, 0, index.reshape(-1, 1).expand(-1, dim))`, `GroupedExperts` with separate `w1`, `w2`, `w3`
  parameters under `torch._grouped_mm` with `offsets = torch.cumsum(num_tokens_per_expert, 0, dtype=int32)`, the
  FP8 step on the routed rows inside the experts (as a float8 grouped GEMM quantises its operand), the clamped
  SwiGLU; `score_before_experts=False` (titan's other setting, True, weights the experts' input, which is not the
  spec's function), so the scores multiply the routed output in fp32; the shared expert a `FeedForward` (w1, w2, w3
  `Float8Linear`s); the combine by `scatter_add` of the weighted routed rows into the shared output (titan's
  `out = shared(x); out.scatter_add(0, index, routed_output)`), kept in fp32 as the spec accumulates, one cast after.
No load-balancing buffer update (inference). Attention itself is reduced to q + kv (one visible key, whose softmax
weight is 1); its sites are the ones around it.

forward(x [B, 1, hc, D] bf16, pre_mix [B, 1, hc] fp32, positions [B] int64, keys [B, N, ihd] bf16, n_c [B] int64)
  -> (h [B, 1, D] bf16, x_new [B, 1, hc, D] bf16, idx [B, 1, k] int64)

Sites (each a fusion when the backend finds it): mhc_coeffs x2, qkv_norm, indexer_topk, wo_a, mhc_post_pre x2,
moe_route, moe_metadata, moe_experts, moe_finalize.

Measured when the block was written (fx mode, CPU, 3 requests and 1): 7 of the 11 sites fused (mhc_coeffs x2,
mhc_post_pre x2, qkv_norm with its FP8 step, indexer_topk, moe_route). The misses, and the general fixes:
- wo_a (declined, extra user): the `[B, 1, rd/2]` view of the looked-up cos that the inverse RoPE reads is the one
  the q RoPE reads too. Now a region's layout ops of bound inputs that the graph also reads outside are left in
  place for those readers (`matcher.MatchResult.kept`) instead of failing the match.
- moe_metadata (near miss at the histc): `histc(float(ids), bins=E, min=0, max=E)` of top-k ids is now the float of
  their int32 scatter_add counts, and `cumsum(float(counts), dtype=int32)` the cumsum of the counts
  (`normalize._histc_of_indices`, `_cumsum_of_exact_cast`); histc traces under Dynamo as `aten.histc`.
- moe_finalize (near miss at the scatter_add): the combine accumulated into the shared expert's output is now a
  formulation (`*_into_shared`: the shared row added first rather than last, fp32 reordering).
- moe_experts (near miss at the slice of GEMM1's output): GroupedExperts' w1 and w3 are two parameters, which the
  op took only stacked [E, 2I, D] (a cat copying all experts' weights on every call). The op now takes them apart
  (its `w3` argument; the kernel reads each expert's gate and up rows from the two weights), and a sorted
  formulation may start at GEMM1's input rows (`experts_split_rows_fp8_unweighted`: the routed rows here are
  FP8-rounded after the gather, so the op's x is those rows and its token 0..M-1).
All 11 sites fuse now.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .params import param_factory

FP8_MAX, AMAX_FLOOR = torch.finfo(torch.float8_e4m3fn).max, 1e-4
# the sites that fuse: all of them
SITES = {"mhc_coeffs": 2, "qkv_norm": 1, "indexer_topk": 1, "wo_a": 1, "mhc_post_pre": 2, "moe_route": 1,
         "moe_metadata": 1, "moe_experts": 1, "moe_finalize": 1}


@dataclass
class ModelArgs:
    dim: int = 64
    hc_mult: int = 4
    q_lora_rank: int = 32
    kv_dim: int = 64
    n_heads: int = 4
    head_dim: int = 64
    qk_rope_head_dim: int = 16
    o_groups: int = 2
    o_lora_rank: int = 16
    num_experts: int = 8
    top_k: int = 2
    moe_inter_dim: int = 32
    index_n_heads: int = 2
    index_head_dim: int = 32
    index_topk: int = 4
    window_size: int = 8
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-20
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    fp8_block_size: int = 32


def fp8_blockwise_fake_quant(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """FP8 e4m3 quantise-dequantise of x [..., n * block_size] per block of block_size along the last dim: scale
    s = 2^ceil(log2(max(amax, 1e-4) / 448)), q = e4m3(clamp(x / s, +-448)), returned as q * s in x's dtype."""
    blocks = x.to(torch.float32).unflatten(-1, (-1, block_size))
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    x_fp8 = (blocks / scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
    return (x_fp8.to(torch.float32) * scale).flatten(-2).to(x.dtype)


def linear(cls, weight: nn.Parameter, **kwargs) -> nn.Linear:
    """A bias-free `cls` (an nn.Linear) holding `weight` [out, in]."""
    module = cls(weight.shape[1], weight.shape[0], bias=False, device="meta", **kwargs)
    module.weight = weight
    return module


def rms_norm(weight: nn.Parameter, eps: float) -> nn.RMSNorm:
    norm = nn.RMSNorm(weight.shape[0], eps=eps, device="meta")
    norm.weight = weight
    return norm


class Float8Linear(nn.Linear):
    """An nn.Linear whose input is FP8 fake-quantised per block of `block_size` before the bf16 GEMM."""

    def __init__(self, *args, block_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.block_size = block_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(fp8_blockwise_fake_quant(x, self.block_size), self.weight)


def precompute_freqs_cis(args: ModelArgs) -> torch.Tensor:
    """exp(i * p * theta^(-2j/rd)) for p < max_seq_len, j < rd/2: [max_seq_len, rd/2] complex64."""
    dim = args.qk_rope_head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x [bsz, seqlen, heads, rd] times freqs_cis [bsz, seqlen, rd/2] on its adjacent pairs as complex numbers in
    fp32, in x's dtype."""
    dtype = x.dtype
    x = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(x.size(0), x.size(1), 1, x.size(-1))
    y = torch.view_as_real(x * freqs_cis).flatten(3)
    return y.to(dtype)


class HyperConnection(nn.Module):
    """One mHC site (spec §2.2) at [bsz, seqlen, hc, D]: coefficients, collapse, post."""

    def __init__(self, p, args: ModelArgs):
        super().__init__()
        hc, self.args = args.hc_mult, args
        self.norm = nn.RMSNorm(hc * args.dim, eps=args.norm_eps, elementwise_affine=False)
        self.fn = linear(nn.Linear, p((2 + hc) * hc, hc * args.dim, dtype=torch.float32), dtype=torch.float32)
        self.base = p((2 + hc) * hc, scale=0.5, dtype=torch.float32)
        self.scale = p(3, scale=0.1, mean=1.0, dtype=torch.float32)

    def coefficients(self, x: torch.Tensor):
        """pre [bsz, seqlen, hc], post [bsz, seqlen, hc], comb [bsz, seqlen, hc, hc] of x [bsz, seqlen, hc, D]."""
        hc, args = self.args.hc_mult, self.args
        mixes = self.fn(self.norm(x.flatten(2).float()))
        pre = torch.sigmoid(mixes[..., :hc] * self.scale[0] + self.base[:hc]) + args.hc_eps
        post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * self.scale[1] + self.base[hc:2 * hc])
        logits = mixes[..., 2 * hc:] * self.scale[2] + self.base[2 * hc:]
        comb = F.softmax(logits.unflatten(-1, (hc, hc)), dim=-1) + args.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + args.hc_eps)
        for _ in range(args.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + args.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + args.hc_eps)
        return pre, post, comb

    @staticmethod
    def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """sum_j pre_j x_j in fp32, rounded once: [bsz, seqlen, hc, D], [bsz, seqlen, hc] -> [bsz, seqlen, D]."""
        return (pre.unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)

    @staticmethod
    def post(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """x'_k = post_k out + sum_j comb[j, k] x_j in fp32, rounded once -> [bsz, seqlen, hc, D]."""
        mixed = torch.einsum("bsjk,bsjd->bskd", comb, x.float())
        return (mixed + post.unsqueeze(-1) * out.float().unsqueeze(-2)).to(x.dtype)


class Attention(nn.Module):
    """q / window KV with their norms and RoPE, the indexer, q + kv as the attention output, the inverse RoPE, the
    grouped wo_a and wo_b (spec §2.3-2.5)."""

    def __init__(self, p, args: ModelArgs):
        super().__init__()
        self.args = args
        fp8 = {"block_size": args.fp8_block_size}
        self.wq_a = linear(Float8Linear, p(args.q_lora_rank, args.dim), **fp8)
        self.q_norm = rms_norm(p(args.q_lora_rank, scale=0.1, mean=1.0), args.norm_eps)
        self.wq_b = linear(Float8Linear, p(args.n_heads * args.head_dim, args.q_lora_rank), **fp8)
        self.wkv = linear(Float8Linear, p(args.kv_dim, args.dim), **fp8)
        self.kv_norm = rms_norm(p(args.kv_dim, scale=0.1, mean=1.0), args.norm_eps)
        self.indexer_wq_b = linear(Float8Linear, p(args.index_n_heads * args.index_head_dim, args.q_lora_rank), **fp8)
        self.indexer_weights_proj = linear(nn.Linear, p(args.index_n_heads, args.dim))
        self.wo_a = linear(nn.Linear, p(args.o_groups * args.o_lora_rank, args.n_heads * args.head_dim // args.o_groups))
        self.wo_b = linear(Float8Linear, p(args.dim, args.o_groups * args.o_lora_rank), **fp8)

    def indexer(self, qr, x, keys, n_c):
        """The top-k compressed rows (spec §2.4) offset past the window, -1 where invalid: [bsz, seqlen, k]."""
        args = self.args
        bsz, seqlen, _ = x.shape
        q = self.indexer_wq_b(qr).view(bsz, seqlen, args.index_n_heads, args.index_head_dim)
        weights = self.indexer_weights_proj(x).float() * (args.index_head_dim ** -0.5 * args.index_n_heads ** -0.5)
        logits = torch.matmul(q.float(), keys.float().unsqueeze(1).transpose(-2, -1))
        scores = (F.relu(logits) * weights.unsqueeze(-1)).sum(dim=2)
        attention_mask = torch.arange(keys.shape[1], device=keys.device) < n_c.view(-1, 1, 1)
        scores = scores.masked_fill(~attention_mask, float("-inf"))
        topk_indices = torch.topk(scores, min(args.index_topk, keys.shape[1]), dim=-1, sorted=False)[1]
        topk_indices = topk_indices.sort(dim=-1).values
        return torch.where(topk_indices < n_c.view(-1, 1, 1), topk_indices + args.window_size, -1)

    def forward(self, x, freqs_cis, keys, n_c):
        args = self.args
        bsz, seqlen, _ = x.shape
        nope, rope = args.head_dim - args.qk_rope_head_dim, args.qk_rope_head_dim
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(bsz, seqlen, -1, args.head_dim)
        q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
        q = torch.cat([q_nope, apply_rotary_emb(q_pe, freqs_cis)], dim=-1)
        kv = self.kv_norm(self.wkv(x))
        kv_nope, k_pe = torch.split(kv, [args.kv_dim - rope, rope], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis).squeeze(2)
        kv = fp8_blockwise_fake_quant(torch.cat([kv_nope, k_pe], dim=-1), args.fp8_block_size)
        idx = self.indexer(qr, x, keys, n_c)
        # attention over one visible key (kv, whose softmax weight is 1), q added so the q path stays live
        o = q + kv.unsqueeze(2)
        o_nope, o_pe = torch.split(o, [nope, rope], dim=-1)
        o = torch.cat([o_nope, apply_rotary_emb(o_pe, freqs_cis.conj())], dim=-1)
        wo_a = self.wo_a.weight.view(args.o_groups, args.o_lora_rank, -1)
        z = torch.einsum("bsgd,grd->bsgr", o.view(bsz, seqlen, args.o_groups, -1), wo_a)
        return self.wo_b(z.flatten(2)), idx


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit)) * clamp(u, -limit, limit) in fp32."""
    return F.silu(gate.float().clamp(max=limit)) * up.float().clamp(min=-limit, max=limit)


class FeedForward(nn.Module):
    """titan's FeedForward (the shared expert): w2(swiglu(w1(x), w3(x))), the spec's clamped SwiGLU, FP8 inputs."""

    def __init__(self, p, args: ModelArgs):
        super().__init__()
        self.limit, fp8 = args.swiglu_limit, {"block_size": args.fp8_block_size}
        self.w1 = linear(Float8Linear, p(args.moe_inter_dim, args.dim), **fp8)
        self.w2 = linear(Float8Linear, p(args.dim, args.moe_inter_dim), **fp8)
        self.w3 = linear(Float8Linear, p(args.moe_inter_dim, args.dim), **fp8)

    def forward(self, x):
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit).to(x.dtype))


class GroupedExperts(nn.Module):
    """The routed experts on expert-sorted rows [M, D] under `torch._grouped_mm` (w1, w3 [E, I, D], w2 [E, D, I]),
    the rows FP8 fake-quantised before each GEMM, the clamped SwiGLU in fp32 -> [M, D] bf16."""

    def __init__(self, p, args: ModelArgs):
        super().__init__()
        e, i, d = args.num_experts, args.moe_inter_dim, args.dim
        self.w1, self.w2, self.w3 = p(e, i, d), p(e, d, i), p(e, i, d)
        self.limit, self.block_size = args.swiglu_limit, args.fp8_block_size

    def forward(self, x, num_tokens_per_expert):
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        x = fp8_blockwise_fake_quant(x, self.block_size)
        gate = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offsets)
        up = torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offsets)
        h = fp8_blockwise_fake_quant(clamped_swiglu(gate, up, self.limit).to(x.dtype), self.block_size)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offsets).type_as(x)


class TokenChoiceTopKRouter(nn.Module):
    """Token-choice top-k routing with the spec's score function (§2.6): (top_scores [T, k] fp32, ids [T, k])."""

    def __init__(self, p, args: ModelArgs):
        super().__init__()
        self.gate = linear(nn.Linear, p(args.num_experts, args.dim))
        self.top_k, self.route_scale = args.top_k, args.route_scale

    def forward(self, x, expert_bias):
        # the router GEMM in fp32, as the spec has it
        scores = F.linear(x.to(torch.float32), self.gate.weight.to(torch.float32))
        scores = torch.sqrt(F.softplus(scores))
        # the bias only selects; the gating values come from the scores
        _, selected_experts_indices = torch.topk(scores + expert_bias, k=self.top_k, dim=1)
        top_scores = scores.gather(dim=1, index=selected_experts_indices)
        denominator = top_scores.sum(dim=-1, keepdim=True) + 1e-20
        top_scores = top_scores / denominator
        top_scores = top_scores * self.route_scale
        return top_scores, selected_experts_indices


class TokenReorderer(nn.Module):
    """(scores, token indices) of the expert-sorted (token, slot) pairs, and the tokens per expert [E] fp32."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k

    def forward(self, top_scores, selected_experts_indices):
        num_tokens_per_expert = torch.histc(selected_experts_indices.view(-1).float(), bins=self.num_experts,
                                            min=0, max=self.num_experts)
        token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        token_indices_experts_sorted = token_indices_experts_sorted // self.top_k
        return top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert


class MoE(nn.Module):
    def __init__(self, p, args: ModelArgs):
        super().__init__()
        self.experts = GroupedExperts(p, args)
        self.router = TokenChoiceTopKRouter(p, args)
        self.reorderer = TokenReorderer(args)
        self.shared_experts = FeedForward(p, args)
        self.register_buffer("expert_bias", p(args.num_experts, scale=0.1, dtype=torch.float32).data)

    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices = self.router(x, self.expert_bias)
        top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert = self.reorderer(
            top_scores, selected_experts_indices)
        token_indices_experts_sorted = token_indices_experts_sorted.reshape(-1, 1).expand(-1, dim)
        routed_input = torch.gather(x, dim=0, index=token_indices_experts_sorted)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        out = self.shared_experts(x).to(torch.float32)
        routed_output = routed_output.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)
        out = out.scatter_add(dim=0, index=token_indices_experts_sorted, src=routed_output)
        return out.to(x.dtype).reshape(bs, slen, dim)


class TitanStyleBlock(nn.Module):
    def __init__(self, args: ModelArgs = ModelArgs(), seed: int = 0):
        super().__init__()
        p = param_factory(seed)
        self.args = args
        self.hc_attn, self.hc_ffn = HyperConnection(p, args), HyperConnection(p, args)
        self.attention_norm, self.ffn_norm, self.norm = (
            rms_norm(p(args.dim, scale=0.1, mean=1.0), args.norm_eps) for _ in range(3))
        self.attention = Attention(p, args)
        self.moe = MoE(p, args)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)

    def forward(self, x, pre_mix, positions, keys, n_c):
        freqs_cis = self.freqs_cis[positions].unsqueeze(1)
        pre_a, post_a, comb_a = self.hc_attn.coefficients(x)
        out, idx = self.attention(self.attention_norm(self.hc_attn.collapse(x, pre_mix)), freqs_cis, keys, n_c)
        x = self.hc_attn.post(out, x, post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_ffn.coefficients(x)
        x = self.hc_ffn.post(self.moe(self.ffn_norm(self.hc_ffn.collapse(x, pre_a))), x, post_f, comb_f)
        return self.norm(self.hc_ffn.collapse(x, pre_f)), x, idx
