"""`indexer_topk`: index scores + candidate-block selection / restriction + top-k + window offset
-> dsv41::indexer_topk.

Every formulation the pass lists (the index-source, candidate-source and re-index layer kinds, each with
`topk(sorted=False)` then an ascending sort (the model's) or a sorted `topk` then the sort, or either top-k
scattered into an additive -inf mask, or the sorted top-k rows alone ("_raw", the rest the graph's own code); each
with the softmax scale folded into w (the model's) or applied to relu(q . k) before the head weights, "_scaled")
has a user-written function here; k, the offset, the candidate block size / count and the score scale are read
from the graph.

Comparison: the selected indices are compared per row as index sets (valid entries, offset removed), with the
tie rule: indices whose score equals the row's k-th largest score are interchangeable (any of them is a correct
top-k), so the sets may differ only by such indices; everything scoring strictly above the k-th is in both. Rows
with fewer than k visible rows give -1 for the rest, compared as a count. The candidate mask (a set of blocks) is
compared exactly. A mask is compared as the ascending index set of its zeros (padded with -1 to k), by the same
rule, and its other entries must be -inf. Raw rows are compared as the indices they give (their valid entries, the
rest -1), and must be distinct, ascending and in [0, N). (In practice the fused op runs the same torch.topk on the same scores and
is bit-identical.)
"""

from __future__ import annotations

import math

import expecttest
import pytest
import torch

from dsv41.models.model import select_candidate_blocks

from .harness import BF16, F16, compiled_matches, gen, graph_text, op_counts, pattern_names, rand, run_declined, \
    run_fused_once, run_passes

FUSION, OP = "indexer_topk", "dsv41.indexer_topk"
T, IH, IHD, N = 4, 4, 32, 40
TOPK, OFFSET, CAND_BLOCK, CAND_BLOCKS = 8, 8, 4, 3


def inputs(seed, t=T, n=N, dtype=BF16, with_cand=False):
    """q, w, keys, n_c (row 0 sees everything, row 1 fewer than k rows, row 2 none), [candidates]."""
    g = gen(seed)
    n_c = torch.randint(0, n + 1, (t,), generator=g)
    n_c[0] = n
    if t > 1:
        n_c[1] = min(TOPK - 3, n)
    if t > 2:
        n_c[2] = 0
    out = [rand(g, t, IH, IHD, dtype=dtype), torch.rand(t, IH, generator=g), rand(g, t, n, IHD, dtype=dtype), n_c]
    return out + [torch.rand(t, n, generator=g) < 0.5] if with_cand else out


# ---- the formulations --------------------------------------------------------------------------------------------
SCORE_SCALE = IHD**-0.5  # the "_scaled" formulations' softmax scale, applied to relu(q . k) before the head weights


def index_scores(q, w, keys, n_c, fill=-math.inf, score_scale=None):
    relu = torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu()
    s = ((relu if score_scale is None else relu * score_scale) * w.unsqueeze(-1)).sum(dim=1)
    visible = torch.arange(keys.shape[1], device=s.device) < n_c.unsqueeze(-1)
    return s.masked_fill(~visible, fill)


def topk_then_sort(s, k=TOPK, offset=OFFSET):
    sel = torch.sort(torch.topk(s, min(k, s.shape[1]), dim=-1, sorted=False).indices, dim=-1).values
    return torch.where(s.gather(-1, sel) > -math.inf, sel + offset, -1)


def sorted_topk(s, k=TOPK, offset=OFFSET):
    sel = s.topk(min(k, s.shape[1]), dim=-1).indices.sort(dim=-1).values
    return torch.where(s.gather(-1, sel) > -math.inf, sel + offset, -1)


def topk_mask(s, k=TOPK, sorted_topk=False):
    sel = torch.topk(s, min(k, s.shape[1]), dim=-1, sorted=sorted_topk).indices
    return torch.full_like(s, -math.inf).scatter(-1, sel, 0.0).masked_fill(s == -math.inf, -math.inf)


def sorted_topk_mask(s, k=TOPK):
    return topk_mask(s, k, sorted_topk=True)


def topk_mask_spare(s, k=TOPK, sorted_topk=False):
    """Invalid picks (score -inf) sent to a spare column N of a [T, N + 1] -inf buffer, sliced off after the scatter."""
    vals, sel = torch.topk(s, min(k, s.shape[1]), dim=-1, sorted=sorted_topk)
    sel = torch.where(vals > -math.inf, sel, s.shape[1])
    return torch.full((s.shape[0], s.shape[1] + 1), -math.inf).scatter(-1, sel, 0.0)[:, :-1]


