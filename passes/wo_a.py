"""`wo_a`: the inverse RoPE of the attention output + the grouped wo_a projection.

    o = rope_tail(o, cos, sin, inverse);  z[t, g] = o.view(T, G, -1)[t, g] @ w.view(G, R, -1)[g]^T
  -> dsv41::wo_a(o, cos, sin, w, G)                               [T, H, hd] -> [T, G*R] bf16

G = H*hd / w.shape[1] follows from the shapes. Formulations: einsum (the model's) or bmm over transposed groups;
each with the inverse rotation as the model writes it (`inverse=True`, which negates sin) or as a forward rotation
by a table built with the negated angle (DeepSeek's reference with such a table instead of `freqs_cis.conj()`,
whose complex arithmetic `dsv41.passes.complex_arith` spells in real pairs), for which the op takes sin = -(the
table's sin): the same rotation, bit for bit (a negation is exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.models import functional as fn
from dsv41.passes.complex_arith import per_token, restate_failure
from dsv41.passes.fusion import Derived, FusionPass, Replacement
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


def grouped_einsum(o, w):
    t, g = o.shape[0], _groups(o, w)
    return torch.einsum("tgd,grd->tgr", o.view(t, g, -1), w.view(g, w.shape[0] // g, -1)).flatten(1)


def grouped_bmm(o, w):
    t, g = o.shape[0], _groups(o, w)
    z = torch.bmm(o.view(t, g, -1).transpose(0, 1), w.view(g, w.shape[0] // g, -1).transpose(1, 2))
    return z.transpose(0, 1).flatten(1)


def wo_a_einsum(o, cos, sin, w):
    return grouped_einsum(fn.apply_rope_tail(o, cos, sin, inverse=True), w)


def wo_a_bmm(o, cos, sin, w):
    return grouped_bmm(fn.apply_rope_tail(o, cos, sin, inverse=True), w)


def wo_a_einsum_negated_angle(o, cos, sin_negated, w):
    return grouped_einsum(fn.apply_rope_tail(o, cos, sin_negated), w)


def wo_a_bmm_negated_angle(o, cos, sin_negated, w):
    return grouped_bmm(fn.apply_rope_tail(o, cos, sin_negated), w)


@dataclass(frozen=True)
class WoAForm:
    """A formulation of the inverse RoPE + grouped projection: `contraction`, the grouped product's spelling
    ("einsum" or "bmm"); `negated_angle`, the inverse rotation as a forward one by a table of the negated angle
    (else the model's `inverse=True`)."""

    contraction: str
    negated_angle: bool


class WoAPass(FusionPass):
    name = "wo_a"
    form_type = WoAForm
    tolerance = {torch.bfloat16: (1e-2, 2.0**-7)}  # a bf16 GEMM summed in another order: one bf16 ulp

    def patterns(self):
        variants = (_inputs(1, G), _inputs(T, 1), _inputs(1, 1))
        contraction = (torch.ops.aten.bmm.default, torch.ops.aten.mm.default)
        forms = ((wo_a_einsum, WoAForm("einsum", False)), (wo_a_bmm, WoAForm("bmm", False)),
                 (wo_a_einsum_negated_angle, WoAForm("einsum", True)), (wo_a_bmm_negated_angle, WoAForm("bmm", True)))
        return [Pattern(f.__name__, f, _inputs(T, G), variants=variants, anchor=contraction, form=form)
                for f, form in forms]

    def replacement(self, m):
        o, cos, sin, w = m.inputs
        cos, sin = (per_token(table, o.meta["val"].shape[0]) for table in (cos, sin))
        if m.pattern.form.negated_angle:
            sin = Derived(torch.ops.aten.neg.default, (sin,))
        groups = _groups(o.meta["val"], w.meta["val"])
        return Replacement(torch.ops.dsv41.wo_a.default, (o, cos, sin, w, groups, self.config.kernel), (None,))

    def explain(self, failure, graph):
        return restate_failure(failure, graph)
