"""`mhc_post_pre`: the mHC post of a sublayer output + the collapse with the carried pre + the next RMSNorm.

    x_new = bf16(post_k * y + sum_j comb[j, k] * x_j)      (hc_post)
    h     = rms_norm(bf16(sum_j pre_j * x_new_j), w, eps)  (hc_collapse, rms_norm)
  -> dsv41::mhc_post_pre(y, x, post, comb, pre, w, eps)

Formulations: broadcast-multiply-sum mixing (the model's) or einsum mixing; RMSNorm written out
(x * rsqrt(mean(x^2) + eps) * w) or as F.rms_norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv41.models import functional as fn
from dsv41.passes.fusion import FusionPass, Replacement
from dsv41.passes.matcher import Pattern

T, HC, D = 3, 4, 32


def example_stream_inputs(t: int = T):
    """y, x, post, comb, pre, w: small example tensors of a mHC site with t tokens."""
    bf = torch.bfloat16
    return [torch.empty(t, D, dtype=bf), torch.empty(t, HC, D, dtype=bf), torch.empty(t, HC), torch.empty(t, HC, HC),
            torch.empty(t, HC), torch.empty(D, dtype=bf)]


def one_token_variant(suffix: str, builder):
    """einsum decomposes differently at one token: einsum formulations are also traced at T = 1."""
    return (lambda: builder(1),) if "einsum" in suffix else ()


def post_einsum(y, x, post, comb):
    mixed = torch.einsum("tjk,tjd->tkd", comb, x.float())
    return (post.unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(x.dtype)


def collapse_einsum(x, pre):
    return torch.einsum("tj,tjd->td", pre, x.float()).to(x.dtype)


def rms_norm_functional(x, w, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


def stream_formulations(eps: float):
    """(name suffix, search(y, x, post, comb, pre, w) -> (x_new, h)) of each accepted formulation."""
    def post_pre(post_fn, collapse_fn, norm_fn):
        def search(y, x, post, comb, pre, w):
            x_new = post_fn(y, x, post, comb)
            return x_new, norm_fn(collapse_fn(x_new, pre), w, eps)
        return search

    return [
        ("", post_pre(fn.hc_post, fn.hc_collapse, fn.rms_norm)),
        ("_einsum", post_pre(post_einsum, collapse_einsum, fn.rms_norm)),
        ("_F_rms_norm", post_pre(fn.hc_post, fn.hc_collapse, rms_norm_functional)),
    ]


class MhcPostPrePass(FusionPass):
    name = "mhc_post_pre"

    def patterns(self):
        return [Pattern("post_pre" + suffix, search, example_stream_inputs, variants=one_token_variant(suffix, example_stream_inputs),
                        anchor=torch.ops.aten.rsqrt.default)
                for suffix, search in stream_formulations(self.config.norm_eps)]

    def replacement(self, m):
        y, x, post, comb, pre, w = m.inputs
        op = torch.ops.dsv41.mhc_post_pre.default
        return Replacement(op, (y, x, post, comb, pre, w, self.config.norm_eps, self.config.kernel), (0, 1))
