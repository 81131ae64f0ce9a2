"""A DeepSeek-V4.1 decode block written from the spec alone (/work/shared/spec/dsv41_decode.md) by an engineer who
reaches for library functions: `F.rms_norm` with its weight and eps, `F.linear`, `torch.addcmul` / `torch.bmm` /
`torch.einsum`, `F.softplus`, `F.silu`, `torch.clamp`, `torch.split` / `torch.chunk` / `torch.stack` / `unbind`,
`torch.outer` angles, `torch.frexp` / `torch.ldexp` FP8 scales, `torch.linalg.vecdot` collapses, `take_along_dim`
gathers, a stable `torch.sort` with `torch.searchsorted` expert offsets, `repeat_interleave` pair tokens and an
`index_add` combine. Batch-first `[B, ...]` activations (one token per request), weights `[out, in]`.

The numerics are the spec's: fp32 mHC, post, collapse and norms (one rounding after the fp32 weight multiply), the
interleaved RoPE in fp32, the per-32 ue8m0 FP8 fake quantisation of every GEMM input and of the window KV, FP4
(e2m1, per-32 ue8m0) index queries with fp32 index scores, sqrt-softplus noaux_tc routing, the clamped SwiGLU in
fp32 weighted before w2, and the fp32 combine plus the shared expert rounded once to bf16.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .params import param_factory

BF16, F32 = torch.bfloat16, torch.float32

# Sizes of this block (small, its own): model width, mHC streams, heads, head and RoPE dims, q LoRA rank, wo_a
# groups and rank, window slots, compressed rows, index heads / dim / top-k, experts, experts per token, expert
# width; the FP8 / FP4 block. Model constants are the spec's (2.9).
D, HC, H, HD, RD, QL = 96, 4, 4, 64, 16, 64
GROUPS, O_RANK, WINDOW, N_CAP, RATIO = 2, 32, 8, 20, 2
IDX_HEADS, IDX_DIM, IDX_TOPK = 4, 32, 8
N_EXPERTS, TOP_K, INTER = 12, 4, 32
BLOCK = 32
NORM_EPS, HC_EPS, SINKHORN_ITERS = 1e-20, 1e-6, 20
ROUTE_SCALE, SWIGLU_LIMIT = 1.5, 10.0
FP8_MAX, FP4_MAX = 448.0, 6.0

# The decode sites of the block, each fused once (tests/passes/foreign/test_libfn_style.py).
SITES = {"mhc_coeffs": 2, "qkv_norm": 1, "indexer_topk": 1, "wo_a": 1, "mhc_post_pre": 2, "moe_route": 1,
         "moe_metadata": 1, "moe_experts": 1, "moe_finalize": 1}


def pow2_at_least(x):
    """2^ceil(log2(x)) for positive normal fp32 x, exactly: frexp gives x = m * 2^e with m in [0.5, 1), so the
    power is 2^e, or 2^(e-1) where x is itself a power of two (m == 0.5)."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), exponent - (mantissa == 0.5).to(exponent.dtype))


def fake_fp8(x):
    """Per-32 ue8m0 FP8 e4m3 round trip of x's last dim (spec 2.3): s = 2^ceil(log2(max(amax, 1e-4) / 448)),
    x <- e4m3(clamp(x / s, +-448)) * s, back in x's dtype."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    amax = torch.clamp(torch.amax(blocks.abs(), dim=-1, keepdim=True), min=1e-4)
    scale = pow2_at_least(amax / FP8_MAX)
    q = torch.clamp(blocks / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(F32)
    return (q * scale).flatten(-2).to(x.dtype)


def fake_fp4(x):
    """Per-32 ue8m0 FP4 e2m1 round trip (spec 2.3): s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)), x <- e2m1(clamp(x /
    s, +-6)) * s, e2m1 rounding half to even on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-126)
    scale = pow2_at_least(amax / FP4_MAX)
    y = torch.clamp(blocks / scale, -FP4_MAX, FP4_MAX)
    mag = y.abs()
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    q = torch.copysign(torch.round(mag / step) * step, y)
    return (q * scale).flatten(-2).to(x.dtype)


