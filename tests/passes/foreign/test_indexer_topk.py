"""Foreign formulations of `indexer_topk` (index scores + top-k + ascending indices offset past the window), each
differing from the project's model in one named way. Each must be found exactly once and equal eager exactly (the
indices; scores are fp32 from random inputs, so there are no ties). Index validity written as `sel < n_c` equals
the gathered score > -inf for an index source (every visible row has a finite score), the domain the semantic
check samples (n_c in 0..Ncap). The mask-style formulations return the selection as an additive fp32 mask over the
compressed rows (0 where selected, -inf elsewhere: Hugging Face's form), compared exactly too."""

from __future__ import annotations

import math

import pytest
import torch

from ..harness import assert_found_once
from ..test_indexer_topk import OFFSET, TOPK, inputs

FUSION = "indexer_topk"


def scores(q, w, keys, n_c):
    s = (torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu() * w.unsqueeze(-1)).sum(dim=1)
    visible = torch.arange(keys.shape[1], device=s.device) < n_c.unsqueeze(-1)
    return s.masked_fill(~visible, -math.inf)


def select(s, valid_of):
    sel = torch.sort(torch.topk(s, min(TOPK, s.shape[1]), dim=-1, sorted=False).indices, dim=-1).values
    return torch.where(valid_of(s, sel), sel + OFFSET, -1)


def gathered(s, sel):
    return s.gather(-1, sel) > -math.inf


def validity_by_index(q, w, keys, n_c):
    """equal math written differently: index validity as sel < n_c instead of the gathered score > -inf."""
    return select(scores(q, w, keys, n_c), lambda s, sel: sel < n_c.unsqueeze(-1))


def additive_mask(q, w, keys, n_c):
    """equal math written differently: the visibility as an additive 0 / -inf mask, s + where(visible, 0, -inf)
    (equal to where(visible, s, -inf) but where s is +inf or NaN), with the validity as sel < n_c (the reference's
    `index_score += mask`)."""
    s = (torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu() * w.unsqueeze(-1)).sum(dim=1)
    s = s + torch.where(torch.arange(keys.shape[1]).unsqueeze(0) < n_c.unsqueeze(1), 0.0, -math.inf)
    return select(s, lambda s, sel: sel < n_c.unsqueeze(-1))


def weights_first(q, w, keys, n_c):
    """operand order: head weights times the relu scores."""
    s = (w.unsqueeze(-1) * torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu()).sum(dim=1)
    visible = torch.arange(keys.shape[1]) < n_c.unsqueeze(-1)
    return select(s.masked_fill(~visible, -math.inf), gathered)


def where_fill(q, w, keys, n_c):
    """other spelling: torch.where(visible, s, -inf) instead of masked_fill, visibility by None-indexing."""
    s = (torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu() * w[:, :, None]).sum(dim=1)
    visible = torch.arange(keys.shape[1])[None, :] < n_c[:, None]
    return select(torch.where(visible, s, -math.inf), gathered)


def take_along_dim(q, w, keys, n_c):
    """other spelling: torch.take_along_dim for the gathered scores."""
    return select(scores(q, w, keys, n_c), lambda s, sel: torch.take_along_dim(s, sel, dim=-1) > -math.inf)


def sorted_by_values(q, w, keys, n_c):
    """other spelling: top-k sorted (the default), the ascending order by torch.sort(...)[0], defaults implicit."""
    s = scores(q, w, keys, n_c)
    sel = torch.sort(s.topk(min(TOPK, s.shape[1])).indices)[0]
    return torch.where(s.gather(1, sel) > -math.inf, sel + OFFSET, -1)


def bmm_scores(q, w, keys, n_c):
    """contraction: the scores as a bmm of q by the transposed keys."""
    s = (torch.bmm(q.float(), keys.float().transpose(1, 2)).relu() * w.unsqueeze(-1)).sum(dim=1)
    visible = torch.arange(keys.shape[1]) < n_c.unsqueeze(-1)
    return select(s.masked_fill(~visible, -math.inf), gathered)


def token_major_scores(q, w, keys, n_c):
    """layout: the scores token-major, bmm(keys, q^T) [T, N, H], weighted and summed over the heads last, masked in
    place; the top-k as the first k of a stable descending sort (the same set but among ties, where topk's choice is
    unspecified), validity by sel >= n_c filled in place (SGLang-native code)."""
    s = (torch.bmm(keys.float(), q.float().mT).relu() * w.unsqueeze(1)).sum(dim=-1)
    s.masked_fill_(torch.arange(keys.shape[1]).unsqueeze(0) >= n_c.unsqueeze(1), float("-inf"))
    sel = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :min(TOPK, s.shape[1])]
    sel = torch.sort(sel, dim=-1).values
    return (sel + OFFSET).masked_fill_(sel >= n_c.unsqueeze(1), -1)


def mask_by_visibility(q, w, keys, n_c):
    """mask form, equal math written differently: the selected rows' validity by the position test n >= n_c, not
    s == -inf."""
    s = scores(q, w, keys, n_c)
    sel = torch.topk(s, min(TOPK, s.shape[1]), dim=-1).indices
    hidden = torch.arange(keys.shape[1])[None, :] >= n_c[:, None]
    return torch.full_like(s, -math.inf).scatter(-1, sel, 0.0).masked_fill(hidden, -math.inf)


