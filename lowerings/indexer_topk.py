"""`dsv41::indexer_topk`: index scores, the candidate-block selection or restriction, top-k and the window offset, the
selection returned as indices, as an additive mask over the compressed rows, or as the raw sorted top-k rows (for a
model that maps them itself, e.g. through a paged KV block table)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dsv41.lowerings import _checks, _kernels
from dsv41.models.model import select_candidate_blocks

NAME = "indexer_topk"
INDEX_MAX = 2**63 - 1  # the largest int64 index


def _validate(q, w, keys, n_c, candidates, topk, offset, cand_block, cand_topk_blocks, impl, score_scale,
              return_scores=False, mask=False, raw_indices=False):
    _checks.check_impl(NAME, impl)
    _checks.check_scalar(NAME, "return_scores", return_scores, isinstance(return_scores, bool), "must be a bool")
    _checks.check_scalar(NAME, "raw_indices", raw_indices, isinstance(raw_indices, bool), "must be a bool")
    if raw_indices:
        _checks.check_scalar(NAME, "raw_indices", raw_indices, not mask, "must be False when mask is True (one "
                             "selection form)")
        _checks.check_scalar(NAME, "offset", offset, offset == 0, "must be 0 when raw_indices is True (the raw "
                             "rows carry no offset)")
    _checks.check_finite(NAME, "score_scale", score_scale)
    device = _checks.check_devices(NAME, q=q, w=w, keys=keys, n_c=n_c, candidates=candidates)
    dims = _checks.Dims()
    _checks.check_tensor(NAME, "q", q, torch.bfloat16, "T IH ihd", dims)
    _checks.check_tensor(NAME, "w", w, torch.float32, "T IH", dims)
    _checks.check_tensor(NAME, "keys", keys, torch.bfloat16, "T Ncap ihd", dims)
    _checks.check_tensor(NAME, "n_c", n_c, torch.int64, "T", dims)
    _checks.check_tensor(NAME, "candidates", candidates, torch.bool, "T Ncap", dims, optional=True)
    if _checks.values_on_host(n_c):
        _checks.check_range(NAME, "n_c", n_c, 0, dims["Ncap"], "Ncap (keys.shape[1])")
    _checks.check_scalar(NAME, "topk", topk, topk >= 1, "must be >= 1")
    _checks.check_scalar(NAME, "offset", offset, 0 <= offset <= INDEX_MAX - dims["Ncap"],
                         f"must be in [0, 2**63 - 1 - Ncap] (idx = n + offset, an int64 >= 0), Ncap = {dims['Ncap']} "
                         f"{dims.source('Ncap')}")
    _checks.check_scalar(NAME, "cand_topk_blocks", cand_topk_blocks, cand_topk_blocks >= 0, "must be >= 0")
    if cand_topk_blocks > 0:
        _checks.check_scalar(NAME, "cand_block", cand_block, 1 <= cand_block <= max(dims["Ncap"], 1),
                             f"must be in [1, max(Ncap, 1)] when cand_topk_blocks > 0 (a block of at most the "
                             f"Ncap = {dims['Ncap']} rows {dims.source('Ncap')})")
    _checks.check_scalar(NAME, "return_scores", return_scores, not (return_scores and cand_topk_blocks > 0),
                         "must be False when cand_topk_blocks > 0 (the second output holds the candidate blocks)")
    return device, dims


SCORE_RTOL = 2**-15  # |s - s'| / (sum_h |w_h| |q_h| . |k_n|) allowed between two fp32 summation orders


def visible_scores(q, w, keys, n_c, score_scale=1.0):
    """s [T, Ncap] fp32 with n >= n_c at -inf and NaN kept: the scores a model computes (`return_scores`)."""
    relu = torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu()
    if score_scale != 1.0:
        relu = relu * score_scale
    s = (relu * w.unsqueeze(-1)).sum(dim=1)
    visible = torch.arange(keys.shape[1], device=s.device) < n_c.unsqueeze(-1)
    return s.masked_fill(~visible, -math.inf)


def scores(q, w, keys, n_c, score_scale=1.0):
    """s [T, Ncap] fp32 as the op selects by (before the candidate mask): NaN and n >= n_c are -inf."""
    s = visible_scores(q, w, keys, n_c, score_scale)
    return s.masked_fill(s.isnan(), -math.inf)


def score_tolerance(q, w, keys, score_scale=1.0):
    """[T, Ncap]: SCORE_RTOL x the magnitude sum_h |w_h| |score_scale| (|q_h| . |k_n|) that bounds two summation
    orders' difference of s[t, n] (128-term fp32 dot products, then 32 heads)."""
    magnitude = torch.einsum("thd,tnd->thn", q.float().abs(), keys.float().abs()) * w.abs().unsqueeze(-1)
    return SCORE_RTOL * abs(score_scale) * magnitude.sum(dim=1)


