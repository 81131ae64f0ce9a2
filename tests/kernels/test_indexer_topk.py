"""The indexer kernels (dsv41.kernels.indexer_topk): the score kernel and the exact top-K select.

CPU: every kind of launch compiles for sm_90a (score: plain, candidate-masked, block maxima, without PDL; select:
the one-CTA register build and the smallest and largest shared capacity at k = 512 and 2048, without PDL, the
sampled path's cluster build and its candidate filter); `score_grid` fills one wave and covers the rows;
`select_plan`'s clusters and `sampled_plan`'s filter CTAs cover every width; `sample_plan`'s sample sizes, miss
probabilities and expected candidate counts; a numpy model of the select's steps (one CTA holding a row's full keys
up to 4096 columns, else a cluster of CTAs a row, 16-bit prefixes on chip, the full key re-read where a prefix does
not decide, the histograms summed over the cluster with the earlier CTAs' counts, the collection from those counts;
on the sampled path tau from the strided sample, the filter's segments, the gather by prefix sums and the
candidates' select, else the cluster) equals the tie rule and torch.topk's values on every score pattern below at N
= 1 to 2^20 on both paths, writes every output position once, and reaches the early stop, all 4 rounds, few re-reads
for random scores and all of a CTA's for a constant row, the candidates' select on random rows and the fallback on
the forced misses (constant rows wider than CANDIDATES, ties at tau, the sample holding the largest scores, few
valid scores); `supports` and `select_reason` explain what they reject; the bench rows per width (the op's NaN and
tie rules and `compare_kernel` are tested in tests/lowerings/test_indexer_topk.py).
GPU (H200), outputs poisoned (-7) before each call:
- the select (`topk_indices`, path "cluster" and, above 4096 columns, "sampled") on given scores equals the tie rule
  exactly (a stable descending sort: equal scores, -inf ones included, taken lower index first; NaN as -inf; then
  sorted ascending, + offset, -1 for -inf), -1 positions included: random, constant rows, rising values, crowded
  near-ties (4 levels; neighbours 1 ulp apart, which share their 16-bit prefix: the full keys decide, and the bin's
  ties are cut across CTAs), NaN and +-inf, every CTA's span a permutation of the same values (equal histograms in
  every CTA), the largest scores in the last CTA's span, rows with fewer valid scores than K and none, the largest
  scores in the sampled columns (the sample misses) or in 600 columns it skips, at widths 1 to 2^20: one CTA (<=
  4096 columns, keys in registers; 1025 and 4095 leave threads part-filled), then clusters of 2 to 16 CTAs, widths
  the cluster does not divide (4097: spans 2049 and 2048; 65537: 16 spans of 4097, the last 4082), K = 512 and
  2048; rows in DSV41_TEST_TOKENS (default 1,2,3,8,33,64) at 4096 to 2^20 columns, with short and half-constant
  rows, on paths "auto" and "cluster";
- the candidate filter's counts, columns and keys equal the model's exactly at T = 1, 3, 64 (16 at 2^20) and 4097 to
  2^20 columns, the forced misses' rows falling back and the random rows not;
- the scores of the score kernel against the reference's within its tolerance (`SCORE_RTOL` x sum_h |w_h| |q_h|.|k|),
  -inf exactly where the reference has it, in the plain, candidate-masked and block modes; the block maxima equal the
  max of the kernel's own scores (newest block pinned);
- the whole op against the reference by `compare_kernel` with the inputs (index sets under the tie rule), plain,
  candidate-masked and candidate-block mode; the block mode also exactly against `select_candidate_blocks` of the
  kernel's own scores; N_c = 0, N_c < 512, N_c = Ncap in every batch;
- the op (impl "cute" and "auto", index and mask form) calls the entry; CUDA-graph replays (DSV41_TEST_REPLAYS, default
  100) alternating two input sets are bit-identical to direct calls (the op at 65536 columns: the sampled path; the
  select alone at 2^20 on both paths, round robin over rows that take the candidates and rows that fall back).
DSV41_TEST_MAX_COLUMNS (default 1048576) caps the widths, so compute-sanitizer runs stay short, e.g.
`DSV41_TEST_TOKENS=1,3 DSV41_TEST_MAX_COLUMNS=65536 DSV41_TEST_REPLAYS=2 compute-sanitizer --tool racecheck python3 -m
pytest -m gpu tests/kernels/test_indexer_topk.py`. When CUDA is present these tests fail (never skip) if the kernel
cannot run.
"""

import math
import os

import numpy as np
import pytest
import torch

from tests.kernels.support import assert_compiles_fresh, require_cute_dsl, tokens_from_env

require_cute_dsl()

from dsv41.kernels import indexer_topk as K  # noqa: E402
from dsv41.lowerings import indexer_topk as op_module  # noqa: E402
from dsv41.models.model import select_candidate_blocks  # noqa: E402

TOKENS = tokens_from_env("1,2,3,8,33,64")
MAX_COLUMNS = int(os.environ.get("DSV41_TEST_MAX_COLUMNS", str(1 << 20)))
REPLAYS = int(os.environ.get("DSV41_TEST_REPLAYS", "100"))
TOPK, OFFSET, POISON = 512, 128, -7


def _widths(*widths):
    return [n for n in widths if n <= MAX_COLUMNS]


def _tie_rule(scores, k, offset):
    """The select's definition: the k largest (NaN as -inf), equal scores lower index first, sorted, + offset, -1."""
    s = scores.masked_fill(scores.isnan(), -math.inf)
    sel = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k].sort(dim=-1).values
    return torch.where(s.gather(-1, sel) > -math.inf, sel + offset, -1)


def _select(scores, k, offset=OFFSET, **kw):
    out = torch.full((scores.shape[0], k), POISON, dtype=torch.int64, device=scores.device)
    return K.topk_indices(scores, k, offset, out=out, **kw)


