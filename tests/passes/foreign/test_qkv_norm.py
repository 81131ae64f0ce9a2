"""Foreign formulations of `qkv_norm` (q/kv RMSNorms + KV RoPE + FP8 fake quant), each differing from the
project's model in one named way. Each must be found exactly once and equal eager: bit-exact where the foreign
math is equal on the values it sees (the exp2 FP8 scale equals the bit-manipulated one on every bf16 amax, checked
exhaustively in test_exp2_scale_equals_bit_scale_on_bf16), within one bf16 ulp for a mean written as sum / n
(no FP8 tail there: a 1-ulp difference may move an FP8 bucket). Where a formulation has the FP8 step, the op must
hold it (its pattern `q_kv_norm_rope_fp8*`), not only the norms with the step left as glue; the FP8 spellings of
fp8_forms.py likewise, and those of other math are declined with a recorded reason."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch
import torch.nn.functional as F

from dsv41.models import functional as fn
from dsv41.tools import graphdiff

from ..harness import NORM_EPS, assert_found_once
from ..test_qkv_norm import KVD, QD, inputs, split_inputs
from . import fp8_forms

FUSION = "qkv_norm"
EXACT, BF16_ULP = {}, dict(atol=1e-6, rtol=2.0**-7)


def norm(x, w, eps=NORM_EPS):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def fp8_exp2(x, block=32):
    """The FP8 round trip with the scale as exp2(ceil(log2(amax / 448)))."""
    xf = x.float().unflatten(-1, (-1, block))
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    return ((xf / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s).flatten(-2).to(x.dtype)


def rope_stride2(x, cos, sin):
    """Interleaved RoPE on the tail by stride-2 slices (x[..., 0::2], x[..., 1::2])."""
    rd = cos.shape[-1] * 2
    tail = x[..., -rd:].float()
    x0, x1 = tail[..., 0::2], tail[..., 1::2]
    rot = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rd], rot), dim=-1)


def exp2_fp8_scale(qkv, q_w, kv_w, cos, sin):
    """equal math written differently: the FP8 scale by exp2/ceil/log2 instead of the exponent bits."""
    qr, kv = norm(qkv[:, :QD], q_w), norm(qkv[:, QD:], kv_w)
    return qr, fp8_exp2(fn.apply_rope_tail(kv, cos, sin))


def stride2_rope(qkv, q_w, kv_w, cos, sin):
    """equal math written differently: interleaved RoPE by stride-2 slicing instead of unflatten + select."""
    qr, kv = norm(qkv[:, :QD], q_w), norm(qkv[:, QD:], kv_w)
    return qr, fn.fp8_fake_quant(rope_stride2(kv, cos, sin), 32)


def rope_written_back(qkv, q_w, kv_w, cos, sin):
    """other op: the RoPE tail rotated on its even / odd elements and written back into kv by `copy_` (SGLang's
    q_pe write-back), instead of a cat."""
    qr, kv = norm(qkv[:, :QD], q_w), norm(qkv[:, QD:], kv_w)
    pe = kv[..., -2 * cos.shape[-1]:]
    x0, x1 = pe[..., ::2].float(), pe[..., 1::2].float()
    pe.copy_(torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2))
    return qr, fn.fp8_fake_quant(kv, 32)


def weight_times_normalised(qkv, q_w, kv_w, cos, sin, eps=NORM_EPS):
    """operand order: w * (x * r) and a commuted mean-square add (eps + mean)."""
    def norm_w_first(x, w):
        xf = x.float()
        return (w.float() * (xf * torch.rsqrt(eps + xf.pow(2).mean(-1, keepdim=True)))).to(x.dtype)
    qr, kv = norm_w_first(qkv[:, :QD], q_w), norm_w_first(qkv[:, QD:], kv_w)
    return qr, fn.fp8_fake_quant(fn.apply_rope_tail(kv, cos, sin), 32)


def split_with_sizes(qkv, q_w, kv_w, cos, sin):
    """layout: the merged output split by torch.split instead of slicing."""
    q, kv = torch.split(qkv, [QD, KVD], dim=-1)
    return norm(q, q_w), fn.fp8_fake_quant(fn.apply_rope_tail(norm(kv, kv_w), cos, sin), 32)


def two_gemm_outputs(x, wq, wkv, q_w, kv_w, cos, sin):
    """op contract: q and kv from two GEMMs (HF's wq_a and wkv) with the HF-style exp2 scale and stride-2 RoPE."""
    q, kv = F.linear(x, wq), x @ wkv.t()
    return norm(q, q_w), fp8_exp2(rope_stride2(norm(kv, kv_w), cos, sin))


def two_gemms_of_requantised_input(x, wq, wkv, q_w, kv_w, cos, sin):
    """op contract: q and kv from two GEMMs whose inputs are two equal FP8 roundings of x (DeepSeek's reference
    `linear` quantises its activation per call): one activation by value, though two nodes."""
    q, kv = F.linear(fp8_exp2(x), wq), F.linear(fp8_exp2(x), wkv)
    return norm(q, q_w), fp8_exp2(rope_stride2(norm(kv, kv_w), cos, sin))


def unit_seq_dim(qkv, q_w, kv_w, cos, sin):
    """layout: HF's [B, S=1, ...]: qkv, cos and sin carry the sequence dim of one decode step, the norms, RoPE and
    FP8 tail run at [B, 1, ...] and return [B, 1, ...] (the op computes at [T, ...], T = B)."""
    qr, kv = norm(qkv[..., :QD], q_w), norm(qkv[..., QD:], kv_w)
    tail = kv[..., -2 * cos.shape[-1]:].float().unflatten(-1, (-1, 2))
    x0, x1 = tail[..., 0], tail[..., 1]
    rot = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(kv.dtype)
    return qr, fn.fp8_fake_quant(torch.cat((kv[..., :-2 * cos.shape[-1]], rot), dim=-1), 32)


def unit_seq_inputs(seed):
    """inputs() with the sequence dim: qkv [T, 1, q_dim + kv_dim], cos and sin [T, 1, rd/2]."""
    qkv, q_w, kv_w, cos, sin = inputs(seed)
    return [qkv.unsqueeze(1), q_w, kv_w, cos.unsqueeze(1), sin.unsqueeze(1)]


def megatron_sequence_first(x, w_qkv, q_w, kv_w, angle):
    """layout and RoPE: Megatron's sequence-first [S=1, T, ...] activations (F.linear of x.unsqueeze(0), the merged
    output split by torch.split), the interleaved rotary of angles repeated per pair by `torch.stack` with cos and
    sin taken of the repeated angles and the rotate by stride-2 slices, the FP8 step by exp2."""
    qkv = F.linear(x.unsqueeze(0), w_qkv)
    q, kv = torch.split(qkv, [QD, KVD], dim=-1)
    emb = torch.stack((angle.view(-1, 1), angle.view(-1, 1)), dim=-1).view(1, angle.shape[0], -1)
    kv = norm(kv, kv_w)
    rd = emb.shape[-1]
    tail = kv[..., -rd:].float()
    rotated = torch.stack((-tail[..., 1::2], tail[..., ::2]), dim=-1).view(*tail.shape)
    tail = tail * torch.cos(emb) + rotated * torch.sin(emb)
    return norm(q, q_w)[0], fp8_exp2(torch.cat((kv[..., :-rd], tail.to(kv.dtype)), dim=-1))[0]


def megatron_inputs(seed):
    """x [T, 64], the merged w_qkv [q_dim + kv_dim, 64], the norm weights, the rotary angles [T, rd/2]."""
    x, wq, wkv, q_w, kv_w, cos, sin = split_inputs(seed)
    return [x, torch.cat((wq, wkv)), q_w, kv_w, torch.atan2(sin, cos)]


def mean_as_sum(qkv, q_w, kv_w, eps=NORM_EPS):
    """other op: the mean square as sum(x^2) / n (no RoPE/FP8 tail)."""
    def norm_sum(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / xf.shape[-1] + eps) * w.float()).to(x.dtype)
    return norm_sum(qkv[:, :QD], q_w), norm_sum(qkv[:, QD:], kv_w)