def reference(q, w, keys, n_c, candidates, topk, offset, cand_block, cand_topk_blocks, mask=False, score_scale=1.0,
              return_scores=False, raw_indices=False):
    """Plain torch, the tail of the model's Indexer.forward op for op (NaN scores as -inf); with `mask`, the
    selection scattered into an additive mask instead; with `raw_indices`, the sorted top-k rows themselves; with a
    `score_scale` other than 1, relu(q . k) scaled by it before the head weights; with `return_scores`, the visible
    scores (NaN kept) as the second output."""
    t, n_cap = keys.shape[0], keys.shape[1]
    visible = visible_scores(q, w, keys, n_c, score_scale)
    s = visible.masked_fill(visible.isnan(), -math.inf)  # scores(...)
    if return_scores:
        cand = visible
    elif cand_topk_blocks > 0:
        cand = select_candidate_blocks(s, n_c, cand_block, cand_topk_blocks)
    else:
        cand = torch.empty((t, 0), dtype=torch.bool, device=s.device)
    if candidates is not None:
        s = s.masked_fill(~candidates, -math.inf)
    sel = torch.topk(s, min(topk, n_cap), dim=-1, sorted=False).indices
    sel = torch.sort(sel, dim=-1).values
    if raw_indices:
        return sel, cand
    valid = s.gather(-1, sel) > -math.inf
    if mask:
        return selection_mask(torch.where(valid, sel, -1), n_cap), cand
    return torch.where(valid, sel + offset, -1), cand


def selection_mask(idx, n_cap):
    """The additive mask [T, Ncap] fp32 of a selection idx [T, K] (offset 0, -1 = none): 0 at the selected rows."""
    kept = torch.zeros((idx.shape[0], n_cap + 1), dtype=torch.bool, device=idx.device)
    kept.scatter_(-1, torch.where(idx >= 0, idx, n_cap), True)
    return torch.where(kept[:, :n_cap], 0.0, -math.inf)


def _unordered(idx):
    """Whether some row's valid (>= 0) entries of idx are not strictly ascending."""
    valid = idx >= 0
    running = torch.where(valid, idx, -1).cummax(-1).values
    before = torch.cat([torch.full_like(idx[:, :1], -1), running[:, :-1]], dim=-1)
    return bool((valid & (idx <= before)).any())


def _same_selection(got, want, values, tol):
    """None when the selections got and want (bool [T, N]) of the top-K of values [T, N] agree under the tie rule:
    the same count per row, got only where values > -inf, and every entry of one but not the other within tol [T]
    of the K-th largest selected value (an exact tie, or a near-tie under another summation order)."""
    kth = values.masked_fill(~want, math.inf).amin(-1, keepdim=True)
    tol = tol.unsqueeze(-1)
    bad = (got.sum(-1) != want.sum(-1)) | (got & (values == -math.inf)).any(-1)
    bad |= (got & ~want & (values < kth - tol)).any(-1) | (want & ~got & (values > kth + tol)).any(-1)
    rows = bad.nonzero().flatten().tolist()
    return f"rows {rows[:8]}{' ...' if len(rows) > 8 else ''} select other entries" if rows else None


def _selected(idx, offset, n_cols):
    """bool [T, N]: the columns idx - offset of the valid entries of idx (None if one lies outside [0, N))."""
    valid = idx >= 0
    cols = torch.where(valid, idx - offset, n_cols)
    if bool(((cols < 0) | (cols > n_cols) | (valid & (cols == n_cols))).any()):
        return None
    chosen = torch.zeros((idx.shape[0], n_cols + 1), dtype=torch.bool, device=idx.device)
    return chosen.scatter_(-1, cols, True)[:, :n_cols]