def _score_rows(kind, t, n, g):
    """Scores [t, n] of one pattern (CPU, then moved by the caller)."""
    if kind == "random":
        return torch.randn(t, n, generator=g)
    if kind == "constant":
        return torch.full((t, n), 0.75)
    if kind == "rising":
        return torch.arange(n, dtype=torch.float32).expand(t, n).contiguous() * 1e-3
    if kind == "four-levels":
        return torch.randint(0, 4, (t, n), generator=g).float() * 0.5
    if kind == "ulp-apart":  # 1.0 and its next 15 floats, so many columns share each of 16 adjacent values
        return 1.0 + torch.randint(0, 16, (t, n), generator=g).float() * 2**-23
    if kind == "nan-inf":
        s = torch.randn(t, n, generator=g)
        u = torch.rand(t, n, generator=g)
        s[u < 0.3] = math.nan
        s[(u >= 0.3) & (u < 0.6)] = -math.inf
        s[(u >= 0.6) & (u < 0.61)] = math.inf
        s[(u >= 0.61) & (u < 0.7)] = -0.0
        s[(u >= 0.7) & (u < 0.8)] = 0.0
        return s
    if kind == "cta-permuted":  # every CTA's span a permutation of the same values: equal histograms in every CTA
        span = K.select_plan(n)[1]
        base = torch.randn(span, generator=g)
        perms = [base[torch.randperm(span, generator=g)] for _ in range(t * -(-n // span))]
        return torch.cat(perms).view(t, -1)[:, :n].contiguous()
    if kind == "top-in-last-cta":  # the largest scores in the last CTA's span (short when the cluster does not divide)
        s = torch.randn(t, n, generator=g)
        s[:, -min(n, 700):] += 100.0
        return s
    if kind == "sample-high":  # the sampled columns hold the largest scores: tau is above every other column, so
        # the candidates are the j (sample_plan) largest sampled columns, fewer than k on wide rows (the fallback)
        s = torch.randn(t, n, generator=g)
        s[:, _sample_columns(n)] += 100.0
        return s
    if kind == "spike-unsampled":  # 600 of the largest scores in columns the sample skips, from the row's middle
        s = torch.randn(t, n, generator=g)
        skipped = np.ones(n, bool)
        skipped[_sample_columns(n)] = False
        s[:, torch.from_numpy(np.flatnonzero(skipped[n // 3:])[:600] + n // 3)] += 100.0
        return s
    if kind == "few-valid":  # row r has r * 37 valid scores (row 0: none), the rest -inf
        s = torch.full((t, n), -math.inf)
        for r in range(t):
            m = min(n, r * 37)
            s[r, torch.randperm(n, generator=g)[:m]] = torch.randn(m, generator=g)
        return s
    raise ValueError(kind)


KINDS = ["random", "constant", "rising", "four-levels", "ulp-apart", "nan-inf", "cta-permuted", "top-in-last-cta",
         "few-valid", "sample-high", "spike-unsampled"]


def _sample_columns(n):
    """The columns of a row of n the sampled path's threshold reads for the top TOPK (all of them in a row narrower than
    the sample)."""
    samples = K.sample_plan(n, min(n, TOPK))[0]
    return np.arange(min(n, samples)) * max(1, n // samples)


def _op_inputs(t, n_cap, seed, candidates=False, device="cuda"):
    """The op's arguments: q, keys ~ N(0, 1) bf16, w ~ N(0, 1/32) fp32 (both signs, as weights_proj gives); n_c
    random with N_c = Ncap, 0 and < 512 among the first rows."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, K.HEADS, K.HEAD_DIM, generator=g).bfloat16()
    w = torch.randn(t, K.HEADS, generator=g) / K.HEADS**0.5
    keys = torch.randn(t, n_cap, K.HEAD_DIM, generator=g).bfloat16()
    n_c = torch.randint(0, n_cap + 1, (t,), generator=g)
    for r, v in enumerate((n_cap, 0, min(n_cap, 300))[:t]):
        n_c[r] = v
    cand = torch.rand(t, n_cap, generator=g) < 0.3 if candidates else None
    inputs = dict(q=q, w=w, keys=keys, n_c=n_c, candidates=cand)
    return {k: None if v is None else v.to(device) for k, v in inputs.items()}


def _op(inputs, topk=TOPK, cand_topk_blocks=0, **kw):
    t, n_cap = inputs["keys"].shape[:2]
    out = torch.full((t, min(topk, n_cap)), POISON, dtype=torch.int64, device=inputs["q"].device)
    return K.indexer_topk(*inputs.values(), topk=topk, offset=OFFSET, cand_block=K.BLOCK,
                          cand_topk_blocks=cand_topk_blocks, out=out, **kw)


def _assert_op_matches(got, inputs, topk=TOPK, cand_topk_blocks=0):
    kwargs = dict(topk=topk, offset=OFFSET, cand_block=K.BLOCK, cand_topk_blocks=cand_topk_blocks)
    assert not (got[0] == POISON).any(), "idx left unwritten"
    want = op_module.reference(*inputs.values(), **kwargs)
    mismatch = op_module.compare_kernel(got, want, {**inputs, **kwargs})
    assert mismatch is None, mismatch


# CPU


SCORE_VARIANTS = [(False, False, True), (True, False, True), (False, True, True), (False, False, False)]
SELECT_VARIANTS = [(512, 0, True, False), (2048, 0, True, False), (512, 4096, True, False),
                   (512, 65536, True, False), (2048, 8192, True, False), (2048, 32768, True, False),
                   (512, 16384, False, False), (512, 4096, True, True), (512, 65536, True, True),
                   (2048, 8192, False, True)]


# A model of the select (TopkSelect: a cluster of CTAs per row, each its span's 16-bit key prefixes on chip), step
# for step, on int64 arrays holding the kernel's int32 keys, elements in column order (numpy: this CPU torch build
# takes milliseconds per cumsum or boolean index of 64K elements).

_INT_MIN, _KEY_NEG_INF = -(2**31), -(0x7F800000) - 1


def _order_keys(scores):
    """The kernel's order keys [T, N] int64: signed order = score order; NaN and -inf share -inf's key, -0 is +0."""
    bits = scores.contiguous().view(torch.int32).numpy().astype(np.int64)
    key = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = np.where(bits == _INT_MIN, 0, key)
    return np.where(scores.isnan().numpy(), _KEY_NEG_INF, key)


def _bin_edges(prefix, level):
    """(lowest, highest) key whose top `level` bits in unsigned order are `prefix`."""
    lo = (prefix << (32 - level)) + _INT_MIN
    return lo, lo + (1 << (32 - level)) - 1


def _model_rounds(row, k, cluster_n, span, resident, stats):
    """(prefix, remaining, level, gt_before, eq_before) of one row of keys after the radix rounds as the cluster
    runs them (``resident``: one CTA holding the full keys; the rounds' digits are the same bits): the bin's top
    ``level`` bits, how many of its keys to take, and per CTA the keys above the bin and in it of the CTAs before."""
    n = len(row)
    u = row - _INT_MIN  # unsigned order
    top = u >> 16  # the prefixes in shared memory
    cta = np.arange(n) // span  # each column's CTA
    prefix, remaining, level = 0, k, 0
    gt_before, eq_before = np.zeros(cluster_n, np.int64), np.zeros(cluster_n, np.int64)
    for rnd in range(4):
        if rnd == 0:
            match, digit = np.ones(n, bool), top >> 8
        elif rnd == 1:
            match, digit = (top >> 8) == prefix, top & 255
        else:  # the full key, re-read from global memory, of each key whose prefix matches
            reread = top == prefix >> (8 * rnd - 16)
            if not resident:
                stats["reread"] = max(stats["reread"], int(np.bincount(cta[reread], minlength=1).max()))
            match, digit = reread & ((u >> (32 - 8 * rnd)) == prefix), (u >> (24 - 8 * rnd)) & 255
        hists = np.zeros((cluster_n, 256), np.int64)
        np.add.at(hists, (cta[match], digit[match]), 1)
        total = hists.sum(0)
        above = total[::-1].cumsum()[::-1] - total
        (d,) = np.flatnonzero((above < remaining) & (remaining <= above + total))
        earlier = hists.cumsum(0) - hists  # per CTA: the histogram of the CTAs before it
        gt_before += earlier[:, d + 1:].sum(1)
        eq_before = earlier[:, d]
        prefix, remaining, level = (prefix << 8) | int(d), remaining - int(above[d]), 8 * (rnd + 1)
        if remaining == total[d]:
            break
    stats["levels"].add(level)
    return prefix, remaining, level, gt_before, eq_before


def _model_collect(key, cols, lo, hi, remaining, gt_before, eq_before, idx, written, offset):
    """One CTA's collection: ``key`` its keys in column order (the lowest of their prefix where that decides),
    ``cols`` their columns; writes idx (and counts the writes of each position in ``written``)."""
    gt, eq = key > hi, (key >= lo) & (key <= hi)
    n_gt = gt_before + gt.cumsum() - gt
    n_eq = eq_before + eq.cumsum() - eq
    take = gt | (eq & (n_eq < remaining))
    pos = (n_gt + np.minimum(n_eq, remaining))[take]
    np.add.at(written, pos, 1)
    idx[pos] = np.where(key[take] > _KEY_NEG_INF, cols[take] + offset, -1)


def _model_row(row, k, offset, cluster_n, span, resident, stats):
    """idx [k] of one row of keys as the cluster selects it (``resident``: one CTA holding the full keys, which
    decide every round and the collection)."""
    n = len(row)
    top = (row - _INT_MIN) >> 16
    prefix, remaining, level, gt_before, eq_before = _model_rounds(row, k, cluster_n, span, resident, stats)
    lo, hi = _bin_edges(prefix, level)
    idx = np.full(k, POISON)
    written = np.zeros(k, np.int64)
    for r in range(cluster_n):
        part = slice(r * span, min((r + 1) * span, n))
        key = (top[part] << 16) + _INT_MIN  # the lowest key with the prefix, unless the full key decides
        exact = resident | ((level > 16) & (top[part] == (lo - _INT_MIN) >> 16))
        if not resident:
            stats["reread"] = max(stats["reread"], int(exact.sum()))
        key = np.where(exact, row[part], key)
        _model_collect(key, np.arange(n)[part], lo, hi, remaining, gt_before[r], eq_before[r], idx, written, offset)
    assert (written == 1).all(), "positions written other than once"
    return idx


def _model_candidates(row, k, t, sms):
    """(counts [P], cols [P * seg], keys [P * seg]) of one row as CandidateFilter writes them (POISON in the slots
    it leaves): tau from the row's strided sample by the register select, the keys >= tau and above -inf's."""
    n = len(row)
    samples, j = K.sample_plan(n, k)
    prefix, _, level, _, _ = _model_rounds(row[np.arange(samples) * (n // samples)], j, 1, samples, True,
                                           {"levels": set(), "reread": 0})
    tau = max(_bin_edges(prefix, level)[0], _KEY_NEG_INF + 1)
    ctas, width, seg = K.sampled_plan(t, n, sms)
    counts = np.zeros(ctas, np.int64)
    cols, keys = np.full(ctas * seg, POISON), np.full(ctas * seg, POISON)
    for p in range(ctas):
        hit = np.flatnonzero(row[p * width:(p + 1) * width] >= tau) + p * width
        counts[p], m = len(hit), min(len(hit), seg)
        cols[p * seg:p * seg + m], keys[p * seg:p * seg + m] = hit[:m], row[hit[:m]]
    return counts, cols, keys


def _model_sampled_row(row, k, offset, t, sms, stats):
    """idx [k] of one row as the sampled path selects it: the candidates (``_model_candidates``), gathered in
    column order and selected on one CTA when k <= their count <= CANDIDATES, else the cluster's select."""
    counts, ws_cols, ws_keys = _model_candidates(row, k, t, sms)
    total = int(counts.sum())
    if not k <= total <= K.CANDIDATES:
        stats["paths"].add("fallback")
        cluster_n, span, _ = K.select_plan(len(row))
        return _model_row(row, k, offset, cluster_n, span, False, stats)
    stats["paths"].add("sampled")
    seg = K.sampled_plan(t, len(row), sms)[2]
    filled = np.flatnonzero(counts)  # the non-empty segments, and their first candidates (strictly increasing)
    starts = (np.cumsum(counts) - counts)[filled]
    i = np.arange(total)
    r = np.searchsorted(starts, i, side="right") - 1  # the last of them starting at or before candidate i
    assert (np.diff(r) <= 1).all(), "a thread's next candidate is more than one non-empty segment on"
    slot = filled[r] * seg + i - starts[r]
    cols, keys = ws_cols[slot], ws_keys[slot]
    assert (cols != POISON).all() and (np.diff(cols) > 0).all(), "gathered a slot not written, or out of order"
    prefix, remaining, level, _, _ = _model_rounds(keys, k, 1, total, True, stats)
    lo, hi = _bin_edges(prefix, level)
    idx = np.full(k, POISON)
    written = np.zeros(k, np.int64)
    _model_collect(keys, cols, lo, hi, remaining, 0, 0, idx, written, offset)
    assert (written == 1).all(), "positions written other than once"
    return idx


def _model_select(scores, k, offset, stats=None, path="cluster", sms=132):
    """idx [T, k] as topk_indices computes it on ``path`` ("cluster" or "sampled") on a GPU of ``sms`` SMs,
    through the model; `stats` collects the round levels reached, the most full keys a CTA re-reads from global
    memory in a pass, and which of the sampled path's selects ran."""
    stats = {"levels": set(), "reread": 0, "paths": set()} if stats is None else stats
    t, n = scores.shape
    if path == "sampled":
        rows = [_model_sampled_row(row, k, offset, t, sms, stats) for row in _order_keys(scores)]
    else:
        cluster_n, span, capacity = K.select_plan(n)
        rows = [_model_row(row, k, offset, cluster_n, span, capacity == 0, stats) for row in _order_keys(scores)]
    return torch.from_numpy(np.stack(rows))


MODEL_WIDTHS = [1, 7, 600, 4095, 4096, 4097, 16385, 61441, 65537, 300001, 1 << 20]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,path", [(n, "cluster") for n in MODEL_WIDTHS]
                         + [(n, "sampled") for n in MODEL_WIDTHS if n > K.CTA_COLUMNS], ids=lambda v: f"{v}")
def test_select_model_is_exact(n, path, kind):
    """The model equals the tie rule exactly and selects the values torch.topk selects (as multisets), at k = 512
    and 2048: one CTA, clusters of 2 (4097: spans 2049 and 2048) to 16 CTAs, widths the cluster does not divide,
    2^20; the sampled path (candidates, their select or the cluster's) at every width above one CTA."""
    t = 1 if n > 65537 else 2
    g = torch.Generator().manual_seed(7 * n + KINDS.index(kind))
    s = _score_rows(kind, t, n, g)
    for k in sorted({min(TOPK, n), min(2048, n)}):
        got = _model_select(s, k, OFFSET, path=path)
        assert torch.equal(got, _tie_rule(s, k, OFFSET)), f"k={k}"
        clean = s.masked_fill(s.isnan(), -math.inf)
        taken = torch.where(got >= 0, clean.gather(-1, (got - OFFSET).clamp(min=0)), -math.inf)
        assert torch.equal(taken.sort(-1).values, torch.topk(clean, k, dim=-1).values.sort(-1).values), f"k={k}"


def test_select_model_paths():
    """The rows reach every path: random scores stop early and re-read few full keys from global memory (the
    16-bit prefixes decide almost all); a constant row runs all 4 rounds and re-reads every key of a CTA; the
    bin's ties are cut across CTAs (rows 2 and 3 of "ulp-apart": 16 values over 2^20 columns)."""
    g = torch.Generator().manual_seed(0)
    random_stats = {"levels": set(), "reread": 0}
    _model_select(torch.randn(1, 524288, generator=g), TOPK, 0, random_stats)
    assert max(random_stats["levels"]) < 32 and random_stats["reread"] < 64
    constant_stats = {"levels": set(), "reread": 0}
    got = _model_select(torch.full((1, 1 << 20), 0.25), 2048, 0, constant_stats)
    assert constant_stats["levels"] == {32} and constant_stats["reread"] == K.MAX_SPAN
    assert torch.equal(got[0], torch.arange(2048))


def test_sampled_model_paths():
    """The sampled path selects from its candidates on random rows (within 2x of j * N / samples) and falls back to the
    cluster where the sample misses or the row has no useful threshold: a constant row wider than CANDIDATES (every
    column ties at tau), the sampled columns holding the largest scores (j < 512 candidates, sample_plan), too
    few valid scores; a constant row of at most CANDIDATES columns is all candidates. On 2 SMs the filter's CTAs
    take half a row each, their segments capped at CANDIDATES slots (a constant row: the fallback)."""
    g = torch.Generator().manual_seed(3)
    for n, kind, sms, path in [(65536, "random", 132, "sampled"), (524288, "random", 132, "sampled"),
                               (1 << 20, "random", 132, "sampled"), (65536, "random", 2, "sampled"),
                               (8192, "constant", 132, "sampled"), (65536, "constant", 132, "fallback"),
                               (65536, "constant", 2, "fallback"), (524288, "sample-high", 132, "fallback"),
                               (1 << 20, "sample-high", 132, "fallback"), (65536, "four-levels", 132, "fallback"),
                               (65536, "few-valid", 132, "fallback"), (65536, "spike-unsampled", 132, "sampled")]:
        s = _score_rows(kind, 1 if kind != "few-valid" else 2, n, g)
        stats = {"levels": set(), "reread": 0, "paths": set()}
        got = _model_select(s, TOPK, OFFSET, stats, "sampled", sms)
        assert stats["paths"] == {path}, (n, kind, sms, stats["paths"])
        assert torch.equal(got, _tie_rule(s, TOPK, OFFSET)), (n, kind, sms)
        if kind == "random":
            counts = _model_candidates(_order_keys(s)[0], TOPK, 1, sms)[0]
            samples, j = K.sample_plan(n, TOPK)
            expected = j * n / samples  # j sampled keys, each standing for n / samples
            assert expected / 2 <= counts.sum() <= 2 * expected, (n, counts.sum(), expected)


def test_sample_and_filter_plans():
    """sample_plan takes the fewest samples (1024 up to 2^17 columns at k = 512, 2048 at 2^18, 4096 from 2^19) with
    a miss probability of at most MISS_TARGET, which holds up to 2^19 columns at k = 512 (2^20: 1.3e-5 with 4096,
    which hold about 2 of the top 512), and puts the expected candidate count j * N / samples between k and
    CANDIDATES; sampled_plan's CTAs cover the row in whole chunks, at most MAX_SEGMENTS a row, one an SM for few
    rows, never an empty one."""
    for n in (4097, 8192, 65536, 131072, 262144, 524288, 1 << 20):
        for k in (1, 512, 2048):
            samples, j = K.sample_plan(n, k)
            miss = K.sample_miss(n, k, samples)
            assert samples in K.SAMPLE_SIZES and 1 <= j <= samples
            assert miss[j - 1] <= K.MISS_TARGET or (samples == K.SAMPLE_SIZES[-1] and miss[j - 1] == min(miss))
            smaller = [m for m in K.SAMPLE_SIZES if m < samples]
            assert all(min(K.sample_miss(n, k, m)) > K.MISS_TARGET for m in smaller)
            if k == 512 and n <= 524288:
                assert miss[j - 1] <= K.MISS_TARGET
            if k > 1:
                assert k < j * n / samples < K.CANDIDATES, (n, k, j)
    assert [K.sample_plan(n, 512)[0] for n in (65536, 131072, 262144, 524288)] == [1024, 1024, 2048, 4096]
    assert K.sample_plan(1 << 20, 512) == (4096, 11) and 1e-5 < K.sample_miss(1 << 20, 512, 4096)[10] < 2e-5
    assert K.sampled_plan(1, 524288, 132) == (64, 8192, 8192) and K.sampled_plan(1, 1 << 20, 132) == (128, 8192, 8192)
    assert K.sampled_plan(64, 1 << 20, 132) == (2, 524288, K.CANDIDATES)
    for sms in (2, 114, 132):
        for t in (1, 3, 64, 500):
            for n in (4097, 8191, 65537, 524288, (1 << 20) - 1, 1 << 20):
                ctas, width, seg = K.sampled_plan(t, n, sms)
                assert 1 <= ctas <= K.MAX_SEGMENTS and width % K._CHUNK == 0 and (ctas - 1) * width < n <= ctas * width
                assert seg == min(width, K.CANDIDATES) and (t * ctas <= sms or ctas == 1)


@pytest.mark.parametrize("variant", SCORE_VARIANTS, ids=lambda c: "masked{}-blocks{}-pdl{}".format(*c))
def test_score_compiles_for_sm90a(variant, monkeypatch, tmp_path):
    assert_compiles_fresh(monkeypatch, tmp_path, K._compile_index_score, variant)


@pytest.mark.parametrize("variant", SELECT_VARIANTS, ids=lambda c: "k{}-capacity{}-pdl{}-sampled{}".format(*c))
def test_select_compiles_for_sm90a(variant, monkeypatch, tmp_path):
    assert_compiles_fresh(monkeypatch, tmp_path, K._compile_topk_select, variant)


@pytest.mark.parametrize("pdl", [True, False], ids=lambda p: f"pdl{p}")
def test_candidate_filter_compiles_for_sm90a(pdl, monkeypatch, tmp_path):
    assert_compiles_fresh(monkeypatch, tmp_path, K._compile_candidate_filter, (pdl,))


def test_select_plan_covers_the_widths():
    """One CTA up to 4096 columns (capacity 0: its keys in registers), then ceil(N / 4096) CTAs a row up to 16,
    every CTA at least one column, the spans covering the row, the capacity the power of two that holds a span (at
    least 4096: its shared prefixes at most 128 KB; capacities 4096 and 8192, rows up to 2^17, hold 4 and 8 keys a
    thread in registers instead). SELECT_VARIANTS compiles the one-CTA build, both register-cluster builds and the
    smallest and largest prefix capacities at both k; the other capacities only change the shared allocation."""
    assert [K.select_plan(n) for n in (1, 4096, 4097, 65536, 65537)] == [
        (1, 1, 0), (1, 4096, 0), (2, 2049, 4096), (16, 4096, 4096), (16, 4097, 8192)]
    assert K.select_plan(524288) == (16, 32768, 32768) and K.select_plan(1 << 20) == (16, 65536, 65536)
    assert K.select_plan(131072) == (16, 8192, 8192)  # layer 20's blocks at Ncap = 2^20
    assert K.select_plan(131073)[2] == 16384 > K.MAX_RESIDENT_SPAN  # the first width through the shared prefixes
    for n in [1, 7, 4096, 4097, 8191, 61441, 65537, 300001, (1 << 20) - 1, 1 << 20]:
        cluster_n, span, capacity = K.select_plan(n)
        assert 1 <= cluster_n <= K.MAX_CLUSTER and (cluster_n - 1) * span < n <= cluster_n * span
        if cluster_n == 1:  # one CTA, its keys in registers
            assert capacity == 0 and n <= K.CTA_COLUMNS
        else:
            assert span <= capacity <= K.MAX_SPAN and capacity & (capacity - 1) == 0


def test_score_grid_is_one_wave():
    """The score grid covers every row with CTAs of whole 128-column rounds, within one wave of 3 CTAs an SM on the
    H200's 132 SMs (and a 114-SM part) while T <= 3 x SMs, with the fewest rounds that do; never an empty CTA."""
    assert K.score_grid(1, 4096, 132) == (1, 32) and K.score_grid(1, 524288, 132) == (11, 373)
    assert K.score_grid(1, 1 << 20, 132) == (21, 391) and K.score_grid(64, 524288, 132) == (683, 6)
    for sms in (114, 132):
        for t in (1, 2, 3, 8, 33, 64, 396, 500):
            for n in (1, 127, 128, 4096, 65537, 524288, 1 << 20):
                rounds, ctas = K.score_grid(t, n, sms)
                assert (ctas - 1) * rounds * 128 < n <= ctas * rounds * 128
                assert t * ctas <= max(t, K.SCORE_CTAS_PER_SM * sms)
                if rounds > 1:  # one round fewer would need more CTAs a row than a wave has for each row
                    assert -(-n // ((rounds - 1) * 128)) > max(1, K.SCORE_CTAS_PER_SM * sms // t)


def test_supports_explains():
    inputs = _op_inputs(2, 64, 0, candidates=True, device="cpu")
    args = list(inputs.values())
    kw = dict(topk=TOPK, offset=OFFSET, cand_block=8, cand_topk_blocks=0)
    assert K.supports(*args, **kw) == "q is not a CUDA tensor"
    assert "q must be torch.bfloat16" in K.supports(args[0].float(), *args[1:], **kw)
    assert "w must have shape [2, 32]" in K.supports(args[0], args[1][:, :-1], *args[2:], **kw)
    assert "keys must be torch.bfloat16" in K.supports(*args[:2], args[2].float(), *args[3:], **kw)
    assert "n_c must be torch.int64" in K.supports(*args[:3], args[3].int(), args[4], **kw)
    assert "candidates must have shape [2, 64]" in K.supports(*args[:4], args[4][:, :-1], **kw)
    small = dict(inputs, q=inputs["q"][:, :16], w=inputs["w"][:, :16])
    assert "IH and ihd must be 32 and 128, got 16 and 128" in K.supports(*small.values(), **kw)
    assert "Ncap must be in [1, 1048576], got 0" in K.supports(*args[:2], args[2][:, :0], args[3], None, **kw)
    assert K.supports(*args, **{**kw, "topk": 4096}) == "q is not a CUDA tensor"  # K = min(topk, Ncap) = 64
    wide = torch.empty(1, 4096, K.HEAD_DIM, dtype=torch.bfloat16)
    one = dict(q=inputs["q"][:1], w=inputs["w"][:1], keys=wide, n_c=inputs["n_c"][:1], candidates=None)
    assert "min(topk, 4096) = 4096 is above the kernel's 2048" in K.supports(*one.values(), **{**kw, "topk": 4096})
    assert "cand_block must be 8 in candidate-block mode, got 4" in K.supports(
        *one.values(), **{**kw, "cand_block": 4, "cand_topk_blocks": 2048})
    assert "no model layer does both" in K.supports(*args, **{**kw, "cand_topk_blocks": 2048})
    assert "must be 3-D" in K.supports(args[0][0], *args[1:], **kw)
    with pytest.raises(ValueError, match="indexer_topk: q is not a CUDA tensor"):
        K.indexer_topk(*args, **kw)


def test_select_reason_explains():
    s = torch.zeros(2, 100)
    assert K.select_reason(s, 5) == "scores is not a CUDA tensor"
    assert "2-D torch.float32" in K.select_reason(s.double(), 5)
    assert "k must be in [1, min(N, 2048)] = [1, 100], got 101" in K.select_reason(s, 101)
    assert "k must be in [1, min(N, 2048)] = [1, 100], got 0" in K.select_reason(s, 0)
    assert "N must be in [1, 1048576], got 1048577" in K.select_reason(torch.zeros(1, (1 << 20) + 1), 5)
    assert K.select_reason(torch.zeros(1, 1 << 20), 2048) == "scores is not a CUDA tensor"  # no candidate limit
    with pytest.raises(ValueError, match="topk_indices: k must be in"):
        K.topk_indices(s, 0)
    assert "path must be one of ('auto', 'sampled', 'cluster'), got 'fast'" in K.select_reason(s, 5, "fast")
    assert "path 'sampled' needs N > 4096 (one CTA takes a narrower row), got N = 4096" in K.select_reason(
        torch.zeros(1, 4096), 5, "sampled")
    assert K.select_reason(torch.zeros(1, 4097), 5, "sampled") == "scores is not a CUDA tensor"
    with pytest.raises(ValueError, match="topk_indices: path must be one of"):
        K.topk_indices(torch.zeros(1, 4097), 5, path="radix")


# GPU


SELECT_WIDTHS = _widths(1, 7, 600, 1025, 4095, 4096, 4097, 16385, 61441, 65536, 65537, 131072, 131073, 300001,
                        (1 << 20) - 1, 1 << 20)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,path", [(n, "cluster") for n in SELECT_WIDTHS]
                         + [(n, "sampled") for n in SELECT_WIDTHS if n > K.CTA_COLUMNS], ids=lambda v: f"{v}")
def test_select_matches_the_tie_rule(n, path, kind):
    t = 2 if n > 65537 else 3
    g = torch.Generator().manual_seed(n + KINDS.index(kind))
    for k in sorted({min(TOPK, n), min(2048, n)}):
        s = _score_rows(kind, t, n, g).cuda()
        got = _select(s, k, path=path)
        want = _tie_rule(s, k, OFFSET)
        assert torch.equal(got, want), f"k={k}: {(got != want).sum().item()} entries differ"


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["auto", "cluster"])
@pytest.mark.parametrize("t", TOKENS, ids=lambda t: f"T{t}")
def test_select_rows(t, path):
    """T rows at once (the sampled filter's CTAs: one an SM over the rows, so wider CTAs as T grows)."""
    g = torch.Generator().manual_seed(t)
    for n in _widths(4096, 4097, 40000, 65536, 524288, 1 << 20):
        s = _score_rows("random", t, n, g).cuda()
        s[::3, 300:] = -math.inf  # every third row: fewer valid scores than k
        s[1::3, : n // 2] = 0.5  # and every third from the second: half the row one value
        assert torch.equal(_select(s, TOPK, pdl=t % 2 == 0, path=path), _tie_rule(s, TOPK, OFFSET)), f"N={n}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "constant", "sample-high", "nan-inf", "few-valid", "ulp-apart"])
@pytest.mark.parametrize("n", _widths(4097, 65536, 524288, 1 << 20), ids=lambda n: f"N{n}")
@pytest.mark.parametrize("t", [1, 3, 64], ids=lambda t: f"T{t}")
def test_filter_matches_the_model(t, n, kind):
    """The sampled path's candidates (CandidateFilter through filter_candidates) equal the numpy model's exactly:
    every CTA's count and the columns and keys in the slots of its segment it writes; the rows of the forced misses
    do fall back (their totals outside [k, CANDIDATES]) and the random rows do not."""
    if t * n > (1 << 24):
        t = (1 << 24) // n  # 16 rows of 2^20: the numpy model of 64 would take minutes
    g = torch.Generator().manual_seed(n + t)
    s = _score_rows(kind, t, n, g)
    counts, cols, keys, seg = K.filter_candidates(s.cuda(), TOPK)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert seg == K.sampled_plan(t, n, sms)[2]
    fast = []  # per row: whether the select takes the candidates (else the fallback)
    for r, row in enumerate(_order_keys(s)):
        want_counts, want_cols, want_keys = _model_candidates(row, TOPK, t, sms)
        assert np.array_equal(counts[r].cpu().numpy(), want_counts), f"row {r}: counts"
        written = want_cols != POISON
        assert np.array_equal(cols[r].cpu().numpy()[written], want_cols[written]), f"row {r}: columns"
        assert np.array_equal(keys[r].cpu().numpy()[written], want_keys[written]), f"row {r}: keys"
        fast.append(TOPK <= int(want_counts.sum()) <= K.CANDIDATES)
    if kind == "random":
        assert all(fast), fast
    if kind == "few-valid":  # row r: 37 r valid scores, fewer than k up to row 13
        assert not any(fast[:14]), fast
    if (kind == "constant" and n > K.CANDIDATES) or (kind == "sample-high" and n >= 65536):
        assert not any(fast), fast


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["plain", "masked", "blocks"])
@pytest.mark.parametrize("n_cap", _widths(1001, 4096, 65536), ids=lambda n: f"Ncap{n}")
def test_scores_match_reference(n_cap, mode):
    inputs = _op_inputs(4, n_cap, n_cap, candidates=mode == "masked")
    got, block_max = K.index_scores(*inputs.values(), blocks=mode == "blocks")
    want = op_module.scores(*list(inputs.values())[:4])
    if mode == "masked":
        want = want.masked_fill(~inputs["candidates"], -math.inf)
    tol = op_module.score_tolerance(*list(inputs.values())[:3])
    hidden = want == -math.inf
    assert torch.equal(got == -math.inf, hidden), "-inf where the reference has none, or the other way"
    err = (got - want).abs().masked_fill(hidden, 0.0)
    assert bool((err <= tol).all()), f"max error {err.max().item():.3g}, {(err > tol).sum().item()} beyond tolerance"
    if mode == "blocks":
        assert torch.equal(block_max, op_module._block_maxima(got, inputs["n_c"], K.BLOCK))


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS, ids=lambda t: f"T{t}")
def test_op_matches_reference(t):
    for seed in range(2):
        inputs = _op_inputs(t, 4096, 10 * t + seed)
        _assert_op_matches(_op(inputs), inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("n_cap", _widths(65536, 524288, 1 << 20), ids=lambda n: f"Ncap{n}")
def test_op_wide_rows(n_cap):
    """Rows wider than one select CTA: clusters of 16 CTAs (spans of 4096, 32768 and 65536 columns)."""
    inputs = _op_inputs(2 if n_cap > 65536 else 3, n_cap, n_cap)
    _assert_op_matches(_op(inputs), inputs)


@pytest.mark.gpu
def test_op_wide_row_partly_visible():
    """A wide key cache of which only the first n_c rows are visible (a long max_context, a shorter sequence): the
    score kernel reads no key past n_c and scores those columns -inf; the op equals the reference."""
    n_cap = min(MAX_COLUMNS, 524288)
    inputs = _op_inputs(1, n_cap, 70)
    inputs["n_c"][0] = n_cap // 3 + 77  # not a multiple of a score round (128) or a tile (8)
    _assert_op_matches(_op(inputs), inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5], ids=lambda t: f"T{t}")
def test_op_candidate_masked(t):
    inputs = _op_inputs(t, 16384 if MAX_COLUMNS >= 16384 else 4096, 20 + t, candidates=True)
    _assert_op_matches(_op(inputs), inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("n_cap", _widths(1001, 65536, 1 << 20), ids=lambda n: f"Ncap{n}")
def test_op_candidate_blocks(n_cap):
    """Layer 20: the top-2048 blocks of 8 by block maximum, the newest kept; as the reference under the tie rule,
    and exactly as select_candidate_blocks of the kernel's own scores (random scores: no ties)."""
    t = 2 if n_cap > 65536 else 3
    inputs = _op_inputs(t, n_cap, 30 + n_cap)
    got = _op(inputs, cand_topk_blocks=2048)
    _assert_op_matches(got, inputs, cand_topk_blocks=2048)
    scores, _ = K.index_scores(*inputs.values())
    assert torch.equal(got[1], select_candidate_blocks(scores, inputs["n_c"], K.BLOCK, 2048))


@pytest.mark.gpu
def test_op_nan_keys():
    """Keys of NaN make NaN scores, which count as -inf: never selected (N_c > K) or -1 (N_c < K)."""
    inputs = _op_inputs(3, 4096, 60)
    inputs["keys"][:, ::3] = math.nan
    inputs["n_c"][1] = 600  # 400 numbers, 200 NaN: 112 of the 512 are -1
    got = _op(inputs)
    _assert_op_matches(got, inputs)
    assert ((got[0] - OFFSET) % 3 != 0)[got[0] >= 0].all() and (got[0][1] == -1).sum() == 112


@pytest.mark.gpu
def test_op_runs_the_kernel():
    """dsv41::indexer_topk with impl="cute" (and "auto" on Hopper) calls this kernel, in index and mask form."""
    import dsv41.lowerings  # noqa: F401  (registers the ops)

    inputs = _op_inputs(4, 4096, 40)
    args = (*inputs.values(), TOPK, OFFSET, K.BLOCK, 0)
    want = K.indexer_topk(*inputs.values(), topk=TOPK, offset=OFFSET, cand_block=K.BLOCK, cand_topk_blocks=0)
    unshifted = K.indexer_topk(*inputs.values(), topk=TOPK, offset=0, cand_block=K.BLOCK, cand_topk_blocks=0)
    for impl in ("cute", "auto"):
        got = torch.ops.dsv41.indexer_topk(*args, False, impl)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), impl
        mask, _ = torch.ops.dsv41.indexer_topk(*args, True, impl)
        assert torch.equal(mask, op_module.selection_mask(unshifted[0], 4096)), impl


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [0, 2048], ids=["plain", "blocks"])
def test_cuda_graph_replay(blocks):
    """Replays alternating two input sets (different selections) are bit-identical to direct calls."""
    n_cap = min(65536, MAX_COLUMNS)
    sets = [_op_inputs(3, n_cap, seed) for seed in (50, 51)]
    call = lambda s: K.indexer_topk(*s.values(), topk=TOPK, offset=OFFSET, cand_block=K.BLOCK,  # noqa: E731
                                    cand_topk_blocks=blocks)
    direct = [call(s) for s in sets]
    for (idx, cand), s in zip(direct, sets, strict=True):
        again = call(s)
        assert torch.equal(idx, again[0]) and torch.equal(cand, again[1]), "direct calls are not deterministic"
        _assert_op_matches((idx, cand), s, cand_topk_blocks=blocks)
    assert not torch.equal(direct[0][0], direct[1][0]), "the two input sets should select differently"
    static = {k: None if v is None else v.clone() for k, v in sets[0].items()}  # candidates: None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = call(static)
    for i in range(REPLAYS):
        for key, src in sets[i % 2].items():
            if src is not None:
                static[key].copy_(src)
        outs[0].fill_(POISON)
        outs[1].fill_(i % 2 == 0)
        graph.replay()
        assert torch.equal(outs[0], direct[i % 2][0]) and torch.equal(outs[1], direct[i % 2][1]), f"replay {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["sampled", "cluster"])
def test_select_cuda_graph_replay(path):
    """The select alone on the widest rows (16-CTA clusters, rounds 2-3 re-reading full keys for the ulp-apart rows;
    on the sampled path the random rows take the candidates, the ulp-apart (too many ties at tau) and sample-high
    (too few candidates) rows the fallback): replays round robin over the three score sets, outputs poisoned before
    each, are bit-identical to the direct calls, which equal the tie rule."""
    n = min(1 << 20, MAX_COLUMNS)
    g = torch.Generator().manual_seed(70)
    sets = [_score_rows(kind, 2, n, g).cuda() for kind in ("random", "ulp-apart", "sample-high")]
    direct = [_select(s, TOPK, path=path) for s in sets]
    for got, s in zip(direct, sets, strict=True):
        assert torch.equal(got, _tie_rule(s, TOPK, OFFSET))
    static = sets[0].clone()
    out = torch.full((2, TOPK), POISON, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        K.topk_indices(static, TOPK, OFFSET, out=out, path=path)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.topk_indices(static, TOPK, OFFSET, out=out, path=path)
    for i in range(min(REPLAYS, 30)):
        static.copy_(sets[i % 3])
        out.fill_(POISON)
        graph.replay()
        assert torch.equal(out, direct[i % 3]), f"replay {i}"


def test_bench_table_and_plot_per_width(tmp_path):
    """`dsv41 bench kernels --op indexer_topk` rows carry their width: one table line per (width, T), the further
    variants listed after, and the plot over the widths."""
    from dsv41.tools import bench_kernels

    rows = [{"op": "indexer_topk", "tokens": 1, "columns": n, "variant": v, "us": us * n / 4096, "floor_us": n / 4096}
            for n in (4096, 65536) for v, us in (("dsv41", 3.0), ("eager", 30.0), ("inductor", 20.0), ("select", 2.0))]
    result = {"gpu": "H200", "torch": "2.11", "copy_gbps": 4274.0, "rows": rows}
    text = bench_kernels.table(result)
    assert "indexer_topk     65536   1    48.00" in text and "x ind" in text
    assert "further variants:" in text and "indexer_topk      4096   1  select             2.00 us" in text
    pytest.importorskip("matplotlib")
    assert bench_kernels.plot(result, tmp_path / "kernels.png") and (tmp_path / "kernels.png").stat().st_size > 0
    assert [op.columns for op in bench_kernels._built_ops(["indexer_topk"], [4096, 65536])] == [4096, 65536]
