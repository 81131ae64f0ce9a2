"""dsv41::indexer_topk: bit-exact with the tail of the model's Indexer.forward on CPU, for a plain index source,
the candidate source (which also returns the candidate blocks) and a re-index layer; the mask form equal to the
index form scattered into an additive mask; the raw form the sorted top-k rows the index form maps (and the kernel
not asked for it); NaN scores as -inf; `compare_kernel`'s tie rule; argument errors."""

import math


import pytest
import torch
import torch.nn.functional as F

from dsv41.lowerings import ALL_OPS, _kernels
from dsv41.lowerings import indexer_topk as op_module
from dsv41.models import functional as fn
from dsv41.models.config import TINY
from dsv41.models.model import Indexer, _Params

op = ALL_OPS["indexer_topk"]


def _indexer_inputs(ix, g, t, n_cap):
    """The Indexer.forward arguments, and its q and w computed as Indexer.forward computes them."""
    cfg = ix.cfg
    qr = torch.randn(t, cfg.q_lora_rank, generator=g).bfloat16()
    h = torch.randn(t, cfg.dim, generator=g).bfloat16()
    keys = torch.randn(t, n_cap, cfg.index_head_dim, generator=g).bfloat16()
    n_c = torch.randint(0, n_cap + 1, (t,), generator=g)
    n_c[0] = n_cap
    angle = torch.rand(t, cfg.rope_head_dim // 2, generator=g) * 6.3
    cos, sin = angle.cos(), angle.sin()
    q = F.linear(fn.fp8_fake_quant(qr), ix.wq_b).view(t, cfg.index_n_heads, cfg.index_head_dim)
    q = fn.fp4_fake_quant(fn.apply_rope_tail(q, cos, sin), 32, e4m3_scale=False)
    w = F.linear(h, ix.weights_proj).float() * (cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
    return (qr, h, keys, n_c, cos, sin), q, w


@pytest.mark.parametrize("n_cap", [24, 6], ids=["topk<Ncap", "topk>Ncap"])
@pytest.mark.parametrize("layer", [2, 4, 6], ids=["index-source", "candidate-source", "re-index"])
def test_reference_matches_model(layer, n_cap):
    cfg = TINY
    ix = Indexer(cfg, layer, _Params(0, "cpu", torch.bfloat16))
    g = torch.Generator().manual_seed(layer * 100 + n_cap)
    args, q, w = _indexer_inputs(ix, g, 5, n_cap)
    shared = {"candidates": torch.rand(5, n_cap, generator=g) < 0.5} if ix.is_reindex else {}
    candidates = shared.get("candidates")
    want = ix(*args, shared)
    idx, cand = op(q, w, args[2], args[3], candidates, cfg.index_topk, cfg.window_size, cfg.candidate_block_size,
                   cfg.candidate_topk_blocks if ix.is_candidate_source else 0, impl="reference")
    assert torch.equal(idx, want)
    if ix.is_candidate_source:
        assert torch.equal(cand, shared["candidates"])
    else:
        assert cand.shape == (5, 0) and cand.dtype == torch.bool


@pytest.mark.parametrize("variant", [dict(), dict(candidates=True), dict(cand_topk_blocks=2), dict(n_cap=4, topk=6)],
                         ids=["index-source", "re-index", "candidate-source", "topk>Ncap"])
def test_mask_form_is_the_scattered_indices(samples, variant):
    """mask[t, n] = 0 exactly where n + offset is among the valid indices of the index form, -inf elsewhere, in fp32;
    the candidate output is the same; the fake gives the same shape and dtype."""
    kw = samples("indexer_topk", seed=7, **variant)
    kw["n_c"][1] = min(2, kw["keys"].shape[1])  # a row with fewer visible rows than k: -1 indices, no zero for them
    idx, cand = op(**kw, impl="reference")
    mask, cand_m = op(**kw, mask=True, impl="reference")
    want = torch.full(mask.shape, -math.inf)
    for r, row in enumerate(idx):
        want[r, row[row >= 0] - kw["offset"]] = 0.0
    assert mask.dtype == torch.float32 and torch.equal(mask, want) and torch.equal(cand, cand_m)
    fake, _ = op(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}, mask=True)
    assert fake.shape == mask.shape and fake.dtype == torch.float32


@pytest.mark.parametrize("variant", [dict(), dict(candidates=True), dict(cand_topk_blocks=2), dict(n_cap=4, topk=6)],
                         ids=["index-source", "re-index", "candidate-source", "topk>Ncap"])
def test_raw_form_is_the_sorted_top_k(samples, variant):
    """raw_indices: the K rows of torch.topk on the scores, ascending, every one of them (those whose score is -inf
    too, where a row has fewer than K scores): the index form is their valid ones + offset, the rest -1; the
    candidate output is the same; the fake gives the same shape and dtype."""
    kw = samples("indexer_topk", seed=8, **variant)
    kw["n_c"][1] = min(2, kw["keys"].shape[1])  # a row with fewer visible rows than k
    idx, cand = op(**kw, impl="reference")
    sel, cand_r = op(**{**kw, "offset": 0}, raw_indices=True, impl="reference")
    s = op_module.scores(kw["q"], kw["w"], kw["keys"], kw["n_c"])
    if kw["candidates"] is not None:
        s = s.masked_fill(~kw["candidates"], -math.inf)
    want = torch.topk(s, min(kw["topk"], s.shape[1]), dim=-1, sorted=False).indices.sort(-1).values
    assert sel.dtype == torch.int64 and torch.equal(sel, want) and torch.equal(cand, cand_r)
    assert (sel[1] >= 2).any() and torch.equal(idx, torch.where(s.gather(-1, sel) > -math.inf, sel + kw["offset"], -1))
    fake, _ = op(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in {**kw, "offset": 0}.items()},
                 raw_indices=True)
    assert fake.shape == sel.shape and fake.dtype == torch.int64


