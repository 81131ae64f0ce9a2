"""A tiny two-sublayer DeepSeek-V4.1 decode block written from the spec (/work/shared/spec/dsv41_decode.md §2) the
way a researcher porting the paper into a minimal, readable codebase (nanoGPT / HF-Mixtral style) would (our own
code, a sixth style beside the model and the other blocks here), with the spellings those do not use:

- activations `(B, S, C)` with S = 1, unpacked as `B, S, _ = x.size()`;
- an `RMSNorm` module `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)` on `x.float()`, times the bf16
  weight (promoted to fp32, so one rounding, the spec's), then `.type_as(x)`;
- an `FP8Linear(nn.Linear)` that fake-quantises its input on every call (so `wq_a` and `wkv` each quantise h,
  two nodes computing one value), by `quant_dequant`: `reshape(-1, 32)` rows, `max(...).values`,
  the scale as `2.0 ** ceil(log2(amax / 448))`;
- the mHC coefficients with `m.split`, the scales by `unbind()`, the Sinkhorn as `for _ in range(iters - 1)`
  after the first column normalisation, the post as `comb^T @ x` by `torch.matmul` plus `post * y`, the collapse
  as `pre[..., None, :] @ x` by `torch.matmul`;
- RoPE GPT-J style: `x * cos + rotate_every_two(x) * sin` on the interleaved pairs (the spec's layout), cos/sin
  [B, S, rd/2] expanded by `repeat_interleave(2, -1)`, `rotate_every_two` as `stack((-x2, x1), -1).flatten(-2)`;
  the inverse with `-sin`;
- the indexer scores by `torch.matmul(q, keys.transpose(-1, -2))` and `F.relu`, visibility by
  `masked_fill(~mask, float('-inf'))`, `torch.topk(...).indices` then `.sort(-1).values`, validity as the spec
  writes it (`where(sel < n_c, sel + window, -1)`);
- the router with `F.softplus(...).sqrt()`, `scores + bias` for selection, `gather` for the weights,
  `/ w.sum(-1, keepdim=True)`; the experts by the selected experts' weights gathered per (token, slot)
  (`w1[topk_ids]`) and a dense `einsum` over them (one static-shape graph); the routing weight before w2;
  the combine by `torch.zeros(...).scatter_add_` of the [T * k, D] rows, the shared expert added.
Attention itself is reduced to q + kv (a single visible key, whose softmax weight is 1, so every head reads kv);
its sites are the ones around it.

forward(x [B, 1, hc, D] bf16, pre_mix [B, 1, hc] fp32, cos/sin [B, 1, rd/2] fp32, keys [B, N, ihd] bf16,
        n_c [B] int64) -> (h [B, 1, D] bf16, x_new [B, 1, hc, D] bf16, idx [B, 1, k] int64)

Sites (each a fusion when the backend finds it): mhc_coeffs x2, qkv_norm, indexer_topk, wo_a, mhc_post_pre x2,
moe_route, moe_experts, moe_finalize. No moe_metadata site (no sort); the experts, per-pair einsums on gathered
w1 / w3 / w2, are the gathered split formulation with the FP8 round trip of the [T, k, I] activation
(`reshape(-1, 32)` rows, the `2.0 ** ceil(log2(...))` scale) inside the op.

Measured when the block was written (fx mode, CPU): 8 of the 9 sites fused, qkv_norm only as its two norms
(`q_kv_norm_none_split`, the KV RoPE and FP8 step left as glue). The causes, and their general fixes
(`dsv41.passes.normalize`):
- GPT-J's RoPE (above) is not the patterns' pairwise form: the inverse RoPE before the einsum stopped wo_a (near
  miss "wrong op after 10 of 30 pattern ops: expected aten::view, found add.Tensor"), and qkv_norm's RoPE
  formulations did not match. Now `x * cos2 + rotate_every_two(x) * sin2`, with cos2/sin2 repeated by
  `repeat_interleave(2, -1)`, is the pairwise form (exact). Then qkv_norm fused with RoPE, still without the FP8
  step, and nothing recorded why (no `narrowed` entry).
- `quant_dequant`'s rows of the [B, 1, kv] value end in one view that merges the blocks and restores the unit dim,
  the cast below it, where the `unflatten` spelling ends at [B, kv], casts, then views [B, 1, kv]. Now the cast of
  such a view is the cast of the merged value, viewed after (exact).
After: all 9 fused, qkv_norm as `q_kv_norm_rope_fp8_split`, outputs equal to eager (test_tutorial_style.py).
- The experts stayed a near miss at their FP8 step: at I = 32 each row is one block, which the rows normalisation
  (then two or more blocks a row) left as the `[T k, 32]` view where the pattern has `[T, k, 1, 32]`, a scalar
  mismatch in the exact phase; past it, the combine read the experts' output as a `[T k, D]` view where the
  pattern's is `[T, k, D]`. (Not the operand order of `q.float() * scale`, once thought the cause: it pairs right.)
  Now rows of one block whose view merges leading dims run at the block view (normalize), and a pattern output the
  graph views to another shape is the op's output viewed so (the matcher): all 10 fuse, moe_experts as
  `gathered_einsum_split_fp8`, at B = 3 and B = 1.
head_dim is 64, two FP8 blocks a KV row (the spec's 512 dims are 16 blocks).
Tried and not kept (on the experts alone, outside this block): a Python loop over all experts with
`torch.where(ids == e)` rows compiles under `fullgraph=True, dynamic=False` (torch 2.13) through the backend to one
graph with data-dependent sizes, equal to eager on two routings without a recompile; no fusion matched it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .params import param_factory

EPS, HC_EPS, SINKHORN_ITERS, ROUTE_SCALE, SWIGLU_LIMIT, WINDOW, FP8_BLOCK = 1e-20, 1e-6, 20, 1.5, 10.0, 8, 32
T_SITES = {"mhc_coeffs": 2, "qkv_norm": 1, "indexer_topk": 1, "wo_a": 1, "mhc_post_pre": 2, "moe_route": 1,
           "moe_experts": 1, "moe_finalize": 1}


def quant_dequant(x, block=FP8_BLOCK):
    """FP8 e4m3 round trip per block of 32 along the last dim with a power-of-two scale (spec §2.3)."""
    rows = x.float().reshape(-1, block)
    amax = rows.abs().max(dim=-1, keepdim=True).values.clamp(min=1e-4)
    scale = 2.0 ** torch.ceil(torch.log2(amax / 448.0))
    q = (rows / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(x.shape).to(x.dtype)


def rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope(x, cos, sin):
    """Interleaved RoPE on the last 2 * cos.shape[-1] dims of x [B, S, ..., d]; cos/sin [B, S, rd/2] fp32."""
    rd = 2 * cos.shape[-1]
    extra = x.dim() - cos.dim()
    cos = cos.repeat_interleave(2, dim=-1).view(*cos.shape[:2], *([1] * extra), rd)
    sin = sin.repeat_interleave(2, dim=-1).view(*sin.shape[:2], *([1] * extra), rd)
    x_pass, x_rot = x[..., :-rd], x[..., -rd:].float()
    x_rot = x_rot * cos + rotate_every_two(x_rot) * sin
    return torch.cat((x_pass, x_rot.type_as(x)), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)

    def forward(self, x):
        return (self._norm(x.float()) * self.weight).type_as(x)


class FP8Linear(nn.Linear):
    """nn.Linear(bias=False) whose input is FP8-rounded first, as the checkpoint's FP8 GEMMs quantise activations."""

    def forward(self, x):
        return F.linear(quant_dequant(x), self.weight)