def sorted_topk_mask_spare(s, k=TOPK):
    return topk_mask_spare(s, k, sorted_topk=True)


def topk_raw(s, k=TOPK):
    """The sorted top-k rows alone: what the graph does with them (a block table's translation) is its own."""
    return torch.sort(torch.topk(s, min(k, s.shape[1]), dim=-1, sorted=False).indices, dim=-1).values


def sorted_topk_raw(s, k=TOPK):
    return s.topk(min(k, s.shape[1]), dim=-1).indices.sort(dim=-1).values


def index_source(select, scale=None):
    def f(q, w, keys, n_c):
        return select(index_scores(q, w, keys, n_c, score_scale=scale))
    return f


def candidate_source(select, scale=None):
    def f(q, w, keys, n_c):
        s = index_scores(q, w, keys, n_c, score_scale=scale)
        return select(s), select_candidate_blocks(s, n_c, CAND_BLOCK, CAND_BLOCKS)
    return f


def reindex(select, scale=None):
    def f(q, w, keys, n_c, cand):
        return select(index_scores(q, w, keys, n_c, score_scale=scale).masked_fill(~cand, -math.inf))
    return f


FORMULATIONS = {f"{kind}{tag}{scaled}": (make(select, scale), kind)
                for tag, select in (("", topk_then_sort), ("_sorted", sorted_topk), ("_mask", topk_mask),
                                    ("_mask_sorted", sorted_topk_mask), ("_mask_spare", topk_mask_spare),
                                    ("_mask_spare_sorted", sorted_topk_mask_spare), ("_raw", topk_raw),
                                    ("_raw_sorted", sorted_topk_raw))
                for kind, make in (("index_source", index_source), ("candidate_source", candidate_source),
                                   ("reindex", reindex))
                for scaled, scale in (("", None), ("_scaled", SCORE_SCALE))}


def scores_of(kind, q, w, keys, n_c, cand=None, score_scale=None):
    s = index_scores(q, w, keys, n_c, score_scale=score_scale)
    return s.masked_fill(~cand, -math.inf) if kind == "reindex" else s


def assert_same_selection(got, want, s, offset=OFFSET, k=TOPK):
    """Per row: the same number of -1s, and the same index set up to ties at the k-th score (see the docstring)."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.int64
    for r in range(s.shape[0]):
        g, w = got[r][got[r] >= 0] - offset, want[r][want[r] >= 0] - offset
        assert len(g) == len(w), f"row {r}: {len(g)} valid indices, expected {len(w)}"
        assert (got[r] == -1).sum() == (want[r] == -1).sum()
        if len(w) == 0:
            continue
        assert torch.equal(g, g.sort().values), f"row {r}: indices not ascending"
        kth = s[r].topk(min(k, s.shape[1])).values[len(w) - 1]
        differ = set(g.tolist()) ^ set(w.tolist())
        assert all(s[r, i] == kth for i in differ), f"row {r}: {sorted(differ)} differ and are not ties at {kth}"


def mask_indices(mask, k=TOPK):
    """The ascending indices of a mask's zeros per row, padded with -1 to min(k, N); its other entries are -inf."""
    assert mask.dtype == torch.float32 and bool(((mask == 0) | (mask == -math.inf)).all())
    width = min(k, mask.shape[1])
    rows = [torch.nonzero(r == 0).flatten() for r in mask]
    assert all(len(r) <= width for r in rows)
    return torch.stack([torch.cat([r, r.new_full((width - len(r),), -1)]) for r in rows])


def raw_as_indices(sel, s, offset=OFFSET):
    """Raw sorted top-k rows [T, K] (distinct, ascending, in [0, N)) as the index selection: + offset where the row's
    score is above -inf, else -1."""
    assert sel.dtype == torch.int64 and bool(((sel >= 0) & (sel < s.shape[1])).all())
    assert bool((sel[:, 1:] > sel[:, :-1]).all()), "raw rows not distinct and ascending"
    return torch.where(s.gather(-1, sel) > -math.inf, sel + offset, -1)


def check(kind, got, want, x, mask=False, score_scale=None, raw=False):
    if kind != "candidate_source":
        got, want = (got,), (want,)
    cand = x[4] if kind == "reindex" else None
    s = scores_of(kind, *x[:4], cand, score_scale)
    if mask:
        assert_same_selection(mask_indices(got[0]), mask_indices(want[0]), s, offset=0)
    elif raw:
        assert_same_selection(raw_as_indices(got[0], s), raw_as_indices(want[0], s), s)
    else:
        assert_same_selection(got[0], want[0], s)
    if kind == "candidate_source":
        assert got[1].dtype == torch.bool and torch.equal(got[1], want[1])


