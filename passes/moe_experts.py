"""`moe_experts`: the routed experts at small row counts, GEMM1 (w1||w3) + clamped SwiGLU x routing weight (+ FP8
fake quantisation) + GEMM2 (w2) on the expert-sorted rows.

    gu = _grouped_mm(x[token], w13^T, offs);  a = bf16(swiglu_clamped(gu[:, :I], gu[:, I:], limit) * w[:, None])
    a = fp8_fake_quant(a, block) (when present);  out = _grouped_mm(a, w2^T, offs)
  -> dsv41::moe_experts(x, token, w, offs, w13, w2, limit, block)

Its own fusion, not part of `moe_finalize`: the finalize (combine + shared add) applies at every batch and under TP
sits on the far side of an all-reduce, while this one is a bandwidth kernel for few rows that declines above
MAX_ROWS (T * k rows) and leaves the `_grouped_mm` path to larger batches; the two compose (finalize takes this op's
rows as its `expert_out`), so either can be disabled alone. Formulations: the model's, with and without the fake
quantisation of the activation (the config's fp8_block), and both without the routing weight, where the model weights
the rows after w2 (vLLM's order; MaxText's unpermute einsum): the op then takes weights of 1 (`a * 1.0` is `a`, exact);
limit from the config (another limit is a scalar decline).
"""

from __future__ import annotations

import torch

from dsv41.lowerings.moe_experts import MAX_ROWS
from dsv41.models import functional as fn
from dsv41.passes.fusion import Derived, FusionPass, Replacement
from dsv41.passes.matcher import Pattern

T, D, I, E, K = 3, 32, 32, 4, 6
aten, prims = torch.ops.aten, torch.ops.prims
UNWEIGHTED, UNWEIGHTED_FP8 = "experts_unweighted", "experts_fp8_unweighted"


def _inputs():
    bf = torch.bfloat16
    return [torch.empty(T, D, dtype=bf), torch.empty(T * K, dtype=torch.int64), torch.empty(T * K),
            torch.empty(E, dtype=torch.int32), torch.empty(E, 2 * I, D, dtype=bf), torch.empty(E, D, I, dtype=bf)]


def _unweighted_inputs():
    x, token, _, *rest = _inputs()
    return [x, token, *rest]


def experts(x, token, row_weights, offsets, w13, w2, limit, quant_block):
    """The model's routed experts (`MoE.forward`) from the sorted rows to the down projection's output; row_weights
    None: the rows unweighted (weighted after w2)."""
    inter = w2.shape[2]
    gu = torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offsets)
    a = fn.swiglu_clamped(gu[:, :inter], gu[:, inter:], limit)
    if row_weights is not None:
        a = a * row_weights.unsqueeze(-1)
    a = a.to(x.dtype)
    if quant_block:
        a = fn.fp8_fake_quant(a, quant_block)
    return torch._grouped_mm(a, w2.transpose(1, 2), offs=offsets)


class MoeExpertsPass(FusionPass):
    name = "moe_experts"
    int_ranges = {"token": lambda metas, free: (0, metas["x"].shape[0])}
    # a formulation computed with other ops may round g, u or a to the neighbouring bf16 and so flip an FP8 step
    tolerance = {torch.bfloat16: (2.0**-5, 2.0**-6)}

    def patterns(self):
        c = self.config

        def experts_fp8(x, token, row_weights, offsets, w13, w2):
            return experts(x, token, row_weights, offsets, w13, w2, c.swiglu_limit, c.fp8_block)

        def experts_bf16(x, token, row_weights, offsets, w13, w2):
            return experts(x, token, row_weights, offsets, w13, w2, c.swiglu_limit, 0)

        def experts_fp8_unweighted(x, token, offsets, w13, w2):
            return experts(x, token, None, offsets, w13, w2, c.swiglu_limit, c.fp8_block)

        def experts_bf16_unweighted(x, token, offsets, w13, w2):
            return experts(x, token, None, offsets, w13, w2, c.swiglu_limit, 0)

        anchor = aten._grouped_mm.default
        return [Pattern("experts_fp8", experts_fp8, _inputs, anchor=anchor),
                Pattern("experts", experts_bf16, _inputs, anchor=anchor),
                Pattern(UNWEIGHTED_FP8, experts_fp8_unweighted, _unweighted_inputs, anchor=anchor),
                Pattern(UNWEIGHTED, experts_bf16_unweighted, _unweighted_inputs, anchor=anchor)]

    def check(self, m):
        rows = m.inputs[1].meta["val"].shape[0]
        if rows > MAX_ROWS:
            return f"rows: M = T*k = {rows} > {MAX_ROWS} (small-row kernel); the _grouped_mm path stays"
        return None

    def sample_inputs(self, m, g):
        """As the base class, with valid offsets: random expert row counts (some zero) that sum to M; the first row
        weight zero, so that row's activation is an all-zero FP8 block, where the amax floor (1e-4) decides the
        scale (without it 0 / 0 is NaN)."""
        values = super().sample_inputs(m, g)
        weighted = m.pattern.name not in (UNWEIGHTED, UNWEIGHTED_FP8)
        if weighted and m.inputs[2] in values:
            values[m.inputs[2]][0] = 0
        offsets = m.inputs[3 if weighted else 2]
        rows, experts_n = m.inputs[1].meta["val"].shape[0], offsets.meta["val"].shape[0]
        counts = torch.bincount(torch.randint(0, experts_n, (rows,), generator=g), minlength=experts_n)
        values[offsets] = torch.cumsum(counts, 0).to(torch.int32).to(offsets.meta["val"].device)
        return values

    def replacement(self, m):
        quant_block = self.config.fp8_block if m.pattern.name in ("experts_fp8", UNWEIGHTED_FP8) else 0
        inputs = list(m.inputs)
        if m.pattern.name in (UNWEIGHTED, UNWEIGHTED_FP8):  # rows weighted after w2: weights of 1 ([M] fp32)
            ones = Derived(aten.ones_like.default, (inputs[1],))
            inputs.insert(2, Derived(prims.convert_element_type.default, (ones, torch.float32)))
        return Replacement(torch.ops.dsv41.moe_experts.default,
                           (*inputs, self.config.swiglu_limit, quant_block, self.config.kernel), (None,))
