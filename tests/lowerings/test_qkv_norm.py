"""dsv41::qkv_norm: bit-exact with the model's q_norm / kv_norm / KV RoPE / FP8 fake-quant chain on CPU, in every
combination of the optional RoPE and quantisation, and with the double-rounding RMSNorm (HF's) under
norm_rounding="bf16_then_weight"; argument errors."""

import pytest
import torch

from dsv41.lowerings import ALL_OPS
from dsv41.models import functional as fn

op = ALL_OPS["qkv_norm"]


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("quant_block", [32, 0])
@pytest.mark.parametrize("seed", range(2))
def test_reference_matches_model(samples, rope, quant_block, seed):
    kw = samples("qkv_norm", seed=seed, rope=rope, quant_block=quant_block)
    qkv, ql, eps = kw["qkv"], kw["q_weight"].shape[0], kw["eps"]
    want_q = fn.rms_norm(qkv[:, :ql], kw["q_weight"], eps)
    want_kv = fn.rms_norm(qkv[:, ql:], kw["kv_weight"], eps)
    if rope:
        want_kv = fn.apply_rope_tail(want_kv, kw["cos"], kw["sin"])
    if quant_block:
        want_kv = fn.fp8_fake_quant(want_kv, quant_block)
    qr, kv = op(**kw, impl="reference")
    assert torch.equal(qr, want_q) and torch.equal(kv, want_kv)


def hf_norm(x, w, eps):
    """HF's RMSNorm: weight * bf16(x * rsqrt(mean(x^2) + eps)), the weight multiply in bf16."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("seed", range(2))
def test_reference_bf16_then_weight_matches_hf_norm(samples, rope, seed):
    kw = samples("qkv_norm", seed=seed, rope=rope, quant_block=32)
    qkv, ql, eps = kw["qkv"], kw["q_weight"].shape[0], kw["eps"]
    want_q = hf_norm(qkv[:, :ql], kw["q_weight"], eps)
    want_kv = hf_norm(qkv[:, ql:], kw["kv_weight"], eps)
    if rope:
        want_kv = fn.apply_rope_tail(want_kv, kw["cos"], kw["sin"])
    qr, kv = op(**{**kw, "norm_rounding": "bf16_then_weight"}, impl="reference")
    assert torch.equal(qr, want_q) and torch.equal(kv, fn.fp8_fake_quant(want_kv, 32))
    single, _ = op(**kw, impl="reference")
    assert not torch.equal(qr, single)  # the two roundings are different math on these values


BAD = {
    "norm_rounding": (lambda kw: dict(norm_rounding="bf16"),
                      r"'norm_rounding' must be one of \('fp32_weight', 'bf16_then_weight'\), got 'bf16'"),
    "qkv width": (lambda kw: dict(qkv=kw["qkv"][:, :-1]), r"'qkv' must have shape \[T, q_dim\+kv_dim\] = \[3, 96\], got \[3, 95\]"),
    "cos T": (lambda kw: dict(cos=kw["cos"][:-1]), r"'cos' must have shape \[T, rd/2\] = \[3, 8\], got \[2, 8\]"),
    "sin rd": (lambda kw: dict(sin=kw["sin"][:, :-1]), r"'sin' must have shape \[T, rd/2\] = \[3, 8\], got \[3, 7\]"),
    "sin alone": (lambda kw: dict(cos=None), r"arguments 'cos' and 'sin' must both be tensors or both be None"),
    "rd > kv_dim": (lambda kw: dict(cos=torch.ones(3, 40), sin=torch.ones(3, 40)),
                    r"'cos' and 'sin' have 40 columns, so they rotate rd = 80 dims, more than kv_dim = 64"),
    "quant_block negative": (lambda kw: dict(quant_block=-1), r"'quant_block' must be >= 0, got -1"),
    "quant_block divides": (lambda kw: dict(quant_block=24), r"'quant_block' must divide kv_dim = 64 \(from 'kv_weight'\), got 24"),
}


@pytest.mark.parametrize("change", BAD.values(), ids=BAD.keys())
def test_bad_inputs(samples, rejects, change):
    kw = samples("qkv_norm")
    changes, match = change
    rejects(op, kw, ValueError, match, **changes(kw))


def test_cos_sin_as_halves_of_a_complex_table(samples, rejects):
    """cos and sin as the real and imaginary halves of a complex64 table (strided views, as
    `dsv41.passes.complex_arith` hands them to the op) give the result of contiguous copies; the complex table
    itself is rejected, naming the argument."""
    kw = samples("qkv_norm", rope=True, quant_block=32)
    halves = torch.view_as_real(torch.polar(torch.ones_like(kw["cos"]), torch.rand_like(kw["cos"]) * 6))
    cos, sin = halves[..., 0], halves[..., 1]
    assert not cos.is_contiguous()
    got = op(**{**kw, "cos": cos, "sin": sin}, impl="reference")
    want = op(**{**kw, "cos": cos.contiguous(), "sin": sin.contiguous()}, impl="reference")
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    rejects(op, kw, TypeError, r"'sin' must be torch.float32, got torch.complex64", sin=torch.view_as_complex(halves))
