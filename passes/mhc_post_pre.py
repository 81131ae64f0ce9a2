"""`mhc_post_pre`: the mHC post of a sublayer output + the collapse with the carried pre + the next RMSNorm.

    x_new = bf16(post_k * y + sum_j comb[j, k] * x_j)      (hc_post)
    h     = rms_norm(bf16(sum_j pre_j * x_new_j), w, eps)  (hc_collapse, rms_norm)
  -> dsv41::mhc_post_pre(y, x, post, comb, pre, w, eps)

Formulations, every combination of: the mixing by broadcast-multiply-sum (the model's) or einsum; the collapse by
multiply-sum or einsum; RMSNorm written out (x * rsqrt(mean(x^2) + eps) * w) or as F.rms_norm, both rounding once
after the fp32 weight multiply, or written out rounding twice, w * bf16(x * rsqrt(...)) in bf16 (HF's RMSNorm; the
op's norm_rounding="bf16_then_weight").
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


def rms_norm_bf16_then_weight(x, w, eps):
    return fn.rms_norm(x, w, eps, "bf16_then_weight")


# name suffix of a formulation whose RMSNorm rounds twice -> the op's norm_rounding; the others: "fp32_weight"
BF16_NORM = "_bf16_then_weight"


# the spellings of each part of a site, one formulation per combination: (name part, function)
_POSTS = (("", fn.hc_post), ("einsum", post_einsum))
_COLLAPSES = (("", fn.hc_collapse), ("einsum", collapse_einsum))
_NORMS = {"fp32_weight": (("", fn.rms_norm), ("_F_rms_norm", rms_norm_functional)),
          "bf16_then_weight": ((BF16_NORM, rms_norm_bf16_then_weight),)}


def _contraction_suffix(post: str, collapse: str) -> str:
    """"_einsum" when both contractions are einsums, "_einsum_post" / "_einsum_collapse" when one is, else ""."""
    if post and collapse:
        return "_einsum"
    return "_einsum_post" if post else "_einsum_collapse" if collapse else ""


def stream_formulations(eps: float, roundings: tuple = ("fp32_weight",)):
    """(name suffix, search(y, x, post, comb, pre, w) -> (x_new, h)) of each accepted formulation whose RMSNorm
    rounds as one of `roundings` says (`dsv41.models.functional.NORM_ROUNDINGS`): every combination of a post, a
    collapse and a norm spelling (a user mixes them freely)."""
    def post_pre(post_fn, collapse_fn, norm_fn):
        def search(y, x, post, comb, pre, w):
            x_new = post_fn(y, x, post, comb)
            return x_new, norm_fn(collapse_fn(x_new, pre), w, eps)
        return search

    return [(_contraction_suffix(p_name, c_name) + n_name, post_pre(post_fn, collapse_fn, norm_fn))
            for rounding in roundings for n_name, norm_fn in _NORMS[rounding]
            for p_name, post_fn in _POSTS for c_name, collapse_fn in _COLLAPSES]


def norm_rounding(pattern_name: str) -> str:
    """The op's norm_rounding for a formulation of `stream_formulations` or of qkv_norm (by its name)."""
    return "bf16_then_weight" if pattern_name.endswith(BF16_NORM) else "fp32_weight"


class MhcPostPrePass(FusionPass):
    name = "mhc_post_pre"

    def patterns(self):
        return [Pattern("post_pre" + suffix, search, example_stream_inputs, variants=one_token_variant(suffix, example_stream_inputs),
                        anchor=torch.ops.aten.rsqrt.default)
                for suffix, search in stream_formulations(self.config.norm_eps, fn.NORM_ROUNDINGS)]

    def replacement(self, m):
        y, x, post, comb, pre, w = m.inputs
        op = torch.ops.dsv41.mhc_post_pre.default
        args = (y, x, post, comb, pre, w, self.config.norm_eps, norm_rounding(m.pattern.name), self.config.kernel)
        return Replacement(op, args, (0, 1))
