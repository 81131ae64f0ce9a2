"""A tiny two-sublayer DeepSeek-V4.1 decode block written as a user porting vLLM's torch code or DeepSeek's
reference `inference/model.py` would write it (our own code, a third style beside the model and hf_style.py):

- merged and stacked parameters: one `wqkv_a` [q_lora + kv_dim, D] split by `torch.split`, stacked `w13`
  [E, 2I, D] and `shared_w13` [2I, D] split by `chunk`;
- contractions as `x @ w.T`, `torch.einsum` and `torch.matmul`; the mHC mixing as `bmm(comb^T, x)`;
- RMSNorm as a module, `x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)` times the bf16 weight, promoted by the
  multiply (the same fp32 product as `w.float()`), rounded once;
- RoPE on `[.., rd/2, 2]` pairs by `unflatten(...).unbind(-1)` and `stack`, with the cos/sin table precomputed as
  one `[T, rd/2, 2]` tensor (cos, sin in the last dim); the inverse RoPE written out as its own formula
  (x0 c + x1 s, x1 c - x0 s) rather than as a rotation by -sin;
- the reference's FP8 scale `2^ceil(log2(amax / 448))` by exp2;
- the Sinkhorn loop with explicit row/column steps, dims counted from the front, eps added on the left;
- the router as `scores = F.linear(x.float(), w.float())`, `topk(scores + bias)` then `gather`;
- the indexer's visibility by `torch.where(visible, s, -inf)`, its selection as window-offset indices (-1 invalid);
- the MoE combine by `scatter_add_` over the expert-sorted rows, the routing weights applied before w2.

Attention itself is reduced to a projection of q (its sites are the ones around it).

forward(x [T, hc, D] bf16, pre_mix [T, hc] fp32, freqs [T, rd/2, 2] fp32, keys [T, N, ihd] bf16, n_c [T] int64)
  -> (h [T, D] bf16, x_new [T, hc, D] bf16, idx [T, k] int64)

Sites (each a fusion when the backend finds it): mhc_coeffs x2, qkv_norm, indexer_topk, wo_a, mhc_post_pre x2,
moe_route, moe_experts, moe_finalize.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .params import param_factory

EPS, HC_EPS, ITERS, ROUTE_SCALE, SWIGLU_LIMIT, WINDOW = 1e-20, 1e-6, 20, 1.5, 10.0, 8
T_SITES = {"mhc_coeffs": 2, "qkv_norm": 1, "indexer_topk": 1, "wo_a": 1, "mhc_post_pre": 2, "moe_route": 1,
           "moe_metadata": 1, "moe_experts": 1, "moe_finalize": 1}


class RMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float = EPS):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).type_as(x)


def rotate_pairs(x, cos, sin):
    """Interleaved RoPE of x [..., rd] on its (x[2i], x[2i+1]) pairs; cos, sin broadcast to [..., rd/2]."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2).type_as(x)