def test_raw_form_runs_the_reference_on_any_device(samples, monkeypatch):
    """The kernel writes -1 for a pick whose score is -inf, not the row: with raw_indices the op does not ask for
    it ("auto" runs the reference wherever it would run the kernel; "cute" raises, naming raw_indices)."""
    asked = []
    monkeypatch.setattr(_kernels, "select", lambda *a, **k: asked.append(a) or None)
    kw = {**samples("indexer_topk"), "offset": 0}
    op(**kw, raw_indices=True)
    assert asked == []
    op(**kw)
    assert len(asked) == 1
    with pytest.raises(RuntimeError, match="impl='cute' but the kernel does not return raw indices"):
        op(**kw, raw_indices=True, impl="cute")


BAD = {
    "w T": (lambda kw: dict(w=kw["w"][:-1]), r"'w' must have shape \[T, IH\] = \[3, 4\], got \[2, 4\]"),
    "w IH": (lambda kw: dict(w=kw["w"][:, :-1]), r"'w' must have shape \[T, IH\] = \[3, 4\]"),
    "keys ihd": (lambda kw: dict(keys=kw["keys"][..., :-1]), r"'keys' must have shape \[T, Ncap, ihd\] = \[3, 16, 32\]"),
    "keys T": (lambda kw: dict(keys=kw["keys"][:-1]), r"'keys' must have shape \[T, Ncap, ihd\]"),
    "n_c T": (lambda kw: dict(n_c=kw["n_c"][:-1]), r"'n_c' must have shape \[T\] = \[3\], got \[2\]"),
    "candidates Ncap": (lambda kw: dict(candidates=kw["candidates"][:, :-1]), r"'candidates' must have shape \[T, Ncap\] = \[3, 16\]"),
    "topk": (lambda kw: dict(topk=0), r"'topk' must be >= 1, got 0"),
    "cand_topk_blocks": (lambda kw: dict(cand_topk_blocks=-1), r"'cand_topk_blocks' must be >= 0, got -1"),
    "cand_block": (lambda kw: dict(cand_block=0), r"'cand_block' must be in \[1, max\(Ncap, 1\)\] when cand_topk_blocks > 0 .*, got 0"),
    "score_scale": (lambda kw: dict(score_scale=math.inf), r"'score_scale' must be a finite number, got inf"),
    "raw_indices with mask": (lambda kw: dict(raw_indices=True, mask=True, offset=0),
                              r"'raw_indices' must be False when mask is True .*, got True"),
    "raw_indices with offset": (lambda kw: dict(raw_indices=True), r"'offset' must be 0 when raw_indices is True .*, got 8"),
}


@pytest.mark.parametrize("change", BAD.values(), ids=BAD.keys())
def test_bad_inputs(samples, rejects, change):
    kw = samples("indexer_topk", candidates=True, cand_topk_blocks=2)
    changes, match = change
    rejects(op, kw, ValueError, match, **changes(kw))


def test_mask_must_be_a_bool(samples, rejects):
    """The schema's bool: the dispatcher rejects another type, naming the argument."""
    rejects(op, samples("indexer_topk"), RuntimeError, r"type 'bool' for argument 'mask'", mask="yes")


def test_reference_treats_nan_as_minus_inf(samples):
    """Keys of NaN give NaN scores: never selected ahead of a number, and -1 when taken (too few valid rows)."""
    kw = samples("indexer_topk", seed=1)
    kw["n_c"][:] = 16
    kw["keys"][:, ::2] = math.nan
    idx, _ = op(**{**kw, "topk": 4}, impl="reference")
    assert ((idx - kw["offset"]) % 2 == 1).all(), idx  # 8 numbers per row: the top 4 are odd columns
    idx, _ = op(**{**kw, "topk": 12}, impl="reference")
    assert ((idx == -1).sum(-1) == 4).all() and (((idx - kw["offset"]) % 2 == 1) | (idx == -1)).all(), idx
    s = op_module.scores(kw["q"], kw["w"], kw["keys"], kw["n_c"])
    assert torch.equal(s[:, ::2], torch.full_like(s[:, ::2], -math.inf))