CASES = {
    "exp2_fp8_scale": (exp2_fp8_scale, inputs, EXACT),
    "stride2_rope": (stride2_rope, inputs, EXACT),
    "rope_written_back": (rope_written_back, inputs, EXACT),
    "weight_times_normalised": (weight_times_normalised, inputs, EXACT),
    "split_with_sizes": (split_with_sizes, inputs, EXACT),
    "two_gemm_outputs": (two_gemm_outputs, split_inputs, EXACT),
    "two_gemms_of_requantised_input": (two_gemms_of_requantised_input, split_inputs, EXACT),
    "unit_seq_dim": (unit_seq_dim, unit_seq_inputs, EXACT),
    "megatron_sequence_first": (megatron_sequence_first, megatron_inputs, EXACT),
    "mean_as_sum": (mean_as_sum, lambda seed: inputs(seed, rope=False), BF16_ULP),
}


def fused_pattern(report) -> str:
    return next(p for p in report.passes if p.name == FUSION).replaced[0]["pattern"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_found_once_and_equal_to_eager(name):
    """Found once, with the FP8 step inside the op wherever the formulation has one (else it stays glue after it)."""
    f, inputs_of, tol = CASES[name]
    report = assert_found_once(f, inputs_of, FUSION, **tol)
    assert ("_fp8" in fused_pattern(report)) == (name != "mean_as_sum"), fused_pattern(report)


def with_fp8(quant, kv_dim=KVD):
    """The model's norms and RoPE, then the KV FP8 round trip spelled by `quant` (fp8_forms)."""
    def f(qkv, q_w, kv_w, cos, sin):
        qr, kv = norm(qkv[:, :QD], q_w), norm(qkv[:, QD:], kv_w)
        return qr, quant(fn.apply_rope_tail(kv, cos, sin))
    return f, lambda seed: inputs(seed, kv_dim=kv_dim)


FP8_SAME = {**{name: (q, KVD) for name, q in fp8_forms.SAME.items()},
            "reference_one_block": (fn.fp8_fake_quant, fp8_forms.BLOCK),
            **{name: (q, fp8_forms.BLOCK) for name, q in fp8_forms.ONE_BLOCK.items()}}


@pytest.mark.parametrize("name", sorted(FP8_SAME))
def test_fp8_spelling_is_fused_with_the_step(name):
    """An FP8 round trip equal to the reference on bf16 (fp8_forms.SAME, one block a row): found once with the step."""
    quant, kv_dim = FP8_SAME[name]
    f, inputs_of = with_fp8(quant, kv_dim)
    report = assert_found_once(f, inputs_of, FUSION)
    assert fused_pattern(report) == "q_kv_norm_rope_fp8", fused_pattern(report)


@pytest.mark.parametrize("name", sorted(fp8_forms.DIFFERENT))
def test_fp8_of_other_math_stays_out_with_a_reason(name):
    """Other FP8 math (fp8_forms.DIFFERENT): the norms and RoPE fuse, the step stays the graph's own (so the result
    is the user's, bit for bit), and the report says why the FP8 formulation was not taken: a record of the fused
    site (narrowed), not a decline."""
    f, inputs_of = with_fp8(fp8_forms.DIFFERENT[name])
    report = assert_found_once(f, inputs_of, FUSION)
    assert fused_pattern(report) == "q_kv_norm_rope"
    assert not report.declined[FUSION], report.declined
    (narrowed,) = report.narrowed[FUSION]
    assert re.match(r"fused as q_kv_norm_rope at %\w+; the wider q_kv_norm_rope_fp8 was not accepted: ", narrowed), narrowed


def test_graphdiff_why_shows_the_narrowed_site(tmp_path):
    """`dsv41 graphdiff show DIR --why qkv_norm` on the e5m2 step: the site is listed as fused by the narrower
    formulation, with the reason the wider one was not accepted, and not as a candidate that did not match; the
    HTML report's pass page lists it too."""
    f, inputs_of = with_fp8(fp8_forms.DIFFERENT["e5m2"])
    with graphdiff.record(tmp_path / "rec"):
        report = assert_found_once(f, inputs_of, FUSION)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert graphdiff.main(["show", str(tmp_path / "rec"), "--why", FUSION]) == 0
    text = out.getvalue()
    (narrowed,) = report.narrowed[FUSION]
    anchor = re.match(r"fused as q_kv_norm_rope at (%\w+);", narrowed).group(1)
    assert "(1 matched, 0 candidates did not match)" in text, text
    assert "fused by a narrower formulation (1):" in text and f"    {anchor} " in text, text
    assert re.search(r": fused as q_kv_norm_rope; the wider q_kv_norm_rope_fp8 was not accepted: \w[\w ]* after \d+ of "
                     r"\d+ pattern ops: ", text), text
    with contextlib.redirect_stdout(io.StringIO()):
        assert graphdiff.main(["show", str(tmp_path / "rec"), "--format", "html", "--out", str(tmp_path / "html")]) == 0
    pages = "".join(p.read_text() for p in (tmp_path / "html").rglob("*.html"))
    assert "Fused by a narrower formulation (1)" in pages and "the wider <b>q_kv_norm_rope_fp8</b>" in pages


def test_exp2_scale_equals_bit_scale_on_bf16():
    """The domain of the exp2 form: equal to the bit-manipulated power of two on every positive bf16 amax."""
    b = torch.arange(2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    b = b[torch.isfinite(b) & (b > 0)].clamp_min(1e-4)
    assert torch.equal(torch.exp2(torch.ceil(torch.log2(b / 448.0))), fn._pow2_ceil(b * (1.0 / 448.0)))
