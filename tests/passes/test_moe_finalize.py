"""`moe_finalize`: the combine of the routed expert outputs + the shared-expert add + the cast
-> dsv41::moe_finalize.

Every formulation the pass lists (combine by index_add (the model's) or scatter_add over an expanded index; with
the shared add, or the combine alone as under TP where an all-reduce sits between; the unpermutes of sorted rows;
the per-slot sums of rows in (token, slot) order) has a user-written function here. The combine with the shared add is claimed before the combine alone. The op accumulates in the same
row order as index_add_, so index_add formulations are bit-exact (atol=rtol=0); scatter_add sums the same rows
in fp32, possibly in another order: fp32 tolerance (atol=rtol=1e-6) for the combine-only output, bf16 (atol=rtol=
1.6e-2) after the cast.
"""

from __future__ import annotations

import expecttest
import pytest
import torch

from .harness import BF16, F16, assert_close, compiled_matches, declined, gen, graph_text, op_counts, pattern_names, \
    rand, run_declined, run_fused_once, run_passes

FUSION, OP = "moe_finalize", "dsv41.moe_finalize"
T, D, K = 3, 32, 6


def inputs(seed, t=T, dtype=BF16, shared=True):
    """expert_out [T*K, D] (rows sorted by expert: tokens permuted), token [T*K], [shared [T, D]]."""
    g = gen(seed)
    out = [rand(g, t * K, D, dtype=dtype), torch.randperm(t * K, generator=g) // K]
    return out + [rand(g, t, D, dtype=dtype)] if shared else out


def combine_index_add(out, token, t):
    return torch.zeros(t, out.shape[1], dtype=torch.float32, device=out.device).index_add_(0, token, out.float())


def combine_scatter_add(out, token, t):
    y = torch.zeros(t, out.shape[1], dtype=torch.float32, device=out.device)
    return y.scatter_add_(0, token.unsqueeze(-1).expand(-1, out.shape[1]), out.float())


def with_shared(combine):
    def f(out, token, shared):
        return (combine(out, token, shared.shape[0]) + shared.float()).to(shared.dtype)
    return f


def combine_only(combine):
    def f(out, token):
        return combine(out, token, T)
    return f


FORMULATIONS = {"index_add_shared": with_shared(combine_index_add), "index_add_only": combine_only(combine_index_add),
                "scatter_add_shared": with_shared(combine_scatter_add),
                "scatter_add_only": combine_only(combine_scatter_add)}


def weighted(combine):
    """vLLM's order: each row times its routing weight in fp32 after the down projection, then the combine."""
    def rows(out, w):
        return out.float() * w.unsqueeze(-1)
    return lambda out, w, token, t: combine(rows(out, w), token, t)


WEIGHTED_FORMULATIONS = {
    "index_add_weighted_shared": lambda out, token, w, shared: (weighted(combine_index_add)(out, w, token, shared.shape[0])
                                                                + shared.float()).to(shared.dtype),
    "index_add_weighted_only": lambda out, token, w: weighted(combine_index_add)(out, w, token, T),
    "scatter_add_weighted_shared": lambda out, token, w, shared: (weighted(combine_scatter_add)(out, w, token, shared.shape[0])
                                                                  + shared.float()).to(shared.dtype),
    "scatter_add_weighted_only": lambda out, token, w: weighted(combine_scatter_add)(out, w, token, T),
}


def weighted_inputs(seed, shared=True):
    out, token, *rest = inputs(seed, shared=shared)
    return [out, token, torch.rand(out.shape[0], generator=gen(seed + 100))] + rest


def tolerance(name):
    if name.startswith("index_add"):
        return dict(atol=0, rtol=0)
    return dict(atol=1e-6, rtol=1e-6) if name.endswith("_only") else dict(atol=1.6e-2, rtol=1.6e-2)


def into_shared(combine, weighted):
    """The combine accumulated into the shared output in fp32 (TorchTitan's), the rows weighted in fp32 or not."""
    def f(out, token, *rest):
        *w, shared = rest
        rows = out.float() * w[0].unsqueeze(-1) if weighted else out.float()
        if combine == "index_add":
            return shared.float().index_add(0, token, rows).to(shared.dtype)
        return shared.float().scatter_add(0, token.unsqueeze(-1).expand(-1, rows.shape[1]), rows).to(shared.dtype)
    return f


INTO_SHARED_FORMULATIONS = {f"{c}{'_weighted' if w else ''}_into_shared": into_shared(c, w)
                            for c in ("index_add", "scatter_add") for w in (True, False)}


def unpermute_of(ids, out, w):
    """MaxText's unpermute of the rows `out` sorted by the stable argsort of the flat expert ids: back in (token,
    slot) order by the inverse permutation, [T, k, D], summed with the [T, k] weights by einsum."""
    order = torch.argsort(ids, stable=True)
    rows = out[torch.argsort(order)].reshape(w.shape[0], w.shape[1], out.shape[1])
    return torch.einsum("tkd,tk->td", rows.float(), w)


UNPERMUTE_FORMULATIONS = {
    "unpermute_shared": lambda out, ids, w, shared: (unpermute_of(ids, out, w) + shared.float()).to(shared.dtype),
    "unpermute_only": lambda out, ids, w: unpermute_of(ids, out, w),
}


def unweighted_unpermute_of(ids, out):
    """The unpermute of rows already weighted (before w2, the spec's order): [T, k, D] summed over k."""
    order = torch.argsort(ids, stable=True)
    return out[torch.argsort(order)].reshape(-1, K, out.shape[1]).float().sum(dim=1)


UNWEIGHTED_FORMULATIONS = {
    "unpermute_unweighted_shared": lambda out, ids, shared: (unweighted_unpermute_of(ids, out)
                                                             + shared.float()).to(shared.dtype),
    "unpermute_unweighted_only": lambda out, ids: unweighted_unpermute_of(ids, out),
}


def unpermute_inputs(seed, shared=True, weights=True):
    """expert rows [T*K, D], flat expert ids [T*K] (equal ids abound), [weights [T, K] fp32], [shared [T, D]]."""
    g = gen(seed)
    out = [rand(g, T * K, D), torch.randint(0, 4, (T * K,), generator=g)]
    w = [torch.rand(T, K, generator=g)] if weights else []
    return out + w + ([rand(g, T, D)] if shared else [])


SLOT_FORMULATIONS = {
    "slots_einsum_shared": lambda rows, w, shared: (torch.einsum("tkd,tk->td", rows.float(), w)
                                                    + shared.float()).to(shared.dtype),
    "slots_mul_sum_shared": lambda rows, w, shared: ((rows.float() * w.unsqueeze(-1)).sum(dim=1)
                                                     + shared.float()).to(shared.dtype),
    "slots_unweighted_shared": lambda rows, shared: (rows.float().sum(dim=1) + shared.float()).to(shared.dtype),
}


def slot_inputs(seed, t=T, weights=True):
    """expert rows [T, K, D] in (token, slot) order, [weights [T, K] fp32], shared [T, D]."""
    g = gen(seed)
    rows = [rand(g, t, K, D)] + ([torch.rand(t, K, generator=g)] if weights else [])
    return rows + [rand(g, t, D)]


def bf16_accumulation(out, token, weights, shared):
    """HF's experts combine: the weighted rows (fp32) rounded to bf16, `index_add_`ed into a bf16 zeros_like, the
    shared expert added in bf16."""
    rows = out * weights.unsqueeze(-1)
    return torch.zeros_like(shared).index_add_(0, token, rows.to(shared.dtype)) + shared


def bf16_accumulation_inputs(seed):
    out, token, shared = inputs(seed)
    return [out, token, torch.rand(T * K, generator=gen(seed + 100)), shared]


def test_bf16_accumulation_is_declined_with_its_reason():
    """The combine accumulated in bf16 matches its listed formulation once and is declined (it rounds every row and
    step, the op once); the graph keeps it and still computes eager's values exactly, which do differ from the op's
    fp32 sum rounded once."""
    x = bf16_accumulation_inputs(0)
    gm, report = run_passes(bf16_accumulation, x, FUSION)
    assert report.matches[FUSION] == 0 and op_counts(gm)[OP] == 0
    (reason,) = report.declined[FUSION]
    assert reason.startswith("index_add_bf16_shared") and "accumulates in bf16" in reason, reason
    out, token, weights, shared = x
    assert torch.equal(gm(*x), bf16_accumulation(*x))
    one_rounding = torch.ops.dsv41.moe_finalize(out, token, shared, T, weights, "reference")
    assert not torch.equal(one_rounding, bf16_accumulation(*x))


def test_every_formulation_has_a_test():
    assert pattern_names(FUSION) == (set(FORMULATIONS) | set(WEIGHTED_FORMULATIONS) | set(UNPERMUTE_FORMULATIONS)
                                     | set(UNWEIGHTED_FORMULATIONS) | set(INTO_SHARED_FORMULATIONS)
                                     | set(SLOT_FORMULATIONS) | {"index_add_bf16_shared"})


@pytest.mark.parametrize("name", sorted(INTO_SHARED_FORMULATIONS))
def test_into_shared_formulation_is_fused(name):
    """The op adds the shared row after the routed rows, the graph before them: fp32 reordering before the one
    rounding, so equal to eager within one bf16 ulp (atol=rtol=2^-7); the weights are the op's where the graph
    weights the rows."""
    f, weighted = INTO_SHARED_FORMULATIONS[name], "_weighted" in name
    inputs_of = weighted_inputs if weighted else inputs
    gm, report, node = run_fused_once(f, inputs_of(0), FUSION, ("aten.index_add", "aten.scatter_add"))
    assert report.passes[1].replaced[0]["pattern"] == name and node.args[3] == T
    assert (node.args[4] is not None) == weighted
    for seed in (1, 2):
        x = inputs_of(seed)
        got = gm(*x)
        assert not got.isnan().any()
        assert_close(got, f(*x), atol=2 ** -7, rtol=2 ** -7)


@pytest.mark.parametrize("t", [T, 1])
@pytest.mark.parametrize("name", sorted(SLOT_FORMULATIONS))
def test_per_slot_formulation_is_fused(name, t):
    """Rows already in (token, slot) order: the op takes them viewed [T * K, D] with token = p // K of row p and the
    weights flattened alike (none for the unweighted sum). The op sums a token's K products in slot order from +0.0;
    the graph's batched product may sum them in another order: within one bf16 ulp of eager after the rounding
    (atol 0, rtol 2^-7), no NaN."""
    f = SLOT_FORMULATIONS[name]
    weighted = "unweighted" not in name
    gm, report, node = run_fused_once(f, slot_inputs(0, t, weighted), FUSION, ("aten.bmm", "aten.sum.dim_IntList"))
    assert report.passes[1].replaced[0]["pattern"] == name
    assert node.args[3] == t and (node.args[4] is not None) == weighted
    for seed in (1, 2):
        x = slot_inputs(seed, t, weighted)
        assert_close(gm(*x), f(*x), atol=0, rtol=2**-7)


@pytest.mark.parametrize("name", sorted(UNPERMUTE_FORMULATIONS))
def test_unpermute_formulation_is_fused(name):
    """The op takes token = order // k and the weights gathered by order; the einsum sums a token's rows in slot
    order, the op in row order: fp32 reordering (atol=rtol=1e-6 before the cast, one bf16 ulp after)."""
    f = UNPERMUTE_FORMULATIONS[name]
    shared = name.endswith("_shared")
    gm, report, node = run_fused_once(f, unpermute_inputs(0, shared=shared), FUSION, ("aten.bmm", "aten.sort"))
    assert report.passes[1].replaced[0]["pattern"] == name and node.args[3] == T and node.args[4] is not None
    for seed in (1, 2):
        x = unpermute_inputs(seed, shared=shared)
        assert_close(gm(*x), f(*x), **(dict(atol=1.6e-2, rtol=1.6e-2) if shared else dict(atol=1e-6, rtol=1e-6)))


@pytest.mark.parametrize("name", sorted(UNWEIGHTED_FORMULATIONS))
def test_unweighted_unpermute_formulation_is_fused(name):
    """The op takes token = order // k and no weights; the graph sums a token's k rows in slot order, the op in row
    order: fp32 reordering (atol=rtol=1e-6 before the cast, one bf16 ulp after)."""
    f = UNWEIGHTED_FORMULATIONS[name]
    shared = name.endswith("_shared")
    gm, report, node = run_fused_once(f, unpermute_inputs(0, shared, weights=False), FUSION, ("aten.sort",))
    assert report.passes[1].replaced[0]["pattern"] == name and node.args[3] == T and node.args[4] is None
    for seed in (1, 2):
        x = unpermute_inputs(seed, shared, weights=False)
        assert_close(gm(*x), f(*x), **(dict(atol=1.6e-2, rtol=1.6e-2) if shared else dict(atol=1e-6, rtol=1e-6)))


def test_unpermute_of_indices_not_a_sort_is_declined_and_the_per_slot_sum_fuses():
    """An `order` that is a graph input (not known to be a permutation) declines the unpermute, naming it; the rows
    the graph gathers by argsort(order) are then rows in (token, slot) order for the per-slot sum, which fuses with
    that gather kept (the op reads the gathered rows); within one bf16 ulp of eager."""
    def f(out, order, w, shared):
        rows = out[torch.argsort(order)].reshape(T, K, D)
        return (torch.einsum("tkd,tk->td", rows.float(), w) + shared.float()).to(shared.dtype)

    def inputs_of(seed):
        out, _, w, shared = unpermute_inputs(seed)
        return [out, torch.randperm(T * K, generator=gen(seed)), w, shared]

    gm, report = run_passes(f, inputs_of(0), FUSION)
    assert report.matches == {FUSION: 1} and op_counts(gm)["aten.sort"] == 1, gm.code
    assert report.passes[1].replaced[0]["pattern"] == "slots_einsum_shared"
    assert "is not the indices of a sort of 18 values" in declined(report, FUSION), report.declined
    x = inputs_of(1)
    assert_close(gm(*x), f(*x), atol=0, rtol=2**-7)


@pytest.mark.parametrize("name", sorted(WEIGHTED_FORMULATIONS))
def test_weighted_formulation_is_fused(name):
    """The weights after w2 become the op's `weights`; equal to eager (bit-exact for index_add)."""
    f = WEIGHTED_FORMULATIONS[name]
    shared = name.endswith("_shared")
    gm, report, node = run_fused_once(f, weighted_inputs(0, shared=shared), FUSION, ("aten.index_put", "aten.scatter_add"))
    assert report.passes[1].replaced[0]["pattern"] == name and node.args[5] is not None  # weights
    x = weighted_inputs(1, shared=shared)
    assert_close(gm(*x), f(*x), **tolerance(name))


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_formulation_is_fused(name):
    f = FORMULATIONS[name]
    shared = name.endswith("_shared")
    gone = ("aten.index_put", "aten.scatter_add", "aten.full", "aten.add.Tensor", "prims.convert_element_type")
    gm, report, node = run_fused_once(f, inputs(0, shared=shared), FUSION, gone)
    assert report.passes[1].replaced[0]["pattern"] == name  # the wider formulation claims the shared add
    assert node.args[3] == T and (node.args[2] is None) == (not shared)
    x = inputs(1, shared=shared)
    got, want = gm(*x), f(*x)
    assert got.dtype == want.dtype == (BF16 if shared else torch.float32)
    assert_close(got, want, **tolerance(name))


def two_layers(out, token, shared):
    y1 = FORMULATIONS["index_add_shared"](out, token, shared)
    y2 = FORMULATIONS["scatter_add_only"](out * 2, token)
    return y1, y2


def test_two_sites_two_matches():
    gm, report = run_passes(two_layers, inputs(0), FUSION)
    assert report.matches[FUSION] == 2 and op_counts(gm)[OP] == 2
    assert sorted(r["pattern"] for r in report.passes[1].replaced) == ["index_add_shared", "scatter_add_only"]
    x = inputs(2)
    got, want = gm(*x), two_layers(*x)
    assert_close(got[0], want[0], atol=0, rtol=0)
    assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_model_moe_tail_through_the_backend():
    """The end of MoE.forward: weighted expert rows in expert order, index_add_ combine, shared add, cast."""
    def tail(out, token, shared):
        t = shared.shape[0]
        y = torch.zeros(t, shared.shape[1], dtype=torch.float32, device=out.device).index_add_(0, token, out.float())
        return (y + shared.float()).to(shared.dtype)

    assert compiled_matches(tail, inputs) == {FUSION: 1}


def test_golden():
    gm, _ = run_passes(FORMULATIONS["index_add_shared"], inputs(0, t=2), FUSION)
    expecttest.assert_expected_inline(graph_text(gm), """\
%arg0_1: bf16[12, 32] = input
%arg1_1: i64[12] = input
%arg2_1: bf16[2, 32] = input
%moe_finalize_default: bf16[2, 32] = dsv41.moe_finalize(%arg0_1, %arg1_1, %arg2_1, 2, None, 'auto')
return %moe_finalize_default
""")


# ---- declines ---------------------------------------------------------------------------------------------------
def test_decline_token_limit():
    reasons = run_declined(FORMULATIONS["scatter_add_shared"], inputs(0, t=3), FUSION, max_tokens=2)
    assert "token limit: T=3 > max_tokens=2" in reasons


@pytest.mark.parametrize("name", ["index_add_shared", "index_add_only"])
def test_decline_fp16(name):
    reasons = run_declined(FORMULATIONS[name], inputs(0, dtype=F16, shared=name.endswith("_shared")), FUSION)
    assert "dtype" in reasons and "float16" in reasons
