"""The sparse-attention indexer (spec section 2.4): ``dsv41::indexer_topk`` as a score kernel and an exact top-K.

q [T, 32, 128] bf16, w [T, 32] fp32, keys [T, Ncap, 128] bf16, n_c [T] int64, candidates [T, Ncap] bool or None:

    s[t, n]  = sum_h w[t, h] * relu(q[t, h] . keys[t, n])        fp32; -inf where n >= n_c[t], where
               (candidate-masked mode) not candidates[t, n], and where the sum is NaN              [T, Ncap]
    idx[t]   = the K = min(topk, Ncap) columns of the largest s[t, n] (equal scores: the lower index first),
               sorted ascending, + offset; -1 where s is -inf (fewer than K valid columns)          [T, K] int64

``IndexScore`` (launch 1) writes s to an fp32 workspace, reading the bf16 keys once: CTA (t, j) owns ``rounds``
x 128 consecutive columns of row t, each of its 4 warps 32 columns per round as 4 tiles of 8. A warp holds all 32
heads of q[t] in registers as the A operand of ``mma.sync.m16n8k16`` (two 16-head tiles, bf16 in, fp32
accumulation: the bf16 x bf16 products are exact in fp32) and streams the keys as the B operand, 16-byte vectors
in the column relabelling of ``dsv41.kernels.moe_route`` (lane (r, q) = (lane / 4, lane % 4) loads columns [8q,
8q + 8) of each 32-wide chunk of key row r of the tile). Summation order: the 128-term dot products in the MMA's
order, then per column the 4 heads a lane holds, then a butterfly over the 8 lanes holding the other heads; the
reference (cuBLAS) sums in another order, so scores agree to a few fp32 ulps of sum_h |w_h| |q_h . k|, not bit for
bit. In candidate-block mode (layer 20) the same kernel writes each 8-column block's maximum (a tile is a block),
the newest block (n_c - 1) // 8 pinned to +inf, to a second workspace bs [T, ceil(Ncap / 8)].

The select is an exact radix select on order-preserving 32-bit keys (NaN and -inf share the lowest key of a score;
-0 = +0), 8-bit digits from the top: a round builds a 256-bin shared histogram (warp-aggregated shared atomics) of
the keys matching the digits chosen so far and picks the digit of the bin holding the remaining take-th largest.
The rounds stop as soon as that bin holds exactly the keys still to take (rows of distinct scores stop after 2
or 3 of the 4), which leaves the bin [lo, hi] (the keys with the chosen top bits) and how many of its keys to take.
A collection pass keeps every key > hi and the first keys in [lo, hi] in column order, placing each at (keys > hi
before it) + min(bin keys before it, needed) by a block-wide scan: the output comes out sorted by column, ties
broken by the lower column. CTAs have 1024 threads.

``TopkSelect`` holds per_thread keys a thread in registers (element e = j * 1024 + thread, column order = (j,
thread) order). A row of N <= 4096 columns is one such CTA, which writes the output (launch 2). A wider row is
split into ceil(N / S) slices of S columns (``select_plan``: a power of two times 1024, about N / 128 so a row fills
about a wave of the 132 SMs, at least 2048 and 2K, at most 16384), one CTA each (launch 2), which writes the exact
local top-K of its slice (keys and columns in column order, padded below every score) and two bounds: kth = lo of
its K-th key's bin (a lower bound of that key; none when the slice has fewer than K keys), and rank = the lowest key
with the top 16 bits of its r-th largest key, r = ceil(K / full slices) (a second histogram in round 1; 8 bits when
the rounds stop after round 0; none from a short last slice). Every key of the
row's top-K is >= B = max(max kth, min rank): one slice alone has K keys >= its K-th key, and the full slices
together have >= r * full slices >= K keys >= min rank. ``TopkMerge`` (launch 3, one CTA a row) reduces B, streams
the slices' candidates from global memory 8 consecutive per thread, compacts those >= B in order into a workspace
(block scans; round 0's histogram on the way), runs the remaining rounds and the collection over the survivors,
streamed again, and writes the output. Nothing bounds the survivor count (a constant row keeps all slices x K
candidates); a row of random scores keeps about 3% of them (1789 of 128 x 512 at 2^19 columns, in the model). Every element of the global top-K (tie rule
included) is in its slice's local top-K and >= B, so the merge is exact. No CTA waits for another (no cooperative
launch, no spin barrier, no atomics in global memory), so the launches are CUDA-graph capturable and
bit-deterministic. The test file's numpy model of these steps is checked against torch.topk on the CPU.

Candidate-block mode selects min(cand_topk_blocks, ceil(Ncap / 8)) blocks from bs with the same select kernel
(K = 2048, no offset) and expands the chosen blocks to the [T, Ncap] bool mask in torch.

Resources (ptxas for sm_90a, CUDA 13.0's ptxas -v on the PTX the DSL emits, CUTE_DSL_KEEP=ptx): the score kernel
takes 168 registers (3 CTAs of 128 threads per SM); the one-CTA select (1 to 4 keys per thread) 32 registers, the
slice CTAs 52 to 64 (2, 8 and 16 keys per thread: 52, 56, 64), the merge 64; none spills.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, const_expr

from dsv41.kernels import cute_utils
from dsv41.kernels.compile_cache import (cached_kernel, compile_tvm_ffi, env_stream, fake_tensor, hopper_reason,
                                         shape_reason)

HEADS = 32  # index heads (IH) the score kernel is built for
HEAD_DIM = 128  # index head dim (ihd)
BLOCK = 8  # the candidate block size the score kernel's block maxima take (one MMA tile of columns)
MAX_COLUMNS = 1 << 20  # Ncap
MAX_K = 2048
THREADS = 1024  # per select CTA
SINGLE_COLUMNS = 4 * THREADS  # the widest row one CTA selects alone
MAX_SLICE_COLUMNS = 16 * THREADS  # the widest slice
TARGET_SLICES = 128  # slices per wide row: about one wave of the H200's 132 SMs
_WARPS = 4  # per score CTA
_TILE = 8  # key columns per MMA (its N)
_TILES = 4  # MMA tiles per warp per round
_ROUND_COLS = _WARPS * _TILES * _TILE  # 128 columns per CTA round
_MAX_ROUNDS = 8
_TARGET_CTAS = 4 * 132  # score CTAs worth launching before a CTA takes more rounds
_CHUNKS = HEAD_DIM // 32  # 32-column chunks of a head: 4 lanes x one 16-byte vector each
_VEC = 8  # bf16 per 16-byte vector
_SEL_WARPS = THREADS // 32
_BINS = 256
_ROUNDS = 4  # of 8-bit digits, at most
_GROUP = 8  # consecutive candidates per merge thread and chunk
_CHUNK = _GROUP * THREADS  # candidates per merge pass step
_INT_MAX = 2**31 - 1
_INT_MIN = -(2**31)
_PAD = _INT_MIN  # the key of a padding slot: below every score's key
_KEY_NEG_INF = -(0x7F800000) - 1  # the key of -inf (and NaN): the float bits 0xFF800000 ^ 0x7FFFFFFF


class IndexScore:
    """The index scores (and, with ``blocks``, the candidate-block maxima) of every column; ``masked``: the
    candidate-masked mode."""

    def __init__(self, masked: bool, blocks: bool, pdl: bool):
        self.masked = masked
        self.blocks = blocks
        self.pdl = pdl

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mW: cute.Tensor, mKeys: cute.Tensor, mNc: cute.Tensor, mCand: cute.Tensor,
                 mScores: cute.Tensor, mBlocks: cute.Tensor, rounds: Int32, ctas_per_row: Int32, n_ctas: Int32,
                 stream):
        self.kernel(mQ, mW, mKeys, mNc, mCand, mScores, mBlocks, rounds, ctas_per_row).launch(
            grid=[n_ctas, 1, 1], block=[_WARPS * 32, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mW: cute.Tensor, mKeys: cute.Tensor, mNc: cute.Tensor, mCand: cute.Tensor,
               mScores: cute.Tensor, mBlocks: cute.Tensor, rounds: Int32, ctas_per_row: Int32):
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        r = lane // 4  # head r (+ 8, 16, 24) of the A operand, key column r of a tile
        q = lane % 4  # which 8 columns of each 32-column chunk
        t = cta // ctas_per_row
        col0 = (cta % ctas_per_row) * (rounds * _ROUND_COLS)
        n_cap = mKeys.shape[1]
        vec = (_VEC,)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        n_c = Int32(cutlass.max(cutlass.min(mNc[t], Int64(n_cap)), Int64(-1)))

        # A operand: a[m][h][c] = the 4 bf16 pairs of head 16m + 8h + r in chunk c; w of the same heads
        a = [[cute_utils.load_bf16_pairs(cute.tiled_divide(mQ[t, 16 * m + 8 * h + r, None], vec)[None, 4 * c + q])
              for c in range(_CHUNKS)] for m in range(2) for h in range(2)]
        w = [mW[t, 16 * m + 8 * h + r] for m in range(2) for h in range(2)]

        for rnd in cutlass.range(rounds):
            base = col0 + rnd * _ROUND_COLS + warp * (_TILES * _TILE)
            b_tiles = []  # every tile's B operand, requested before the first MMA
            for i in cutlass.range_constexpr(_TILES):
                n = base + i * _TILE + r
                gK = cute.tiled_divide(mKeys[t, cutlass.min(n, n_cap - 1), None], vec)
                b_tiles.append([cute_utils.load_bf16_pairs(gK[None, 4 * c + q], n < n_cap) for c in range(_CHUNKS)])
            for i in cutlass.range_constexpr(_TILES):
                n0 = base + i * _TILE
                if n0 < n_cap:  # warp-uniform
                    self.tile(t, n0, n_cap, n_c, q, a, w, b_tiles[i], mCand, mScores, mBlocks)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def tile(self, t: Int32, n0: Int32, n_cap: Int32, n_c: Int32, q: Int32, a: list, w: list, b: list,
             mCand: cute.Tensor, mScores: cute.Tensor, mBlocks: cute.Tensor):
        """Scores of key columns [n0, n0 + 8) of row t (one warp); lanes 0..3 store columns n0 + 2q, n0 + 2q + 1."""
        lane = cute.arch.lane_idx()
        acc = [[Float32(0.0)] * 4 for _ in range(2)]
        for m in cutlass.range_constexpr(2):
            for c in cutlass.range_constexpr(_CHUNKS):
                for j in cutlass.range_constexpr(2):  # the chunk's two k-steps of 16 (relabelled) columns
                    acc[m] = cute_utils.mma_m16n8k16(
                        acc[m], [a[2 * m][c][2 * j], a[2 * m + 1][c][2 * j], a[2 * m][c][2 * j + 1],
                                 a[2 * m + 1][c][2 * j + 1]], [b[c][2 * j], b[c][2 * j + 1]])
        # accumulator fragment of head tile m: (head 16m + r, columns 2q, 2q + 1), (head 16m + 8 + r, the same)
        vals = []
        for e in cutlass.range_constexpr(2):
            part = (w[0] * _relu(acc[0][e]) + w[1] * _relu(acc[0][2 + e])) + (
                w[2] * _relu(acc[1][e]) + w[3] * _relu(acc[1][2 + e]))
            for off in cutlass.range_constexpr(3):  # sum over the 8 lanes of this q (the other heads)
                part = part + cute.arch.shuffle_sync_bfly(part, offset=4 << off)
            col = n0 + 2 * q + e
            hidden = (col >= n_c) | _is_nan(part)
            if const_expr(self.masked):
                hidden = hidden | (mCand[t, cutlass.min(col, n_cap - 1)] == Uint8(0))
            vals.append(cutlass.select_(hidden, Float32(-math.inf), part))
            if lane < 4:
                if col < n_cap:
                    mScores[t, col] = vals[e]
        if const_expr(self.blocks):
            best = cute.arch.fmax(vals[0], vals[1])
            for off in cutlass.range_constexpr(2):  # over the 4 lanes of the tile's columns
                best = cute.arch.fmax(best, cute.arch.shuffle_sync_bfly(best, offset=1 << off))
            pinned = (n_c > 0) & (n0 // BLOCK == (n_c - 1) // BLOCK)
            if lane == 0:
                mBlocks[t, n0 // BLOCK] = cutlass.select_(pinned, Float32(math.inf), best)


class TopkSelect:
    """The exact top-``k`` of rows of scores held in registers, ``per_thread`` keys per thread (element e = j *
    1024 + thread).

    ``final``: one CTA per row of N <= 1024 * per_thread columns, which writes the output [T, k] int64 (column +
    offset, -1 for a -inf score). Else one CTA per (row, slice of 1024 * per_thread columns), which writes its slice's
    k candidates (keys and columns, in column order, padded below every score) and its two bounds (module
    docstring) to the workspace.
    """

    def __init__(self, k: int, per_thread: int, final: bool, pdl: bool):
        self.k = k
        self.per_thread = per_thread
        self.final = final
        self.pdl = pdl

    @cute.jit
    def __call__(self, mScores: cute.Tensor, mCandKey: cute.Tensor, mCandIdx: cute.Tensor, mBounds: cute.Tensor,
                 mOut: cute.Tensor, offset: Int64, rank: Int32, n_ctas: Int32, stream):
        self.kernel(mScores, mCandKey, mCandIdx, mBounds, mOut, offset, rank).launch(
            grid=[n_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mScores: cute.Tensor, mCandKey: cute.Tensor, mCandIdx: cute.Tensor, mBounds: cute.Tensor,
               mOut: cute.Tensor, offset: Int64, rank: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        smem = cutlass.memory.SmemAllocator()
        sHist = smem.allocate_tensor(Int32, cute.make_layout(_BINS), byte_alignment=16)
        sScan = smem.allocate_tensor(Int32, cute.make_layout((2, _SEL_WARPS)), byte_alignment=16)
        sRankHist = smem.allocate_tensor(Int32, cute.make_layout(_BINS), byte_alignment=16)
        sPick = smem.allocate_tensor(Int32, cute.make_layout(6), byte_alignment=8)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()

        n_cols = mScores.shape[1]
        span = self.per_thread * THREADS  # columns per CTA
        slices = (n_cols + span - 1) // span
        t = cta
        first = Int32(0)  # the CTA's first column
        sl = Int32(0)  # its slice
        if const_expr(not self.final):
            t = cta // slices
            sl = cta % slices
            first = sl * span
        count = cutlass.min(n_cols - first, span)  # its keys
        take = cutlass.min(count, self.k)  # how many it selects
        keys = []
        for j in cutlass.range_constexpr(self.per_thread):
            e = j * THREADS + tidx
            key = Int32(_PAD)
            if e < count:
                key = _order_key(mScores[t, first + e])
            keys.append(key)

        # Radix select, 8-bit digits from the top: after a round, `prefix` = the top `level` bits of the take-th
        # largest key (unsigned order), `remaining` = how many keys with those bits are still to take; it stops
        # early once they are all of that bin's keys. A slice's rounds 0 and 1 (if it runs) also find the top
        # `rank_level` bits `rank_prefix` of its rank-th largest key, in a second histogram.
        prefix = Int32(0)
        remaining = take
        level = Int32(0)
        done = Int32(0)
        rank_prefix = Int32(0)
        rank_remaining = rank
        rank_level = Int32(8)
        for rnd in cutlass.range_constexpr(_ROUNDS):
            if done == 0:
                shift = 24 - 8 * rnd
                ranked = rnd < 2 and not self.final  # the rank's bin: round 0 shares sHist, round 1 has sRankHist
                if tidx < _BINS:
                    sHist[tidx] = Int32(0)
                    if const_expr(ranked and rnd == 1):
                        sRankHist[tidx] = Int32(0)
                cute.arch.barrier()
                for j in cutlass.range_constexpr(self.per_thread):
                    _histogram_add(sHist, _digit(keys[j], rnd), _matches(keys[j], rnd, prefix))
                    if const_expr(ranked and rnd == 1):
                        _histogram_add(sRankHist, _digit(keys[j], rnd), _matches(keys[j], rnd, rank_prefix))
                cute.arch.barrier()
                if warp == 0:
                    _pick_digit(sHist, sPick, 0, prefix, remaining, lane)
                if const_expr(ranked):
                    if warp == 1:
                        _pick_digit(sRankHist if const_expr(rnd == 1) else sHist, sPick, 3, rank_prefix, rank_remaining,
                                    lane)
                cute.arch.barrier()
                prefix = sPick[0]
                remaining = sPick[1]
                done = cutlass.select_(remaining == sPick[2], Int32(1), Int32(0))
                level = Int32(32 - shift)
                if const_expr(ranked):
                    rank_prefix = sPick[3]
                    rank_remaining = sPick[4]
                    rank_level = Int32(32 - shift)
        lo, hi = _bin_edges(prefix, level)

        # Collection in column order: element (j, thread) goes to (keys > hi before it) + min(keys in the bin
        # before it, remaining); the first `remaining` keys of the bin in column order are taken.
        row_base = sl * self.k
        lt = Int32(cute.arch.lanemask_lt())
        n_gt = Int32(0)
        n_eq = Int32(0)
        for j in cutlass.range_constexpr(self.per_thread):
            e = j * THREADS + tidx
            gt = keys[j] > hi
            eq = (keys[j] >= lo) & (keys[j] <= hi) & (keys[j] != Int32(_PAD))
            ball_gt = cute.arch.vote_ballot_sync(gt)
            ball_eq = cute.arch.vote_ballot_sync(eq)
            if lane == 0:
                sScan[j % 2, warp] = cute.arch.popc(ball_gt) + (cute.arch.popc(ball_eq) << 16)
            cute.arch.barrier()
            warp_total = sScan[j % 2, lane]  # lane l: warp l's packed counts
            incl = _warp_inclusive_scan(warp_total, lane)
            before = cute.arch.shuffle_sync(incl - warp_total, warp) + cute.arch.popc(ball_gt & lt) + (
                cute.arch.popc(ball_eq & lt) << 16)
            block_total = cute.arch.shuffle_sync(incl, _SEL_WARPS - 1)
            gt_before = n_gt + (before & Int32(0xFFFF))
            eq_before = n_eq + (before >> 16)
            if gt | (eq & (eq_before < remaining)):
                pos = gt_before + cutlass.min(eq_before, remaining)
                if const_expr(self.final):
                    mOut[t, pos] = cutlass.select_(keys[j] > Int32(_KEY_NEG_INF), Int64(first + e) + offset,
                                                   Int64(-1))
                else:
                    mCandKey[t, row_base + pos] = keys[j]
                    mCandIdx[t, row_base + pos] = first + e
            n_gt = n_gt + (block_total & Int32(0xFFFF))
            n_eq = n_eq + (block_total >> 16)
        if const_expr(not self.final):
            for p in cutlass.range(take + tidx, self.k, THREADS):  # padding after a short last slice's keys
                mCandKey[t, row_base + p] = Int32(_PAD)
                mCandIdx[t, row_base + p] = Int32(-1)
            if tidx == 0:  # the bounds: no bound from a slice with fewer than k keys (kth) or span keys (rank)
                mBounds[t, sl] = cutlass.select_(take == self.k, lo, Int32(_PAD))
                mBounds[t, slices + sl] = cutlass.select_(count == span, _bin_edges(rank_prefix, rank_level)[0],
                                                          Int32(_INT_MAX))
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()


class TopkMerge:
    """The exact top-``k`` of each row's slice candidates (one CTA per row), streamed from global memory.

    mCandKey, mCandIdx [T, C] (C = slices * k, slice by slice in column order), mBounds [T, 2 * slices]; mSurvKey,
    mSurvIdx [T, C]: a workspace for the candidates at or above the row's bound, compacted in order; mOut [T, k].
    """

    def __init__(self, k: int, pdl: bool):
        self.k = k
        self.pdl = pdl

    @cute.jit
    def __call__(self, mCandKey: cute.Tensor, mCandIdx: cute.Tensor, mBounds: cute.Tensor, mSurvKey: cute.Tensor,
                 mSurvIdx: cute.Tensor, mOut: cute.Tensor, offset: Int64, n_ctas: Int32, stream):
        self.kernel(mCandKey, mCandIdx, mBounds, mSurvKey, mSurvIdx, mOut, offset).launch(
            grid=[n_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mCandKey: cute.Tensor, mCandIdx: cute.Tensor, mBounds: cute.Tensor, mSurvKey: cute.Tensor,
               mSurvIdx: cute.Tensor, mOut: cute.Tensor, offset: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        smem = cutlass.memory.SmemAllocator()
        sHist = smem.allocate_tensor(Int32, cute.make_layout(_BINS), byte_alignment=16)
        sScan = smem.allocate_tensor(Int32, cute.make_layout((2, _SEL_WARPS)), byte_alignment=16)
        sBound = smem.allocate_tensor(Int32, cute.make_layout((2, _SEL_WARPS)), byte_alignment=16)
        sPick = smem.allocate_tensor(Int32, cute.make_layout(3), byte_alignment=8)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        n_cand = mCandKey.shape[1]
        slices = mBounds.shape[1] // 2

        # The bound: max(max over slices of kth, min over slices of rank), every key of the top-k is >= it.
        kth = Int32(_PAD)
        rank = Int32(_INT_MAX)
        for s in cutlass.range(tidx, slices, THREADS):
            kth = cutlass.max(kth, mBounds[t, s])
            rank = cutlass.min(rank, mBounds[t, slices + s])
        kth = _warp_reduce(kth, cutlass.max)
        rank = _warp_reduce(rank, cutlass.min)
        if lane == 0:
            sBound[0, warp] = kth
            sBound[1, warp] = rank
        if tidx < _BINS:
            sHist[tidx] = Int32(0)
        cute.arch.barrier()
        bound = cutlass.max(_warp_reduce(sBound[0, lane], cutlass.max), _warp_reduce(sBound[1, lane], cutlass.min))

        # Compaction of the candidates >= bound, in order, with the histogram of radix round 0.
        n_surv = Int32(0)
        for base in cutlass.range(0, n_cand, _CHUNK):
            e0 = base + tidx * _GROUP
            keys = []
            live = []
            for j in cutlass.range_constexpr(_GROUP):
                key = Int32(_PAD)
                if e0 + j < n_cand:
                    key = mCandKey[t, e0 + j]
                keys.append(key)
                live.append((key >= bound) & (key != Int32(_PAD)))
                _histogram_add(sHist, _digit(key, 0), live[j])
            mine = cute_utils.tree_sum([cutlass.select_(v, Int32(1), Int32(0)) for v in live])
            before, total = _block_scan(mine, sScan, (base // _CHUNK) % 2, warp, lane)
            pos = n_surv + before
            for j in cutlass.range_constexpr(_GROUP):
                if live[j]:
                    mSurvKey[t, pos] = keys[j]
                    mSurvIdx[t, pos] = mCandIdx[t, e0 + j]
                pos = pos + cutlass.select_(live[j], Int32(1), Int32(0))
            n_surv = n_surv + total
        cute.arch.barrier()

        # Radix select over the survivors (as TopkSelect's, each round a pass over them).
        prefix = Int32(0)
        remaining = Int32(self.k)
        level = Int32(0)
        done = Int32(0)
        for rnd in cutlass.range_constexpr(_ROUNDS):
            if done == 0:
                if const_expr(rnd > 0):
                    if tidx < _BINS:
                        sHist[tidx] = Int32(0)
                    cute.arch.barrier()
                    for base in cutlass.range(0, n_surv, _CHUNK):
                        for j in cutlass.range_constexpr(_GROUP):
                            key = Int32(_PAD)
                            if base + tidx * _GROUP + j < n_surv:
                                key = mSurvKey[t, base + tidx * _GROUP + j]
                            _histogram_add(sHist, _digit(key, rnd), _matches(key, rnd, prefix))
                    cute.arch.barrier()
                if warp == 0:
                    _pick_digit(sHist, sPick, 0, prefix, remaining, lane)
                cute.arch.barrier()
                prefix = sPick[0]
                remaining = sPick[1]
                done = cutlass.select_(remaining == sPick[2], Int32(1), Int32(0))
                level = Int32(8 * (rnd + 1))
        lo, hi = _bin_edges(prefix, level)

        # Collection in order: each thread's _GROUP consecutive survivors per chunk, one block scan per chunk.
        n_gt = Int32(0)
        n_eq = Int32(0)
        for base in cutlass.range(0, n_surv, _CHUNK):
            e0 = base + tidx * _GROUP
            keys = []
            for j in cutlass.range_constexpr(_GROUP):
                key = Int32(_PAD)
                if e0 + j < n_surv:
                    key = mSurvKey[t, e0 + j]
                keys.append(key)
            gts = [cutlass.select_(key > hi, Int32(1), Int32(0)) for key in keys]
            eqs = [cutlass.select_((key >= lo) & (key <= hi) & (key != Int32(_PAD)), Int32(1), Int32(0))
                   for key in keys]
            before, total = _block_scan(cute_utils.tree_sum(gts) + (cute_utils.tree_sum(eqs) << 16), sScan,
                                        (base // _CHUNK) % 2, warp, lane)
            gt_before = n_gt + (before & Int32(0xFFFF))
            eq_before = n_eq + (before >> 16)
            for j in cutlass.range_constexpr(_GROUP):
                if (gts[j] == 1) | ((eqs[j] == 1) & (eq_before < remaining)):
                    mOut[t, gt_before + cutlass.min(eq_before, remaining)] = cutlass.select_(
                        keys[j] > Int32(_KEY_NEG_INF), Int64(mSurvIdx[t, e0 + j]) + offset, Int64(-1))
                gt_before = gt_before + gts[j]
                eq_before = eq_before + eqs[j]
            n_gt = n_gt + (total & Int32(0xFFFF))
            n_eq = n_eq + (total >> 16)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def _relu(x: Float32) -> Float32:
    """max(x, 0) that keeps NaN (as torch.relu)."""
    return cutlass.select_(x < Float32(0.0), Float32(0.0), x)


@cute.jit
def _is_nan(x: Float32):
    return (cute_utils.float_bits(x) & Int32(0x7FFFFFFF)) > Int32(0x7F800000)


@cute.jit
def _order_key(x: Float32) -> Int32:
    """An Int32 whose signed order is the score order: NaN and -inf both map to the key of -inf, -0 to +0's."""
    bits = cute_utils.float_bits(x)
    key = cutlass.select_(bits < 0, bits ^ Int32(0x7FFFFFFF), bits)
    key = cutlass.select_(bits == Int32(_INT_MIN), Int32(0), key)  # -0
    return cutlass.select_(_is_nan(x), Int32(_KEY_NEG_INF), key)