def test_every_formulation_has_a_test():
    assert pattern_names(FUSION) == set(FORMULATIONS)


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_formulation_is_fused(name):
    f, kind = FORMULATIONS[name]
    gone = ("aten.topk", "aten.sort", "aten.bmm", "aten.relu", "aten.gather")
    gm, _, node = run_fused_once(f, inputs(0, with_cand=kind == "reindex"), FUSION, gone)
    topk, offset, cand_block, cand_blocks, mask, _, score_scale = node.args[5:12]
    raw = "_raw" in name
    assert (topk, offset, mask) == ((TOPK, 0, True) if "_mask" in name else (TOPK, 0, False) if raw else
                                    (TOPK, OFFSET, False))
    assert (node.args[13] if len(node.args) > 13 else False) is raw  # raw_indices
    assert (cand_block, cand_blocks) == ((CAND_BLOCK, CAND_BLOCKS) if kind == "candidate_source" else (0, 0))
    assert (node.args[4] is None) == (kind != "reindex")
    assert score_scale == (SCORE_SCALE if name.endswith("_scaled") else 1.0)
    x = inputs(1, with_cand=kind == "reindex")
    check(kind, gm(*x), f(*x), x, mask="_mask" in name, score_scale=SCORE_SCALE if name.endswith("_scaled") else None,
          raw=raw)


@pytest.mark.parametrize("k, offset, n", [(5, 3, N), (8, 128, 6)])
def test_k_and_offset_are_read_from_the_graph(k, offset, n):
    """Another k and window offset; n < k clamps k to n (min(k, N) in the graph)."""
    def f(q, w, keys, n_c):
        return topk_then_sort(index_scores(q, w, keys, n_c), k, offset)

    gm, report = run_passes(f, inputs(0, n=n), FUSION)
    assert report.matches[FUSION] == 1
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and "indexer_topk" in str(n.target))
    assert node.args[5:7] == (min(k, n), offset)
    x = inputs(2, n=n)
    assert_same_selection(gm(*x), f(*x), index_scores(*x), offset=offset, k=k)


BLOCK_SIZE = 4


