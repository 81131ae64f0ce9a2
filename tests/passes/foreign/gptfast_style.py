"""A DeepSeek-V4.1 MoE sublayer (spec §2.6) written in the style of gpt-fast's Mixtral `MOEFeedForward` /
`ConditionalFeedForward` (our own code): the decode-time formulation without a sort, each token's expert weights
gathered and multiplied in batched einsums.

- `x.view(-1, dim)` of the `[B, S=1, D]` activations; the router by `F.linear` on fp32 (the bf16 `nn.Linear` gate's
  weight cast, as the spec computes it), `F.softplus(...).sqrt()`,
  `torch.topk(scores + bias, k)`, the weights by `gather`, normalised in place (`/=`) and scaled;
- the routed experts as gpt-fast's `ConditionalFeedForward`: `w1`, `w3`, `w2` parameters `[E, I, D]` / `[E, D, I]`
  held apart, `self.w1[expert_indices]` gathered per (token, slot), `einsum('ti,taoi->tao')`, the clamped SwiGLU in
  fp32, the FP8 round trip of the activation (`unflatten` blocks, the spec's power-of-two scale by `exp2(ceil(log2))`),
  `einsum('tao,taio->tai')` for w2;
- the routing weight applied after w2, as gpt-fast does: `einsum('tai,ta->ti', expert_outs.float(), weights)`;
- the shared expert as three `nn.Linear`s with the same clamped SwiGLU, added in fp32, one bf16 rounding.

forward(h [B, 1, D] bf16) -> [B, 1, D] bf16.

Sites (measured, fx mode, CPU; `test_gptfast_style.py`): moe_route, moe_experts (`gathered_einsum_split_fp8_
unweighted`: w1 and w3 apart, which the op reads as stored, on the pairs sorted by expert) and
moe_finalize (`slots_einsum_shared`: the per-slot einsum `'tai,ta->ti'` over rows in (token, slot) order, + shared,
one rounding, is the op on those rows with token = p // k; it reads the experts' op's rows, put back in pair order,
through views). Before the
per-slot formulation the combine was no moe_finalize candidate. No moe_metadata site (no sort in the block).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .params import param_factory

ROUTE_SCALE, SWIGLU_LIMIT, FP8_BLOCK = 1.5, 10.0, 32
SITES = {"moe_route": 1, "moe_experts": 1, "moe_finalize": 1}


def fp8_round_trip(x, block=FP8_BLOCK):
    """The spec's per-32 FP8 e4m3 round trip with a power-of-two scale, in x's dtype."""
    xf = x.float().unflatten(-1, (-1, block))
    scale = torch.exp2(torch.ceil(torch.log2(xf.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0)))
    return ((xf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale).flatten(-2).to(x.dtype)


def clamped_swiglu(g, u):
    return F.silu(g.float().clamp(max=SWIGLU_LIMIT)) * u.float().clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)


class ConditionalFeedForward(nn.Module):
    def __init__(self, p, n_experts, dim, inter):
        super().__init__()
        self.w1, self.w3, self.w2 = p(n_experts, inter, dim), p(n_experts, inter, dim), p(n_experts, dim, inter)

    def forward(self, x, expert_indices):
        w1_weights = self.w1[expert_indices]  # [T, A, I, D]
        w3_weights = self.w3[expert_indices]  # [T, A, I, D]
        w2_weights = self.w2[expert_indices]  # [T, A, D, I]
        x1 = torch.einsum("ti,taoi->tao", x, w1_weights)
        x3 = torch.einsum("ti,taoi->tao", x, w3_weights)
        act = fp8_round_trip(clamped_swiglu(x1, x3).to(x.dtype))
        return torch.einsum("tao,taio->tai", act, w2_weights)  # [T, A, D]


class GptFastStyleMoE(nn.Module):
    def __init__(self, dim=64, n_experts=8, topk=2, inter=64, seed=0):
        super().__init__()
        p = param_factory(seed)
        self.dim, self.topk = dim, topk
        self.gate = nn.Linear(dim, n_experts, bias=False, dtype=torch.bfloat16)
        self.gate.weight = p(n_experts, dim)
        self.gate_bias = p(n_experts, scale=0.1, dtype=torch.float32)
        self.cond_ffn = ConditionalFeedForward(p, n_experts, dim, inter)
        self.shared_w1, self.shared_w3, self.shared_w2 = (nn.Linear(a, b, bias=False, dtype=torch.bfloat16)
                                                          for a, b in ((dim, inter), (dim, inter), (inter, dim)))
        for layer in (self.shared_w1, self.shared_w3, self.shared_w2):
            layer.weight = p(*layer.weight.shape)

    def forward(self, h):
        x = h.view(-1, self.dim)
        scores = F.softplus(F.linear(x.float(), self.gate.weight.float())).sqrt()  # [T, E]
        expert_indices = torch.topk(scores + self.gate_bias, self.topk, dim=-1).indices  # [T, A]
        expert_weights = scores.gather(-1, expert_indices)
        expert_weights /= expert_weights.sum(dim=-1, keepdim=True) + 1e-20
        expert_weights = expert_weights * ROUTE_SCALE
        expert_outs = self.cond_ffn(x, expert_indices)
        y = torch.einsum("tai,ta->ti", expert_outs.float(), expert_weights)
        shared = self.shared_w2(fp8_round_trip(clamped_swiglu(self.shared_w1(x), self.shared_w3(x)).to(x.dtype)))
        return (y + shared.float()).to(h.dtype).view_as(h)
