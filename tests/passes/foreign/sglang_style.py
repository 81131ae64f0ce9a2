"""A tiny two-sublayer DeepSeek-V4.1 decode block written as an engineer porting SGLang's torch-native fallbacks
(`forward_native` of its RMSNorm, RotaryEmbedding and MoE layers) would write it, from the spec
(/work/shared/spec/dsv41_decode.md, sections 2.1-2.6), choosing spellings the other foreign blocks do not use:

- in-place arithmetic on fresh fp32 values everywhere SGLang's native code uses it (`mul_`, `add_`, `div_`,
  `sqrt_`, `clamp_`, `addcmul_`, `masked_fill_`), the RoPE written back into its slice by `copy_`;
- RMSNorm as SGLang's `forward_native`: `x.to(fp32)`, `variance = x.pow(2).mean(-1, keepdim=True)`,
  `x.mul_(rsqrt(variance + eps))`, then `mul_` by the bf16 weight (promoted, one rounding: the spec's);
- the mHC GEMM as `torch.mm(x, fn.t())` scaled in place, its pieces by plain slicing, the Sinkhorn in place;
- the post as `matmul(comb.mT, x)` with the scaled output added by `addcmul_`, the collapse as `bmm` of the pre row;
- RoPE from a `cos_sin_cache` buffer [max_pos, rd] (cos and sin concatenated) looked up by `index_select` on the
  positions and split by `chunk(2)`; the rotation on the even/odd elements `x[..., ::2]`, `x[..., 1::2]`,
  recombined by `stack(...).flatten(-2)`; the inverse as the rotation by `-sin`;
- the indexer scores token-major by `bmm(keys, q.mT)` -> [T, N, H], heads summed last, invisible rows masked in
  place, and the top-k as `sort(descending=True, stable=True)` sliced to k, then sorted ascending: the same set as
  `topk` (ties at the k-th score broken towards the lower index, which `topk` leaves unspecified), validity by the
  spec's `sel < n_c`;
- the router's top-k the same way (`sort(descending=True, stable=True)[..., :k]`), its weights normalised in place;
- the MoE metadata as SGLang's `moe_forward_native`: counts as the column sums of a `new_zeros` [T, E] map filled by
  `scatter_(1, ids, 1)`, the stable `argsort` of the flat ids, `order // k`;
- the combine as SGLang's unpermute: `new_x[order] = rows` into `empty_like`, then `view(T, k, D)` summed over k
  (the routing weight already applied before w2, as the spec has it), the shared output added in place.

Attention itself is reduced to a projection of q (its sites are the ones around it).

forward(x [T, hc, D] bf16, pre_mix [T, hc] fp32, positions [T] int64, keys [T, N, ihd] bf16, n_c [T] int64)
  -> (h [T, D] bf16, x_new [T, hc, D] bf16, idx [T, k] int64)

Sites (each a fusion when the backend finds it): mhc_coeffs x2, qkv_norm, indexer_topk, wo_a, mhc_post_pre x2,
moe_route, moe_metadata, moe_experts, moe_finalize.

Measured when the block was written (fx mode, 3 tokens): 7 of the 11 sites fused (mhc_coeffs x2, mhc_post_pre x2,
wo_a, moe_experts, and qkv_norm with its bare norms only). What each miss was, and the general fix that made it
fuse (`dsv41.passes.normalize`, `dsv41.passes.moe_finalize`):
- qkv_norm's RoPE and FP8 step (narrowed to the norms): the `copy_` write-back traces as `copy(slice, rotated)`
  inside the slice_scatter; a copy of a same-shape source is now the source in the destination's dtype.
- moe_route (no candidate: no topk): the descending sort's first k is now a topk.
- moe_metadata (near miss, then an extra user): `topk_ids.reshape(-1)` of the sort's strided slice traced as a
  clone, a second root beside the routing map's flat ids (a clone of a contiguous computed value is now the value);
  then the unpermute read the sort's order, which the op does not return: it fuses once moe_finalize takes it.
- moe_finalize (near miss): `new_x[order] = rows` is now the gather by the inverse permutation, and the unpermute
  without routing weights (rows weighted before w2) is a formulation.
- indexer_topk (no candidate: another computation): the token-major scores `bmm(keys, q^T)` [T, N, H] summed
  over the heads last are now the head-major form (a sum over a product's columns is the sum over the transposed
  product's rows).
After: all 11 fused, outputs equal to eager (test_sglang_style.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .params import param_factory

EPS, HC_EPS, ITERS, ROUTE_SCALE, SWIGLU_LIMIT, WINDOW = 1e-20, 1e-6, 20, 1.5, 10.0, 8
FP8_MAX, FP8_BLOCK, AMAX_FLOOR, ROPE_THETA = torch.finfo(torch.float8_e4m3fn).max, 32, 1e-4, 10000.0
T_SITES = {"mhc_coeffs": 2, "qkv_norm": 1, "indexer_topk": 1, "wo_a": 1, "mhc_post_pre": 2, "moe_route": 1,
           "moe_metadata": 1, "moe_experts": 1, "moe_finalize": 1}


class RMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float = EPS):
        super().__init__()
        self.weight, self.variance_epsilon = weight, eps

    def forward(self, x):
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return x.mul_(self.weight).to(orig_dtype)


def per_token_group_quant_round_trip(x, group_size=FP8_BLOCK):
    """FP8 e4m3 fake quantisation per group of `group_size` elements with a power-of-two (ue8m0) scale
    2^ceil(log2(max(amax, 1e-4) / 448)), dequantised in fp32 and returned in x's dtype and shape."""
    x_ = x.to(torch.float32).reshape(x.numel() // group_size, group_size)
    amax = x_.abs().max(dim=-1, keepdim=True)[0].clamp_(min=AMAX_FLOOR)
    x_s = torch.pow(2.0, torch.ceil(torch.log2(amax / FP8_MAX)))
    x_q = (x_ / x_s).clamp_(min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
    return x_q.to(torch.float32).mul_(x_s).to(x.dtype).reshape(x.shape)


def rotate_even_odd(x, cos, sin):
    """Interleaved RoPE of x [..., rd] on its (x[2i], x[2i+1]) pairs in fp32, in x's dtype; cos, sin broadcast to
    [..., rd/2]."""
    x1, x2 = x[..., ::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


class SglangStyleBlock(nn.Module):
    def __init__(self, d=64, hc=4, q_lora=32, kv_dim=64, heads=4, head_dim=32, groups=2, o_rank=16, rope_dim=16,
                 experts=8, topk=2, inter=64, index_heads=2, index_dim=32, index_topk=4, max_position=64, seed=0):
        super().__init__()
        p = param_factory(seed)
        n_mix = (2 + hc) * hc
        self.hc, self.q_lora, self.kv_dim, self.heads, self.groups, self.o_rank, self.rope_dim = (
            hc, q_lora, kv_dim, heads, groups, o_rank, rope_dim)
        self.n_experts, self.topk, self.inter, self.index_heads, self.index_dim, self.index_topk = (
            experts, topk, inter, index_heads, index_dim, index_topk)
        self.max_position = max_position
        self.hc_attn_fn, self.hc_ffn_fn = (p(n_mix, hc * d, dtype=torch.float32) for _ in range(2))
        self.hc_attn_base, self.hc_ffn_base = (p(n_mix, scale=0.5, dtype=torch.float32) for _ in range(2))
        self.hc_attn_scale, self.hc_ffn_scale = (p(3, scale=0.1, mean=1.0, dtype=torch.float32) for _ in range(2))
        self.attn_norm, self.ffn_norm, self.out_norm = (RMSNorm(p(d, scale=0.1, mean=1.0)) for _ in range(3))
        self.wq_a, self.wkv = p(q_lora, d), p(kv_dim, d)
        self.q_norm, self.kv_norm = RMSNorm(p(q_lora, scale=0.1, mean=1.0)), RMSNorm(p(kv_dim, scale=0.1, mean=1.0))
        self.wq_b = p(heads * head_dim, q_lora)
        self.index_wq_b, self.index_weights_proj = p(index_heads * index_dim, q_lora), p(index_heads, d)
        self.wo_a = p(groups * o_rank, heads // groups * head_dim)
        self.wo_b = p(d, groups * o_rank)
        self.gate_weight, self.e_score_correction_bias = p(experts, d), p(experts, scale=0.1, dtype=torch.float32)
        self.w13_weight, self.w2_weight = p(experts, 2 * inter, d), p(experts, d, inter)
        self.shared_gate_up_proj, self.shared_down_proj = p(2 * inter, d), p(d, inter)
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def hc_mixes(self, x, fn, base, scale):
        """pre [T, hc], post [T, hc], comb [T, hc, hc] of an mHC site (spec 2.2); x [T, hc, D] bf16."""
        t, hc = x.shape[0], self.hc
        xf = x.reshape(t, -1).float()
        mixes = torch.mm(xf, fn.t()).mul_(torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + EPS))
        pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]).add_(HC_EPS)
        post = torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc]).mul_(2.0)
        logits = mixes[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc)
        comb = torch.softmax(logits, dim=-1).add_(HC_EPS)
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(HC_EPS))
        for _ in range(ITERS - 1):
            comb.div_(comb.sum(dim=-1, keepdim=True).add_(HC_EPS))
            comb.div_(comb.sum(dim=-2, keepdim=True).add_(HC_EPS))
        return pre, post, comb

    @staticmethod
    def hc_post(y, residual, post, comb):
        """x'_k = sum_j comb[j, k] x_j + post_k y in fp32, stored bf16; y [T, D], residual [T, hc, D]."""
        mixed = torch.matmul(comb.mT, residual.float())
        return mixed.addcmul_(post.unsqueeze(-1), y.float().unsqueeze(1)).to(residual.dtype)

    @staticmethod
    def hc_collapse(x, pre):
        """u = sum_j pre_j x_j in fp32, stored bf16; x [T, hc, D], pre [T, hc]."""
        return torch.bmm(pre.unsqueeze(1), x.float()).squeeze(1).to(x.dtype)

    def rope_(self, x, cos, sin):
        """x with its trailing rope_dim elements rotated pairwise, written back in place by copy_."""
        x_pe = x[..., -self.rope_dim:]
        x_pe.copy_(rotate_even_odd(x_pe, cos, sin))
        return x

    def attention(self, h, positions, keys, n_c):
        t = h.shape[0]
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        h_q = per_token_group_quant_round_trip(h)
        qr = self.q_norm(F.linear(h_q, self.wq_a))
        kv = per_token_group_quant_round_trip(self.rope_(self.kv_norm(F.linear(h_q, self.wkv)), cos, sin))
        # the indexer, token-major scores [T, N, H]
        q_idx = F.linear(qr, self.index_wq_b).view(t, self.index_heads, self.index_dim)
        weights = F.linear(h, self.index_weights_proj).float().mul_(self.index_dim ** -0.5 * self.index_heads ** -0.5)
        scores = torch.bmm(keys.float(), q_idx.float().mT)
        scores = F.relu(scores).mul_(weights.unsqueeze(1)).sum(dim=-1)
        n = keys.shape[1]
        scores.masked_fill_(torch.arange(n, device=n_c.device).unsqueeze(0) >= n_c.unsqueeze(1), float("-inf"))
        sel = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :min(self.index_topk, n)]
        sel = torch.sort(sel, dim=-1).values
        idx = (sel + WINDOW).masked_fill_(sel >= n_c.unsqueeze(1), -1)
        # attention reduced to a projection of q, then the inverse RoPE and the grouped wo_a
        o = F.linear(per_token_group_quant_round_trip(qr), self.wq_b).view(t, self.heads, -1) + kv[:, None, :1]
        o = self.rope_(o, cos.unsqueeze(1), -sin.unsqueeze(1))
        z = torch.bmm(o.view(t, self.groups, -1).transpose(0, 1), self.wo_a.view(self.groups, self.o_rank, -1).mT)
        return F.linear(per_token_group_quant_round_trip(z.transpose(0, 1).reshape(t, -1)), self.wo_b), idx

    @staticmethod
    def swiglu(gate, up):
        """silu(min(g, limit)) * clamp(u, -limit, limit) in fp32."""
        return F.silu(gate.float().clamp_(max=SWIGLU_LIMIT)).mul_(up.float().clamp_(-SWIGLU_LIMIT, SWIGLU_LIMIT))

    def moe(self, h):
        t, d, k, e = h.shape[0], h.shape[1], self.topk, self.n_experts
        scores = F.softplus(torch.mm(h.float(), self.gate_weight.float().t())).sqrt_()
        topk_ids = torch.sort(scores + self.e_score_correction_bias, dim=-1, descending=True, stable=True)[1][:, :k]
        topk_weights = scores.gather(1, topk_ids)
        topk_weights.div_(topk_weights.sum(dim=-1, keepdim=True).add_(1e-20)).mul_(ROUTE_SCALE)
        cnts = topk_ids.new_zeros((t, e))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.reshape(-1).argsort(stable=True)
        token = idxs // k
        offs = tokens_per_expert.cumsum(dim=0).to(torch.int32)
        x = per_token_group_quant_round_trip(h)
        sorted_tokens = x[token]
        gate_up = torch._grouped_mm(sorted_tokens, self.w13_weight.mT, offs=offs)
        act = self.swiglu(*gate_up.split(self.inter, dim=-1)).mul_(topk_weights.view(-1)[idxs].unsqueeze(-1))
        outs = torch._grouped_mm(per_token_group_quant_round_trip(act.to(h.dtype)), self.w2_weight.mT, offs=offs)
        shared_act = self.swiglu(*F.linear(x, self.shared_gate_up_proj).split(self.inter, dim=-1))
        shared = F.linear(per_token_group_quant_round_trip(shared_act.to(h.dtype)), self.shared_down_proj)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        y = new_x.view(t, k, d).float().sum(dim=1)
        return y.add_(shared.float()).to(h.dtype)

    def forward(self, x, pre_mix, positions, keys, n_c):
        pre_a, post_a, comb_a = self.hc_mixes(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        h = self.attn_norm(self.hc_collapse(x, pre_mix))
        y, idx = self.attention(h, positions, keys, n_c)
        x = self.hc_post(y, x, post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_mixes(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        h = self.ffn_norm(self.hc_collapse(x, pre_a))
        x = self.hc_post(self.moe(h), x, post_f, comb_f)
        return self.out_norm(self.hc_collapse(x, pre_f)), x, idx
