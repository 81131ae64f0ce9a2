"""`indexer_topk`: index scores + the candidate-block selection or restriction + top-k + the window offset,
without materialising the [T, H, N] scores (spec 3a).

    s[t, n] = sum_h w[t, h] * relu(q[t, h] . keys[t, n]),  -inf where n >= n_c[t]
    layer 20:            cand = candidate blocks of s (newest pinned)       -> second output
    re-index layers:     s = -inf where not cand                            (cand is an input)
    sel = sort(topk(s, k)); idx = where(s[sel] > -inf, sel + offset, -1)
  -> dsv41::indexer_topk(q, w, keys, n_c, cand?, k, offset, cand_block, cand_topk_blocks)

k, offset and the candidate block size and count are read from the matched graph. Formulations: the three
layer kinds, each with top-k unsorted (the model's) or sorted, followed by the ascending sort.
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


def scores(q, w, keys, n_c):
    s = (torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu() * w.unsqueeze(-1)).sum(dim=1)
    visible = torch.arange(keys.shape[1], device=s.device) < n_c.unsqueeze(-1)
    return s.masked_fill(~visible, -math.inf)


def select(s, topk, offset, sorted_topk):
    sel = torch.topk(s, min(topk, s.shape[1]), dim=-1, sorted=sorted_topk).indices
    sel = torch.sort(sel, dim=-1).values
    valid = s.gather(-1, sel) > -math.inf
    return torch.where(valid, sel + offset, -1)


def make_patterns(sorted_topk: bool):
    tag = "_sorted" if sorted_topk else ""

    def plain(q, w, keys, n_c, topk, offset):
        return select(scores(q, w, keys, n_c), topk, offset, sorted_topk)

    def candidates(q, w, keys, n_c, topk, offset, cand_block, cand_topk):
        s = scores(q, w, keys, n_c)
        cand = select_candidate_blocks(s, n_c, cand_block, cand_topk)
        return select(s, topk, offset, sorted_topk), cand

    def reindex(q, w, keys, n_c, cand, topk, offset):
        s = scores(q, w, keys, n_c).masked_fill(~cand, -math.inf)
        return select(s, topk, offset, sorted_topk)

    sel_free = {"topk": (aten.topk.default, -1, 1), "offset": (aten.add.Tensor, -1, 1)}
    sort = (aten.sort.default, aten.sort.stable)
    defaults = {"topk": 8, "offset": 8}
    return [
        Pattern("candidate_source" + tag, candidates, _inputs(False),
                {**sel_free, "cand_topk": (aten.topk.default, 0, 1), "cand_block": (aten.view.default, 2, (1, 2))},
                {**defaults, "cand_block": 4, "cand_topk": 2}, anchor=sort),
        Pattern("reindex" + tag, reindex, _inputs(True), sel_free, defaults, anchor=sort),
        Pattern("index_source" + tag, plain, _inputs(False), sel_free, defaults, anchor=sort),
    ]


class IndexerTopkPass(FusionPass):
    name = "indexer_topk"
    int_ranges = {"n_c": lambda metas, free: (0, metas["keys"].shape[1] + 1)}  # valid rows: 0 .. Ncap

    def patterns(self):
        return make_patterns(False) + make_patterns(True)

    def replacement(self, m):
        kind = m.pattern.name.removesuffix("_sorted")
        q, w, keys, n_c = m.inputs[:4]
        cand = m.inputs[4] if kind == "reindex" else None
        cand_block, cand_topk = m.free.get("cand_block", 0), m.free.get("cand_topk", 0)
        outputs = (0, 1) if kind == "candidate_source" else (0,)
        args = (q, w, keys, n_c, cand, m.free["topk"], m.free["offset"], cand_block, cand_topk, self.config.kernel)
        return Replacement(torch.ops.dsv41.indexer_topk.default, args, outputs)
