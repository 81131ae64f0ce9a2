"""`mhc_coeffs`: the mHC coefficients of a site (spec 2.2) -> one dsv41::mhc_coeffs call.

    r = rsqrt(mean(x^2) + eps) over the 4 streams; m = (x @ fn^T) * r                   [T, 24]
    pre = sigmoid(m[:, :4] s0 + b) + hc_eps; post = 2 sigmoid(m[:, 4:8] s1 + b)
    comb = Sinkhorn(softmax(m[:, 8:].view(4, 4) s2 + b) + hc_eps), 20 column / 19 row normalisations

Formulations: the model's (GEMM then scale by r; normalisations as `c / (c.sum() + eps)`), and variants that
normalise first (`(x * r) @ fn^T`, RMSNorm-without-weight then linear) with the normalisations written as
multiplication by the reciprocal of the sum or as the model's division.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from dsv41.models import functional as fn
from dsv41.passes.fusion import FusionPass, Replacement
from dsv41.passes.matcher import Pattern

T, HC, D = 3, 4, 32
aten = torch.ops.aten


def _inputs():
    n = (2 + HC) * HC
    return [torch.empty(T, HC, D, dtype=torch.bfloat16), torch.empty(n, HC * D), torch.empty(n), torch.empty(3)]


def hc_mixes_prenorm(x, fn_w, base, scale, norm_eps, hc_eps, iters, reciprocal=True):
    """Normalise, then the GEMM; the Sinkhorn normalisations by the reciprocal of the sum or (`reciprocal` False)
    by division, as the model's."""
    t, hc, _ = x.shape
    xf = x.flatten(1).float()
    m = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)) @ fn_w.t()
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(m[:, hc: 2 * hc] * scale[1] + base[hc: 2 * hc])
    c = torch.softmax(m[:, 2 * hc:].view(t, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), dim=-1) + hc_eps

    def normalised(c, dim):
        return c * (1.0 / (c.sum(dim=dim, keepdim=True) + hc_eps)) if reciprocal else c / (c.sum(dim=dim, keepdim=True) + hc_eps)

    c = normalised(c, -2)
    for _ in range(iters - 1):
        c = normalised(normalised(c, -1), -2)
    return pre, post, c


def hc_mixes_prenorm_div(x, fn_w, base, scale, norm_eps, hc_eps, iters):
    return hc_mixes_prenorm(x, fn_w, base, scale, norm_eps, hc_eps, iters, reciprocal=False)


@dataclass(frozen=True)
class CoeffsForm:
    """A formulation of the coefficients: `normalised_first`, x normalised before the GEMM (else the GEMM's output
    scaled by r, the model's); `reciprocal`, the Sinkhorn normalisations as products with the reciprocal of the sum
    (else divisions, the model's)."""

    normalised_first: bool
    reciprocal: bool


class MhcCoeffsPass(FusionPass):
    name = "mhc_coeffs"
    form_type = CoeffsForm
    tolerance = {torch.float32: (1e-5, 1e-4)}  # pre, post, comb in [0, 2], summed in another fp32 order

    def patterns(self):
        c = self.config
        out = []
        for name, mixes, form in (("hc_mixes", fn.hc_mixes, CoeffsForm(False, False)),
                                  ("hc_mixes_prenorm", hc_mixes_prenorm, CoeffsForm(True, True)),
                                  ("hc_mixes_prenorm_div", hc_mixes_prenorm_div, CoeffsForm(True, False))):
            def search(x, fn_w, base, scale, mixes=mixes):
                return mixes(x, fn_w, base, scale, c.norm_eps, c.hc_eps, c.sinkhorn_iters)

            out.append(Pattern(name, search, _inputs, anchor=aten.sigmoid.default, form=form))
        return out

    def explain(self, failure, graph):
        """A Sinkhorn chain that ends early or late fails at its first or last normalisation: count the
        normalisations through the blocking node (back to the softmax, forward to the end) and report the
        iteration count as the scalar it is."""
        start = next(n for n in graph.nodes if n.name == failure.blocking)
        norm_ops = (aten.div.Tensor, aten.mul.Tensor)
        back, node = 0, start
        while node.op == "call_function" and node.target in norm_ops and isinstance(node.args[0], fx.Node):
            back += 1
            node = node.args[0]
        forward, node = 0, start
        while (nxt := next((u for u in node.users if u.target in norm_ops and u.args[0] is node), None)) is not None:
            forward += 1
            node = nxt
        norms = back + forward
        found = (norms + 1) // 2
        if norms < 2 or found == self.config.sinkhorn_iters or not ("sum" in failure.reason or failure.kind == "semantic"):
            return failure
        return dataclasses.replace(failure, kind="scalar", reason=f"sinkhorn iterations: expected {self.config.sinkhorn_iters}, "
                                   f"found {found} ({norms} normalisations through %{failure.blocking})")

    def replacement(self, m):
        x, fn_w, base, scale = m.inputs
        c = self.config
        op = torch.ops.dsv41.mhc_coeffs.default
        return Replacement(op, (x, fn_w, base, scale, c.norm_eps, c.hc_eps, c.sinkhorn_iters, c.kernel), (0, 1, 2))
