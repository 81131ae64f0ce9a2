"""A tiny two-sublayer DeepSeek-V4.1 decode block written in the style of DeepSeek's own reference
`inference/model.py` (our own code, a fifth style beside the model, hf_style.py, vllm_style.py and module_style.py),
from the spec (sections 2 and 3), choosing spellings those four do not use:

- a `ModelArgs` dataclass, a module per component (`RMSNorm`, `Linear`, `Gate`, `Expert`-like routed weights,
  `MoE`, `Indexer`, `Attention`, `Block`), `@torch.no_grad()` on the block's forward;
- a `linear(x, weight)` helper that runs the FP8 activation step as the reference's `act_quant` (returning the
  e4m3 values and the per-block scales, without keepdim) and `weight_dequant`-like rescaling, the scale
  `2 ** ceil(log2(amax / 448))` by `torch.pow(2, ...)`, no clamp before the cast;
- RMSNorm as `F.rms_norm` on the bf16 activation with the bf16 weight (torch upcasts inside);
- the mHC statistic by `x.square()`, the coefficient scales by `torch.addcmul(base, mixes, scale)`, the Sinkhorn
  by in-place `div_` with `add_` of eps, the post by `torch.baddbmm`, the collapse by `einsum('tjd,tj->td')`
  (operands in the other order);
- RoPE by `view_as_complex` against a complex64 `freqs_cis` buffer built once (`precompute_freqs_cis`) and indexed
  by the positions inside the step, the inverse by `conj()`, written back by `torch.cat`;
- weights stored transposed ([in, out]) where the reference's kernels want them so: the router's gate (`x @ W`),
  wo_a per group ([G, H/G * hd, R], `bmm` over the groups in front), the routed experts' stacked w13 / w2
  ([E, D, 2I] / [E, I, D], `_grouped_mm` without a transpose);
- the indexer scores by `einsum('thd,tnd->thn')` with `relu_`, the visibility as an additive 0 / -inf mask, the
  selection `topk(...)[1]` then sorted, valid as `sel < n_c`;
- the router `scores.topk(k)[1]` then `gather`, normalised in place (`/=`, `*=`);
- the MoE metadata with the counts by `scatter_reduce_(..., "sum")`, the token by `div(..., rounding_mode="floor")`,
  the row weights by `torch.take`, gate/up by `view(-1, 2, I).unbind(1)`, silu by `g * sigmoid(g)`;
- the combine by `scatter_reduce_(..., "sum")` over expanded token indices, the shared expert as three separate
  projections (w1, w3, w2).

Attention itself is reduced to a projection of q (its sites are the ones around it).

forward(x [T, hc, D] bf16, pre_mix [T, hc] fp32, positions [T] int64, keys [T, N, ihd] bf16, n_c [T] int64)
  -> (h [T, D] bf16, x_new [T, hc, D] bf16, idx [T, k] int64)

Sites (each a fusion when the backend finds it): mhc_coeffs x2, qkv_norm, indexer_topk, wo_a, mhc_post_pre x2,
moe_route, moe_metadata, moe_experts, moe_finalize.

Measured when the block was written (fx mode, 3 tokens): 1 of the 11 sites fused (mhc_coeffs at the FFN site),
1 of the 10 misses with a `declined` entry. Each miss and the general fix that made it fuse
(`dsv41.passes.normalize`, `.matcher`):
- mhc_coeffs at the attention site: `torch.addcmul(base, mixes, scale)`. fp32 `addcmul` / `addcdiv` are the add of
  the product / quotient.
- mhc_post_pre x2: the post by `baddbmm` and the collapse by `einsum('tjd,tj->td')` (a bmm of the matrix by the
  vector). `baddbmm(a, b, c)` / `addmm` are the GEMM plus a, and a batched matrix times a vector is the vector
  times the matrix transposed, so both einsum operand orders are one form.
- qkv_norm: each `linear` rounds x to FP8 again, so wq_a and wkv read two equal but separate chains, where the
  two-GEMM formulation's guard wants one activation. Two nodes are one value when they apply the same pure op to
  arguments that are one value (`matcher.same_value`), which the guard now asks.
- moe_metadata and moe_finalize: counts and combine by `scatter_reduce_(..., "sum")`, which is `scatter_add`.
- moe_route and wo_a: the router's `x @ W` with W [D, E] and the per-group [G, in, out] wo_a under `bmm`. A pattern
  input read through permutes and splitting views (a weight the pattern transposes) binds a graph input already in
  that layout; the op takes it through the inverse chain, where that chain is views only (the router's [D, E] gate
  as its transpose, read in place). wo_a's [G, in, out] weight would have to be copied into the op's [G * R, in]
  layout on every call, so that site is declined with that reason (a fused wo_a slower than the user's bmm).
- indexer_topk (no record): the visibility as an additive 0 / -inf mask, `s + where(n < n_c, 0, -inf)`, with the
  validity as `sel < n_c`. An add of a where of two constants is the where of two adds, `where(visible, s + 0,
  s - inf)`, whose branches the match takes as parts computed another way (islands) beside the validity test.
- moe_experts, in part: gate/up by `view(-1, 2, I).unbind(1)` (a select of a split dim's outer factor is a run
  slice), the scale viewed twice for the quotient and the product (a pattern value read twice may be two nodes
  repeating one op on the same operands), w13 / w2 as `_grouped_mm`'s [E, K, N] operands (the inverse layout,
  above).
After: 10 of the 11 fused, then 9 with wo_a declined for the weight copy; outputs equal to eager
(test_ref_style.py); the semantic check accepted the islands (the indexer's mask and validity). The last two misses
then, and their fix:
- moe_experts, and qkv_norm's FP8 step (qkv_norm fused its norms and RoPE, the step stayed glue): `act_quant`
  returns its e4m3 blocks viewed flat and the dequantisation views them into blocks again around the cast (view,
  cast, view back), which no FP8 formulation reads. Pointwise ops between a view and the view back to the viewed
  value's own shape are those ops at that shape (`normalize._pointwise_between_views`; broadcast operands only
  where they vary along the dims both shapes keep, so the per-block scale multiply stays at the blocks).
  A first version of that rewrite stopped the model's own wo_a fusing in the TINY model (0 of 8, with wo_a the
  only fusion enabled too: not an effect of the fusions' order): the model's FP8 step reads wo_a's output
  `z = einsum(...).flatten(1)` as blocks of 32, and TINY's o_lora_rank is 32, so `z.float().unflatten(-1, (-1, 32))`
  views the flattened [T, G * R] value back to the einsum's [T, G, R] around the cast. The rewrite cast the einsum
  output at [T, G, R] and erased the `.flatten(1)` view where every wo_a formulation ends, so the matcher found no
  pattern output below the bmm and recorded the 8 sites as "another computation" (the first output compared was the
  FP8 step's product), with no decline naming them. test_wo_a.py's R = 16 never views back, hence TINY only. The
  rewrite now leaves a round trip whose first view a pattern may start or end at (`normalize.keeps_first_view`):
  a view of a graph input or a GEMM output, as the other normalisations leave them, or the view of a reshape that
  copies a non-contiguous value (a clone and a view: the einsum's `.flatten(1)`, an expanded mask flattened).
After: 10 of the 11 fused (wo_a declined as above), the window KV's FP8 step inside qkv_norm
(`q_kv_norm_rope_fp8_split`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .params import param_factory

# every site but wo_a (declined: its weight would be copied every call)
T_SITES = {"mhc_coeffs": 2, "qkv_norm": 1, "indexer_topk": 1, "mhc_post_pre": 2, "moe_route": 1,
           "moe_metadata": 1, "moe_experts": 1, "moe_finalize": 1}


@dataclass
class ModelArgs:
    dim: int = 64
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-20
    q_lora_rank: int = 32
    head_dim: int = 32
    kv_dim: int = 64
    rope_head_dim: int = 16
    n_heads: int = 4
    o_groups: int = 2
    o_lora_rank: int = 16
    n_routed_experts: int = 8
    n_activated_experts: int = 2
    moe_inter_dim: int = 64
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    index_n_heads: int = 2
    index_head_dim: int = 32
    index_topk: int = 4
    window_size: int = 8
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    block_size: int = 32


def precompute_freqs_cis(args: ModelArgs) -> torch.Tensor:
    """The complex64 rotation table [max_seq_len, rope_head_dim / 2]: exp(i * p * theta^(-2j / rd))."""
    rd = args.rope_head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, ..., rd] rotated pairwise by freqs_cis [T, rd / 2] (its conjugate for the inverse), in x's dtype."""
    dtype, shape = x.dtype, x.shape
    z = torch.view_as_complex(x.float().view(*shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(z.size(0), *([1] * (z.dim() - 2)), z.size(-1))
    if inverse:
        freqs_cis = freqs_cis.conj()
    return torch.view_as_real(z * freqs_cis).flatten(-2).to(dtype)


def act_quant(x: torch.Tensor, block_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [..., n], fp32 scales [..., n / block_size]) with ue8m0 scales 2^ceil(log2(amax / 448))."""
    blocks = x.float().view(*x.shape[:-1], -1, block_size)
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-4)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    y = (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return y.view(x.shape), scale


def act_dequant(y: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    block_size = y.shape[-1] // scale.shape[-1]
    blocks = y.float().view(*y.shape[:-1], -1, block_size)
    return (blocks * scale[..., None]).view(y.shape).to(dtype)


def fp8_round_trip(x: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    return act_dequant(*act_quant(x, block_size), dtype=x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, quant: bool = False) -> torch.Tensor:
    """y = x W^T, the activation FP8-rounded first where the reference runs an FP8 GEMM."""
    if quant:
        x = fp8_round_trip(x)
    return F.linear(x, weight)


class Linear(nn.Module):
    def __init__(self, weight: nn.Parameter, quant: bool = False):
        super().__init__()
        self.weight, self.quant = weight, quant

    def forward(self, x):
        return linear(x, self.weight, self.quant)


class RMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


class HyperConnection(nn.Module):
    """One mHC site: its coefficients (hc_pre), the collapse and the post (hc_post)."""

    def __init__(self, args: ModelArgs, p):
        super().__init__()
        hc = args.hc_mult
        self.args = args
        self.fn = p((2 + hc) * hc, hc * args.dim, dtype=torch.float32)
        self.base = p((2 + hc) * hc, scale=0.5, dtype=torch.float32)
        self.scale = p(3, scale=0.1, mean=1.0, dtype=torch.float32)

    def coefficients(self, x):
        """pre [T, hc], post [T, hc], comb [T, hc, hc] of x [T, hc, D]."""
        a, hc = self.args, self.args.hc_mult
        xf = x.flatten(1).float()
        mixes = F.linear(xf, self.fn) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + a.norm_eps)
        s_pre, s_post, s_comb = self.scale
        pre = torch.addcmul(self.base[:hc], mixes[:, :hc], s_pre).sigmoid() + a.hc_eps
        post = torch.addcmul(self.base[hc:2 * hc], mixes[:, hc:2 * hc], s_post).sigmoid() * 2
        logits = torch.addcmul(self.base[2 * hc:].view(hc, hc), mixes[:, 2 * hc:].view(-1, hc, hc), s_comb)
        comb = F.softmax(logits, dim=-1, dtype=torch.float32) + a.hc_eps
        comb.div_(comb.sum(dim=1, keepdim=True).add_(a.hc_eps))
        for _ in range(a.hc_sinkhorn_iters - 1):
            comb.div_(comb.sum(dim=2, keepdim=True).add_(a.hc_eps))
            comb.div_(comb.sum(dim=1, keepdim=True).add_(a.hc_eps))
        return pre, post, comb

    @staticmethod
    def collapse(x, pre):
        return torch.einsum("tjd,tj->td", x.float(), pre).to(x.dtype)

    @staticmethod
    def post(y, x, post, comb):
        """x'_k = post_k y + sum_j comb[j, k] x_j as one baddbmm, fp32, stored in x's dtype."""
        scaled = post.unsqueeze(2) * y.float().unsqueeze(1)
        return torch.baddbmm(scaled, comb.transpose(1, 2), x.float()).to(x.dtype)


class Indexer(nn.Module):
    def __init__(self, args: ModelArgs, p):
        super().__init__()
        self.args = args
        self.wq_b = Linear(p(args.index_n_heads * args.index_head_dim, args.q_lora_rank))
        self.weights_proj = Linear(p(args.index_n_heads, args.dim))
        self.softmax_scale = args.index_head_dim ** -0.5

    def forward(self, x, qr, keys, n_c):
        """idx [T, k]: the top-k compressed rows by sum_h w_h relu(q_h . k_n) past the window, -1 where invalid."""
        a = self.args
        t, n = keys.shape[0], keys.shape[1]
        q = self.wq_b(qr).view(t, a.index_n_heads, a.index_head_dim)
        weights = self.weights_proj(x).float() * (self.softmax_scale * a.index_n_heads ** -0.5)
        index_score = torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu_()
        index_score = (index_score * weights.unsqueeze(-1)).sum(dim=1)
        mask = torch.where(torch.arange(n, device=n_c.device).unsqueeze(0) < n_c.unsqueeze(1), 0.0, float("-inf"))
        index_score = index_score + mask
        sel = index_score.topk(min(a.index_topk, n), dim=-1)[1]
        sel = torch.sort(sel, dim=-1)[0]
        return torch.where(sel < n_c.unsqueeze(1), sel + a.window_size, -1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, p):
        super().__init__()
        a = self.args = args
        self.wq_a = Linear(p(a.q_lora_rank, a.dim), quant=True)
        self.wkv = Linear(p(a.kv_dim, a.dim), quant=True)
        self.q_norm = RMSNorm(p(a.q_lora_rank, scale=0.1, mean=1.0), a.norm_eps)
        self.kv_norm = RMSNorm(p(a.kv_dim, scale=0.1, mean=1.0), a.norm_eps)
        self.wq_b = Linear(p(a.n_heads * a.head_dim, a.q_lora_rank), quant=True)
        self.indexer = Indexer(a, p)
        group_in = a.n_heads // a.o_groups * a.head_dim
        self.wo_a = p(a.o_groups, group_in, a.o_lora_rank, scale=group_in ** -0.5)  # [G, in, out]: per-group W^T
        self.wo_b = Linear(p(a.dim, a.o_groups * a.o_lora_rank), quant=True)

    def forward(self, x, freqs_cis, keys, n_c):
        a, t = self.args, x.size(0)
        qr = self.q_norm(self.wq_a(x))
        kv = self.kv_norm(self.wkv(x))
        kv_nope, kv_pe = torch.split(kv, [a.kv_dim - a.rope_head_dim, a.rope_head_dim], dim=-1)
        kv = fp8_round_trip(torch.cat([kv_nope, apply_rotary_emb(kv_pe, freqs_cis)], dim=-1))
        idx = self.indexer(x, qr, keys, n_c)
        # attention reduced to a projection of q, then the inverse RoPE and the grouped wo_a
        o = self.wq_b(qr).view(t, a.n_heads, a.head_dim) + kv[:, None, :1]
        o_nope, o_pe = torch.split(o, [a.head_dim - a.rope_head_dim, a.rope_head_dim], dim=-1)
        o = torch.cat([o_nope, apply_rotary_emb(o_pe, freqs_cis, inverse=True)], dim=-1)
        z = torch.bmm(o.view(t, a.o_groups, -1).transpose(0, 1), self.wo_a)
        return self.wo_b(z.transpose(0, 1).reshape(t, -1)), idx


class Gate(nn.Module):
    def __init__(self, args: ModelArgs, p):
        super().__init__()
        self.args = args
        self.weight_t = p(args.dim, args.n_routed_experts, scale=args.dim ** -0.5)  # [D, E], stored transposed
        self.bias = p(args.n_routed_experts, scale=0.1, dtype=torch.float32)

    def forward(self, x):
        a = self.args
        scores = F.softplus(x.float() @ self.weight_t.float()).sqrt()
        original_scores = scores
        indices = (scores + self.bias).topk(a.n_activated_experts, dim=-1)[1]
        weights = original_scores.gather(1, indices)
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        weights *= a.route_scale
        return weights, indices


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, p):
        super().__init__()
        a = self.args = args
        self.gate = Gate(a, p)
        # the routed experts stacked as _grouped_mm's [E, K, N] operands
        self.w13 = p(a.n_routed_experts, a.dim, 2 * a.moe_inter_dim, scale=a.dim ** -0.5)
        self.w2 = p(a.n_routed_experts, a.moe_inter_dim, a.dim, scale=a.moe_inter_dim ** -0.5)
        self.shared_w1, self.shared_w3 = (Linear(p(a.moe_inter_dim, a.dim), quant=True) for _ in range(2))
        self.shared_w2 = Linear(p(a.dim, a.moe_inter_dim), quant=True)

    def swiglu(self, g, u):
        limit = self.args.swiglu_limit
        g, u = g.float().clamp(max=limit), u.float().clamp(min=-limit, max=limit)
        return g * torch.sigmoid(g) * u

    def forward(self, x):
        a = self.args
        t, d, k, e = x.size(0), x.size(1), a.n_activated_experts, a.n_routed_experts
        weights, indices = self.gate(x)
        flat = indices.flatten()
        order = flat.sort(stable=True)[1]
        token = torch.div(order, k, rounding_mode="floor")
        counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_reduce_(0, flat, torch.ones_like(flat), "sum")
        offsets = counts.cumsum(0).to(torch.int32)
        row_weights = torch.take(weights, order)
        xq = fp8_round_trip(x)
        gu = torch._grouped_mm(xq[token], self.w13, offs=offsets)
        g, u = gu.view(-1, 2, a.moe_inter_dim).unbind(1)
        act = fp8_round_trip((self.swiglu(g, u) * row_weights[:, None]).to(x.dtype))
        rows = torch._grouped_mm(act, self.w2, offs=offsets)
        shared = self.shared_w2(self.swiglu(self.shared_w1(x), self.shared_w3(x)).to(x.dtype))
        y = torch.zeros(t, d, dtype=torch.float32, device=x.device)
        y.scatter_reduce_(0, token.unsqueeze(1).expand(-1, d), rows.float(), "sum")
        return (y + shared.float()).to(x.dtype)


class RefStyleBlock(nn.Module):
    def __init__(self, args: ModelArgs | None = None, seed: int = 0):
        super().__init__()
        a = self.args = args or ModelArgs()
        p = param_factory(seed)
        self.hc, self.index_dim = a.hc_mult, a.index_head_dim
        self.hc_attn, self.hc_ffn = HyperConnection(a, p), HyperConnection(a, p)
        self.attn_norm, self.ffn_norm, self.norm = (RMSNorm(p(a.dim, scale=0.1, mean=1.0), a.norm_eps) for _ in range(3))
        self.attn, self.ffn = Attention(a, p), MoE(a, p)
        self.register_buffer("freqs_cis", precompute_freqs_cis(a), persistent=False)

    @torch.no_grad()
    def forward(self, x, pre_mix, positions, keys, n_c):
        freqs_cis = self.freqs_cis[positions]
        pre_a, post_a, comb_a = self.hc_attn.coefficients(x)
        h = self.attn_norm(HyperConnection.collapse(x, pre_mix))
        y, idx = self.attn(h, freqs_cis, keys, n_c)
        x = HyperConnection.post(y, x, post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_ffn.coefficients(x)
        h = self.ffn_norm(HyperConnection.collapse(x, pre_a))
        x = HyperConnection.post(self.ffn(h), x, post_f, comb_f)
        return self.norm(HyperConnection.collapse(x, pre_f)), x, idx
