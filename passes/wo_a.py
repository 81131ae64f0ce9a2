"""`wo_a`: the inverse RoPE of the attention output + the grouped wo_a projection.

    o = rope_tail(o, cos, sin, inverse);  z[t, g] = o.view(T, G, -1)[t, g] @ w.view(G, R, -1)[g]^T
  -> dsv41::wo_a(o, cos, sin, w, G)                               [T, H, hd] -> [T, G*R] bf16

G = H*hd / w.shape[1] follows from the shapes. Formulations: einsum (the model's) or bmm over transposed groups.
"""

from __future__ import annotations

import torch

from dsv41.models import functional as fn
from dsv41.passes.fusion import FusionPass, Replacement
from dsv41.passes.matcher import Pattern

T, H, HD, G, R, RD = 3, 4, 32, 2, 16, 16


def _inputs(t: int, g: int):
    """Example inputs with t tokens and g groups: einsum and bmm decompose differently when a dim is 1, so
    each formulation is traced at every combination of t and g in {1, more}."""
    def inputs():
        bf = torch.bfloat16
        return [torch.empty(t, H, HD, dtype=bf), torch.empty(t, RD // 2), torch.empty(t, RD // 2),
                torch.empty(g * R, (H // g) * HD, dtype=bf)]
    return inputs


def _groups(o, w):
    return o.shape[1] * o.shape[2] // w.shape[1]


def wo_a_einsum(o, cos, sin, w):
    t, g = o.shape[0], _groups(o, w)
    o = fn.apply_rope_tail(o, cos, sin, inverse=True)
    return torch.einsum("tgd,grd->tgr", o.view(t, g, -1), w.view(g, w.shape[0] // g, -1)).flatten(1)


def wo_a_bmm(o, cos, sin, w):
    t, g = o.shape[0], _groups(o, w)
    o = fn.apply_rope_tail(o, cos, sin, inverse=True)
    z = torch.bmm(o.view(t, g, -1).transpose(0, 1), w.view(g, w.shape[0] // g, -1).transpose(1, 2))
    return z.transpose(0, 1).flatten(1)


class WoAPass(FusionPass):
    name = "wo_a"
    tolerance = {torch.bfloat16: (1e-2, 2.0**-7)}  # a bf16 GEMM summed in another order: one bf16 ulp

    def patterns(self):
        variants = (_inputs(1, G), _inputs(T, 1), _inputs(1, 1))
        contraction = (torch.ops.aten.bmm.default, torch.ops.aten.mm.default)
        return [Pattern("wo_a_einsum", wo_a_einsum, _inputs(T, G), variants=variants, anchor=contraction),
                Pattern("wo_a_bmm", wo_a_bmm, _inputs(T, G), variants=variants, anchor=contraction)]

    def replacement(self, m):
        o, cos, sin, w = m.inputs
        groups = _groups(o.meta["val"], w.meta["val"])
        return Replacement(torch.ops.dsv41.wo_a.default, (o, cos, sin, w, groups, self.config.kernel), (None,))
