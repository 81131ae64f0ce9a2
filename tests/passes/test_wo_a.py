"""`wo_a`: inverse RoPE of the attention output + the grouped wo_a projection -> dsv41::wo_a.

Both formulations the pass lists (einsum over the groups, the model's; bmm over transposed groups) have a
user-written function here, with the model's inverse RoPE helper. The fused op computes the einsum formulation:
bit-exact for it (atol=rtol=0); the bmm formulation is the same bf16 batched GEMM on CPU and is compared within
bf16 tolerance (atol=rtol=1.6e-2). The fusion has no numeric constant (no eps), so its declines are the token
limit and the dtype.
"""

from __future__ import annotations

import expecttest
import pytest
import torch

from dsv41.models import functional as fn

from .harness import BF16, F16, assert_close, compiled_matches, gen, graph_text, op_counts, pattern_names, rand, \
    rope_angles, run_declined, run_fused_once, run_passes

FUSION, OP = "wo_a", "dsv41.wo_a"
T, H, HD, G, R, RD = 3, 4, 32, 2, 16, 16


def inputs(seed, t=T, dtype=BF16, heads=H, groups=G):
    g = gen(seed)
    cos, sin = rope_angles(g, t, RD // 2)
    return [rand(g, t, heads, HD, dtype=dtype), cos, sin, rand(g, groups * R, heads // groups * HD, dtype=dtype, scale=0.1)]


def grouped_einsum(o, cos, sin, w):
    """The model's: inverse RoPE, then one einsum over the head groups."""
    t, g = o.shape[0], w.shape[0] // R
    o = fn.apply_rope_tail(o, cos, sin, inverse=True)
    return torch.einsum("tgd,grd->tgr", o.view(t, g, -1), w.view(g, R, -1)).flatten(1)


def grouped_bmm(o, cos, sin, w):
    """The groups as the batch of a bmm: [G, T, d] x [G, d, R] -> [T, G*R]."""
    t, g = o.shape[0], w.shape[0] // R
    o = fn.apply_rope_tail(o, cos, sin, inverse=True)
    z = torch.bmm(o.view(t, g, -1).transpose(0, 1), w.view(g, R, -1).transpose(1, 2))
    return z.transpose(0, 1).flatten(1)


def grouped_einsum_negated_angle(o, cos, sin_negated, w):
    """The inverse RoPE as a forward rotation by a table built with the negated angle (its sin is -sin)."""
    t, g = o.shape[0], w.shape[0] // R
    o = fn.apply_rope_tail(o, cos, sin_negated)
    return torch.einsum("tgd,grd->tgr", o.view(t, g, -1), w.view(g, R, -1)).flatten(1)


def grouped_bmm_negated_angle(o, cos, sin_negated, w):
    t, g = o.shape[0], w.shape[0] // R
    o = fn.apply_rope_tail(o, cos, sin_negated)
    z = torch.bmm(o.view(t, g, -1).transpose(0, 1), w.view(g, R, -1).transpose(1, 2))
    return z.transpose(0, 1).flatten(1)


FORMULATIONS = {"wo_a_einsum": grouped_einsum, "wo_a_bmm": grouped_bmm,
                "wo_a_einsum_negated_angle": grouped_einsum_negated_angle,
                "wo_a_bmm_negated_angle": grouped_bmm_negated_angle}
TOL = {name: dict(atol=0, rtol=0) if "einsum" in name else dict(atol=1.6e-2, rtol=1.6e-2) for name in FORMULATIONS}


def test_every_formulation_has_a_test():
    assert pattern_names(FUSION) == set(FORMULATIONS)


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_formulation_is_fused(name):
    f = FORMULATIONS[name]
    negated = name.endswith("_negated_angle")  # the op's sin is the negation of the table's: one aten.neg stays
    gone = ("aten.bmm", "aten.cat", "aten.stack", "prims.convert_element_type") + (() if negated else ("aten.neg",))
    gm, _, node = run_fused_once(f, inputs(0), FUSION, gone)
    assert node.args[4] == G  # groups, derived from the shapes
    assert (node.args[2].target is torch.ops.aten.neg.default) == negated
    x = inputs(1)
    assert_close(gm(*x), f(*x), **TOL[name])


def two_layers(o, cos, sin, w):
    z1 = grouped_einsum(o, cos, sin, w)
    o2 = o + z1.sum(-1, keepdim=True).unsqueeze(-1)
    return z1, grouped_bmm(o2, cos, sin, w)


def test_two_sites_two_matches():
    gm, report = run_passes(two_layers, inputs(0), FUSION)
    assert report.matches[FUSION] == 2 and op_counts(gm)[OP] == 2 and op_counts(gm)["aten.bmm"] == 0
    x = inputs(2)
    assert_close(gm(*x), two_layers(*x), atol=1.6e-2, rtol=1.6e-2)


@torch.no_grad()
def test_model_output_projection_through_the_backend():
    """The tail of Attention.forward: inverse RoPE, grouped einsum, fake quant, wo_b."""
    def tail(o, cos, sin, w, wo_b):
        t, g = o.shape[0], G
        o = fn.apply_rope_tail(o, cos, sin, inverse=True)
        z = torch.einsum("tgd,grd->tgr", o.view(t, g, -1), w.view(g, R, -1)).flatten(1)
        return torch.nn.functional.linear(fn.fp8_fake_quant(z), wo_b)

    assert compiled_matches(tail, lambda seed: inputs(seed) + [rand(gen(seed), 64, G * R, scale=0.2)]) == {FUSION: 1}


def _einsum_at_block_rank(o, w, g, r):
    return torch.einsum("tgd,grd->tgr", o.view(o.shape[0], g, -1), w.view(g, r, -1)).flatten(1)


def _bmm_at_block_rank(o, w, g, r):
    return torch.bmm(o.view(o.shape[0], g, -1).transpose(0, 1), w.view(g, r, -1).transpose(1, 2)).transpose(0, 1).flatten(1)


@pytest.mark.parametrize("grouped", [_einsum_at_block_rank, _bmm_at_block_rank], ids=["einsum", "bmm"])
def test_output_viewed_back_into_its_groups_by_the_fp8_step(grouped):
    """At R = 32, the FP8 block (TINY's o_lora_rank), the model's FP8 step reads z = (...).flatten(1) [T, G * R] as
    blocks of 32, `z.float().unflatten(-1, (-1, 32))`: the GEMM's own [T, G, R] around the cast. The normalisation
    leaves the `.flatten(1)` where the formulations end (the view of a reshape's copy, `normalize.keeps_first_view`;
    a first `_pointwise_between_views` erased it here, and TINY's wo_a fused 0 of 8):
    found once, the FP8 step after the op, equal to eager bit for bit (the op's reference runs the same bf16 GEMM
    here, and a rounding apart could move an FP8 bucket, so no tolerance would do)."""
    r = 32

    def tail(o, cos, sin, w):
        return fn.fp8_fake_quant(grouped(fn.apply_rope_tail(o, cos, sin, inverse=True), w, G, r))

    def inputs_at_block_rank(seed):
        return inputs(seed)[:3] + [rand(gen(seed), G * r, H // G * HD, scale=0.1)]

    gm, report = run_passes(tail, inputs_at_block_rank(0), FUSION)
    assert report.matches == {FUSION: 1} and op_counts(gm)[OP] == 1, (report.declined, report.unrelated)
    x = inputs_at_block_rank(1)
    assert_close(gm(*x), tail(*x), atol=0, rtol=0)


def test_golden():
    gm, _ = run_passes(grouped_einsum, inputs(0, t=2), FUSION)
    expecttest.assert_expected_inline(graph_text(gm), """\
%arg0_1: bf16[2, 4, 32] = input
%arg1_1: f32[2, 8] = input
%arg2_1: f32[2, 8] = input
%arg3_1: bf16[32, 64] = input
%wo_a_default: bf16[2, 32] = dsv41.wo_a(%arg0_1, %arg1_1, %arg2_1, %arg3_1, 2, 'auto')
return %wo_a_default
""")


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_size_one_dims_are_fused(name):
    """Batch-1 decode (T=1) and one o-group per TP rank (G=1: TINY at TP=2, FLASH at TP=8)."""
    f = FORMULATIONS[name]
    missed = []
    for t, heads, groups in ((1, H, G), (T, H // G, 1), (1, H // G, 1)):
        x = inputs(0, t=t, heads=heads, groups=groups)
        gm, report = run_passes(f, x, FUSION)
        if report.matches[FUSION] != 1:
            missed.append((t, groups, report.declined[FUSION]))
            continue
        x = inputs(1, t=t, heads=heads, groups=groups)
        assert_close(gm(*x), f(*x), **TOL[name])
    assert not missed, f"not fused at (T, G, declined): {missed}"


# ---- declines ---------------------------------------------------------------------------------------------------
def test_decline_token_limit():
    reasons = run_declined(grouped_einsum, inputs(0, t=3), FUSION, max_tokens=2)
    assert "token limit: T=3 > max_tokens=2" in reasons


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_decline_fp16(name):
    reasons = run_declined(FORMULATIONS[name], inputs(0, dtype=F16), FUSION)
    assert "dtype" in reasons and "float16" in reasons


def test_forward_rope_is_fused_as_the_inverse_by_the_negated_sin():
    """The op undoes the RoPE: a graph that applies the forward rotation by (cos, sin) is the op's inverse rotation
    by (cos, -sin), so the op's sin is the graph's sin input negated (the same sin would be another computation)."""
    gm, _, node = run_fused_once(grouped_einsum_negated_angle, inputs(0), FUSION, ("aten.bmm",))
    sin = next(n for i, n in enumerate(gm.graph.find_nodes(op="placeholder")) if i == 2)
    assert node.args[2].target is torch.ops.aten.neg.default and node.args[2].args[0] is sin
    x = inputs(1)
    assert_close(gm(*x), grouped_einsum_negated_angle(*x), atol=0, rtol=0)