@cute.jit
def _digit(key: Int32, rnd: cutlass.Constexpr[int]) -> Int32:
    """Digit ``rnd`` (8 bits, from the top) of ``key`` in unsigned order."""
    return ((key ^ Int32(_INT_MIN)) >> (24 - 8 * rnd)) & Int32(_BINS - 1)


@cute.jit
def _matches(key: Int32, rnd: cutlass.Constexpr[int], prefix: Int32):
    """Whether ``key`` is a key (not padding) whose digits before round ``rnd`` are ``prefix``."""
    live = key != Int32(_PAD)
    if const_expr(rnd > 0):
        live = live & ((((key ^ Int32(_INT_MIN)) >> (32 - 8 * rnd)) & Int32((1 << (8 * rnd)) - 1)) == prefix)
    return live


@cute.jit
def _bin_edges(prefix: Int32, level: Int32):
    """(lowest, highest) key whose top ``level`` bits in unsigned order are ``prefix`` (8 <= level <= 32)."""
    low_bits = 32 - level
    lo = (prefix << low_bits) ^ Int32(_INT_MIN)
    return lo, lo + ((Int32(1) << low_bits) - Int32(1))


@cute.jit
def _warp_inclusive_scan(val: Int32, lane: Int32) -> Int32:
    for off in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(val, offset=1 << off)
        val = val + cutlass.select_(lane >= (1 << off), other, Int32(0))
    return val