def rotate_pairs(x, cos, sin):
    """Interleaved RoPE of the adjacent pairs of x's last dim in fp32, back in x's dtype: (a, b) ->
    (a cos - b sin, a sin + b cos); cos, sin broadcast against x[..., ::2]. The inverse rotation passes -sin."""
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([torch.addcmul(a * cos, b, sin, value=-1), torch.addcmul(b * cos, a, sin)], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def rope_tail(x, cos, sin):
    """x with its last RD dims rotated (cos, sin [B, RD/2], broadcast over x's middle dims)."""
    head, tail = torch.split(x, [x.shape[-1] - RD, RD], dim=-1)
    mid = (1,) * (x.dim() - 2)
    return torch.cat([head, rotate_pairs(tail, cos.view(cos.shape[0], *mid, -1), sin.view(sin.shape[0], *mid, -1))], -1)


def hc_coefficients(x, fn, base, scale):
    """mHC coefficients (spec 2.2): x [B, HC, D] bf16 -> pre, post [B, HC], comb [B, HC, HC] fp32."""
    flat = x.flatten(1).float()
    inv_rms = flat.pow(2).mean(dim=-1, keepdim=True).add(NORM_EPS).rsqrt()
    mixes = F.linear(flat, fn) * inv_rms
    m_pre, m_post, m_comb = torch.split(mixes, [HC, HC, HC * HC], dim=-1)
    b_pre, b_post, b_comb = torch.split(base, [HC, HC, HC * HC])
    s_pre, s_post, s_comb = scale.unbind()
    pre = torch.sigmoid(torch.addcmul(b_pre, m_pre, s_pre)) + HC_EPS
    post = torch.sigmoid(torch.addcmul(b_post, m_post, s_post)) * 2.0
    logits = torch.addcmul(b_comb.view(HC, HC), m_comb.view(-1, HC, HC), s_comb)
    comb = F.softmax(logits, dim=-1) + HC_EPS
    comb = comb / (comb.sum(dim=-2, keepdim=True) + HC_EPS)
    for _ in range(SINKHORN_ITERS - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + HC_EPS)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + HC_EPS)
    return pre, post, comb


def hc_expand(y, x, post, comb):
    """mHC post: X'_k = post_k y + sum_j comb[j, k] X_j in fp32, stored bf16. y [B, D], x [B, HC, D]."""
    mixed = (comb.unsqueeze(-1) * x.float().unsqueeze(2)).sum(dim=1)
    return torch.addcmul(mixed, post.unsqueeze(-1), y.float().unsqueeze(1)).to(BF16)


def hc_reduce_norm(x, pre, weight):
    """Collapse u = sum_j pre_j X_j (fp32, stored bf16), then RMSNorm with the weight (fp32 inside, one rounding)."""
    u = torch.linalg.vecdot(pre.unsqueeze(-1), x.float(), dim=1).to(BF16)
    return F.rms_norm(u, (u.shape[-1],), weight, eps=NORM_EPS)


def clamped_swiglu(gate_up):
    """silu(min(g, 10)) * clamp(u, -10, 10) in fp32 of the [..., 2 I] GEMM1 output's halves, the limit a 0-d tensor."""
    limit = torch.tensor(SWIGLU_LIMIT)
    g, u = torch.chunk(gate_up.float(), 2, dim=-1)
    return F.silu(torch.clamp(g, max=limit)) * torch.clamp(u, -limit, limit)