def paged_translation(q, w, keys, n_c, block_table):
    """A serving engine's indexer: the sorted top-k rows translated through a paged cache's block table to pool
    slots, `block_table[t, row // bs] * bs + row % bs`, -1 where the row is past n_c (int32 lengths and table)."""
    sel = topk_raw(index_scores(q, w, keys, n_c))
    slots = block_table.gather(1, sel // BLOCK_SIZE).long() * BLOCK_SIZE + sel % BLOCK_SIZE
    return slots.masked_fill(sel >= n_c[:, None], -1)


def paged_inputs(seed):
    q, w, keys, n_c = inputs(seed)
    table = torch.randperm(T * N // BLOCK_SIZE, generator=gen(seed + 100)).view(T, N // BLOCK_SIZE).to(torch.int32)
    return [q, w, keys, n_c.to(torch.int32), table]


def test_block_table_translation_leaves_the_core_fused():
    """The scores and their sorted top-k fuse (raw rows, the op told so); the translation through the block table
    and the -1 past n_c stay the graph's, on the op's rows: equal to eager on fresh inputs. The int32 lengths reach
    the op widened to int64."""
    gm, report = run_passes(paged_translation, paged_inputs(0), FUSION)
    assert report.matches == {FUSION: 1} and _fused(report) == ["index_source_raw"], report.near_misses
    ops = op_counts(gm)
    assert ops[OP] == 1 and ops["aten.topk"] == ops["aten.sort"] == ops["aten.bmm"] == 0 and ops["aten.gather"] == 1
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and "indexer_topk" in str(n.target))
    n_c = node.args[3]
    assert n_c.target is torch.ops.prims.convert_element_type.default and n_c.args == (gm.graph.find_nodes(
        op="placeholder")[3], torch.int64)
    for seed in (1, 2):
        x = paged_inputs(seed)
        assert torch.equal(gm(*x), paged_translation(*x))


def test_validity_written_another_way_widens_the_raw_core():
    """The spec's validity `where(sel < n_c, sel + W, -1)` (not the pattern's `s[sel] > -inf`): the raw core matches
    op for op, and its wider index formulation, with that part computed another way and checked, takes the site,
    so the validity and the offset run inside the op."""
    def f(q, w, keys, n_c):
        sel = topk_raw(index_scores(q, w, keys, n_c))
        return torch.where(sel < n_c.unsqueeze(-1), sel + OFFSET, -1)

    gm, report = run_passes(f, inputs(0), FUSION)
    assert report.matches == {FUSION: 1} and _fused(report) == ["index_source"], report.declined
    assert op_counts(gm)["aten.where"] == 0 and not report.narrowed.get(FUSION)
    x = inputs(1)
    assert_same_selection(gm(*x), f(*x), index_scores(*x))


def _fused(report):
    return [r["pattern"] for p in report.passes if p.name == FUSION for r in p.replaced]


def three_layers(q, w, keys, n_c):
    """The model's chain: a candidate source, then a re-index layer using its candidates, then an index source."""
    i1, cand = candidate_source(topk_then_sort)(q, w, keys, n_c)
    i2 = reindex(sorted_topk)(q, w * 2, keys, n_c, cand)
    return i1, i2, index_source(topk_then_sort)(q, w * 3, keys, n_c)


def test_three_sites_three_matches():
    gm, report = run_passes(three_layers, inputs(0), FUSION)
    assert report.matches[FUSION] == 3 and op_counts(gm)[OP] == 3 and op_counts(gm)["aten.topk"] == 0
    x = inputs(3)
    got, want = gm(*x), three_layers(*x)
    _, cand = candidate_source(topk_then_sort)(*x)
    assert_same_selection(got[0], want[0], index_scores(*x))
    assert_same_selection(got[1], want[1], index_scores(x[0], x[1] * 2, x[2], x[3]).masked_fill(~cand, -math.inf))
    assert_same_selection(got[2], want[2], index_scores(x[0], x[1] * 3, x[2], x[3]))


@torch.no_grad()
def test_model_indexer_through_the_backend():
    def check(got, want, x):
        assert_same_selection(got, want, index_scores(*x))

    assert compiled_matches(index_source(topk_then_sort), inputs, check=check) == {FUSION: 1}


def test_golden():
    gm, _ = run_passes(FORMULATIONS["candidate_source"][0], inputs(0, t=2, n=8), FUSION)
    expecttest.assert_expected_inline(graph_text(gm), """\
%arg0_1: bf16[2, 4, 32] = input
%arg1_1: f32[2, 4] = input
%arg2_1: bf16[2, 8, 32] = input
%arg3_1: i64[2] = input
%indexer_topk_default: (i64[2, 8], b8[2, 8]) = dsv41.indexer_topk(%arg0_1, %arg1_1, %arg2_1, %arg3_1, None, 8, 8, 4, 2, False, 'auto', 1.0)
%getitem_7: b8[2, 8] = getitem(%indexer_topk_default, 1)
%getitem_6: i64[2, 8] = getitem(%indexer_topk_default, 0)
return [%getitem_6, %getitem_7]
""")


# ---- declines ---------------------------------------------------------------------------------------------------
def test_decline_token_limit():
    reasons = run_declined(FORMULATIONS["reindex"][0], inputs(0, t=4, with_cand=True), FUSION, max_tokens=3)
    assert "token limit: T=4 > max_tokens=3" in reasons


def test_decline_fp16():
    reasons = run_declined(FORMULATIONS["index_source_sorted"][0], inputs(0, dtype=F16), FUSION)
    assert "dtype" in reasons and "float16" in reasons


def test_decline_other_mask_value():
    """Masking invisible rows with -1e30 instead of -inf is another computation (they would count as valid)."""
    def f(q, w, keys, n_c):
        return topk_then_sort(index_scores(q, w, keys, n_c, fill=-1e30))

    reasons = run_declined(f, inputs(0), FUSION)
    assert "scalar" in reasons and "-inf" in reasons and "-1e+30" in reasons, reasons


def test_decline_extra_user_of_unscored_interior():
    """A value inside the region other than the scores s (which the op can return) read elsewhere, here the
    unmasked head-weighted sums: an extra user, named."""
    def f(q, w, keys, n_c):
        raw = (torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu() * w.unsqueeze(-1)).sum(dim=1)
        visible = torch.arange(keys.shape[1]) < n_c.unsqueeze(-1)
        return topk_then_sort(raw.masked_fill(~visible, -math.inf)), raw.amax(-1)

    reasons = run_declined(f, inputs(0), FUSION)
    assert "extra user" in reasons and "inside the pattern is also used by" in reasons and "amax" in reasons, reasons