def linear(p, in_f, out_f, cls=nn.Linear, dtype=torch.bfloat16):
    layer = cls(in_f, out_f, bias=False, dtype=dtype)
    layer.weight = p(out_f, in_f, dtype=dtype)
    return layer


class HyperConnection(nn.Module):
    """One mHC site's coefficients (spec §2.2): pre [B, S, hc], post [B, S, hc], comb [B, S, hc, hc]."""

    def __init__(self, p, hc, dim):
        super().__init__()
        self.hc = hc
        self.fn = linear(p, hc * dim, (2 + hc) * hc, dtype=torch.float32)
        self.base = p((2 + hc) * hc, scale=0.5, dtype=torch.float32)
        self.scale = p(3, scale=0.1, mean=1.0, dtype=torch.float32)

    def forward(self, x):
        hc = self.hc
        B, S, _, _ = x.size()
        xf = x.view(B, S, -1).float()
        m = self.fn(xf) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
        m_pre, m_post, m_comb = m.split([hc, hc, hc * hc], dim=-1)
        b_pre, b_post, b_comb = self.base.split([hc, hc, hc * hc], dim=-1)
        a_pre, a_post, a_comb = self.scale.unbind()
        pre = torch.sigmoid(m_pre * a_pre + b_pre) + HC_EPS
        post = 2 * torch.sigmoid(m_post * a_post + b_post)
        comb = (m_comb * a_comb + b_comb).view(B, S, hc, hc).softmax(dim=-1) + HC_EPS
        comb = comb / (comb.sum(dim=-2, keepdim=True) + HC_EPS)
        for _ in range(SINKHORN_ITERS - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + HC_EPS)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + HC_EPS)
        return pre, post, comb