def compare_kernel(got, want, inputs: dict | None = None) -> str | None:
    """None when the kernel's (idx, cand) agree with the reference's, else the first difference.

    The kernel's valid indices must be strictly ascending. Without `inputs`, the two must select the same index
    sets (idx as sorted rows, -1 included; cand equal). With `inputs` (the op's arguments by name) they are compared
    under the tie rule: as index sets that may differ only in entries whose score lies within the summation-order
    tolerance (score_tolerance, the row's largest) of the K-th largest selected score, the -1 entries by count;
    likewise the candidate blocks, by block maximum."""
    (got_idx, got_cand), (want_idx, want_cand) = got, want
    for name, g, w in (("idx", got_idx, want_idx), ("cand", got_cand, want_cand)):
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"{name}: {g.dtype}{list(g.shape)} vs the reference's {w.dtype}{list(w.shape)}"
    if _unordered(got_idx):
        return "idx: the valid indices of a row are not strictly ascending"
    if inputs is None:
        if not torch.equal(got_idx.sort(-1).values, want_idx.sort(-1).values):
            return "idx: the index sets differ"
        return None if torch.equal(got_cand, want_cand) else "cand: the candidate masks differ"
    q, w, keys, n_c, score_scale = inputs["q"], inputs["w"], inputs["keys"], inputs["n_c"], inputs.get("score_scale", 1.0)
    n_cap = keys.shape[1]
    s = scores(q, w, keys, n_c, score_scale)
    tol = score_tolerance(q, w, keys, score_scale).masked_fill(s == -math.inf, 0.0).amax(-1)
    if want_cand.shape[1]:
        block = inputs["cand_block"]
        picked = [c[:, ::block] for c in (got_cand, want_cand)]
        if not torch.equal(got_cand, picked[0].repeat_interleave(block, dim=1)[:, :n_cap]):
            return "cand: not whole candidate blocks"
        why = _same_selection(*picked, _block_maxima(s, n_c, block), tol)
        if why is not None:
            return f"cand: {why}"
    if inputs["candidates"] is not None:
        s = s.masked_fill(~inputs["candidates"], -math.inf)
    chosen = [_selected(idx, inputs["offset"], n_cap) for idx in (got_idx, want_idx)]
    if chosen[0] is None:
        return f"idx: an index outside [offset, offset + Ncap) = [{inputs['offset']}, {inputs['offset'] + n_cap})"
    why = _same_selection(*chosen, s, tol)
    return None if why is None else f"idx: {why}"