@cute.jit
def _warp_reduce(val: Int32, op: cutlass.Constexpr) -> Int32:
    for off in cutlass.range_constexpr(5):
        val = op(val, cute.arch.shuffle_sync_bfly(val, offset=1 << off))
    return val


@cute.jit
def _block_scan(val: Int32, sScan: cute.Tensor, parity: Int32, warp: Int32, lane: Int32):
    """(sum of ``val`` over the threads before this one, over all threads) for a CTA of THREADS threads; one barrier,
    on the half ``parity`` of sScan [2, 32] (alternate it between consecutive calls)."""
    incl = _warp_inclusive_scan(val, lane)
    if lane == 31:
        sScan[parity, warp] = incl
    cute.arch.barrier()
    warp_total = sScan[parity, lane]  # lane l: warp l's sum
    warp_incl = _warp_inclusive_scan(warp_total, lane)
    before = cute.arch.shuffle_sync(warp_incl - warp_total, warp) + incl - val
    return before, cute.arch.shuffle_sync(warp_incl, _SEL_WARPS - 1)


@cute.jit
def _histogram_add(sHist: cute.Tensor, digit: Int32, live):
    """sHist[digit] += 1 for every live lane of the warp: one shared atomic per distinct digit (the lowest lane of
    the lanes that share it adds their count); nothing when no lane is live (most warps after the first round)."""
    if cute.arch.vote_any_sync(live):
        peers = cute.arch.match_sync(-1, cutlass.select_(live, digit, Int32(-1)))
        leader = (peers & cute.arch.lanemask_lt()) == 0
        if live & leader:
            cute.arch.atomic_add(sHist.iterator + digit, Int32(cute.arch.popc(peers)))


