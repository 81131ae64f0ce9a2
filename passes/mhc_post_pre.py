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

import enum
from dataclasses import dataclass

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


def one_token_variant(form: StreamForm, builder):
    """einsum decomposes differently at one token: einsum formulations are also traced at T = 1."""
    return (lambda: builder(1),) if form.post_einsum or form.collapse_einsum else ()


def post_einsum(y, x, post, comb):
    mixed = torch.einsum("tjk,tjd->tkd", comb, x.float())
    return (post.unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(x.dtype)


def collapse_einsum(x, pre):
    return torch.einsum("tj,tjd->td", pre, x.float()).to(x.dtype)


def rms_norm_functional(x, w, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


def rms_norm_bf16_then_weight(x, w, eps):
    return fn.rms_norm(x, w, eps, "bf16_then_weight")


class Norm(enum.Enum):
    """How a formulation writes its RMSNorm: out (x * rsqrt(mean(x^2) + eps) * w) or as F.rms_norm, both rounding
    once after the fp32 weight multiply, or out rounding twice, w * bf16(x * rsqrt(...)) in bf16 (HF's)."""

    WRITTEN = "written"
    FUNCTIONAL = "F.rms_norm"
    BF16_THEN_WEIGHT = "bf16_then_weight"

    @property
    def rounding(self) -> str:
        """The op's norm_rounding (`dsv41.models.functional.NORM_ROUNDINGS`)."""
        return "bf16_then_weight" if self is Norm.BF16_THEN_WEIGHT else "fp32_weight"


# each norm's name suffix and function
NORMS = {Norm.WRITTEN: ("", fn.rms_norm), Norm.FUNCTIONAL: ("_F_rms_norm", rms_norm_functional),
         Norm.BF16_THEN_WEIGHT: ("_bf16_then_weight", rms_norm_bf16_then_weight)}
# the spellings of each contraction of a site: (einsum, function)
_POSTS = ((False, fn.hc_post), (True, post_einsum))
_COLLAPSES = ((False, fn.hc_collapse), (True, collapse_einsum))


@dataclass(frozen=True)
class StreamForm:
    """A formulation of a post + pre site: `post_einsum`, the mixing by einsum (else broadcast-multiply-sum, the
    model's); `collapse_einsum`, the collapse by einsum (else multiply-sum); `norm`, how its RMSNorm is written."""

    post_einsum: bool
    collapse_einsum: bool
    norm: Norm

    def name_suffix(self) -> str:
        """"_einsum" when both contractions are einsums, "_einsum_post" / "_einsum_collapse" when one is, then the
        norm's suffix."""
        contractions = {(True, True): "_einsum", (True, False): "_einsum_post", (False, True): "_einsum_collapse",
                        (False, False): ""}[self.post_einsum, self.collapse_einsum]
        return contractions + NORMS[self.norm][0]


def stream_formulations(eps: float, roundings: tuple = ("fp32_weight",)):
    """(form, search(y, x, post, comb, pre, w) -> (x_new, h)) of each accepted formulation whose RMSNorm rounds as
    one of `roundings` says (`dsv41.models.functional.NORM_ROUNDINGS`): every combination of a post, a collapse and
    a norm spelling (a user mixes them freely)."""
    def post_pre(post_fn, collapse_fn, norm_fn):
        def search(y, x, post, comb, pre, w):
            x_new = post_fn(y, x, post, comb)
            return x_new, norm_fn(collapse_fn(x_new, pre), w, eps)
        return search

    return [(StreamForm(post_einsum, collapse_einsum, norm), post_pre(post_fn, collapse_fn, norm_fn))
            for rounding in roundings for norm, (_, norm_fn) in NORMS.items() if norm.rounding == rounding
            for post_einsum, post_fn in _POSTS for collapse_einsum, collapse_fn in _COLLAPSES]


class MhcPostPrePass(FusionPass):
    name = "mhc_post_pre"
    form_type = StreamForm

    def patterns(self):
        return [Pattern("post_pre" + form.name_suffix(), search, example_stream_inputs,
                        variants=one_token_variant(form, example_stream_inputs), anchor=torch.ops.aten.rsqrt.default,
                        form=form)
                for form, search in stream_formulations(self.config.norm_eps, fn.NORM_ROUNDINGS)]

    def replacement(self, m):
        y, x, post, comb, pre, w = m.inputs
        op = torch.ops.dsv41.mhc_post_pre.default
        args = (y, x, post, comb, pre, w, self.config.norm_eps, m.pattern.form.norm.rounding, self.config.kernel)
        return Replacement(op, args, (0, 1))
