"""`dsv41::indexer_topk`: index scores, the candidate-block selection or restriction, top-k and the window offset, the
selection returned as indices or as an additive mask over the compressed rows."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dsv41.lowerings import _checks, _kernels
from dsv41.models.model import select_candidate_blocks

NAME = "indexer_topk"


def _validate(q, w, keys, n_c, candidates, topk, cand_block, cand_topk_blocks, impl):
    _checks.check_impl(NAME, impl)
    device = _checks.check_devices(NAME, q=q, w=w, keys=keys, n_c=n_c, candidates=candidates)
    dims = {}
    _checks.check_tensor(NAME, "q", q, torch.bfloat16, "T IH ihd", dims)
    _checks.check_tensor(NAME, "w", w, torch.float32, "T IH", dims)
    _checks.check_tensor(NAME, "keys", keys, torch.bfloat16, "T Ncap ihd", dims)
    _checks.check_tensor(NAME, "n_c", n_c, torch.int64, "T", dims)
    _checks.check_tensor(NAME, "candidates", candidates, torch.bool, "T Ncap", dims, optional=True)
    if _checks.values_on_host(n_c):
        _checks.check_range(NAME, "n_c", n_c, 0, dims["Ncap"], "Ncap (keys.shape[1])")
    _checks.check_scalar(NAME, "topk", topk, topk >= 1, "must be >= 1")
    _checks.check_scalar(NAME, "cand_topk_blocks", cand_topk_blocks, cand_topk_blocks >= 0, "must be >= 0")
    if cand_topk_blocks > 0:
        _checks.check_scalar(NAME, "cand_block", cand_block, cand_block >= 1, "must be >= 1 when cand_topk_blocks > 0")
    return device, dims


def reference(q, w, keys, n_c, candidates, topk, offset, cand_block, cand_topk_blocks, mask=False):
    """Plain torch, the tail of the model's Indexer.forward op for op; with `mask`, the selection scattered into an
    additive mask instead."""
    t, n_cap = keys.shape[0], keys.shape[1]
    s = (torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu() * w.unsqueeze(-1)).sum(dim=1)
    visible = torch.arange(n_cap, device=s.device) < n_c.unsqueeze(-1)
    s = s.masked_fill(~visible, -math.inf)
    if cand_topk_blocks > 0:
        cand = select_candidate_blocks(s, n_c, cand_block, cand_topk_blocks)
    else:
        cand = torch.empty((t, 0), dtype=torch.bool, device=s.device)
    if candidates is not None:
        s = s.masked_fill(~candidates, -math.inf)
    sel = torch.topk(s, min(topk, n_cap), dim=-1, sorted=False).indices
    sel = torch.sort(sel, dim=-1).values
    valid = s.gather(-1, sel) > -math.inf
    if mask:
        kept = torch.zeros_like(s, dtype=torch.bool).scatter(-1, sel, valid)
        return torch.where(kept, 0.0, -math.inf), cand
    return torch.where(valid, sel + offset, -1), cand


@torch.library.custom_op("dsv41::indexer_topk", mutates_args=())
def indexer_topk(q: Tensor, w: Tensor, keys: Tensor, n_c: Tensor, candidates: Tensor | None, topk: int, offset: int,
                 cand_block: int, cand_topk_blocks: int, mask: bool = False, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """Top-k compressed-KV rows per token by index score (spec 2.4), as sorted indices offset past the window or,
    with `mask`, as an additive mask over the compressed rows (the form attention adds to its scores).

    q [T, IH, ihd] bf16 (roped, fp4-fake-quantised), w [T, IH] fp32 (scaled head weights), keys [T, Ncap, ihd] bf16,
    n_c [T] int64 (valid rows), candidates [T, Ncap] bool or None; K = min(topk, Ncap):
        s[t, n]  = sum_h w[t, h] * relu(q[t, h] . keys[t, n])  in fp32;  -inf where n >= n_c[t]       [T, Ncap]
        cand     = select_candidate_blocks(s, n_c, cand_block, cand_topk_blocks) if cand_topk_blocks > 0
                   (from s before the candidate mask; [T, Ncap] bool), else an empty [T, 0] bool
        s        = -inf where not candidates[t, n]  (if candidates is given)
        sel      = the indices of torch.topk(s, K, sorted=False), sorted ascending                       [T, K]
        idx      = sel + offset where s[t, sel] > -inf, else -1                                         [T, K] int64
        mask     = 0 where n is in sel[t] and s[t, n] > -inf, else -inf  (offset unused)           [T, Ncap] fp32
    -> (idx, cand), or (mask, cand) with `mask`.
    impl: "auto" | "cute" | "reference" (see `dsv41.lowerings._kernels`).
    """
    device, _ = _validate(q, w, keys, n_c, candidates, topk, cand_block, cand_topk_blocks, impl)
    args = (q, w, keys, n_c, candidates)
    kwargs = dict(topk=topk, offset=offset, cand_block=cand_block, cand_topk_blocks=cand_topk_blocks)
    if mask:  # the kernel contract returns indices: the reference builds the mask
        return reference(*args, **kwargs, mask=True)
    kernel = _kernels.select(NAME, NAME, impl, device, args, kwargs) or reference
    return kernel(*args, **kwargs)


@indexer_topk.register_fake
def _(q, w, keys, n_c, candidates, topk, offset, cand_block, cand_topk_blocks, mask=False, impl="auto"):
    _, dims = _validate(q, w, keys, n_c, candidates, topk, cand_block, cand_topk_blocks, impl)
    t, n_cap = dims["T"], dims["Ncap"]
    if mask:
        selection = q.new_empty((t, n_cap), dtype=torch.float32)
    else:
        selection = q.new_empty((t, torch.sym_min(topk, n_cap)), dtype=torch.int64)
    return selection, q.new_empty((t, n_cap if cand_topk_blocks > 0 else 0), dtype=torch.bool)