@cute.jit
def _pick_digit(sHist: cute.Tensor, sPick: cute.Tensor, slot: cutlass.Constexpr[int], prefix: Int32,
                remaining: Int32, lane: Int32):
    """One warp: the digit d whose bin holds the remaining-th largest key (#keys in higher bins < remaining <= that
    + sHist[d]); sPick[slot:slot + 3] = (prefix extended by d, remaining - #keys in higher bins, sHist[d]). Lane l
    owns bins [8l, 8l + 8)."""
    bins = [sHist[8 * lane + i] for i in range(8)]
    total = cute_utils.tree_sum(bins)
    suffix = total  # becomes the keys in the bins of lanes >= this one
    for off in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_down(suffix, offset=1 << off)
        suffix = suffix + cutlass.select_(lane + (1 << off) < 32, other, Int32(0))
    above = suffix - total
    for i in cutlass.range_constexpr(7, -1, -1):
        if (above < remaining) & (remaining <= above + bins[i]):
            sPick[slot] = (prefix << 8) | (8 * lane + i)
            sPick[slot + 1] = remaining - above
            sPick[slot + 2] = bins[i]
        above = above + bins[i]


def config_reason(heads: int, head_dim: int, n_cap: int, topk: int, cand_block: int, cand_topk_blocks: int,
                  masked: bool) -> str | None:
    """Why the kernels have no build for these sizes and settings (None when they have)."""
    if (heads, head_dim) != (HEADS, HEAD_DIM):
        return f"IH and ihd must be {HEADS} and {HEAD_DIM}, got {heads} and {head_dim}"
    if not 1 <= n_cap <= MAX_COLUMNS:
        return f"Ncap must be in [1, {MAX_COLUMNS}], got {n_cap}"
    for name, k, n in (("topk", min(topk, n_cap), n_cap),
                       ("cand_topk_blocks", min(cand_topk_blocks, -(-n_cap // BLOCK)), -(-n_cap // BLOCK))):
        if k > MAX_K:
            return f"min({name}, {n}) = {k} is above the kernel's {MAX_K}"
    if cand_topk_blocks > 0 and cand_block != BLOCK:
        return f"cand_block must be {BLOCK} in candidate-block mode, got {cand_block}"
    if cand_topk_blocks > 0 and masked:
        return "candidates and cand_topk_blocks > 0 together (no model layer does both)"
    return None


def supports(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_c: torch.Tensor, candidates: torch.Tensor | None,
             *, topk: int, offset: int, cand_block: int, cand_topk_blocks: int, score_scale: float = 1.0,
             return_scores: bool = False) -> str | None:
    """None when the kernels compute ``dsv41::indexer_topk`` (index form) of these arguments, else the reason."""
    if return_scores:
        return "return_scores: the kernel does not write the scores out"
    if score_scale != 1.0:
        return f"score_scale {score_scale!r}: the kernel sums w[t, h] * relu(q . k) with the scale folded into w"
    if q.dim() != 3 or keys.dim() != 3:
        return f"q and keys must be 3-D, got shapes {list(q.shape)} and {list(keys.shape)}"
    (t, heads, head_dim), n_cap = q.shape, keys.shape[1]
    for reason in (shape_reason("q", q, torch.bfloat16, (t, heads, head_dim)),
                   shape_reason("w", w, torch.float32, (t, heads)),
                   shape_reason("keys", keys, torch.bfloat16, (t, n_cap, head_dim)),
                   shape_reason("n_c", n_c, torch.int64, (t,)),
                   None if candidates is None else shape_reason("candidates", candidates, torch.bool, (t, n_cap))):
        if reason is not None:
            return reason
    reason = config_reason(heads, head_dim, n_cap, topk, cand_block, cand_topk_blocks, candidates is not None)
    if reason is not None:
        return reason
    if not -(2**62) < offset < 2**62:
        return f"offset {offset} is outside the kernel's int64 range"
    optional = {} if candidates is None else {"candidates": candidates}
    return hopper_reason(q=q, w=w, keys=keys, n_c=n_c, **optional)


def slice_columns(n: int, k: int) -> int:
    """Columns per slice CTA of a row of n > SINGLE_COLUMNS columns at k: the power of two times 1024 nearest above
    n / TARGET_SLICES, at least 2048 and 2k (so a slice's k-th key filters), at most MAX_SLICE_COLUMNS."""
    want = max(-(-n // TARGET_SLICES), 2 * THREADS, 2 * k)
    return min(1 << (want - 1).bit_length(), MAX_SLICE_COLUMNS)


def select_plan(n: int, k: int) -> tuple[int, int, int]:
    """(keys per thread, slices, rank) of the select of rows of n columns at k: one CTA (slices = 1) up to
    SINGLE_COLUMNS columns, else slices of slice_columns(n, k) and the rank ceil(k / full slices) whose bin each
    full slice reports (module docstring)."""
    if n <= SINGLE_COLUMNS:
        return 1 << max(0, math.ceil(math.log2(-(-n // THREADS)))), 1, 0
    cols = slice_columns(n, k)
    return cols // THREADS, -(-n // cols), -(-k // (n // cols))


@cached_kernel(__file__, cute_utils.__file__)
def _compile_index_score(masked: bool, blocks: bool, pdl: bool):
    t, n = cute.sym_int(), cute.sym_int()
    return compile_tvm_ffi(
        IndexScore(masked, blocks, pdl),
        fake_tensor(BFloat16, (t, HEADS, HEAD_DIM)), fake_tensor(Float32, (t, HEADS), 4),
        fake_tensor(BFloat16, (t, n, HEAD_DIM)), fake_tensor(Int64, (t,), 8),
        fake_tensor(Uint8, (cute.sym_int(), cute.sym_int()), 1), fake_tensor(Float32, (t, n), 4),
        fake_tensor(Float32, (cute.sym_int(), cute.sym_int()), 4), Int32(1), Int32(1), Int32(1), env_stream(),
    )


@cached_kernel(__file__, cute_utils.__file__)
def _compile_topk_select(k: int, per_thread: int, final: bool, pdl: bool):
    t = cute.sym_int()
    return compile_tvm_ffi(
        TopkSelect(k, per_thread, final, pdl),
        fake_tensor(Float32, (t, cute.sym_int()), 4), fake_tensor(Int32, (t, cute.sym_int()), 4),
        fake_tensor(Int32, (t, cute.sym_int()), 4), fake_tensor(Int32, (t, cute.sym_int()), 4),
        fake_tensor(Int64, (t, k), 8), Int64(0), Int32(1), Int32(1), env_stream(),
    )


@cached_kernel(__file__, cute_utils.__file__)
def _compile_topk_merge(k: int, pdl: bool):
    t, c = cute.sym_int(), cute.sym_int()
    return compile_tvm_ffi(
        TopkMerge(k, pdl),
        fake_tensor(Int32, (t, c), 4), fake_tensor(Int32, (t, c), 4), fake_tensor(Int32, (t, cute.sym_int()), 4),
        fake_tensor(Int32, (t, c), 4), fake_tensor(Int32, (t, c), 4), fake_tensor(Int64, (t, k), 8), Int64(0),
        Int32(1), env_stream(),
    )


def compile_scores(masked: bool, blocks: bool, pdl: bool = True):
    """The compiled score launch of a mode (``masked``: candidate-masked; ``blocks``: with the block maxima), from
    memory, disk or a fresh compile."""
    return _compile_index_score(masked, blocks, pdl)


def select_launches(n_cols: int, k: int, pdl: bool = True) -> list:
    """The compiled select launches for rows of ``n_cols`` scores and ``k`` (memory, disk or a fresh compile):
    [single] for one CTA a row, else [slices, merge]."""
    per_thread, slices, _ = select_plan(n_cols, k)
    if slices == 1:
        return [_compile_topk_select(k, per_thread, True, pdl)]
    return [_compile_topk_select(k, per_thread, False, pdl), _compile_topk_merge(k, pdl)]


def select_reason(scores: torch.Tensor, k: int) -> str | None:
    """None when ``topk_indices`` takes these arguments, else the reason it cannot."""
    if scores.dtype != torch.float32 or scores.dim() != 2:
        return f"scores must be a 2-D torch.float32 tensor [T, N], got {scores.dtype} of shape {list(scores.shape)}"
    n = scores.shape[1]
    if not 1 <= n <= MAX_COLUMNS:
        return f"N must be in [1, {MAX_COLUMNS}], got {n}"
    if not 1 <= k <= min(n, MAX_K):
        return f"k must be in [1, min(N, {MAX_K})] = [1, {min(n, MAX_K)}], got {k}"
    return hopper_reason(scores=scores)


def topk_indices(scores: torch.Tensor, k: int, offset: int = 0, *, out: torch.Tensor | None = None,
                 pdl: bool = True) -> torch.Tensor:
    """idx [T, k] int64: per row the k columns of the largest scores (NaN as -inf; equal scores: the lower column
    first), sorted ascending, + offset; -1 where the score is -inf. scores [T, N] fp32 contiguous on a Hopper
    device, 1 <= k <= min(N, 2048), N <= 2^20. ``out`` optionally supplies the output."""
    reason = select_reason(scores, k)
    if reason is not None:
        raise ValueError(f"topk_indices: {reason}")
    t, n = scores.shape
    if out is None:
        out = scores.new_empty((t, k), dtype=torch.int64)
    else:
        reason = shape_reason("out", out, torch.int64, (t, k)) or hopper_reason(scores=scores, out=out)
        if reason is not None:
            raise ValueError(f"topk_indices: {reason}")
    if t == 0:
        return out
    _, slices, rank = select_plan(n, k)
    launches = select_launches(n, k, pdl)
    if slices == 1:
        unused = scores.new_empty((t, 1), dtype=torch.int32)  # no workspace (its rows must still number T)
        launches[0](scores, unused, unused, unused, out, offset, 0, t)
        return out
    # workspace: the slices' candidates, their bounds, the candidates that pass the bound
    cand_key, cand_idx, surv_key, surv_idx = scores.new_empty((4, t, slices * k), dtype=torch.int32).unbind(0)
    bounds = scores.new_empty((t, 2 * slices), dtype=torch.int32)
    launches[0](scores, cand_key, cand_idx, bounds, out, offset, rank, t * slices)
    launches[1](cand_key, cand_idx, bounds, surv_key, surv_idx, out, offset, t)
    return out


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_c: torch.Tensor,
                 candidates: torch.Tensor | None = None, blocks: bool = False, pdl: bool = True):
    """(s [T, Ncap] fp32, bs [T, ceil(Ncap / 8)] fp32 or None): the score kernel (module docstring); arguments as
    ``supports`` takes them."""
    t, n_cap = keys.shape[0], keys.shape[1]
    scores = q.new_empty((t, n_cap), dtype=torch.float32)
    block_max = q.new_empty((t, -(-n_cap // BLOCK)) if blocks else (1, 1), dtype=torch.float32)
    cand = (candidates if candidates is not None else scores.new_empty((1, 1), dtype=torch.bool)).view(torch.uint8)
    if t > 0:
        rounds = min(_MAX_ROUNDS, max(1, t * n_cap // (_ROUND_COLS * _TARGET_CTAS)))
        ctas_per_row = -(-n_cap // (rounds * _ROUND_COLS))
        compile_scores(candidates is not None, blocks, pdl)(q, w, keys, n_c, cand, scores, block_max, rounds,
                                                           ctas_per_row, t * ctas_per_row)
    return scores, block_max if blocks else None


def indexer_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_c: torch.Tensor,
                 candidates: torch.Tensor | None, *, topk: int, offset: int, cand_block: int, cand_topk_blocks: int,
                 out: torch.Tensor | None = None, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx [T, K] int64, cand [T, Ncap] bool or [T, 0]) = ``dsv41::indexer_topk`` in its index form (module
    docstring; sizes as ``supports`` accepts them). ``out`` optionally supplies idx."""
    reason = supports(q, w, keys, n_c, candidates, topk=topk, offset=offset, cand_block=cand_block,
                      cand_topk_blocks=cand_topk_blocks)
    if reason is not None:
        raise ValueError(f"indexer_topk: {reason}")
    t, n_cap = keys.shape[0], keys.shape[1]
    scores, block_max = index_scores(q, w, keys, n_c, candidates, cand_topk_blocks > 0, pdl)
    idx = topk_indices(scores, min(topk, n_cap), offset, out=out, pdl=pdl)
    if cand_topk_blocks == 0:
        return idx, q.new_empty((t, 0), dtype=torch.bool)
    n_blocks = block_max.shape[1]
    chosen = topk_indices(block_max, min(cand_topk_blocks, n_blocks), pdl=pdl)
    keep = torch.zeros((t, n_blocks + 1), dtype=torch.bool, device=q.device)
    keep.scatter_(1, torch.where(chosen >= 0, chosen, n_blocks), True)
    return idx, keep[:, :n_blocks].repeat_interleave(BLOCK, dim=1)[:, :n_cap]