def test_compare_kernel_applies_the_tie_rule(samples):
    """Ties at the K-th score may go either way (and -1 entries sit anywhere); anything else is a mismatch."""
    kw = samples("indexer_topk", t=1, ih=1, ihd=2, n_cap=8, topk=4, offset=8)
    kw["q"][0, 0] = torch.tensor([1.0, 0.0])  # s = w * relu(keys[..., 0]), w > 0
    kw["keys"] = torch.zeros(1, 8, 2, dtype=torch.bfloat16)
    kw["keys"][0, :, 0] = torch.tensor([3, 1, 2, 2, 2, 0.5, 4, 1])
    kw["n_c"][:] = 8
    want = op(**kw, impl="reference")
    cand = want[1]

    def judge(idx, inputs=kw):
        return op_module.compare_kernel((torch.tensor([idx]), cand), want, inputs)

    o = kw["offset"]
    assert judge([o, o + 2, o + 3, o + 6]) is None and judge([o, o + 3, o + 4, o + 6]) is None  # ties at 2
    assert "select other entries" in judge([o, o + 1, o + 2, o + 6])  # 1 < 2: not a tie
    assert "strictly ascending" in judge([o, o + 3, o + 2, o + 6])
    assert "outside" in judge([o - 1, o + 2, o + 3, o + 6])
    kw["n_c"][:] = 3
    want = op(**kw, impl="reference")
    assert judge([-1, o, o + 1, o + 2]) is None and judge([o, o + 1, o + 2, -1]) is None  # -1 by count
    assert "select other entries" in judge([o, o + 1, -1, -1])
    assert judge([o, o + 1, o + 2, -1], None) is None  # without the inputs: the same sorted rows
    assert "differ" in judge([o, o + 1, o + 3, -1], None)


def test_compare_kernel_candidate_blocks(samples):
    """The candidate blocks are compared by block maximum under the same rule, and must be whole blocks."""
    kw = samples("indexer_topk", seed=3, cand_topk_blocks=2)
    want = op(**kw, impl="reference")
    assert op_module.compare_kernel(want, want, kw) is None
    cand, b, row = want[1].clone(), kw["cand_block"], 0
    kept = cand[row, ::b].nonzero().flatten()
    dropped = (~cand[row, ::b]).nonzero().flatten()
    assert len(kept) == 2 and len(dropped) >= 1
    swapped = cand.clone()
    swapped[row, kept[-1] * b:(kept[-1] + 1) * b] = False
    swapped[row, dropped[0] * b:(dropped[0] + 1) * b] = True
    assert "cand: rows [0]" in op_module.compare_kernel((want[0], swapped), want, kw)
    partial = cand.clone()
    partial[row, kept[0] * b] = False
    assert "whole candidate blocks" in op_module.compare_kernel((want[0], partial), want, kw)


def test_score_scale_is_applied_before_the_head_weights(samples):
    """score_scale c: s = sum_h (relu(q . k) * c) * w, in that order (not relu(q . k) * (c * w)); the selection is
    the top-k of those scores; c = 1 is the unscaled op bit for bit."""
    kw = samples("indexer_topk", seed=3)
    kw["n_c"][:] = kw["keys"].shape[1] - 1  # k finite scores per row: no ties among -inf picks
    c = 32**-0.5
    relu = torch.einsum("thd,tnd->thn", kw["q"].float(), kw["keys"].float()).relu()
    want = (relu * c * kw["w"].unsqueeze(-1)).sum(dim=1)
    want = want.masked_fill(torch.arange(want.shape[1]) >= kw["n_c"].unsqueeze(-1), -math.inf)
    assert torch.equal(op_module.scores(kw["q"], kw["w"], kw["keys"], kw["n_c"], c), want)
    idx, _ = op(**kw, impl="reference", score_scale=c)
    sel = torch.topk(want, min(kw["topk"], want.shape[1]), dim=-1).indices.sort(-1).values
    assert torch.equal(idx, torch.where(want.gather(-1, sel) > -math.inf, sel + kw["offset"], -1))
    assert all(torch.equal(a, b) for a, b in zip(op(**kw, impl="reference", score_scale=1.0), op(**kw, impl="reference")))


def test_kernel_declines_a_score_scale():
    """The kernel folds the scale into w: it declines score_scale != 1 with a reason (the reference runs)."""
    kernel = pytest.importorskip("dsv41.kernels.indexer_topk")
    t, n = 2, 64
    args = (torch.empty(t, 64, 128, dtype=torch.bfloat16), torch.empty(t, 64), torch.empty(t, n, 128, dtype=torch.bfloat16),
            torch.zeros(t, dtype=torch.int64), None)
    reason = kernel.supports(*args, topk=8, offset=0, cand_block=0, cand_topk_blocks=0, score_scale=0.5)
    assert reason is not None and "score_scale 0.5" in reason
