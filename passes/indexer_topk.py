"""`indexer_topk`: index scores + the candidate-block selection or restriction + top-k + the window offset,
without materialising the [T, H, N] scores (spec 3a).

    s[t, n] = sum_h w[t, h] * relu(q[t, h] . keys[t, n]),  -inf where n >= n_c[t]
    layer 20:            cand = candidate blocks of s (newest pinned)       -> second output
    re-index layers:     s = -inf where not cand                            (cand is an input)
    sel = sort(topk(s, k)); idx = where(s[sel] > -inf, sel + offset, -1)
      or, as an additive mask:  mask = full(-inf).scatter(sel, 0), -inf where s == -inf     (offset 0, mask=True)
      or so with a spare column: mask = full([T, N + 1], -inf).scatter(where(s[sel] > -inf, sel, N), 0)[:, :N]
  -> dsv41::indexer_topk(q, w, keys, n_c, cand?, k, offset, cand_block, cand_topk_blocks, mask, impl, score_scale)

k, offset, the candidate block size and count, and a score scale are read from the matched graph. Formulations:
the three layer kinds, each with top-k unsorted (the model's) or sorted, the selection as ascending indices or as a
mask (invalid picks masked after the scatter, or sent to a spare column that is sliced off, HF's), the softmax
scale folded into w (the model's) or applied to relu(q . k) before the head weights (`score_scale`, HF's: not the
same rounding, so the op computes it so). The index-source and re-index forms also return the scores s (before
the candidate mask) where the graph reads them outside the region, e.g. a model's own candidate-block selection
that no pattern matches (`return_scores`; then only the selection is fused, and s comes from the op).
"""

from __future__ import annotations

import math

import torch

from dsv41.models.model import select_candidate_blocks
from dsv41.passes.fusion import FusionPass, Replacement
from dsv41.passes.matcher import Pattern

T, IH, IHD, N = 3, 4, 32, 64
aten = torch.ops.aten


def _inputs(with_cand: bool):
    def inputs():
        base = [torch.empty(T, IH, IHD, dtype=torch.bfloat16), torch.empty(T, IH), torch.empty(T, N, IHD, dtype=torch.bfloat16),
                torch.empty(T, dtype=torch.int64)]
        return base + ([torch.empty(T, N, dtype=torch.bool)] if with_cand else [])
    return inputs


def scores(q, w, keys, n_c, score_scale=None):
    """The model's scores (the softmax scale folded into w) or, given `score_scale`, relu(q . k) scaled before the
    head weights."""
    relu = torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu()
    if score_scale is not None:
        relu = relu * score_scale
    s = (relu * w.unsqueeze(-1)).sum(dim=1)
    visible = torch.arange(keys.shape[1], device=s.device) < n_c.unsqueeze(-1)
    return s.masked_fill(~visible, -math.inf)


def select(s, topk, offset, sorted_topk):
    sel = torch.topk(s, min(topk, s.shape[1]), dim=-1, sorted=sorted_topk).indices
    sel = torch.sort(sel, dim=-1).values
    valid = s.gather(-1, sel) > -math.inf
    return torch.where(valid, sel + offset, -1)


def select_mask(s, topk, sorted_topk):
    sel = torch.topk(s, min(topk, s.shape[1]), dim=-1, sorted=sorted_topk).indices
    mask = torch.full_like(s, -math.inf).scatter(-1, sel, 0.0)
    return mask.masked_fill(s == -math.inf, -math.inf)


def select_mask_spare(s, topk, sorted_topk):
    vals, sel = torch.topk(s, min(topk, s.shape[1]), dim=-1, sorted=sorted_topk)
    sel = torch.where(vals > -math.inf, sel, s.shape[1])
    mask = torch.full((s.shape[0], s.shape[1] + 1), -math.inf, device=s.device).scatter(-1, sel, 0.0)
    return mask[:, :-1]


# mask forms: None (indices), "" (invalid picks masked after the scatter), "_spare" (sent to a spare column)
MASK_FORMS = (None, "", "_spare")


KINDS = ("candidate_source", "reindex", "index_source")


def make_patterns(sorted_topk: bool, mask_form: str | None, scaled: bool):
    mask = mask_form is not None
    tag = ("_mask" + mask_form if mask else "") + ("_sorted" if sorted_topk else "") + ("_scaled" if scaled else "")
    sel_free = {"topk": (aten.topk.default, -1, 1)} if mask else {"topk": (aten.topk.default, -1, 1), "offset": (aten.add.Tensor, -1, 1)}
    defaults = {"topk": 8} if mask else {"topk": 8, "offset": 8}
    if scaled:  # the first mul of the trace: relu(q . k) * score_scale
        sel_free, defaults = {**sel_free, "score_scale": (aten.mul.Tensor, 0, 1)}, {**defaults, "score_scale": 0.125}

    def selection(s, topk, offset=0, score_scale=None):
        if not mask:
            return select(s, topk, offset, sorted_topk)
        return (select_mask_spare if mask_form == "_spare" else select_mask)(s, topk, sorted_topk)

    def plain(q, w, keys, n_c, **free):
        s = scores(q, w, keys, n_c, free.get("score_scale"))
        return selection(s, **free), s

    def candidates(q, w, keys, n_c, cand_block, cand_topk, **free):
        s = scores(q, w, keys, n_c, free.get("score_scale"))
        cand = select_candidate_blocks(s, n_c, cand_block, cand_topk)
        return selection(s, **free), cand

    def reindex(q, w, keys, n_c, cand, **free):
        s = scores(q, w, keys, n_c, free.get("score_scale"))
        return selection(s.masked_fill(~cand, -math.inf), **free), s

    anchor = aten.scatter.value if mask else (aten.sort.default, aten.sort.stable)
    return [
        Pattern("candidate_source" + tag, candidates, _inputs(False),
                {**sel_free, "cand_topk": (aten.topk.default, 0, 1), "cand_block": (aten.view.default, 2, (1, 2))},
                {**defaults, "cand_block": 4, "cand_topk": 2}, anchor=anchor),
        Pattern("reindex" + tag, reindex, _inputs(True), sel_free, defaults, anchor=anchor, optional_outputs=1),
        Pattern("index_source" + tag, plain, _inputs(False), sel_free, defaults, anchor=anchor, optional_outputs=1),
    ]


class IndexerTopkPass(FusionPass):
    name = "indexer_topk"
    int_ranges = {"n_c": lambda metas, free: (0, metas["keys"].shape[1] + 1)}  # valid rows: 0 .. Ncap

    def patterns(self):
        return [p for scaled in (False, True) for form in MASK_FORMS for sorted_topk in (False, True)
                for p in make_patterns(sorted_topk, form, scaled)]

    def replacement(self, m):
        kind = next(k for k in KINDS if m.pattern.name.startswith(k))
        q, w, keys, n_c = m.inputs[:4]
        cand = m.inputs[4] if kind == "reindex" else None
        cand_block, cand_topk = m.free.get("cand_block", 0), m.free.get("cand_topk", 0)
        return_scores = any(m.exposed)  # the graph reads the scores elsewhere too (its own candidate selection)
        outputs = (0, 1) if kind == "candidate_source" or return_scores else (0,)
        mask = "_mask" in m.pattern.name
        args = (q, w, keys, n_c, cand, m.free["topk"], m.free.get("offset", 0), cand_block, cand_topk, mask, self.config.kernel,
                m.free.get("score_scale", 1.0), *((True,) if return_scores else ()))
        return Replacement(torch.ops.dsv41.indexer_topk.default, args, outputs)
