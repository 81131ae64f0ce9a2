"""`moe_experts`: the routed experts' grouped GEMMs + clamped SwiGLU x routing weight (+ FP8 fake quantisation)
-> dsv41::moe_experts, found on synthetic graphs and in the tiny model (fx mode), declined above MAX_ROWS rows.

Every formulation the pass lists has a test. The op's reference runs the model's own ops, so the fused graph of a
sorted-rows formulation is bit-exact with eager on CPU (atol=rtol=0); a gathered one (batched products over
per-pair gathered weights) sums its GEMMs in another kernel, so it is held to the pass's bf16 tolerance.
"""

from __future__ import annotations

import expecttest
import pytest
import torch

from dsv41.lowerings.moe_experts import MAX_ROWS
from dsv41.models import TINY, DSV41Model
from dsv41.models import functional as fn
from dsv41.passes.moe_experts import MoeExpertsPass, experts, flat_pair_experts, gathered_experts, \
    gathered_split_experts, per_row_experts

from .harness import BF16, assert_close, compile_fx, config, make_backend, gen, graph_text, op_counts, pattern_names, rand, \
    run_declined, run_fused_once, run_passes

FUSION, OP = "moe_experts", "dsv41.moe_experts"
D, I, E, K, LIMIT, BLOCK = 64, 64, 8, 6, 10.0, 32