class LibFnBlock(nn.Module):
    """One decode layer of an index-source ratio-2 layer: the attention sublayer (mHC coefficients, collapse + norm,
    q / kv norms with the KV RoPE and FP8 step, the indexer's top-k, sparse attention with sink, the inverse RoPE
    and grouped wo_a, wo_b) and the MoE sublayer (router, sorted rows, grouped experts, combine + shared expert),
    each followed by the mHC post and the next collapse + norm.

    forward(x [B, HC, D] bf16, pre_mix [B, HC] fp32, pos [B] int64, window [B, WINDOW, HD] bf16,
    compressed [B, N_CAP, HD] bf16, index_keys [B, N_CAP, IDX_DIM] bf16) -> (h [B, D] bf16, the next sublayer's
    normed input; x_new [B, HC, D] bf16; sel [B, IDX_TOPK] int64, the indexer's picks offset by WINDOW, -1 invalid).
    """

    def __init__(self, seed: int = 0):
        super().__init__()
        p = param_factory(seed)
        self.hc_attn_fn, self.hc_ffn_fn = (p((2 + HC) * HC, HC * D, dtype=F32) for _ in range(2))
        self.hc_attn_base, self.hc_ffn_base = (p((2 + HC) * HC, scale=0.5, dtype=F32) for _ in range(2))
        self.hc_attn_scale, self.hc_ffn_scale = (p(3, scale=0.1, mean=1.0, dtype=F32) for _ in range(2))
        self.attn_norm, self.ffn_norm, self.next_attn_norm = (p(D, scale=0.1, mean=1.0) for _ in range(3))
        self.wqkv_a = p(QL + HD, D)
        self.q_norm, self.kv_norm = p(QL, scale=0.1, mean=1.0), p(HD, scale=0.1, mean=1.0)
        self.wq_b = p(H * HD, QL)
        self.wo_a = p(GROUPS * O_RANK, H // GROUPS * HD)
        self.wo_b = p(D, GROUPS * O_RANK)
        self.attn_sink = p(H, scale=1.0, dtype=F32)
        self.idx_wq_b = p(IDX_HEADS * IDX_DIM, QL)
        self.idx_weights = p(IDX_HEADS, D)
        self.gate = p(N_EXPERTS, D)
        self.gate_bias = p(N_EXPERTS, scale=0.1, dtype=F32)
        self.w13 = p(N_EXPERTS, 2 * INTER, D)
        self.w2 = p(N_EXPERTS, D, INTER)
        self.shared_w13, self.shared_w2 = p(2 * INTER, D), p(D, INTER)
        # The compress table (spec 2.3): theta 1.6e5 with the YaRN blend, factor 16, at this block's RD.
        i = torch.arange(RD // 2, dtype=torch.float64)
        freqs = 160000.0 ** (-2 * i / RD)
        corr = lambda r: RD * math.log(65536 / (2 * math.pi * r)) / (2 * math.log(160000.0))  # noqa: E731
        low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), RD - 1)
        keep = 1 - torch.clamp((i - low) / max(high - low, 1e-3), 0, 1)
        self.register_buffer("inv_freq", (freqs / 16 * (1 - keep) + freqs * keep).to(F32), persistent=False)

    def attention(self, h, pos, window, compressed, index_keys):
        """h [B, D] bf16 -> (y [B, D] bf16, sel [B, IDX_TOPK] int64)."""
        b = h.shape[0]
        angles = torch.outer(pos.to(F32), self.inv_freq)
        cos, sin = angles.cos(), angles.sin()
        xq = fake_fp8(h)
        q_lat, kv = torch.split(F.linear(xq, self.wqkv_a), [QL, HD], dim=-1)
        qr = F.rms_norm(q_lat, (QL,), self.q_norm, eps=NORM_EPS)
        kv = F.rms_norm(kv, (HD,), self.kv_norm, eps=NORM_EPS)
        kv = fake_fp8(rope_tail(kv, cos, sin))
        q = rope_tail(F.linear(fake_fp8(qr), self.wq_b).view(b, H, HD), cos, sin)

        # Indexer (spec 2.4): fp32 scores over the visible compressed rows, top-k, window offset.
        n_c = torch.div(pos + 1, RATIO, rounding_mode="floor")
        qi = F.linear(fake_fp8(qr), self.idx_wq_b).view(b, IDX_HEADS, IDX_DIM)
        qi = fake_fp4(rope_tail(qi, cos, sin))
        head_w = F.linear(h, self.idx_weights).float() * (IDX_DIM**-0.5 * IDX_HEADS**-0.5)
        logits = torch.bmm(qi.float(), index_keys.float().transpose(1, 2))
        scores = torch.sum(F.relu(logits) * head_w.unsqueeze(-1), dim=1)
        visible = torch.arange(N_CAP, device=h.device).unsqueeze(0) < n_c.unsqueeze(1)
        scores = torch.where(visible, scores, -math.inf)
        picks = torch.topk(scores, min(IDX_TOPK, N_CAP), dim=-1, sorted=False).indices
        picks, _ = torch.sort(picks, dim=-1)
        sel = torch.where(picks < n_c.unsqueeze(1), picks + WINDOW, torch.full_like(picks, -1))

        # Window ring write and the sparse attention with sink (spec 2.3, 2.5).
        ring = torch.index_put(window, (torch.arange(b, device=h.device), pos % WINDOW), kv)
        slots = torch.remainder(pos.unsqueeze(1) + 1 + torch.arange(WINDOW, device=h.device), WINDOW)
        slots = torch.where(slots <= pos.unsqueeze(1), slots, -1)
        idx = torch.cat([slots, sel], dim=1)
        rows = torch.take_along_dim(torch.cat([ring, compressed], 1), idx.clamp(min=0).unsqueeze(-1), dim=1).float()
        att = torch.einsum("bhd,bkd->bhk", q.float(), rows) * HD**-0.5
        att = att.masked_fill((idx < 0).unsqueeze(1), -math.inf)
        m = torch.maximum(att.amax(dim=-1), self.attn_sink)
        prob = torch.exp(att - m.unsqueeze(-1))
        denom = prob.sum(dim=-1) + torch.exp(self.attn_sink - m)
        o = torch.einsum("bhk,bkd->bhd", prob / denom.unsqueeze(-1), rows).to(BF16)

        # Inverse RoPE of the output and the grouped wo_a (spec 2.5), one bmm over the groups.
        o = rope_tail(o, cos, sin.neg())
        per_group = o.view(b, GROUPS, -1).transpose(0, 1)
        z = torch.bmm(per_group, self.wo_a.view(GROUPS, O_RANK, -1).transpose(1, 2)).transpose(0, 1).reshape(b, -1)
        return F.linear(fake_fp8(z), self.wo_b), sel

    def moe(self, h):
        """h [B, D] bf16 -> y [B, D] bf16 (spec 2.6)."""
        b = h.shape[0]
        scores = torch.sqrt(F.softplus(F.linear(h.float(), self.gate.float())))
        experts = torch.topk(scores + self.gate_bias, TOP_K, dim=-1).indices
        w = torch.take_along_dim(scores, experts, dim=1)
        w = torch.div(w, w.sum(dim=-1, keepdim=True) + 1e-20) * ROUTE_SCALE

        flat = experts.flatten()
        sorted_ids, order = torch.sort(flat, stable=True)
        offsets = torch.searchsorted(sorted_ids, torch.arange(N_EXPERTS, device=h.device), right=True).to(torch.int32)
        token = torch.arange(b, device=h.device).repeat_interleave(TOP_K).index_select(0, order)
        row_w = w.flatten().index_select(0, order)

        xq = fake_fp8(h)
        gate_up = torch._grouped_mm(xq.index_select(0, token), self.w13.transpose(1, 2), offs=offsets)
        act = (clamped_swiglu(gate_up) * row_w.unsqueeze(-1)).to(BF16)
        out = torch._grouped_mm(fake_fp8(act), self.w2.transpose(1, 2), offs=offsets)
        routed = torch.zeros(b, D, dtype=F32, device=h.device).index_add(0, token, out.float())

        shared = F.linear(fake_fp8(clamped_swiglu(F.linear(xq, self.shared_w13)).to(BF16)), self.shared_w2)
        return (routed + shared.float()).to(BF16)

    def forward(self, x, pre_mix, pos, window, compressed, index_keys):
        pre_a, post_a, comb_a = hc_coefficients(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        h = hc_reduce_norm(x, pre_mix, self.attn_norm)
        y, sel = self.attention(h, pos, window, compressed, index_keys)
        x = hc_expand(y, x, post_a, comb_a)
        pre_f, post_f, comb_f = hc_coefficients(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        h = hc_reduce_norm(x, pre_a, self.ffn_norm)
        x = hc_expand(self.moe(h), x, post_f, comb_f)
        return hc_reduce_norm(x, pre_f, self.next_attn_norm), x, sel


def inputs(seed: int, block: LibFnBlock, b: int = 3):
    """Fresh decode inputs of B = b requests: streams, a positive carried pre, positions whose visible compressed
    rows N_c = (p + 1) // 2 run from fewer than the top-k to all N_CAP, and the caches."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, HC, D, generator=g).to(BF16)
    pre_mix = torch.rand(b, HC, generator=g) + 0.1
    pos = torch.randint(4, RATIO * N_CAP, (b,), generator=g)
    window = torch.randn(b, WINDOW, HD, generator=g).to(BF16)
    compressed = torch.randn(b, N_CAP, HD, generator=g).to(BF16)
    index_keys = torch.randn(b, N_CAP, IDX_DIM, generator=g).to(BF16)
    return x, pre_mix, pos, window, compressed, index_keys