def hc_collapse(x, pre):
    """sum_j pre_j * x_j in fp32, rounded once: x [B, S, hc, D], pre [B, S, hc] -> [B, S, D]."""
    return torch.matmul(pre.unsqueeze(-2), x.float()).squeeze(-2).type_as(x)


def hc_expand(y, x, post, comb):
    """x'_k = post_k * y + sum_j comb[j, k] * x_j in fp32, rounded once -> [B, S, hc, D]."""
    mixed = torch.matmul(comb.transpose(-1, -2), x.float())
    return (mixed + post.unsqueeze(-1) * y.float().unsqueeze(-2)).type_as(x)


class TutorialStyleBlock(nn.Module):
    def __init__(self, dim=64, hc=4, q_lora=32, n_heads=4, head_dim=64, rope_dim=16, o_groups=2, o_rank=16,
                 n_experts=8, topk=2, inter=32, index_heads=2, index_dim=32, index_topk=4, seed=0):
        super().__init__()
        p = param_factory(seed)
        self.hc, self.n_heads, self.head_dim, self.rope_dim = hc, n_heads, head_dim, rope_dim
        self.o_groups, self.o_rank, self.n_experts, self.topk, self.inter = o_groups, o_rank, n_experts, topk, inter
        self.index_heads, self.index_dim, self.index_topk = index_heads, index_dim, index_topk
        self.hc_attn, self.hc_ffn = HyperConnection(p, hc, dim), HyperConnection(p, hc, dim)
        self.attn_norm, self.ffn_norm, self.norm = (RMSNorm(p(dim, scale=0.1, mean=1.0)) for _ in range(3))
        self.wq_a, self.wkv = linear(p, dim, q_lora, FP8Linear), linear(p, dim, head_dim, FP8Linear)
        self.q_norm, self.kv_norm = RMSNorm(p(q_lora, scale=0.1, mean=1.0)), RMSNorm(p(head_dim, scale=0.1, mean=1.0))
        self.wq_b = linear(p, q_lora, n_heads * head_dim, FP8Linear)
        self.index_wq_b = linear(p, q_lora, index_heads * index_dim, FP8Linear)
        self.index_weights_proj = linear(p, dim, index_heads)
        self.wo_a = linear(p, n_heads // o_groups * head_dim, o_groups * o_rank)
        self.wo_b = linear(p, o_groups * o_rank, dim, FP8Linear)
        self.gate = linear(p, dim, n_experts)
        self.gate_bias = p(n_experts, scale=0.1, dtype=torch.float32)
        self.w1, self.w3, self.w2 = p(n_experts, inter, dim), p(n_experts, inter, dim), p(n_experts, dim, inter)
        self.shared_w1, self.shared_w3 = linear(p, dim, inter, FP8Linear), linear(p, dim, inter, FP8Linear)
        self.shared_w2 = linear(p, inter, dim, FP8Linear)

    def attention(self, h, cos, sin, keys, n_c):
        B, S, _ = h.size()
        qr = self.q_norm(self.wq_a(h))
        q = apply_rope(self.wq_b(qr).view(B, S, self.n_heads, self.head_dim), cos, sin)
        kv = quant_dequant(apply_rope(self.kv_norm(self.wkv(h)), cos, sin))
        # the indexer (spec §2.4), scores in fp32
        q_idx = self.index_wq_b(qr).view(B, S, self.index_heads, self.index_dim)
        w_idx = self.index_weights_proj(h).float() * (self.index_dim ** -0.5 * self.index_heads ** -0.5)
        scores = F.relu(torch.matmul(q_idx.float(), keys.float().unsqueeze(1).transpose(-1, -2)))
        scores = (scores * w_idx.unsqueeze(-1)).sum(dim=-2)
        visible = torch.arange(keys.size(1), device=keys.device) < n_c.view(B, 1, 1)
        scores = scores.masked_fill(~visible, float("-inf"))
        sel = torch.topk(scores, min(self.index_topk, keys.size(1)), dim=-1).indices.sort(dim=-1).values
        idx = torch.where(sel < n_c.view(B, 1, 1), sel + WINDOW, -1)
        # attention over one visible key (kv) is kv itself; q added so the q path stays live
        o = q + kv.unsqueeze(-2)
        o = apply_rope(o, cos, -sin)
        w = self.wo_a.weight.view(self.o_groups, self.o_rank, -1)
        z = torch.einsum("bsgd,grd->bsgr", o.reshape(B, S, self.o_groups, -1), w)
        return self.wo_b(z.reshape(B, S, -1)), idx

    def moe(self, h):
        B, S, C = h.size()
        x = h.view(-1, C)
        scores = F.softplus(F.linear(x.float(), self.gate.weight.float())).sqrt()
        topk_ids = torch.topk(scores + self.gate_bias, self.topk, dim=-1).indices
        w = scores.gather(-1, topk_ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * ROUTE_SCALE
        xq = quant_dequant(x)
        g = torch.einsum("tc,tkic->tki", xq, self.w1[topk_ids]).float()
        u = torch.einsum("tc,tkic->tki", xq, self.w3[topk_ids]).float()
        a = F.silu(g.clamp(max=SWIGLU_LIMIT)) * u.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT) * w.unsqueeze(-1)
        rows = torch.einsum("tki,tkci->tkc", quant_dequant(a.type_as(h)), self.w2[topk_ids])
        token = torch.arange(x.size(0), device=x.device).repeat_interleave(self.topk)
        y = torch.zeros(x.size(0), C, device=x.device).scatter_add_(0, token.unsqueeze(-1).expand(-1, C), rows.reshape(-1, C).float())
        sg, su = self.shared_w1(x).float(), self.shared_w3(x).float()
        shared = self.shared_w2((F.silu(sg.clamp(max=SWIGLU_LIMIT)) * su.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)).type_as(h))
        return (y + shared.float()).type_as(h).view(B, S, C)

    def forward(self, x, pre_mix, cos, sin, keys, n_c):
        pre_a, post_a, comb_a = self.hc_attn(x)
        h = self.attn_norm(hc_collapse(x, pre_mix))
        y, idx = self.attention(h, cos, sin, keys, n_c)
        x = hc_expand(y, x, post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_ffn(x)
        h = self.ffn_norm(hc_collapse(x, pre_a))
        x = hc_expand(self.moe(h), x, post_f, comb_f)
        return self.norm(hc_collapse(x, pre_f)), x, idx