def _block_maxima(s, n_c, block):
    """select_candidate_blocks' block scores: the max of s over each block, the newest block pinned to +inf."""
    t, n_cap = s.shape
    n_blocks = -(-n_cap // block)
    bs = torch.nn.functional.pad(s, (0, n_blocks * block - n_cap), value=-math.inf).view(t, n_blocks, block).amax(-1)
    newest = (n_c - 1).div(block, rounding_mode="floor")
    pin = (torch.arange(n_blocks, device=s.device) == newest.unsqueeze(-1)) & (n_c > 0).unsqueeze(-1)
    return bs.masked_fill(pin, math.inf)


@torch.library.custom_op("dsv41::indexer_topk", mutates_args=())
def indexer_topk(q: Tensor, w: Tensor, keys: Tensor, n_c: Tensor, candidates: Tensor | None, topk: int, offset: int,
                 cand_block: int, cand_topk_blocks: int, mask: bool = False, impl: str = "auto",
                 score_scale: float = 1.0, return_scores: bool = False,
                 raw_indices: bool = False) -> tuple[Tensor, Tensor]:
    """Top-k compressed-KV rows per token by index score (spec 2.4), as sorted indices offset past the window or,
    with `mask`, as an additive mask over the compressed rows (the form attention adds to its scores), or, with
    `raw_indices`, as the sorted top-k rows themselves (for a model that maps them on its own: a paged cache's block
    table, its own validity rule).

    q [T, IH, ihd] bf16 (roped, fp4-fake-quantised), w [T, IH] fp32 (scaled head weights), keys [T, Ncap, ihd] bf16,
    n_c [T] int64 (valid rows), candidates [T, Ncap] bool or None, topk >= 1, 0 <= offset <= 2**63 - 1 - Ncap,
    1 <= cand_block <= max(Ncap, 1) when cand_topk_blocks > 0;
    K = min(topk, Ncap):
        s[t, n]  = sum_h w[t, h] * relu(q[t, h] . keys[t, n])  in fp32;  -inf where n >= n_c[t] or s is NaN  [T, Ncap]
                   (with score_scale != 1: sum_h (relu(q[t, h] . keys[t, n]) * score_scale) * w[t, h], the scale
                   applied before the head weights, as a model that does not fold it into w computes it)
        cand     = select_candidate_blocks(s, n_c, cand_block, cand_topk_blocks) if cand_topk_blocks > 0
                   (from s before the candidate mask; [T, Ncap] bool), else an empty [T, 0] bool
        s        = -inf where not candidates[t, n]  (if candidates is given)
        sel      = the indices of the K largest s[t, n] (torch.topk(s, K)), sorted ascending                  [T, K]
        idx      = sel + offset where s[t, sel] > -inf, else -1                                         [T, K] int64
        mask     = 0 where n is in sel[t] and s[t, n] > -inf, else -inf  (offset unused)           [T, Ncap] fp32
    -> (idx, cand), or (mask, cand) with `mask`, or (sel, cand) with `raw_indices` (offset 0, not with `mask`:
    every one of the K rows, those whose s is -inf included); with `return_scores` (cand_topk_blocks = 0) the second output is
    instead s [T, Ncap] fp32 before the candidate mask, -inf where n >= n_c and NaN kept (the value a model that
    also reads its index scores elsewhere computes, e.g. its own candidate-block selection).
    NaN is never a valid score: it counts as -inf (so it is never selected ahead of a number, and is -1 if taken).
    Tie rule: scores equal to the K-th largest may be taken in any order (with `raw_indices`, where fewer than K
    rows have a score above -inf, the rest of sel is any of the -inf rows); the kernel takes the lower indices first,
    the reference takes what torch.topk takes (its order among equal values is unspecified), so the two are
    compared as index sets that may differ only at such ties, and -1 entries by count (`compare_kernel`). The same
    holds for the candidate blocks at the cand_topk_blocks-th block maximum. The kernel sums s in another order
    than the reference (`SCORE_RTOL`), so near-ties within that tolerance count as ties there.
    impl: "auto" | "cute" | "reference" (see `dsv41.lowerings._kernels`); with `mask` the kernel's indices are
    scattered into the mask in torch. The kernel computes score_scale = 1 and no return_scores only (the reference
    runs otherwise), and writes -1 for the picks whose score is -inf, so with `raw_indices` the reference runs ("auto";
    "cute" raises).
    """
    device, _ = _validate(q, w, keys, n_c, candidates, topk, offset, cand_block, cand_topk_blocks, impl, score_scale,
                          return_scores, mask, raw_indices)
    args = (q, w, keys, n_c, candidates)
    kwargs = dict(topk=topk, offset=0 if mask else offset, cand_block=cand_block, cand_topk_blocks=cand_topk_blocks)
    if raw_indices and impl == "cute":
        raise RuntimeError(f"dsv41::{NAME}: impl='cute' but the kernel does not return raw indices (it writes -1 for "
                           "a pick whose score is -inf); use impl='auto' or 'reference' with raw_indices=True")
    kernel = None if raw_indices else _kernels.select(NAME, NAME, impl, device, args,
                                                      {**kwargs, "score_scale": score_scale, "return_scores": return_scores})
    if kernel is None:
        return reference(*args, **kwargs, mask=mask, score_scale=score_scale, return_scores=return_scores,
                         raw_indices=raw_indices)
    idx, cand = kernel(*args, **kwargs)
    return (selection_mask(idx, keys.shape[1]), cand) if mask else (idx, cand)


@indexer_topk.register_fake
def _(q, w, keys, n_c, candidates, topk, offset, cand_block, cand_topk_blocks, mask=False, impl="auto", score_scale=1.0,
      return_scores=False, raw_indices=False):
    _, dims = _validate(q, w, keys, n_c, candidates, topk, offset, cand_block, cand_topk_blocks, impl, score_scale,
                        return_scores, mask, raw_indices)
    t, n_cap = dims["T"], dims["Ncap"]
    if mask:
        selection = q.new_empty((t, n_cap), dtype=torch.float32)
    else:
        selection = q.new_empty((t, torch.sym_min(topk, n_cap)), dtype=torch.int64)
    if return_scores:
        return selection, q.new_empty((t, n_cap), dtype=torch.float32)
    return selection, q.new_empty((t, n_cap if cand_topk_blocks > 0 else 0), dtype=torch.bool)