def mask_in_place(q, w, keys, n_c):
    """mask form, other spelling: an in-place scatter_ into a new_full buffer, validity by torch.where."""
    s = scores(q, w, keys, n_c)
    sel = s.topk(min(TOPK, s.shape[1]), sorted=False).indices
    mask = s.new_full(s.shape, -math.inf)
    mask.scatter_(1, sel, 0.0)
    return torch.where(s > -math.inf, mask, -math.inf)


def mask_spare_column(q, w, keys, n_c):
    """mask form, HF's spelling: unsorted top-k, invalid picks (score -inf) sent to a spare column N of a
    [T, N + 1] -inf buffer that the 0-scatter fills, the spare column sliced off."""
    s = scores(q, w, keys, n_c)
    n = s.shape[-1]
    vals, sel = s.topk(min(TOPK, n), dim=-1, sorted=False)
    sel = torch.where(vals > -math.inf, sel, n)
    mask = torch.full((s.shape[0], n + 1), -math.inf).scatter_(-1, sel, 0.0)
    return mask[..., :n]


def hidden_by_ge(q, w, keys, n_c):
    """predicate form: the invisible rows as where(n >= n_c, -inf, s), the complement of the model's n < n_c test
    with the branches swapped (integers: no NaN, so an exact identity)."""
    s = (torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu() * w.unsqueeze(-1)).sum(dim=1)
    hidden = torch.arange(keys.shape[1])[None, :] >= n_c[:, None]
    return select(torch.where(hidden, -math.inf, s), gathered)


def scale_before_head_weights(q, w, keys, n_c):
    """op contract: the softmax scale applied to relu(q . k) before the head-weight sum (w unscaled), not folded
    into w: another rounding, which the op computes as such (score_scale)."""
    s = (torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu() * keys.shape[-1] ** -0.5 * w.unsqueeze(-1)).sum(1)
    visible = torch.arange(keys.shape[1]) < n_c.unsqueeze(-1)
    return select(s.masked_fill(~visible, -math.inf), gathered)


def spare_column_full_like(q, w, keys, n_c):
    """other spelling: the spare column's index as a filled tensor, torch.where(valid, sel, full_like(sel, N)), not
    the number N."""
    s = scores(q, w, keys, n_c)
    n = s.shape[-1]
    vals, sel = s.topk(min(TOPK, n), dim=-1, sorted=False)
    sel = torch.where(vals > -math.inf, sel, torch.full_like(sel, n))
    return torch.full((s.shape[0], n + 1), -math.inf).scatter(-1, sel, 0.0)[:, :n]


def scores_also_read(q, w, keys, n_c):
    """op contract: the scores also feed the model's own selection of 2 of the 4-row blocks (by block maximum, no
    newest-block pin, as unflatten + amax + topk + a bool scatter + repeat_interleave), which no pattern computes:
    the op returns the scores for it (`return_scores`) and fuses the top-k."""
    s = scores(q, w, keys, n_c)
    blocks = s.unflatten(-1, (-1, 4)).amax(-1)
    top = blocks.topk(2, dim=-1)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter(-1, top.indices, top.values > -math.inf)
    return select(s, gathered), keep.repeat_interleave(4, dim=-1)


CASES = {f.__name__: f for f in (additive_mask, scores_also_read, spare_column_full_like, validity_by_index, weights_first, where_fill, take_along_dim, sorted_by_values,
                                 bmm_scores, token_major_scores, mask_by_visibility, mask_in_place, mask_spare_column, hidden_by_ge,
                                 scale_before_head_weights)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_found_once_and_equal_to_eager(name):
    assert_found_once(CASES[name], inputs, FUSION)


@pytest.mark.parametrize("name", ["hidden_by_ge", "spare_column_full_like", "scale_before_head_weights"])
def test_found_op_for_op(name):
    """These differ from a pattern only by an exact identity the normalisation applies (or by a form the op
    states): matched op for op, with no part left to the semantic check."""
    report = assert_found_once(CASES[name], inputs, FUSION)
    replaced = next(p for p in report.passes if p.name == FUSION).replaced
    assert [r["verified"] for r in replaced] == [None]


def test_scores_returned_to_their_other_reader():
    """The scores' other reader (the block selection) takes the op's second output, s as the graph computes it
    (NaN kept), and stays in the graph; the op is called with return_scores."""
    from ..harness import run_passes

    gm, report = run_passes(scores_also_read, inputs(0), FUSION)
    fused = [n for n in gm.graph.nodes if n.op == "call_function" and "indexer_topk" in str(n.target)]
    assert report.matches == {FUSION: 1} and len(fused) == 1 and fused[0].args[-1] is True
    readers = {u.args[1] for u in fused[0].users}
    assert readers == {0, 1}, readers
    q, w, keys, n_c = inputs(2)
    keys[1, 3] = float("nan")  # a visible NaN score (n_c[1] = 5): the block selection still sees it as eager does
    got, want = gm(q, w, keys, n_c), scores_also_read(q, w, keys, n_c)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0][[0, 3]], want[0][[0, 3]])  # rows without NaN (the op selects a NaN as -inf: its contract)
