"""`indexer_topk`: index scores + the candidate-block selection or restriction + top-k + the window offset,
without materialising the [T, H, N] scores (spec 3a).

    s[t, n] = sum_h w[t, h] * relu(q[t, h] . keys[t, n]),  -inf where n >= n_c[t]
    layer 20:            cand = candidate blocks of s (newest pinned)       -> second output
    re-index layers:     s = -inf where not cand                            (cand is an input)
    sel = sort(topk(s, k)); idx = where(s[sel] > -inf, sel + offset, -1)
      or, as an additive mask:  mask = full(-inf).scatter(sel, 0), -inf where s == -inf     (offset 0, mask=True)
      or so with a spare column: mask = full([T, N + 1], -inf).scatter(where(s[sel] > -inf, sel, N), 0)[:, :N]
      or the sorted rows sel themselves                                        (offset 0, raw_indices=True)
  -> dsv41::indexer_topk(q, w, keys, n_c, cand?, k, offset, cand_block, cand_topk_blocks, mask, impl, score_scale,
                         return_scores, raw_indices)

k, offset, the candidate block size and count, and a score scale are read from the matched graph. Formulations:
the three layer kinds, each with top-k unsorted (the model's) or sorted, the selection as ascending indices or as a
mask (invalid picks masked after the scatter, or sent to a spare column that is sliced off, HF's), the softmax
scale folded into w (the model's) or applied to relu(q . k) before the head weights (`score_scale`, HF's: not the
same rounding, so the op computes it so). The index-source and re-index forms also return the scores s (before
the candidate mask) where the graph reads them outside the region, e.g. a model's own candidate-block selection
that no pattern matches (`return_scores`; then only the selection is fused, and s comes from the op).

Where the sorted top-k rows are followed by code of the model's own instead of the validity and offset (a serving
engine translates the selected rows through its paged cache's block table and masks those past n_c itself), the
distinctive core still fuses: the raw formulations end at the ascending sort of the top-k indices and the op
returns those rows (`raw_indices`), leaving the rest to the graph. They come last and are each widened by the index
formulation of the same kind (`wider`), so a site whose validity and offset are written another way still fuses
them into the op. The visible-row counts n_c may be of any integer dtype (lengths held in int32): the op takes them
widened to int64, which the comparison with the row index does anyway.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from dsv41.models.model import select_candidate_blocks
from dsv41.passes.fusion import FusionPass, Replacement
from dsv41.passes.matcher import Derived, Pattern

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


def select_raw(s, topk, sorted_topk):
    return torch.sort(torch.topk(s, min(topk, s.shape[1]), dim=-1, sorted=sorted_topk).indices, dim=-1).values


def select_mask_spare(s, topk, sorted_topk):
    vals, sel = torch.topk(s, min(topk, s.shape[1]), dim=-1, sorted=sorted_topk)
    sel = torch.where(vals > -math.inf, sel, s.shape[1])
    mask = torch.full((s.shape[0], s.shape[1] + 1), -math.inf, device=s.device).scatter(-1, sel, 0.0)
    return mask[:, :-1]


# How the graph takes the selected rows: the selection form -> (its name tag, its function of (s, topk, sorted_topk)
# or, for the indices, of (s, topk, offset, sorted_topk)). "indices": sorted, offset, -1 where invalid (the model's);
# "mask" / "mask_spare": an additive mask, invalid picks masked after the scatter or sent to a spare column; "raw":
# the sorted rows themselves, the rest the graph's own code.
SELECTIONS = {"indices": ("", select), "mask": ("_mask", select_mask), "mask_spare": ("_mask_spare", select_mask_spare),
              "raw": ("_raw", select_raw)}
MASKS = ("mask", "mask_spare")
KINDS = ("candidate_source", "reindex", "index_source")
# integer dtypes whose values int64 holds exactly: n_c in one of them is taken widened (a float n_c is not: its
# comparison with the row index is not that of its truncation)
NARROWER_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32)


@dataclass(frozen=True)
class IndexerForm:
    """A formulation of the indexer: `kind`, the layer kind (of KINDS: the candidate source, a re-index layer, an index
    source); `selection`, how the graph takes the selected rows (a key of SELECTIONS); `sorted_topk`, the top-k
    sorted (else unsorted, the model's); `scaled`, a score scale applied to relu(q . k) before the head weights
    (else folded into w, the model's)."""

    kind: str
    selection: str
    sorted_topk: bool
    scaled: bool

    def pattern_name(self) -> str:
        """The formulation's name in reports."""
        return self.kind + SELECTIONS[self.selection][0] + ("_sorted" if self.sorted_topk else "") + \
            ("_scaled" if self.scaled else "")


# every formulation, in the order the pass tries them: the raw selections last, as the narrowest regions
FORMULATIONS = tuple(IndexerForm(kind, selection, sorted_topk, scaled)
                     for last in (False, True) for scaled in (False, True)
                     for selection in SELECTIONS if (selection == "raw") == last
                     for sorted_topk in (False, True) for kind in KINDS)


def make_patterns(sorted_topk: bool, selection_form: str, scaled: bool):
    """The three layer kinds' patterns with this selection form, top-k and scale, in KINDS order."""
    mask, offset_free = selection_form in MASKS, selection_form == "indices"
    sel_free = {"topk": (aten.topk.default, -1, 1)}
    defaults = {"topk": 8}
    if offset_free:
        sel_free, defaults = {**sel_free, "offset": (aten.add.Tensor, -1, 1)}, {**defaults, "offset": 8}
    if scaled:  # the first mul of the trace: relu(q . k) * score_scale
        sel_free, defaults = {**sel_free, "score_scale": (aten.mul.Tensor, 0, 1)}, {**defaults, "score_scale": 0.125}
    choose = SELECTIONS[selection_form][1]

    def selection(s, topk, offset=0, score_scale=None):
        if offset_free:
            return choose(s, topk, offset, sorted_topk)
        return choose(s, topk, sorted_topk)

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

    def pattern(kind, search, inputs, free, free_defaults, optional_outputs):
        form = IndexerForm(kind, selection_form, sorted_topk, scaled)
        return Pattern(form.pattern_name(), search, inputs, free, free_defaults, anchor=anchor,
                       optional_outputs=optional_outputs, form=form)

    return [
        pattern("candidate_source", candidates, _inputs(False),
                {**sel_free, "cand_topk": (aten.topk.default, 0, 1), "cand_block": (aten.view.default, 2, (1, 2))},
                {**defaults, "cand_block": 4, "cand_topk": 2}, 0),
        pattern("reindex", reindex, _inputs(True), sel_free, defaults, 1),
        pattern("index_source", plain, _inputs(False), sel_free, defaults, 1),
    ]


class IndexerTopkPass(FusionPass):
    name = "indexer_topk"
    form_type = IndexerForm
    int_ranges = {"n_c": lambda metas, free: (0, metas["keys"].shape[1] + 1)}  # valid rows: 0 .. Ncap

    def patterns(self):
        made = {}
        for form in FORMULATIONS:
            if form not in made:
                made.update((p.form, p) for p in make_patterns(form.sorted_topk, form.selection, form.scaled))
        return [made[form] for form in FORMULATIONS]

    def wider(self, index):
        """A raw selection is widened by the index selection of the same kind, top-k and scale: the validity and
        offset after the sort, which the graph may write with other ops."""
        forms = [p.form for p in self._patterns.patterns]
        if forms[index].selection != "raw":
            return ()
        return (forms.index(dataclasses.replace(forms[index], selection="indices")),)

    def replacement(self, m):
        kind, selection = m.pattern.form.kind, m.pattern.form.selection
        q, w, keys, n_c = m.inputs[:4]
        if n_c.meta["val"].dtype in NARROWER_INTEGERS:  # the same comparisons with the row index, widened
            n_c = Derived(torch.ops.prims.convert_element_type.default, (n_c, torch.int64))
        cand = m.inputs[4] if kind == "reindex" else None
        cand_block, cand_topk = m.free.get("cand_block", 0), m.free.get("cand_topk", 0)
        return_scores = any(m.exposed)  # the graph reads the scores elsewhere too (its own candidate selection)
        outputs = (0, 1) if kind == "candidate_source" or return_scores else (0,)
        raw = selection == "raw"
        args = (q, w, keys, n_c, cand, m.free["topk"], m.free.get("offset", 0), cand_block, cand_topk,
                selection in MASKS, self.config.kernel, m.free.get("score_scale", 1.0),
                *((return_scores, raw) if raw else (True,) if return_scores else ()))
        return Replacement(torch.ops.dsv41.indexer_topk.default, args, outputs)
