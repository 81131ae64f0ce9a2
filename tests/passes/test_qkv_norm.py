"""`qkv_norm`: the q_norm and kv_norm RMSNorms of the merged wq_a|wkv output (+ the KV RoPE and FP8 fake-quant when
they follow in the chain) -> dsv41::qkv_norm.

Every formulation the pass lists (RMSNorm written out or F.rms_norm; with RoPE + FP8 fake quant, RoPE only, or
the bare norms) has a user-written function here; the RoPE and the FP8 round trip are the model's helpers (the
fusion absorbs exactly those). Tolerances: the written-out norm formulations are bit-exact (atol=rtol=0). The
F.rms_norm ones: F.rms_norm decomposes to the same fp32 ops here, so they are bit-exact too, but the test allows
bf16 tolerance (atol=rtol=1.6e-2) on qr and the un-quantised kv, and for the FP8 output one e4m3 step (12.5%
relative) on at most 1% of the elements, since a 1-ulp bf16 difference upstream may flip a quantisation bucket.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.nn.functional as F

from dsv41.models import functional as fn

from dsv41.passes.printing import op_name

from .harness import BF16, F16, NORM_EPS, assert_close, assert_scalar_decline, compiled_matches, gen, graph_text, op_counts, \
    pattern_names, rand, rope_angles, run_declined, run_fused_once, run_passes

FUSION, OP = "qkv_norm", "dsv41.qkv_norm"
T, QD, KVD, RD = 3, 32, 64, 16


def inputs(seed, t=T, q_dim=QD, kv_dim=KVD, dtype=BF16, rope=True):
    g = gen(seed)
    out = [rand(g, t, q_dim + kv_dim, dtype=dtype, scale=3.0), rand(g, q_dim, scale=0.1, mean=1.0),
           rand(g, kv_dim, scale=0.1, mean=1.0)]
    return out + list(rope_angles(g, t, RD // 2)) if rope else out


# ---- the formulations --------------------------------------------------------------------------------------------
def norm_written_out(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def norm_functional(x, w, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


def norm_bf16_then_weight(x, w, eps):
    """HF's RMSNorm: the normalised x rounded to bf16, then the weight multiply in bf16 (two roundings)."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


NORMS = (("", norm_written_out), ("_F_rms_norm", norm_functional), ("_bf16_then_weight", norm_bf16_then_weight))


def make(norm, tail, eps=NORM_EPS, block=32):
    def bare(qkv, q_w, kv_w):
        q_dim = q_w.shape[0]
        return norm(qkv[:, :q_dim], q_w, eps), norm(qkv[:, q_dim:], kv_w, eps)

    def rope(qkv, q_w, kv_w, cos, sin):
        qr, kv = bare(qkv, q_w, kv_w)
        return qr, fn.apply_rope_tail(kv, cos, sin)

    def rope_fp8(qkv, q_w, kv_w, cos, sin):
        qr, kv = rope(qkv, q_w, kv_w, cos, sin)
        return qr, fn.fp8_fake_quant(kv, block)

    return {"none": bare, "rope": rope, "rope_fp8": rope_fp8}[tail]


def split(f):
    """The same math from two GEMM outputs q and kv (HF's wq_a and wkv) instead of one merged qkv."""
    def from_two(q, kv, *rest):
        return f(torch.cat((q, kv), dim=-1), *rest)
    return from_two


FORMULATIONS = {f"q_kv_norm_{tail}{suffix}": (make(norm, tail), tail)
                for suffix, norm in NORMS for tail in ("rope_fp8", "rope", "none")}


def split_norm(norm, tail, eps=NORM_EPS, block=32):
    def bare(q, kv, q_w, kv_w):
        return norm(q, q_w, eps), norm(kv, kv_w, eps)

    def rope(q, kv, q_w, kv_w, cos, sin):
        qr, kv = bare(q, kv, q_w, kv_w)
        return qr, fn.apply_rope_tail(kv, cos, sin)

    def rope_fp8(q, kv, q_w, kv_w, cos, sin):
        qr, kv = rope(q, kv, q_w, kv_w, cos, sin)
        return qr, fn.fp8_fake_quant(kv, block)

    return {"none": bare, "rope": rope, "rope_fp8": rope_fp8}[tail]