def inputs(seed, t=3, dtype=BF16, inter=I):
    """x [T, D], token [M] (rows sorted by expert: tokens permuted), row weights [M], offsets [E] (some experts
    empty), w13 [E, 2I, D], w2 [E, D, I]."""
    g = gen(seed)
    m = t * K
    counts = torch.bincount(torch.randint(0, E // 2, (m,), generator=g) * 2, minlength=E)  # odd experts get 0 rows
    return [rand(g, t, D, dtype=dtype), torch.randperm(m, generator=g) // K, torch.rand(m, generator=g),
            torch.cumsum(counts, 0).to(torch.int32), rand(g, E, 2 * inter, D, dtype=dtype, scale=D**-0.5),
            rand(g, E, D, inter, dtype=dtype, scale=inter**-0.5)]


FORMULATIONS = {
    "experts_fp8": lambda x, token, w, offs, w13, w2: experts(x, token, w, offs, w13, w2, LIMIT, BLOCK),
    "experts": lambda x, token, w, offs, w13, w2: experts(x, token, w, offs, w13, w2, LIMIT, 0),
    # the rows weighted after w2 (w unused here): the op takes weights of 1
    "experts_fp8_unweighted": lambda x, token, w, offs, w13, w2: experts(x, token, None, offs, w13, w2, LIMIT, BLOCK),
    "experts_unweighted": lambda x, token, w, offs, w13, w2: experts(x, token, None, offs, w13, w2, LIMIT, 0),
}


def split_inputs(seed, t=3):
    """`inputs` with w1 [E, I, D] and w3 [E, I, D] held apart (w13's halves, two graph inputs) before w2."""
    x, token, w, offs, w13, w2 = inputs(seed, t)
    return [x, token, w, offs, w13[:, :I].contiguous(), w13[:, I:].contiguous(), w2]


def _split(block, weighted):
    def f(x, token, w, offs, w1, w3, w2):
        return experts(x, token, w if weighted else None, offs, w1, w2, LIMIT, block, w3=w3)
    return f


# w1 and w3 held apart (TorchTitan's GroupedExperts): the op takes both in place
SPLIT_FORMULATIONS = {f"experts_split{fp8}{suffix}": _split(block, weighted)
                      for block, fp8 in ((BLOCK, "_fp8"), (0, "")) for weighted, suffix in ((True, ""), (False, "_unweighted"))}


def _on_rows(f):
    """f with GEMM1's input rows given (a graph input [M, D]) in place of x and token."""
    def on_rows(rows, *rest):
        return f(rows, None, *rest)
    return on_rows


def rows_inputs(split):
    """inputs(seed) (or split_inputs) with the rows x[token] as one graph input in place of x and token."""
    def make(seed, t=3):
        x, token, *rest = (split_inputs if split else inputs)(seed, t)
        return [x[token], *rest]
    return make


# GEMM1's input rows given (computed outside the region): name -> (fn, inputs(seed, t))
ROWS_FORMULATIONS = {
    **{name.replace("experts", "experts_rows", 1): (_on_rows(f), rows_inputs(False)) for name, f in FORMULATIONS.items()},
    **{name.replace("experts_split", "experts_split_rows", 1): (_on_rows(f), rows_inputs(True))
       for name, f in SPLIT_FORMULATIONS.items()}}


def gathered_inputs(seed, t=3, k=K):
    """x [T, D], expert_idx [T, k] (every token picks expert 2 in its first slot, the others among the even experts,
    so several tokens share experts and the odd ones get none), weights [T, k], w1 [E, I, D], w3 [E, I, D], w2 [E, D,
    I]: the split form's inputs; `stacked` joins w1 and w3."""
    g = gen(seed)
    expert_idx = torch.randint(0, E // 2, (t, k), generator=g) * 2
    expert_idx[:, 0] = 2
    return [rand(g, t, D), expert_idx, torch.rand(t, k, generator=g), rand(g, E, I, D, scale=D**-0.5),
            rand(g, E, I, D, scale=D**-0.5), rand(g, E, D, I, scale=I**-0.5)]


def stacked(inputs):
    x, expert_idx, w, w1, w3, w2 = inputs
    return [x, expert_idx, w, torch.cat([w1, w3], 1), w2]


def _gathered_flat(block, weighted):
    def f(x, expert_idx, w, w13, w2):
        return flat_pair_experts(x, expert_idx, w if weighted else None, w13, w2, LIMIT, block)
    return f


def _gathered(spelling, block, weighted):
    def f(x, expert_idx, w, w13, w2):
        return gathered_experts(x, expert_idx, w if weighted else None, w13, w2, LIMIT, block, spelling)
    return f


def _gathered_split(spelling, block, weighted, joined):
    def f(x, expert_idx, w, w1, w3, w2):
        return gathered_split_experts(x, expert_idx, w if weighted else None, w1, w3, w2, LIMIT, block, spelling,
                                      joined)
    return f


# name -> (fn, inputs(seed, t)); the unweighted ones take w and leave it unused (rows weighted after w2)
GATHERED = {}
for _spelling in ("einsum", "matmul"):
    for _block, _fp8 in ((BLOCK, "_fp8"), (0, "")):
        for _weighted, _suffix in ((True, ""), (False, "_unweighted")):
            GATHERED[f"gathered_{_spelling}{_fp8}{_suffix}"] = (
                _gathered(_spelling, _block, _weighted), lambda seed, t=3: stacked(gathered_inputs(seed, t)))
            for _joined, _cat in ((False, ""), (True, "_cat")):
                GATHERED[f"gathered_{_spelling}_split{_cat}{_fp8}{_suffix}"] = (
                    _gathered_split(_spelling, _block, _weighted, _joined), gathered_inputs)
for _block, _fp8 in ((BLOCK, "_fp8"), (0, "")):
    for _weighted, _suffix in ((True, ""), (False, "_unweighted")):
        GATHERED[f"gathered_flat{_fp8}{_suffix}"] = (
            _gathered_flat(_block, _weighted), lambda seed, t=3: stacked(gathered_inputs(seed, t)))
GATHERED_TOL = dict(zip(("atol", "rtol"), MoeExpertsPass.tolerance[BF16]))


def per_row_inputs(seed, t=3):
    """x [T, D], token [M], expert_idx [M] (the pairs of `gathered_inputs` sorted by expert, stably), row weights
    [M], w13 [E, 2I, D], w2 [E, D, I]."""
    x, expert_idx, w, w13, w2 = stacked(gathered_inputs(seed, t))
    sorted_ids, order = torch.sort(expert_idx.reshape(-1), stable=True)
    return [x, order // K, sorted_ids, w.reshape(-1)[order], w13, w2]


def _per_row(block, weighted):
    def f(x, token, expert_idx, row_weights, w13, w2):
        return per_row_experts(x, token, expert_idx, row_weights if weighted else None, w13, w2, LIMIT, block)
    return f


# name -> fn on per_row_inputs; the unweighted ones leave the row weights unused
PER_ROW = {f"gathered_per_row{_fp8}{_suffix}": _per_row(_block, _weighted)
           for _block, _fp8 in ((BLOCK, "_fp8"), (0, "")) for _weighted, _suffix in ((True, ""), (False, "_unweighted"))}


def test_every_formulation_has_a_test():
    assert pattern_names(FUSION) == set(FORMULATIONS) | set(SPLIT_FORMULATIONS) | set(ROWS_FORMULATIONS) | set(GATHERED) \
        | set(PER_ROW)


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_formulation_is_fused(name):
    f = FORMULATIONS[name]
    gm, report, node = run_fused_once(f, inputs(0), FUSION, ("aten._grouped_mm", "aten.index.Tensor", "aten.exp"))
    assert report.passes[1].replaced[0]["pattern"] == name
    assert node.args[6:] == (LIMIT, BLOCK if name.startswith("experts_fp8") else 0, None, "auto")
    for seed in (1, 2):  # fresh random inputs, other routings
        x = inputs(seed)
        assert_close(gm(*x), f(*x), atol=0, rtol=0)


@pytest.mark.parametrize("t", [3, 1])
@pytest.mark.parametrize("name", sorted(SPLIT_FORMULATIONS))
def test_split_formulation_is_fused(name, t):
    """w1 and w3 apart, a grouped GEMM each: one op taking the graph's w1 as its w13 and w3 as its w3 (no cat, no
    copy of the weights), bit-exact with eager on fresh inputs (the reference runs the same grouped GEMMs)."""
    f = SPLIT_FORMULATIONS[name]
    gm, report, node = run_fused_once(f, split_inputs(0, t), FUSION, ("aten._grouped_mm", "aten.cat", "aten.exp"))
    assert report.passes[1].replaced[0]["pattern"] == name
    assert [a.name for a in node.args[4:6]] == ["arg4_1", "arg6_1"] and node.args[8].name == "arg5_1"
    assert node.args[6:8] == (LIMIT, BLOCK if "_fp8" in name else 0) and node.args[9] == "auto"
    # (the unweighted forms' ones: ones_like, as the decompose pass writes it)
    assert all(op in ("dsv41.moe_experts", "aten.full", "prims.convert_element_type") for op in op_counts(gm))
    for seed in (1, 2):
        x = split_inputs(seed, t)
        got = gm(*x)
        assert not got.isnan().any()
        assert_close(got, f(*x), atol=0, rtol=0)


@pytest.mark.parametrize("name", sorted(ROWS_FORMULATIONS))
def test_rows_formulation_is_fused(name):
    """GEMM1's input rows given: one op whose x is those rows and whose token is 0, 1, ..., M - 1 (weights of 1 where
    unweighted; w1 and w3 apart as w13 and w3), bit-exact with eager on fresh inputs."""
    f, inputs_of = ROWS_FORMULATIONS[name]
    gm, report, node = run_fused_once(f, inputs_of(0), FUSION, ("aten._grouped_mm", "aten.exp"))
    assert report.passes[1].replaced[0]["pattern"] == name
    assert node.args[0].name == "arg0_1" and (node.args[8] is None) == ("_split" not in name)
    for seed in (1, 2):
        x = inputs_of(seed)
        got = gm(*x)
        assert not got.isnan().any()
        assert_close(got, f(*x), atol=0, rtol=0)


def test_split_halves_of_one_w13_sorted_run_stacked():
    """w1 and w3 as the two halves of one stacked w13 (`w13.chunk(2, 1)`): the split formulation matches, and the op
    takes that w13 stacked (w3 None: contiguous expert slices the kernel reads), bit-exact with eager."""
    f = SPLIT_FORMULATIONS["experts_split_fp8"]

    def halves(x, token, w, offs, w13, w2):
        return f(x, token, w, offs, *w13.chunk(2, 1), w2)

    gm, report, node = run_fused_once(halves, inputs(0), FUSION, ("aten._grouped_mm",))
    assert report.passes[1].replaced[0]["pattern"] == "experts_split_fp8"
    assert node.args[4].name == "arg4_1" and node.args[8] is None
    x = inputs(1)
    assert_close(gm(*x), halves(*x), atol=0, rtol=0)


@pytest.mark.parametrize("t", [3, 1])
@pytest.mark.parametrize("name", sorted(GATHERED))
def test_gathered_formulation_is_fused(name, t):
    """Each gathered formulation, op for op: one op on the rows it derives (sorted by a stable argsort, which the
    decompose pass writes as a stable sort), every weight taken as the graph holds it (w1 and w3 apart as its w13 and
    w3: no gather, no cat of any weight), no batched product left, the k of the Flash config, T = 3 and 1; equal to
    eager on fresh inputs within the pass's tolerance, NaN-free."""
    f, inputs_of = GATHERED[name]
    gm, report, node = run_fused_once(f, inputs_of(0, t), FUSION, ("aten.bmm", "aten.exp", "aten.cat"))
    (replaced,) = report.passes[1].replaced
    assert replaced["pattern"] == name and replaced["verified"] is None  # op for op: no semantic check
    assert node.args[6:8] == (LIMIT, BLOCK if "_fp8" in name else 0) and node.args[9] == "auto"
    weights = [node.args[4], node.args[5]] + ([node.args[8]] if "_split" in name else [])
    assert node.args[8] is None or "_split" in name
    assert all(w.op == "placeholder" for w in weights), gm.code  # the weights as stored
    assert op_counts(gm)["aten.sort.stable"] == 2  # the order and its inverse
    for seed in (1, 2):
        x = inputs_of(seed, t)
        got, want = gm(*x), f(*x)
        assert got.shape == ((t * K, D) if "_flat" in name else (t, K, D)) and not got.isnan().any()
        assert_close(got, want, **GATHERED_TOL)


@pytest.mark.parametrize("t", [3, 1])
@pytest.mark.parametrize("name", sorted(PER_ROW))
def test_per_row_formulation_is_fused(name, t):
    """Each sorted row on its own gathered expert weights: one op on the rows sorted by their experts (a stable sort
    and its inverse), w13 and w2 as the graph holds them (no gather of a row's weights), no batched product; the
    graph's row order; equal to eager on fresh inputs within the pass's tolerance, NaN-free."""
    f = PER_ROW[name]
    gm, report, node = run_fused_once(f, per_row_inputs(0, t), FUSION, ("aten.bmm", "aten.exp"))
    (replaced,) = report.passes[1].replaced
    assert replaced["pattern"] == name and replaced["verified"] is None
    assert node.args[6:] == (LIMIT, BLOCK if "_fp8" in name else 0, None, "auto")
    assert [(a.op, tuple(a.meta["val"].shape)) for a in node.args[4:6]] == [("placeholder", (E, 2 * I, D)),
                                                                            ("placeholder", (E, D, I))]
    assert op_counts(gm)["aten.sort.stable"] == 2
    for seed in (1, 2):
        x = per_row_inputs(seed, t)
        got, want = gm(*x), f(*x)
        assert got.shape == (t * K, D) and not got.isnan().any()
        assert_close(got, want, **GATHERED_TOL)


@pytest.mark.parametrize("t", [3, 1])
@pytest.mark.parametrize("name", ["gathered_einsum_split_fp8", "gathered_einsum_split_cat_fp8"])
def test_split_halves_of_one_w13_run_sorted(name, t):
    """w1 and w3 as the two halves of one stacked w13 (`w13.chunk(2, 1)`), used apart or their gathers joined by a
    cat: the split formulation matches, and the op takes that w13 on the sorted rows (no per-pair copy: no cat);
    equal to eager within the pass's tolerance."""
    f, _ = GATHERED[name]

    def halves(x, expert_idx, w, w13, w2):
        return f(x, expert_idx, w, *w13.chunk(2, 1), w2)

    gm, report, node = run_fused_once(halves, stacked(gathered_inputs(0, t)), FUSION, ("aten.bmm", "aten.cat"))
    assert report.passes[1].replaced[0]["pattern"] == name
    assert op_counts(gm)["aten.sort.stable"] == 2 and node.args[4].name == "arg3_1"  # the graph's w13 itself
    x = stacked(gathered_inputs(1, t))
    assert_close(gm(*x), halves(*x), **GATHERED_TOL)


def test_gathered_rows_go_back_to_their_pairs():
    """The inverse permutation, checked where a wrong one shows: pair (t, j) of a token whose x is zero is zero, and
    every other pair's row differs from its neighbours' (distinct experts and tokens)."""
    f, inputs_of = GATHERED["gathered_einsum"]
    gm, _, _ = run_fused_once(f, inputs_of(0), FUSION, ("aten.bmm",))
    x = inputs_of(1)
    x[0][1] = 0
    got, want = gm(*x), f(*x)
    assert (got[1] == 0).all() and (got[0] != 0).any() and (got[2] != 0).any()
    assert_close(got, want, **GATHERED_TOL)


@pytest.mark.parametrize("name", ["gathered_einsum_fp8", "gathered_einsum_split_fp8"])
def test_gathered_declined_above_the_row_limit(name):
    """T = 65 tokens at k = 6 (390 > 384 pairs): declined at both batched products with the row reason, the graph
    left as it was and equal to eager."""
    t = MAX_ROWS // K + 1
    f, inputs_of = GATHERED[name]
    gm, report = run_passes(f, inputs_of(0, t), FUSION, max_tokens=128)
    assert report.matches[FUSION] == 0 and op_counts(gm)[OP] == 0
    bmms = 3 if "_split" in name else 2
    assert op_counts(gm)["aten.bmm"] == bmms
    reason = f"check: rows: M = T*k = {t * K} > {MAX_ROWS} (small-row kernel); the _grouped_mm path stays"
    assert len(report.declined[FUSION]) == bmms and all(r.startswith(f"{name} at %bmm") and r.endswith(reason)
                                                        for r in report.declined[FUSION]), report.declined
    x = inputs_of(1, t)
    assert_close(gm(*x), f(*x), atol=0, rtol=0)


def two_layers(x, token, w, offs, w13, w2):
    y1 = FORMULATIONS["experts_fp8"](x, token, w, offs, w13, w2)
    y2 = FORMULATIONS["experts_fp8"](x * 2, token, w, offs, w13, w2)  # expert weights shared between layers
    return y1, y2


def test_two_sites_two_matches():
    gm, report = run_passes(two_layers, inputs(0), FUSION)
    assert report.matches[FUSION] == 2 and op_counts(gm)[OP] == 2 and op_counts(gm)["aten._grouped_mm"] == 0
    x = inputs(3)
    assert_close(gm(*x), two_layers(*x), atol=0, rtol=0)


def test_golden():
    gm, _ = run_passes(FORMULATIONS["experts_fp8"], inputs(0, t=2), FUSION)
    expecttest.assert_expected_inline(graph_text(gm), """\
%arg0_1: bf16[2, 64] = input
%arg1_1: i64[12] = input
%arg2_1: f32[12] = input
%arg3_1: i32[8] = input
%arg4_1: bf16[8, 128, 64] = input
%arg5_1: bf16[8, 64, 64] = input
%moe_experts_default: bf16[12, 64] = dsv41.moe_experts(%arg0_1, %arg1_1, %arg2_1, %arg3_1, %arg4_1, %arg5_1, 10.0, 32, None, 'auto')
return %moe_experts_default
""")


def foreign(x, token, w, offs, w13, w2, u_clamp=True):
    """Another style: chunk instead of slices, silu as g * sigmoid(g), the weight by [:, None]."""
    g, u = torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offs).float().chunk(2, dim=-1)
    g = torch.clamp(g, max=LIMIT)
    u = torch.clamp(u, min=-LIMIT, max=LIMIT) if u_clamp else u
    a = fn.fp8_fake_quant((g * torch.sigmoid(g) * u * w[:, None]).to(torch.bfloat16), BLOCK)
    return torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)


def test_foreign_formulation_found_by_what_it_computes():
    """Its parts written with other ops are islands: replaced once, after the semantic check on random inputs (valid
    offsets), and equal to eager on fresh inputs."""
    gm, report = run_passes(foreign, inputs(0), FUSION)
    assert report.matches == {FUSION: 1} and op_counts(gm)["aten._grouped_mm"] == 0
    verified = report.passes[1].replaced[0]["verified"]
    assert "checked on 2 random draws" in verified and f", at reduced sizes E = 4 of {E} (" in verified, verified
    x = inputs(1)
    assert_close(gm(*x), foreign(*x), atol=0, rtol=0)


# ---- declines ---------------------------------------------------------------------------------------------------
def test_decline_foreign_without_the_u_clamp():
    """The same style without clamping u computes something else: the semantic check declines it."""
    f = lambda *a: foreign(*a, u_clamp=False)  # noqa: E731
    reasons = run_declined(f, inputs(0), FUSION)
    assert "semantic" in reasons and "differs from dsv41::moe_experts's reference on random inputs" in reasons
def test_decline_above_the_row_limit():
    """T = 65 tokens (within max_tokens=128) give 390 > 384 rows: declined at both GEMMs of the site, the
    _grouped_mm path left as it was and still equal to eager."""
    t = MAX_ROWS // K + 1
    f = FORMULATIONS["experts_fp8"]
    gm, report = run_passes(f, inputs(0, t=t), FUSION, max_tokens=128)
    assert report.matches[FUSION] == 0 and op_counts(gm)["aten._grouped_mm"] == 2
    reason = f"check: rows: M = T*k = {t * K} > {MAX_ROWS} (small-row kernel); the _grouped_mm path stays"
    assert report.declined[FUSION] == [f"experts_fp8 at %_grouped_mm: {reason}", f"experts_fp8 at %_grouped_mm_1: {reason}"]
    x = inputs(1, t=t)
    assert_close(gm(*x), f(*x), atol=0, rtol=0)


def test_at_the_row_limit_fused():
    _, report = run_passes(FORMULATIONS["experts_fp8"], inputs(0, t=MAX_ROWS // K), FUSION)
    assert report.matches[FUSION] == 1 and not report.declined[FUSION]


def test_decline_token_limit():
    assert "token limit: T=3 > max_tokens=2" in run_declined(FORMULATIONS["experts"], inputs(0), FUSION, max_tokens=2)


def test_decline_other_limit():
    """A model with another SwiGLU limit computes something else: a scalar decline naming both limits."""
    f = lambda x, token, w, offs, w13, w2: experts(x, token, w, offs, w13, w2, 7.0, BLOCK)  # noqa: E731
    reasons = run_declined(f, inputs(0), FUSION)
    assert "scalar" in reasons and "expected 10.0, found 7.0" in reasons


# ---- the tiny model, fx mode --------------------------------------------------------------------------------------
def compile_static(fn, **changes):
    """fn through the real backend (fx mode, only this fusion) with static shapes: one graph per token count."""
    backend = make_backend(config(FUSION, **changes))
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False), backend


@pytest.fixture(scope="module")
def moe_layer():
    """The tiny model's layer-0 MoE module (routing, experts, finalize, shared expert)."""
    torch.manual_seed(0)
    return DSV41Model(TINY, [0], max_batch=8, max_context=128).layers["0"].ffn


@pytest.mark.parametrize("fake_quant", [True, False])
@torch.no_grad()
def test_tiny_moe_layer(moe_layer, fake_quant):
    """The model's own MoE (fp8 fake quantisation on: the model's default; off: the bf16 formulation) fuses once
    through the real backend and equals eager bit for bit at T = 1, 5, 8."""
    layer = moe_layer
    layer.cfg = TINY.with_(fake_quant=fake_quant)
    try:
        compiled, backend = compile_static(layer.forward)
        for t in (1, 5, 8):
            h = rand(gen(t), t, TINY.dim)
            assert_close(compiled(h), layer(h), atol=0, rtol=0)
        reports = backend.reports
        assert len(reports) == 3 and all(r.matches == {FUSION: 1} and r.fallback is None for r in reports)
        want = "experts_fp8" if fake_quant else "experts"
        assert all(r.passes[1].replaced[0]["pattern"] == want for r in reports)
    finally:
        layer.cfg = TINY


@torch.no_grad()
def test_tiny_moe_layer_above_the_row_limit(moe_layer):
    """At T = 65 (390 rows, max_tokens raised to 128) the pass declines with the row reason and the compiled
    layer still equals eager."""
    compiled, backend = compile_static(moe_layer.forward, max_tokens=128)
    h = rand(gen(0), 65, TINY.dim)
    assert_close(compiled(h), moe_layer(h), atol=0, rtol=0)
    report = backend.reports[-1]
    assert report.matches == {FUSION: 0}
    assert len(report.declined[FUSION]) == 2 and all("rows: M = T*k = 390 > 384" in r for r in report.declined[FUSION])


def test_tiny_model_counts():
    """The two-layer tiny model in fx mode with every fusion on: one moe_experts per layer, nothing declined."""
    torch.manual_seed(0)
    model = DSV41Model(TINY, [0, 1], max_batch=4, max_context=128)
    compiled, backend = compile_fx(model)
    tokens, positions = torch.tensor([1, 2, 3]), torch.tensor([5, 9, 17])
    with torch.no_grad():
        got = compiled(tokens, positions)
    report = backend.reports[-1]
    assert report.matches[FUSION] == 2 and report.fallback is None and not report.declined[FUSION]
    assert got.shape == (3, TINY.vocab_size) and not got.isnan().any()

