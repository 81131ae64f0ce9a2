"""`moe_finalize`: the combine of the routed expert outputs + the shared-expert add + the cast.

    y = zeros(T, D, fp32).index_add(0, token, expert_out.float());  out = bf16(y + shared.float())
  -> dsv41::moe_finalize(expert_out, token, shared, T)

Under TP an all-reduce sits between the combine and the shared add: then only the combine is replaced
(`shared` None, fp32 out) and `allreduce_mhc` takes the rest. Formulations: index_add (the model's) or
scatter_add over an expanded index; the rows as given (weighted before w2) or times their routing weight in fp32
after w2 (vLLM's order: `weights` of the op).
"""

from __future__ import annotations

import torch

from dsv41.passes.fusion import FusionPass, Replacement
from dsv41.passes.matcher import Pattern

M, T, D = 6, 3, 32
aten = torch.ops.aten


def _inputs(with_shared):
    def inputs():
        base = [torch.empty(M, D, dtype=torch.bfloat16), torch.empty(M, dtype=torch.int64)]
        return base + ([torch.empty(T, D, dtype=torch.bfloat16)] if with_shared else [])
    return inputs


def combine_index_add(out, token, num_tokens):
    return torch.zeros(num_tokens, out.shape[1], dtype=torch.float32, device=out.device).index_add_(0, token, out.float())


def combine_scatter_add(out, token, num_tokens):
    index = token.unsqueeze(-1).expand(-1, out.shape[1])
    return torch.zeros(num_tokens, out.shape[1], dtype=torch.float32, device=out.device).scatter_add_(0, index, out.float())


def _weighted_inputs(with_shared):
    def inputs():
        out, token, *shared = _inputs(with_shared)()
        return [out, token, torch.empty(M)] + shared
    return inputs


class MoeFinalizePass(FusionPass):
    name = "moe_finalize"
    int_ranges = {"token": lambda metas, free: (0, free["num_tokens"])}

    def patterns(self):
        free, defaults = {"num_tokens": (aten.full.default, 0, (0, 0))}, {"num_tokens": T}
        combine_op = (aten.index_add.default, aten.index_put.default, aten.scatter_add.default)  # index_add may decompose
        pats = []
        for name, combine in (("index_add", combine_index_add), ("scatter_add", combine_scatter_add)):
            def with_shared(out, token, shared, num_tokens, combine=combine):
                return (combine(out, token, num_tokens) + shared.float()).to(shared.dtype)

            def combine_only(out, token, num_tokens, combine=combine):
                return combine(out, token, num_tokens)

            def weighted_shared(out, token, weights, shared, num_tokens, combine=combine):
                return (combine(out.float() * weights.unsqueeze(-1), token, num_tokens) + shared.float()).to(shared.dtype)

            def weighted_only(out, token, weights, num_tokens, combine=combine):
                return combine(out.float() * weights.unsqueeze(-1), token, num_tokens)

            pats.append(Pattern(f"{name}_weighted_shared", weighted_shared, _weighted_inputs(True), free, defaults, anchor=combine_op))
            pats.append(Pattern(f"{name}_weighted_only", weighted_only, _weighted_inputs(False), free, defaults, anchor=combine_op))
            pats.append(Pattern(f"{name}_shared", with_shared, _inputs(True), free, defaults, anchor=combine_op))
            pats.append(Pattern(f"{name}_only", combine_only, _inputs(False), free, defaults, anchor=combine_op))
        return pats

    def tokens(self, m):
        return m.free["num_tokens"]

    def replacement(self, m):
        out, token = m.inputs[:2]
        weighted = "_weighted" in m.pattern.name
        weights = m.inputs[2] if weighted else None
        shared = m.inputs[3 if weighted else 2] if m.pattern.name.endswith("_shared") else None
        args = (out, token, shared, m.free["num_tokens"], weights, self.config.kernel)
        return Replacement(torch.ops.dsv41.moe_finalize.default, args, (None,))
