"""The semantic check's sizes (`dsv41.passes.fusion`): a `moe_experts` match with parts computed another way (the
FP8 step's scale by exp2, as gpt-fast and TorchTitan write it) among E = 64 experts is checked on 4 of them, for
the sorted rows (offsets over the drawn experts), the gathered pairs and weights stored transposed (a view chain
cut along the stored value's expert dim); nothing the pass manager allocates comes near the experts' weights; the
record says at what sizes it checked. At those sizes the check still tells a wrong expert, a transposed weight and
another SwiGLU limit apart. Weights viewed with E written into the view (Megatron's flat weights) are drawn reduced
too; a size the region itself bakes is drawn whole within the budget, and declined with both numbers beyond it."""

from __future__ import annotations

import pytest
import torch

from dsv41.passes import fusion as fusion_module
from dsv41.passes.fusion import Derived, Reduction, Replacement
from dsv41.passes.matcher import MatchResult
from dsv41.passes.moe_experts import REDUCED_EXPERTS, MoeExpertsPass

from .allocations import eager_allocations, record
from .foreign.gptfast_style import SWIGLU_LIMIT, clamped_swiglu, fp8_round_trip
from .harness import BF16, aten_graph, config, gen, rand, run_passes

FUSION = "moe_experts"
E, D, I, T, K = 64, 32, 32, 3, 2  # D = I: a transposed w2 has w2's shape
TOL = dict(zip(("atol", "rtol"), MoeExpertsPass.tolerance[BF16]))


def _activation(gu, w):
    """The FP8 round trip (exp2 scale) of bf16(clamped SwiGLU of gu's halves x w)."""
    inter = gu.shape[-1] // 2
    return fp8_round_trip((clamped_swiglu(gu[..., :inter], gu[..., inter:]) * w[..., None]).to(BF16))


def sorted_rows(x, token, w, offs, w13, w2):
    """The model's sorted rows under `_grouped_mm`, the FP8 step written another way."""
    gu = torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offs)
    return torch._grouped_mm(_activation(gu, w), w2.transpose(1, 2), offs=offs)


def sorted_rows_stored_transposed(x, token, w, offs, w13_t, w2_t):
    """As `sorted_rows` with the weights stored transposed, [E, D, 2I] and [E, I, D]: the op reads them through the
    matcher's inverse view chain."""
    gu = torch._grouped_mm(x[token], w13_t, offs=offs)
    return torch._grouped_mm(_activation(gu, w), w2_t, offs=offs)


def gathered_pairs(x, expert_idx, w, w13, w2):
    """Each (token, slot) pair on its gathered expert weights under einsum."""
    gu = torch.einsum("td,tkod->tko", x, w13[expert_idx])
    return torch.einsum("tki,tkdi->tkd", _activation(gu, w), w2[expert_idx])


