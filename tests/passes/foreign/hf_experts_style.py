"""A DeepSeek-V4.1 MoE sublayer (spec §2.6) whose routed experts run as Hugging Face transformers' shared experts
implementations would run them (our own code in the habits of `transformers/integrations/moe.py`, selected there by
`config._experts_implementation`; the default "eager" loop over `nonzero()` experts does not stay in one graph):

- the router as the HF-style block (`hf_style.py`): `F.linear` on fp32, `sqrt(softplus)`, `topk(scores + bias)`,
  the weights by `gather`, normalised and scaled -> top_k_index [T, k], top_k_weights [T, k] fp32;
- an `Experts` module holding `gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I] (`transposed=True`: [E, D, 2I]
  and [E, I, D], HF's `experts_are_transposed`), the pairs flattened as HF does, `expert_ids =
  top_k_index.reshape(-1)`, `token_idx = arange(T).unsqueeze(1).expand(-1, k).reshape(-1)`, `sample_weights =
  top_k_weights.reshape(-1)`, the rows `hidden_states[token_idx]`;
- `implementation="batched_mm"`: each pair's weights gathered, `gate_up_proj[expert_ids]` [S, 2I, D], under
  `torch.bmm(selected, rows.unsqueeze(-1)).squeeze(-1)` (transposed: `bmm(rows.unsqueeze(1), selected).squeeze(1)`);
  `implementation="grouped_mm"`: `perm = argsort(expert_ids, stable=True)`, `inv_perm = argsort(perm, stable=True)`,
  ids, weights and rows gathered `[perm]`, `histc(ids_g.float(), bins=E, min=0, max=E - 1)` counts, `cumsum(...,
  dtype=int32)` offsets, `torch._grouped_mm(rows_g, gate_up_proj.transpose(-2, -1), offs=offsets)`, the output put
  back by `[inv_perm]` after the weights;
- the gate hook (`_apply_gate`) is the spec's clamped SwiGLU in fp32 on `chunk(2, dim=-1)`, then the FP8 per-32
  round trip of the bf16 activation (the w2 GEMM's FP8 input, as the other blocks write it);
- the routing weight applied after the down projection (HF's `out * sample_weights.unsqueeze(-1)`, fp32 by
  promotion), not before it as the spec has it (§2.6 allows both: they differ only by the FP8 step of `w * a`);
- the combine as HF writes it: `final = zeros_like(hidden_states)` (bf16) and `final.index_add_(0, token_idx,
  rows.to(final.dtype))`, then the shared expert added in bf16 (as HF's DeepseekV3 MoE adds `shared_experts`).

Numerics: this block computes HF's function, not the spec's. Each weighted row is rounded to bf16, each
`index_add_` step rounds the running sum to bf16 (k - 1 roundings a token) and the shared add rounds once more;
the spec accumulates in fp32 and rounds once (`y_f = bf16(y)`). The tests compare against this eager block, so
they check HF's function.

forward(h [B, 1, D] bf16) -> [B, 1, D] bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gptfast_style import clamped_swiglu, fp8_round_trip
from .params import param_factory

ROUTE_SCALE = 1.5
IMPLEMENTATIONS = ("batched_mm", "grouped_mm")


class Experts(nn.Module):
    """Routed experts on stacked weights in HF's layout; forward(hidden_states [T, D] bf16, top_k_index [T, k] int64,
    top_k_weights [T, k] fp32) -> [T, D] bf16, the weighted rows accumulated in bf16 as HF does."""

    def __init__(self, p, n_experts, dim, inter, implementation, transposed):
        super().__init__()
        self.implementation, self.experts_are_transposed = implementation, transposed
        gate_up, down = p(n_experts, 2 * inter, dim), p(n_experts, dim, inter)
        if transposed:  # the same experts, stored [E, D, 2I] and [E, I, D]
            gate_up, down = (nn.Parameter(w.transpose(1, 2).contiguous(), requires_grad=False) for w in (gate_up, down))
        self.gate_up_proj, self.down_proj = gate_up, down

    def _apply_gate(self, gate_up_out):
        """[S, 2I] -> the FP8 round trip of bf16(clamped_swiglu(gate, up)) [S, I]."""
        gate, up = gate_up_out.chunk(2, dim=-1)
        return fp8_round_trip(clamped_swiglu(gate, up).to(gate_up_out.dtype))

    def _project(self, rows, weights):
        """Per-sample batched products: rows [S, K] under weights gathered per sample -> [S, N]."""
        if self.experts_are_transposed:
            return torch.bmm(rows.unsqueeze(1), weights).squeeze(1)
        return torch.bmm(weights, rows.unsqueeze(-1)).squeeze(-1)

    def _grouped(self, rows, weights, offsets):
        return torch._grouped_mm(rows, weights if self.experts_are_transposed else weights.transpose(-2, -1),
                                 offs=offsets)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        num_tokens, num_top_k = hidden_states.size(0), top_k_index.size(-1)
        num_experts = self.gate_up_proj.size(0)
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_ids = top_k_index.reshape(-1)
        token_idx = torch.arange(num_tokens, device=hidden_states.device).unsqueeze(1).expand(-1, num_top_k).reshape(-1)
        sample_weights = top_k_weights.reshape(-1)
        current_hidden_states = hidden_states[token_idx]
        if self.implementation == "batched_mm":
            gate_up_out = self._project(current_hidden_states, self.gate_up_proj[expert_ids])
            out_per_sample = self._project(self._apply_gate(gate_up_out), self.down_proj[expert_ids])
            out_per_sample = out_per_sample * sample_weights.unsqueeze(-1)
        else:
            perm = torch.argsort(expert_ids, stable=True)
            inv_perm = torch.argsort(perm, stable=True)
            expert_ids_g, sample_weights_g, current_states_g = expert_ids[perm], sample_weights[perm], current_hidden_states[perm]
            num_tokens_per_expert = torch.histc(expert_ids_g.float(), bins=num_experts, min=0, max=num_experts - 1)
            offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
            gate_up_out = self._grouped(current_states_g, self.gate_up_proj, offsets)
            out_per_sample_g = self._grouped(self._apply_gate(gate_up_out), self.down_proj, offsets)
            out_per_sample = (out_per_sample_g * sample_weights_g.unsqueeze(-1))[inv_perm]
        final_hidden_states.index_add_(0, token_idx, out_per_sample.to(final_hidden_states.dtype))
        return final_hidden_states


class HFExpertsStyleMoE(nn.Module):
    """The MoE sublayer: router, `Experts` in one of HF's implementations, the shared expert (a stacked w13 under
    `F.linear`, the clamped SwiGLU, the FP8 step) added in bf16."""

    def __init__(self, implementation="batched_mm", transposed=False, dim=64, n_experts=8, topk=2, inter=64, seed=0):
        super().__init__()
        assert implementation in IMPLEMENTATIONS, implementation
        p = param_factory(seed)
        self.dim, self.topk, self.inter = dim, topk, inter
        self.gate, self.gate_bias = p(n_experts, dim), p(n_experts, scale=0.1, dtype=torch.float32)
        self.experts = Experts(p, n_experts, dim, inter, implementation, transposed)
        self.shared_w13, self.shared_w2 = p(2 * inter, dim), p(dim, inter)

    def route(self, x):
        """x [T, D] -> (top_k_index [T, k], top_k_weights [T, k] fp32), spec §2.6."""
        scores = F.softplus(F.linear(x.float(), self.gate.float())).sqrt()
        top_k_index = torch.topk(scores + self.gate_bias, self.topk).indices
        w = scores.gather(1, top_k_index)
        return top_k_index, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * ROUTE_SCALE

    def forward(self, h):
        x = h.view(-1, self.dim)
        top_k_index, top_k_weights = self.route(x)
        routed = self.experts(x, top_k_index, top_k_weights)
        gs = F.linear(x, self.shared_w13)
        shared = F.linear(fp8_round_trip(clamped_swiglu(gs[:, :self.inter], gs[:, self.inter:]).to(x.dtype)),
                          self.shared_w2)
        return (routed + shared).view_as(h)