def unrotate_pairs(x, cos, sin):
    """The inverse rotation, written out."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x0 * cos + x1 * sin, x1 * cos - x0 * sin], dim=-1).flatten(-2).type_as(x)


def rope_tail(x, cos, sin, rotate=rotate_pairs):
    rd = 2 * cos.shape[-1]
    nope, pe = torch.split(x, [x.shape[-1] - rd, rd], dim=-1)
    return torch.cat([nope, rotate(pe, cos, sin)], dim=-1)


def act_quant(x, block=32):
    """The reference's act_quant round trip (ue8m0 scales) per `block` elements of the last dim."""
    shape = x.shape
    xf = x.float().reshape(-1, block)
    amax = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    y = (xf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    return y.to(x.dtype).reshape(shape)


class VllmStyleBlock(nn.Module):
    def __init__(self, d=64, hc=4, q_lora=32, kv_dim=64, heads=4, head_dim=32, groups=2, o_rank=16,
                 experts=8, topk=2, inter=64, index_heads=2, index_dim=32, index_topk=4, seed=0):
        super().__init__()
        p = param_factory(seed)
        n_mix = (2 + hc) * hc
        self.hc, self.q_lora, self.kv_dim, self.heads, self.groups, self.o_rank = hc, q_lora, kv_dim, heads, groups, o_rank
        self.n_experts, self.topk, self.inter, self.index_heads, self.index_dim, self.index_topk = (
            experts, topk, inter, index_heads, index_dim, index_topk)
        self.hc_fn = nn.ParameterDict({s: p(n_mix, hc * d, dtype=torch.float32) for s in ("attn", "ffn")})
        self.hc_base = nn.ParameterDict({s: p(n_mix, scale=0.5, dtype=torch.float32) for s in ("attn", "ffn")})
        self.hc_scale = nn.ParameterDict({s: p(3, scale=0.1, mean=1.0, dtype=torch.float32) for s in ("attn", "ffn")})
        self.attn_norm, self.ffn_norm, self.out_norm = (RMSNorm(p(d, scale=0.1, mean=1.0)) for _ in range(3))
        self.wqkv_a = p(q_lora + kv_dim, d)
        self.q_norm, self.kv_norm = RMSNorm(p(q_lora, scale=0.1, mean=1.0)), RMSNorm(p(kv_dim, scale=0.1, mean=1.0))
        self.wq_b = p(heads * head_dim, q_lora)
        self.index_wq, self.index_w = p(index_heads * index_dim, q_lora), p(index_heads, d)
        self.wo_a = p(groups * o_rank, heads // groups * head_dim)
        self.wo_b = p(d, groups * o_rank)
        self.gate, self.gate_bias = p(experts, d), p(experts, scale=0.1, dtype=torch.float32)
        self.w13, self.w2 = p(experts, 2 * inter, d), p(experts, d, inter)
        self.shared_w13, self.shared_w2 = p(2 * inter, d), p(d, inter)

    def hc_pre(self, x, site):
        """pre, post, comb of a site: the normalised GEMM by einsum, split, and the Sinkhorn loop."""
        t, hc, _ = x.shape
        xf = x.flatten(1).float()
        rsqrt = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
        mixes = torch.einsum("tk,nk->tn", xf, self.hc_fn[site]) * rsqrt
        m_pre, m_post, m_comb = torch.split(mixes, [hc, hc, hc * hc], dim=-1)
        b_pre, b_post, b_comb = torch.split(self.hc_base[site], [hc, hc, hc * hc], dim=-1)
        s_pre, s_post, s_comb = self.hc_scale[site].unbind(0)
        pre = torch.sigmoid(m_pre * s_pre + b_pre) + HC_EPS
        post = 2.0 * torch.sigmoid(m_post * s_post + b_post)
        comb = (m_comb.view(t, hc, hc) * s_comb + b_comb.view(hc, hc)).softmax(-1) + HC_EPS
        comb = comb / (HC_EPS + comb.sum(1, keepdim=True))
        for _ in range(ITERS - 1):
            comb = comb / (HC_EPS + comb.sum(2, keepdim=True))
            comb = comb / (HC_EPS + comb.sum(1, keepdim=True))
        return pre, post, comb

    @staticmethod
    def hc_post(y, residual, post, comb):
        """x'_k = sum_j comb[j, k] x_j + post_k y, in fp32 by bmm, stored bf16."""
        mixed = torch.bmm(comb.transpose(1, 2), residual.float())
        return (mixed + post.unsqueeze(2) * y.float().unsqueeze(1)).type_as(residual)

    @staticmethod
    def hc_collapse(x, pre):
        return torch.matmul(pre.unsqueeze(1), x.float()).squeeze(1).type_as(x)

    def attention(self, h, freqs, keys, n_c):
        t = h.shape[0]
        cos, sin = freqs.unbind(-1)
        qkv = act_quant(h) @ self.wqkv_a.T
        q, kv = torch.split(qkv, [self.q_lora, self.kv_dim], dim=-1)
        qr = self.q_norm(q)
        kv = act_quant(rope_tail(self.kv_norm(kv), cos, sin))
        # the indexer
        q_idx = (qr @ self.index_wq.T).view(t, self.index_heads, self.index_dim)
        w_idx = F.linear(h, self.index_w).float() * (self.index_dim ** -0.5 * self.index_heads ** -0.5)
        s = (torch.einsum("thd,tnd->thn", q_idx.float(), keys.float()).relu() * w_idx[:, :, None]).sum(dim=1)
        visible = torch.arange(keys.shape[1], device=keys.device)[None, :] < n_c[:, None]
        s = torch.where(visible, s, -math.inf)
        sel = s.topk(min(self.index_topk, s.shape[1]), dim=-1, sorted=False)[1].sort(dim=-1)[0]
        idx = torch.where(torch.gather(s, 1, sel) > -math.inf, sel + WINDOW, -1)
        # attention reduced to a projection of q, then the inverse RoPE and the grouped wo_a
        o = (act_quant(qr) @ self.wq_b.T).view(t, self.heads, -1) + kv[:, None, :1]
        o = rope_tail(o, cos[:, None], sin[:, None], unrotate_pairs)
        z = torch.matmul(o.view(t, self.groups, 1, -1), self.wo_a.view(self.groups, self.o_rank, -1).transpose(1, 2))
        return act_quant(z.view(t, -1)) @ self.wo_b.T, idx

    def moe(self, h):
        t, d, k, e = h.shape[0], h.shape[1], self.topk, self.n_experts
        scores = F.linear(h.float(), self.gate.float())
        scores = torch.sqrt(F.softplus(scores))
        topk_ids = torch.topk(scores + self.gate_bias, k, dim=-1)[1]
        topk_w = scores.gather(1, topk_ids)
        topk_w = topk_w / (topk_w.sum(dim=-1, keepdim=True) + 1e-20) * ROUTE_SCALE
        x = act_quant(h)
        flat_ids = topk_ids.view(-1)
        order = flat_ids.argsort(stable=True)
        token = torch.floor_divide(order, k)
        counts = torch.zeros(e, dtype=torch.int32, device=flat_ids.device).scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        gate_up = torch._grouped_mm(x[token], self.w13.transpose(1, 2), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate.float().clamp(max=SWIGLU_LIMIT)) * up.float().clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
        act = act_quant((act * topk_w.view(-1)[order][:, None]).to(h.dtype))
        rows = torch._grouped_mm(act, self.w2.transpose(1, 2), offs=offs)
        sg, su = (x @ self.shared_w13.T).chunk(2, dim=-1)
        shared_act = F.silu(sg.float().clamp(max=SWIGLU_LIMIT)) * su.float().clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
        shared = act_quant(shared_act.to(h.dtype)) @ self.shared_w2.T
        y = torch.zeros(t, d, dtype=torch.float32, device=rows.device).scatter_add_(0, token[:, None].expand(-1, d), rows.float())
        return (y + shared.float()).to(h.dtype)

    def forward(self, x, pre_mix, freqs, keys, n_c):
        pre_a, post_a, comb_a = self.hc_pre(x, "attn")
        h = self.attn_norm(self.hc_collapse(x, pre_mix))
        y, idx = self.attention(h, freqs, keys, n_c)
        x = self.hc_post(y, x, post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_pre(x, "ffn")
        h = self.ffn_norm(self.hc_collapse(x, pre_a))
        x = self.hc_post(self.moe(h), x, post_f, comb_f)
        return self.out_norm(self.hc_collapse(x, pre_f)), x, idx