def sorted_inputs(seed, transposed=False):
    """x [T, D], token [M], w [M], offsets [E] (the rows on every third expert, the rest empty), w13 [E, 2I, D],
    w2 [E, D, I] (transposed: stored [E, D, 2I], [E, I, D])."""
    g, m = gen(seed), T * K
    counts = torch.bincount(torch.randint(0, E // 3, (m,), generator=g) * 3, minlength=E)
    w13, w2 = rand(g, E, 2 * I, D, scale=D**-0.5), rand(g, E, D, I, scale=I**-0.5)
    if transposed:
        w13, w2 = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    return [rand(g, T, D), torch.randperm(m, generator=g) // K, torch.rand(m, generator=g),
            torch.cumsum(counts, 0).to(torch.int32), w13, w2]


def gathered_inputs(seed):
    g = gen(seed)
    return [rand(g, T, D), torch.randint(0, E, (T, K), generator=g), torch.rand(T, K, generator=g),
            rand(g, E, 2 * I, D, scale=D**-0.5), rand(g, E, D, I, scale=I**-0.5)]


FORMS = {"sorted": (sorted_rows, sorted_inputs, "experts_fp8"),
         "stored_transposed": (sorted_rows_stored_transposed, lambda seed: sorted_inputs(seed, True), "experts_fp8"),
         "gathered": (gathered_pairs, gathered_inputs, "gathered_einsum_fp8")}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_experts_checked_on_four_of_their_experts(form):
    """Fused once after the semantic check, which drew the experts' weights as 4 of their 64 experts (recorded, with
    the drawn shapes of the two weights); every real tensor the pass manager allocated is at most the larger of the
    formulation's largest eager tensor (its activations) and 4 experts' w13, which is 1/16 of w13; the fused graph
    equals eager on fresh inputs within the pass's tolerance."""
    f, inputs_of, pattern = FORMS[form]
    with record() as log:
        gm, report = run_passes(f, inputs_of(0), FUSION)
    (replaced,) = report.passes[1].replaced
    assert replaced["pattern"] == pattern
    w13_shape, w2_shape = ([REDUCED_EXPERTS, D, 2 * I], [REDUCED_EXPERTS, I, D]) if form == "stored_transposed" else (
        [REDUCED_EXPERTS, 2 * I, D], [REDUCED_EXPERTS, D, I])
    assert f", at reduced sizes E = {REDUCED_EXPERTS} of {E} (" in replaced["verified"], replaced["verified"]
    assert f"{w13_shape}, " in replaced["verified"] and f"{w2_shape}" in replaced["verified"], replaced["verified"]
    w13_bytes = 2 * I * D * E * 2
    bound = max(eager_allocations(f, *inputs_of(0)).largest_bytes(), REDUCED_EXPERTS * w13_bytes // E)
    assert log.allocations and bound <= w13_bytes // 8
    assert log.largest_bytes() <= bound, log.largest()
    x = inputs_of(1)
    got = gm(*x)
    assert not got.isnan().any()
    torch.testing.assert_close(got, f(*x), **TOL)


def _match(f, inputs):
    """The moe_experts pass's match (with parts computed another way) of f's one site, and the pass."""
    gm = aten_graph(f, *inputs)
    fusion = MoeExpertsPass(config(FUSION))
    anchor = fusion.anchors(gm.graph)[0]
    index = next(i for i, p in enumerate(fusion.pattern_set().patterns) if p.name == "gathered_einsum_fp8")
    m = fusion.pattern_set().match_one(index, anchor)
    assert isinstance(m, MatchResult) and m.islands, m
    return fusion, m


def _with_w2(rep: Replacement, w2) -> Replacement:
    args = list(rep.args)
    args[5] = w2
    return Replacement(rep.op, tuple(args), rep.outputs)


def _with_limit(rep: Replacement, limit) -> Replacement:
    args = list(rep.args)
    args[6] = limit
    return Replacement(rep.op, tuple(args), rep.outputs)


WRONG = {  # an op that computes something else than the region: (how, wrong replacement of the right one)
    "wrong expert": lambda rep: _with_w2(rep, Derived(torch.ops.aten.flip.default, (rep.args[5], [0]))),
    "transposed weight": lambda rep: _with_w2(rep, Derived(torch.ops.aten.transpose.int, (rep.args[5], 1, 2))),
    "another limit": lambda rep: _with_limit(rep, SWIGLU_LIMIT * 0.7),
}


@pytest.mark.parametrize("how", sorted(WRONG))
def test_reduced_sizes_still_tell_other_math_apart(how, monkeypatch):
    """With the full-size fallback ruled out (floor 0: the region's activations are far below its weights), the
    right op passes at 4 experts, and each wrong one (its experts in reverse order, w2 transposed, another SwiGLU
    limit) disagrees there: the reason names the reduced sizes and the budget that ruled out the full ones."""
    monkeypatch.setattr(fusion_module, "DRAW_FLOOR_BYTES", 0)
    fusion, m = _match(gathered_pairs, gathered_inputs(0))
    rep = fusion.replacement(m)
    reason, verified = fusion.semantic_check(m, rep)
    assert reason is None and f"at reduced sizes E = {REDUCED_EXPERTS} of {E}" in verified, reason
    reason, _ = fusion.semantic_check(m, WRONG[how](rep))
    assert reason is not None and "differs from dsv41::moe_experts's reference on random inputs" in reason, reason
    assert f"(at reduced sizes E = {REDUCED_EXPERTS} of {E} (" in reason and "over its budget" in reason, reason


def flat_weights_viewed(x, token, w, offs, weight1, weight2):
    """Megatron's GroupedMLP habit: flat [D, E * 2I] / [E * I, D] parameters viewed [E, D, 2I] / [E, I, D] with E
    written into the views, the FP8 step written another way."""
    e, d = offs.shape[0], x.shape[1]
    gu = torch._grouped_mm(x[token], weight1.view(e, d, -1), offs=offs)
    return torch._grouped_mm(_activation(gu, w), weight2.view(e, -1, d), offs=offs)


def flat_inputs(seed):
    x, token, w, offs, w13_t, w2_t = sorted_inputs(seed, transposed=True)
    return [x, token, w, offs, w13_t.view(D, -1), w2_t.view(-1, D)]


def test_weights_viewed_with_their_expert_count_are_drawn_reduced():
    """Megatron's flat weights viewed [E, D, 2I] with E written into the views: the views are the op's weights, read
    by the region as its inputs, so they are drawn as 4 experts like any other."""
    gm, report = run_passes(flat_weights_viewed, flat_inputs(0), FUSION)
    (replaced,) = report.passes[1].replaced
    assert f", at reduced sizes E = {REDUCED_EXPERTS} of {E} (%arg3_1 [{REDUCED_EXPERTS}], %view " \
        f"[{REDUCED_EXPERTS}, {D}, {2 * I}], %view_3 [{REDUCED_EXPERTS}, {I}, {D}]; " in replaced["verified"], replaced
    x = flat_inputs(1)
    torch.testing.assert_close(gm(*x), flat_weights_viewed(*x), **TOL)


def test_a_size_the_region_bakes_is_drawn_whole_within_the_budget(monkeypatch):
    """A size the fusion declares reducible but the region writes into its views (D, which the einsums' views of the
    gathered pairs bake): the region fails at the reduced sizes, so the check draws the graph's sizes, which the
    floor admits (recorded so); with the floor below them, declined at both its products with the reduced failure,
    what the full draw would take and the budget, the graph left as it was and equal to eager."""
    monkeypatch.setattr(MoeExpertsPass, "reductions", {"D": Reduction({"x": 1, "w13": 2, "w2": 1}, D // 2)})
    gm, report = run_passes(gathered_pairs, gathered_inputs(0), FUSION)
    (replaced,) = report.passes[1].replaced
    assert ", at the graph's sizes (0.375 MiB drawn)" in replaced["verified"], replaced["verified"]
    monkeypatch.setattr(fusion_module, "DRAW_FLOOR_BYTES", 0)
    gm, report = run_passes(gathered_pairs, gathered_inputs(0), FUSION)
    assert report.matches[FUSION] == 0
    declined = report.declined[FUSION]
    assert len(declined) == 2 and all(d.startswith(f"gathered_einsum_fp8 at %{bmm}: semantic: ") and
                                      "running the region or the op on random inputs failed" in d and
                                      f"(at reduced sizes D = {D // 2} of {D} (" in d and
                                      "at the graph's sizes the semantic check would draw 0.375 MiB, over its budget of "
                                      in d for d, bmm in zip(declined, ("bmm", "bmm_1"))), declined
    x = gathered_inputs(1)
    torch.testing.assert_close(gm(*x), gathered_pairs(*x), atol=0, rtol=0)
