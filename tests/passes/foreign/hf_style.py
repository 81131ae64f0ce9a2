"""A tiny two-sublayer DeepSeek-V4.1 decode block written in the style of the Hugging Face port (our own code):
separate wq_a / wkv GEMMs, einsum stream mixing, multiply-then-sum collapse, stride-2 RoPE, the exp2 FP8 scale,
the indexer's selection as an additive -inf mask over the compressed rows (its validity by position, n >= n_c), and
the routing weights applied after w2 (vLLM's order). Attention itself is
reduced to a projection of q (its sites are the ones around it); the MoE runs every routed (token, expert) pair.

forward(x [T, hc, D] bf16, pre_mix [T, hc] fp32, cos/sin [T, rd/2] fp32, keys [T, N, ihd] bf16, n_c [T] int64)
  -> (h [T, D] bf16, x_new [T, hc, D] bf16, index_mask [T, N] fp32: 0 at the selected rows, -inf elsewhere)

Sites (each a fusion when the backend finds it): mhc_coeffs x2, qkv_norm, indexer_topk, wo_a, mhc_post_pre x2,
moe_route, moe_experts (its flat pairs' bmm over `w13[flat_e]`, a site since 2026-12-02), moe_finalize.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .params import param_factory

EPS, HC_EPS, ITERS, ROUTE_SCALE, SWIGLU_LIMIT = 1e-20, 1e-6, 20, 1.5, 10.0
T_SITES = {"mhc_coeffs": 2, "qkv_norm": 1, "indexer_topk": 1, "wo_a": 1, "mhc_post_pre": 2, "moe_route": 1,
           "moe_experts": 1, "moe_finalize": 1}


def rms_norm(x, w):
    xf = x.float()
    return (w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS))).to(x.dtype)


def rotate_stride2(x, cos, sin):
    """Interleaved RoPE on the last rd dims, pairs by stride-2 slicing."""
    rd = cos.shape[-1] * 2
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    tail = x[..., -rd:].float()
    x0, x1 = tail[..., 0::2], tail[..., 1::2]
    rot = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rd], rot), dim=-1)


def fp8_round_trip(x, block=32):
    xf = x.float().unflatten(-1, (-1, block))
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    return ((xf / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s).flatten(-2).to(x.dtype)


class HFStyleBlock(nn.Module):
    def __init__(self, d=64, hc=4, q_lora=32, kv_dim=32, heads=4, head_dim=32, groups=2, o_rank=16,
                 experts=8, topk=2, inter=32, index_heads=2, index_dim=32, index_topk=4, seed=0):
        super().__init__()
        p = param_factory(seed)
        n_mix = (2 + hc) * hc
        self.hc, self.heads, self.groups, self.o_rank, self.topk, self.index_topk = hc, heads, groups, o_rank, topk, index_topk
        self.index_heads, self.index_dim, self.inter = index_heads, index_dim, inter
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", p(n_mix, hc * d, dtype=torch.float32))
            setattr(self, f"hc_{site}_base", p(n_mix, scale=0.5, dtype=torch.float32))
            setattr(self, f"hc_{site}_scale", p(3, scale=0.1, mean=1.0, dtype=torch.float32))
        self.attn_norm, self.ffn_norm, self.out_norm = p(d, scale=0.1, mean=1.0), p(d, scale=0.1, mean=1.0), p(d, scale=0.1, mean=1.0)
        self.wq_a, self.wkv = p(q_lora, d), p(kv_dim, d)
        self.q_norm, self.kv_norm = p(q_lora, scale=0.1, mean=1.0), p(kv_dim, scale=0.1, mean=1.0)
        self.wq_b = p(heads * head_dim, q_lora)
        self.index_wq, self.index_w = p(index_heads * index_dim, q_lora), p(index_heads, d)
        self.wo_a = p(groups * o_rank, heads // groups * head_dim)
        self.wo_b = p(d, groups * o_rank)
        self.gate, self.gate_bias = p(experts, d), p(experts, scale=0.1, dtype=torch.float32)
        self.w13, self.w2 = p(experts, 2 * inter, d), p(experts, d, inter)
        self.shared_w13, self.shared_w2 = p(2 * inter, d), p(d, inter)

    def mixes(self, x, site):
        """pre, post, comb of a site: F.linear on the normalised streams, the Sinkhorn loop."""
        t, hc, _ = x.shape
        fn_w, base, scale = (getattr(self, f"hc_{site}_{k}") for k in ("fn", "base", "scale"))
        xf = x.flatten(1).float()
        m = F.linear(xf, fn_w) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
        pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + HC_EPS
        post = 2.0 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
        c = torch.softmax(m[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), dim=-1) + HC_EPS
        for i in range(2 * ITERS - 1):
            c = c / (c.sum(dim=-2 if i % 2 == 0 else -1, keepdim=True) + HC_EPS)
        return pre, post, c

    def post(self, y, x, post, comb):
        """einsum mixing, then the scaled output added."""
        return (torch.einsum("tjk,tjd->tkd", comb, x.float()) + post.unsqueeze(-1) * y.float().unsqueeze(1)).to(x.dtype)

    @staticmethod
    def collapse(x, pre):
        return (x.float() * pre.unsqueeze(-1)).sum(dim=1).to(x.dtype)

    def attention(self, h, cos, sin, keys, n_c):
        t = h.shape[0]
        qr = rms_norm(F.linear(h, self.wq_a), self.q_norm)
        kv = fp8_round_trip(rotate_stride2(rms_norm(F.linear(h, self.wkv), self.kv_norm), cos, sin))
        q_idx = F.linear(qr, self.index_wq).view(t, self.index_heads, self.index_dim)
        w_idx = F.linear(h, self.index_w).float()
        s = (torch.einsum("thd,tnd->thn", q_idx.float(), keys.float()).relu() * w_idx.unsqueeze(-1)).sum(dim=1)
        s = s.masked_fill(~(torch.arange(keys.shape[1], device=keys.device) < n_c.unsqueeze(-1)), -math.inf)
        sel = torch.topk(s, min(self.index_topk, s.shape[1]), dim=-1).indices
        index_mask = torch.full_like(s, -math.inf).scatter_(-1, sel, 0.0)
        index_mask = index_mask.masked_fill(torch.arange(keys.shape[1], device=keys.device) >= n_c.unsqueeze(-1), -math.inf)
        o = F.linear(qr, self.wq_b).view(t, self.heads, -1) + kv[:, None, :1]  # attention reduced to a projection
        o = rotate_stride2(o, cos, -sin)  # undo the RoPE
        z = torch.einsum("tgd,grd->tgr", o.view(t, self.groups, -1), self.wo_a.view(self.groups, self.o_rank, -1)).flatten(1)
        return F.linear(z, self.wo_b), index_mask

    def moe(self, h):
        t, k = h.shape[0], self.topk
        scores = F.softplus(F.linear(h.float(), self.gate.float())).sqrt()
        experts = torch.topk(scores + self.gate_bias, k).indices
        w = scores.gather(1, experts)
        weights = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * ROUTE_SCALE
        token = torch.arange(t, device=h.device).repeat_interleave(k)
        flat_e = experts.flatten()
        gu = torch.bmm(self.w13[flat_e], h[token].unsqueeze(-1)).squeeze(-1)
        a = (F.silu(gu[:, :self.inter].float().clamp(max=SWIGLU_LIMIT)) * gu[:, self.inter:].float().clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)).to(h.dtype)
        rows = torch.bmm(self.w2[flat_e], a.unsqueeze(-1)).squeeze(-1)
        gs = F.linear(h, self.shared_w13)
        shared = F.linear((F.silu(gs[:, :self.inter].float()) * gs[:, self.inter:].float()).to(h.dtype), self.shared_w2)
        y = torch.zeros(t, h.shape[1], dtype=torch.float32, device=h.device).index_add_(0, token, rows.float() * weights.flatten()[:, None])
        return (y + shared.float()).to(h.dtype)

    def forward(self, x, pre_mix, cos, sin, keys, n_c):
        pre_a, post_a, comb_a = self.mixes(x, "attn")
        h = rms_norm(self.collapse(x, pre_mix), self.attn_norm)
        y, index_mask = self.attention(h, cos, sin, keys, n_c)
        x = self.post(y, x, post_a, comb_a)
        pre_f, post_f, comb_f = self.mixes(x, "ffn")
        h = rms_norm(self.collapse(x, pre_a), self.ffn_norm)
        x = self.post(self.moe(h), x, post_f, comb_f)
        return rms_norm(self.collapse(x, pre_f), self.out_norm), x, index_mask