SPLIT_FORMULATIONS = {f"q_kv_norm_{tail}_split{suffix}": (split_norm(norm, tail), tail)
                      for suffix, norm in NORMS for tail in ("rope_fp8", "rope", "none")}


def two_gemms(f):
    """f of q = x @ wq^T and kv = x @ wkv^T: the two GEMMs of one activation (HF's wq_a and wkv)."""
    def from_x(x, wq, wkv, *rest):
        return f(F.linear(x, wq), F.linear(x, wkv), *rest)
    return from_x


SPLIT_FORMULATIONS = {name: (two_gemms(f), tail) for name, (f, tail) in SPLIT_FORMULATIONS.items()}


def split_inputs(seed, rope=True):
    """x [T, 64], wq [q_dim, 64], wkv [kv_dim, 64] bf16 (scaled so q and kv are O(1)), then the norm weights, cos, sin."""
    g = gen(seed + 50)
    _, *rest = inputs(seed, rope=rope)
    return [rand(g, T, 64), rand(g, QD, 64, scale=0.125), rand(g, KVD, 64, scale=0.125)] + rest


def check_result(got, want, name, fp8):
    if "_F_rms_norm" not in name:
        return assert_close(got, want, atol=0, rtol=0)
    assert_close(got[0], want[0], atol=1.6e-2, rtol=1.6e-2)
    if not fp8:
        return assert_close(got[1], want[1], atol=1.6e-2, rtol=1.6e-2)
    close = torch.isclose(got[1].float(), want[1].float(), rtol=0.125, atol=1e-2)
    assert close.float().mean() >= 0.99, f"{(~close).sum()} of {close.numel()} fp8 elements differ by more than one step"


def test_every_formulation_has_a_test():
    assert pattern_names(FUSION) == set(FORMULATIONS) | set(SPLIT_FORMULATIONS)


@pytest.mark.parametrize("name", sorted(SPLIT_FORMULATIONS))
def test_split_formulation_is_fused(name):
    """Two GEMM outputs: one dsv41.qkv_norm on their cat, equal to eager."""
    f, tail = SPLIT_FORMULATIONS[name]
    rope = tail != "none"
    gm, _, node = run_fused_once(f, split_inputs(0, rope=rope), FUSION, ("aten.rsqrt", "aten.mean.dim"))
    assert op_counts(gm)["aten.mm"] == 2  # the GEMMs stay
    assert op_name(node.args[0].target) == "aten.cat" and node.args[6] == (32 if tail == "rope_fp8" else 0)
    assert node.args[7] == ("bf16_then_weight" if name.endswith("_bf16_then_weight") else "fp32_weight")
    x = split_inputs(1, rope=rope)
    check_result(gm(*x), f(*x), name, tail == "rope_fp8")


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_formulation_is_fused(name):
    f, tail = FORMULATIONS[name]
    rope = tail != "none"
    gone = ("aten.rsqrt", "aten.mean.dim", "aten.cat", "aten.cos", "aten.amax", "prims.convert_element_type")
    gm, _, node = run_fused_once(f, inputs(0, rope=rope), FUSION, gone)
    assert node.args[6] == (32 if tail == "rope_fp8" else 0)  # quant_block
    assert (node.args[3] is None) == (not rope)  # cos
    assert node.args[7] == ("bf16_then_weight" if name.endswith("_bf16_then_weight") else "fp32_weight")
    x = inputs(1, rope=rope)
    check_result(gm(*x), f(*x), name, tail == "rope_fp8")


