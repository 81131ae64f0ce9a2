"""`allreduce_mhc`: a TP all-reduce of a sublayer output followed by the mHC post + collapse + RMSNorm.

    attention:  y = bf16(all_reduce(y_partial.float()))
    MoE:        y = bf16(all_reduce(routed_fp32) + shared.float())
    then as mhc_post_pre:  x_new = post(y, x); h = rms_norm(collapse(x_new, pre))
  -> dsv41::allreduce_mhc(y_partial, shared?, x, post, comb, pre, w, eps, group_name)

The all-reduce becomes part of the fused op; the group is read from the matched collective. Formulations:
the two sites, each with the stream formulations of mhc_post_pre.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.passes.fusion import FusionPass, Replacement
from dsv41.passes.matcher import ANY_STR, Pattern
from dsv41.passes.mhc_post_pre import D, T, StreamForm, example_stream_inputs, one_token_variant, stream_formulations

c10d = torch.ops._c10d_functional


def _all_reduce(t):
    return c10d.wait_tensor.default(c10d.all_reduce.default(t, "sum", ANY_STR))


def _ffn_inputs(t: int = T):
    y, *rest = example_stream_inputs(t)
    return [torch.empty(t, D), y] + rest


@dataclass(frozen=True)
class AllReduceMhcForm:
    """A formulation of an all-reduce + post + pre site: `shared_expert`, the MoE site (the all-reduced routed rows
    plus the shared expert's output; else the attention site, the all-reduced output alone); `stream`, how its post,
    collapse and norm are written."""

    shared_expert: bool
    stream: StreamForm


class AllReduceMhcPass(FusionPass):
    name = "allreduce_mhc"
    form_type = AllReduceMhcForm

    def patterns(self):
        pats = []
        for stream, tail in stream_formulations(self.config.norm_eps):
            def attention(y, x, post, comb, pre, w, tail=tail):
                return tail(_all_reduce(y.float()).to(y.dtype), x, post, comb, pre, w)

            def ffn(y, shared, x, post, comb, pre, w, tail=tail):
                return tail((_all_reduce(y) + shared.float()).to(shared.dtype), x, post, comb, pre, w)

            pats.append(Pattern("attention" + stream.name_suffix(), attention, example_stream_inputs,
                                variants=one_token_variant(stream, example_stream_inputs),
                                anchor=c10d.all_reduce.default, form=AllReduceMhcForm(False, stream)))
            pats.append(Pattern("ffn" + stream.name_suffix(), ffn, _ffn_inputs,
                                variants=one_token_variant(stream, _ffn_inputs), anchor=c10d.all_reduce.default,
                                form=AllReduceMhcForm(True, stream)))
        return pats

    def tokens(self, m):
        return m.inputs[-5].meta["val"].shape[0]  # x: the ffn form has the shared-expert input first

    def replacement(self, m):
        group = next(n for n in m.nodes if n.target is c10d.all_reduce.default).args[2]
        if m.pattern.form.shared_expert:
            y, shared, *streams = m.inputs
        else:
            (y, *streams), shared = m.inputs, None
        x, post, comb, pre, w = streams
        args = (y, shared, x, post, comb, pre, w, self.config.norm_eps, group, self.config.kernel)
        return Replacement(torch.ops.dsv41.allreduce_mhc.default, args, (0, 1))