def two_layers(qkv, q_w, kv_w, cos, sin):
    """Two attention layers' norms (fake quant on in one, off in the other)."""
    qr, kv = FORMULATIONS["q_kv_norm_rope_fp8"][0](qkv, q_w, kv_w, cos, sin)
    qkv2 = torch.cat((qr, kv), dim=-1) * 2
    return FORMULATIONS["q_kv_norm_rope_F_rms_norm"][0](qkv2, q_w, kv_w, cos, sin)


def test_two_sites_two_matches():
    gm, report = run_passes(two_layers, inputs(0), FUSION)
    assert report.matches[FUSION] == 2 and op_counts(gm)[OP] == 2 and op_counts(gm)["aten.rsqrt"] == 0
    x = inputs(2)
    assert_close(gm(*x), two_layers(*x), atol=1.6e-2, rtol=1.6e-2)


@torch.no_grad()
def test_model_attention_head_through_the_backend():
    """The model's attention head as written in Attention.forward (fake quant on)."""
    def head(h, wqkv_a, q_w, kv_w, cos, sin):
        qkv = F.linear(fn.fp8_fake_quant(h), wqkv_a)
        qr = fn.rms_norm(qkv[:, :QD], q_w, NORM_EPS)
        kv = fn.rms_norm(qkv[:, QD:], kv_w, NORM_EPS)
        return fn.fp8_fake_quant(qr), fn.fp8_fake_quant(fn.apply_rope_tail(kv, cos, sin), 32)

    def head_inputs(seed):
        g = gen(seed)
        x = inputs(seed)
        return [rand(g, T, 64), rand(g, QD + KVD, 64, scale=0.125)] + x[1:]

    assert compiled_matches(head, head_inputs) == {FUSION: 1}


def test_golden():
    gm, _ = run_passes(FORMULATIONS["q_kv_norm_rope_fp8"][0], inputs(0, t=2), FUSION)
    expecttest.assert_expected_inline(graph_text(gm), """\
%arg0_1: bf16[2, 96] = input
%arg1_1: bf16[32] = input
%arg2_1: bf16[64] = input
%arg3_1: f32[2, 8] = input
%arg4_1: f32[2, 8] = input
%qkv_norm_default: (bf16[2, 32], bf16[2, 64]) = dsv41.qkv_norm(%arg0_1, %arg1_1, %arg2_1, %arg3_1, %arg4_1, 1e-20, 32, 'fp32_weight', 'auto')
%getitem_1: bf16[2, 64] = getitem(%qkv_norm_default, 1)
%getitem: bf16[2, 32] = getitem(%qkv_norm_default, 0)
return [%getitem, %getitem_1]
""")


# ---- declines ---------------------------------------------------------------------------------------------------
def test_decline_token_limit():
    reasons = run_declined(FORMULATIONS["q_kv_norm_rope_fp8"][0], inputs(0, t=3), FUSION, max_tokens=2)
    assert "token limit: T=3 > max_tokens=2" in reasons


def test_decline_fp16_activations():
    reasons = run_declined(FORMULATIONS["q_kv_norm_rope"][0], inputs(0, dtype=F16), FUSION)
    assert "dtype" in reasons and "float16" in reasons


@pytest.mark.parametrize("suffix, norm", [("", norm_written_out), ("_F_rms_norm", norm_functional)])
def test_decline_other_eps(suffix, norm):
    reasons = run_declined(make(norm, "rope_fp8", eps=1e-6), inputs(0), FUSION)
    assert_scalar_decline(reasons, 1e-20, 1e-6)


def test_other_quant_block_is_not_absorbed():
    """FP8 blocks of 16 (config: 32): the quantisation is not taken into the op; the norms + RoPE still are."""
    f = make(norm_written_out, "rope_fp8", block=16)
    gm, report = run_passes(f, inputs(0), FUSION)
    assert report.matches[FUSION] == 1
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and "qkv_norm" in str(n.target))
    assert node.args[6] == 0 and op_counts(gm)["aten.amax"] == 1
    x = inputs(8)
    assert_close(gm(*x), f(*x), atol=0, rtol=0)
