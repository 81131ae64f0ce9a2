"""The sparse-attention indexer (spec section 2.4): ``dsv41::indexer_topk`` as a score kernel and an exact top-K.

q [T, 32, 128] bf16, w [T, 32] fp32, keys [T, Ncap, 128] bf16, n_c [T] int64, candidates [T, Ncap] bool or None:

    s[t, n]  = sum_h w[t, h] * relu(q[t, h] . keys[t, n])        fp32; -inf where n >= n_c[t], where
               (candidate-masked mode) not candidates[t, n], and where the sum is NaN              [T, Ncap]
    idx[t]   = the K = min(topk, Ncap) columns of the largest s[t, n] (equal scores: the lower index first),
               sorted ascending, + offset; -1 where s is -inf (fewer than K valid columns)          [T, K] int64

``IndexScore`` (launch 1) writes s to an fp32 workspace, reading the bf16 keys of the visible columns once: CTA
(t, j) of P a row (``score_grid``: one wave of CTAs when T <= 3 x SMs) takes ``rounds`` rounds of 128 consecutive
columns of row t, round r the columns (r * P + j) * 128 + [0, 128), so that the visible columns [0, n_c) are spread
over all P CTAs whatever n_c is (a key cache sized for a long max_context holding a shorter sequence), each of its 4
warps 32 columns per round as 4 tiles of 8. No key at or past n_c is read: a tile past it stores -inf (and a -inf
block maximum) without loads or MMAs. A warp holds all 32 heads of q[t] in registers as the A operand of
``mma.sync.m16n8k16`` (two 16-head tiles, bf16 in, fp32 accumulation: the bf16 x bf16 products are exact in fp32)
and streams the keys as the B operand, 16-byte vectors
in the column relabelling of ``dsv41.kernels.moe_route`` (lane (r, q) = (lane / 4, lane % 4) loads columns [8q,
8q + 8) of each 32-wide chunk of key row r of the tile). Summation order: the 128-term dot products in the MMA's
order, then per column the 4 heads a lane holds, then a butterfly over the 8 lanes holding the other heads; the
reference (cuBLAS) sums in another order, so scores agree to a few fp32 ulps of sum_h |w_h| |q_h . k|, not bit for
bit. In candidate-block mode (layer 20) the same kernel writes each 8-column block's maximum (a tile is a block),
the newest block (n_c - 1) // 8 pinned to +inf, to a second workspace bs [T, ceil(Ncap / 8)].

The select is an exact radix select on order-preserving 32-bit keys (NaN and -inf share the lowest key of a score;
-0 = +0), 8-bit digits from the top: a round builds a 256-bin histogram of the keys matching the digits chosen so
far and picks the digit of the bin holding the remaining take-th largest. The rounds stop as soon as that bin holds
exactly the keys still to take (rows of distinct scores stop after 2 or 3 of the 4), which leaves the bin [lo, hi]
(the keys with the chosen top bits) and how many of its keys to take. A collection pass keeps every key > hi and the
first keys in [lo, hi] in column order, placing each at (keys > hi before it) + min(bin keys before it, needed): the
output comes out sorted by column, ties broken by the lower column.

``TopkSelect`` (launch 2; the last of 3 on the sampled path below) runs it for a row of N <= 4096 columns on one
CTA of 1024 threads that holds the row's keys in registers (4 consecutive columns a thread): every round's
histogram from the registers, one collection step. A wider row runs on one thread-block cluster of ``cluster_n``
CTAs of 1024 threads: ceil(N / 4096) CTAs, at most 16 (Hopper's non-portable cluster size; ``select_plan``), CTA r
of the cluster owning the span of columns [r * span, (r + 1) * span), span = ceil(N / cluster_n) <= 65536. Why a
cluster: the design it replaces (about 128 slice CTAs a row, then one merge CTA streaming their 128 x K candidates
from global memory twice) spent most of its time in that one serial CTA (ncu at base clocks, 2^19 columns: slices
11.5 us, merge 51.0); in a cluster every CTA works on its own columns until the end, the only serial steps are
256-bin sums, and no candidates travel through global memory. Spans of at most MAX_RESIDENT_SPAN = 8192 columns
(rows up to 2^17: capacity 4096 or 8192) are held in registers, 4 or 8 consecutive keys a thread as on one CTA
(``select_cluster_registers``): every round's histogram from the registers, the cluster sum of each round as below,
one collection step. Wider spans: why 16-bit prefixes on chip: the full keys of a 2^20-wide row do not fit in 16
SMs' shared memory (256 KB a CTA), their top 16 bits do (128 KB), and they decide rounds 0 and 1 and nearly every
key of the collection.
- Pass 1 reads the CTA's scores from global memory once (coalesced, 8 unpredicated loads in flight a thread, the
  last column's again past the span), stores each key's top 16 bits (unsigned order) in shared memory and builds
  round 0's histogram (predicated shared increments, ``_histogram_add``).
- A round: each CTA's histogram of its keys matching the prefix so far (round 1 from the shared prefixes; rounds 2
  and 3 re-read from global memory, L2-resident after the score kernel, the full key of each key whose 16-bit
  prefix matches: a few dozen for random scores, every key for a constant row); a cluster barrier (release /
  acquire); the 256 bins summed over the cluster's CTAs through DSMEM (``ld.shared::cluster``), so every CTA picks
  the same digit and stops after the same round; the same reads give the bins of the CTAs before this one, whose
  counts above the picked digit add up, over the rounds, to the keys > hi in those CTAs, and whose count at the
  last digit is their keys in [lo, hi]. Two histogram buffers alternate, so one cluster barrier a round suffices
  (a buffer is cleared only after every peer has passed the next barrier, i.e. finished reading it).
- The collection pass over the CTA's prefixes (8 consecutive elements a thread, a block scan a chunk of 8192)
  starts from those counts of the earlier CTAs, so the CTAs write disjoint output positions in global column order.
  A key whose prefix is above (below) the top 16 bits of the bin's keys is above (below) the bin; when the bin is
  16 bits wide or wider its prefix decides too; only when the bin is narrower (level 24 or 32) and the prefix is
  the bin's is the full key re-read. A final cluster barrier keeps every CTA's shared memory alive until its
  peers' last reads.
Exactness: the cluster histogram of a round is the row's histogram of the keys matching the prefix, so the rounds
pick the bin of the row's K-th largest key as one CTA over the whole row would; every key > hi and the first
`remaining` keys of [lo, hi] in column order are taken (the tie rule), at a position counted over all keys before
it in column order (the earlier CTAs' counts + the block scans). No CTA waits on another outside its cluster (no
cooperative launch, no spin barrier, no global atomics), so the launch is CUDA-graph capturable and
bit-deterministic. The test file's numpy model of these steps is checked against the tie rule and torch.topk on
the CPU.

The sampled path (``topk_indices``' default for N > SAMPLED_MIN_COLUMNS = 2^17, where it measured faster;
path="cluster" forces the cluster alone) puts a filter over the whole GPU before the select, so the select sees a
few thousand candidates instead of the row (the cluster select is instruction-bound on its 16 SMs: ncu, about 25
SASS a key in pass 1 and 60 in the collection):
- Threshold: tau = the lowest key of the bin the register select (the one-CTA rounds, ``_register_select``) stops
  at for the j-th largest of M sampled keys, columns i * floor(N / M), i < M; tau <= that sampled key (equal after
  4 rounds), and tau is raised above -inf's key, so -inf and NaN are never candidates. ``sample_plan(N, K)``
  picks M in SAMPLE_SIZES (1024, 2048, 4096) and j so that the expected candidate count j * N / M is a few K:
  treating the sample as M independent draws, the path misses when j samples fall among the K - 1 keys above the
  row's K-th largest (P(Bin(M, (K - 1) / N) >= j): too few candidates) or fewer than j among its CANDIDATES = 8192
  largest (P(Bin(M, 8192 / N) < j): too many); the fewest samples, then the smallest j, with the sum <=
  MISS_TARGET = 1e-9, else M = 4096 and the j of the smallest sum (``sample_miss``). K = 512: M = 1024, j = 31 at
  65536 columns (expected 1984 candidates); M = 4096, j = 22 at 524288 (2816, miss 6e-10); M = 4096, j = 11 at
  2^20 (2816, miss 1.3e-5: the sample holds about 2 of the top 512). K = 2048 at 131072 blocks: M = 4096, j = 118
  (3776). Rows whose order follows the stride (or constant rows, crowded ties) miss more often; they only cost the
  fallback's time.
- ``CandidateFilter`` (launch 2 of 3): grid T x P CTAs of 1024 threads (``sampled_plan``: P = one CTA an SM shared
  by the rows, at most one a 8192-column chunk; P = 64 at 524288 columns, 128 at 2^20, 1 CTA a row when T >= the
  SMs). Every CTA computes the row's tau itself from the same sample, so all agree bit for bit: its M / 1024 sample
  loads a thread and its first chunk's 8 loads are issued before the rounds, which thus overlap the CTA's own reads,
  where a separate tau launch (one CTA a row) would add a launch boundary (the filter's griddepcontrol.wait on it)
  and could not overlap the row's reads with the rounds; the price is M scattered L2 reads a CTA (a wave of CTAs: P
  x M 32-byte sectors, 8 MB at P = 64 and M = 4096), not measured yet against the alternative. A chunk: 8
  consecutive columns a thread (8 scalar loads, as a row's start need not be 16-byte aligned: a warp's 8 loads touch
  the same 32 sectors, the 7 after the first expected to hit L1, not measured yet), their keys >= tau counted, one
  block scan, each candidate's column and key to slot (the CTA's candidates before it) of the CTA's segment of
  mCols, mKeys [T, P * seg] (no atomics: the CTA owns its segment, written in column order); slots past seg =
  min(width, 8192) are dropped (that CTA alone exceeds CANDIDATES, so the row falls back); the full count to mCounts
  [T, P].
- ``TopkSelect(sampled=True)`` (launch 3): the cluster build, every CTA of a row's cluster first summing mCounts
  (the same total in all): if K <= total <= CANDIDATES the rank-0 CTA gathers candidate i (column order) from the
  non-empty segment whose first candidate is the last <= i (a thread's 8 consecutive candidates: one binary
  search over the non-empty segments' prefix sums in shared memory, then at most a step each), 8 a thread in
  registers (_PAD past the total), runs the register select for the K-th largest candidate and one
  collection step that writes each taken candidate's column, and the cluster's other CTAs exit; otherwise the
  whole cluster runs the cluster select above on the scores (the decision is uniform over the cluster, so its
  barriers match). Three launches, no host decision: CUDA-graph capturable, bit-deterministic. The filter lets
  the select launch (griddepcontrol.launch_dependents) as soon as its own wait returns, so the select's CTAs can
  take the SMs the filter leaves free and wait there (their griddepcontrol.wait still waits for the whole filter
  grid and its writes); what that saves is not measured yet.
Exactness: let S be the columns whose key is >= tau and above -inf's. Every column in S has a key strictly greater
than every column outside S (outside: key < tau or the lowest key), so when |S| >= K the first K columns of the
row in the select's order (key descending, lower column first) all lie in S, and that order restricted to S is the
order among the candidates, which the select receives in column order; its top K of S is the row's top K (none
-inf, so no -1). When |S| < K (misses, rows with fewer than K valid scores, N_c small) or |S| > CANDIDATES (constant
rows, many ties at tau) the cluster computes the row's result itself. The numpy model of the filter, the gather and
the fallback is checked against the tie rule on the CPU, including forced misses.

Candidate-block mode selects min(cand_topk_blocks, ceil(Ncap / 8)) blocks from bs with the same select kernel
(K = 2048, no offset) and expands the chosen blocks to the [T, Ncap] bool mask in torch.

Resources (ptxas for sm_90a, CUDA 13.0's ptxas -v on the PTX the DSL emits, CUTE_DSL_KEEP=ptx): the score kernel
takes 168 registers (3 CTAs of 128 threads per SM); the cluster select 55 (at most 64 for 1024 threads), no spills,
and 2 * capacity bytes + 4.3 KB of shared memory (132 KB at capacity 65536: one CTA an SM); the one-CTA select 43
(41 before it shared its rounds with the sampled path, ``_register_select``) and 2.3 KB; the sampled build of the
cluster select 58, no spills, 1 KB more shared memory; the candidate filter 54 and 2.3 KB. SASS (nvdisasm) of the
cluster select's loops, instructions per 8 keys a thread: pass 1 199, round 1 101, collection 470 (the build before
had 338, 152 and 544: per-key branches around loads and match.any); the candidate filter's chunk (CUDA 13.0 ptxas,
nvdisasm 13.5): 192 without candidates (24 a key: 8 scalar loads, keys, the block scan), 215 more in a thread
holding candidates; the candidates' select, per thread: the gather of its 8 candidates 252 (skipped past the total),
a round 178 to 212 (8 keys' histogram and the pick), the collection at most 296.

Session 13 (H200, 2026-12-02, one run, ``benchmarks/results/kernels_s13_indexer_experiments_h200.json``, T = 1,
k = 512, the op and its parts against this file's previous build in the same process): the register cluster took
the select at 65536 columns from 10.66 to 7.63 us (``torch.topk`` 46.16: 6.05x) and the op from 20.10 to 17.38; a
key cache of 524288 columns with 1/8 visible went from 52.39 to 28.57 us (the scores 38.43 -> 14.25), 2^20 with
1/16 visible from 85.33 to 33.84; all rows visible, the round-robin rounds cost 0.2 to 0.4 us of the score kernel
(524288: 38.61 -> 39.02; 4096: 4.22 -> 4.41; the op 8.30 -> 8.49 at 4096). Tried and dropped in the same session
(``kernels_s13_indexer_prefetch_dropped_h200.json``): one thread a CTA issuing ``cp.async.bulk.prefetch.L2`` of
its next 1, 2 or 3 rounds' keys (32 KB each) made the op slower at every wide width (524288: 52.57 without, 66.94
/ 69.11 / 74.52 with; 2^20: 85.01 against 108.29 / 111.18 / 121.01), and clusters of 8, 4 or 2 CTAs of wider
spans at 65536 columns were slower than 16 (13.63 / 16.73 / 24.85 against 10.78 us on the prefix build).

Measured on the H200 (2026-12-02, ``benchmarks/results/kernels_s11_indexer.json``, T = 1, k = 512, scores from the
score kernel on random q and keys, all columns visible, under CUDA graphs), the select alone at 65536 / 2^17 / 2^18 /
524288 / 2^20 columns: the sampled path 12.19 (an earlier run) / - / 13.03 / 14.40 / 14.50 us, the cluster alone
11.39 / 11.71 / 16.53 / 26.07 / 45.48, ``torch.topk`` 45.44 / 51.73 / 62.64 / 84.23 / 110.42; the op (score + select)
52.87 us at 524288 and 86.47 at 2^20 (the keys' read floor 33.5 and 67.0). The sampled path's time is nearly flat in
N (its filter reads the row once over the whole GPU); below 2^17 its three launches' chain is slower than one
cluster launch, hence SAMPLED_MIN_COLUMNS. The prices marked "not measured yet" above were not measured apart.

Tried and dropped (session 12, commit 53f6b17, reverted): the filter launch folded into the score kernel. A pre-pass
(one cluster a row) scored the sampled columns with the score kernel's code and computed tau; the score kernel, a
PDL dependent of it, wrote every score and, after its wait, each CTA's keys >= tau to its own segment; the sampled
select then chose among up to 1024 segments. Exact (its GPU tests passed: 15 of the path, 355 of the existing ones;
memcheck 0 errors) but **slower at every width**: the op 24.44 / 29.34 / 58.10 / 91.99 us at 65536 / 2^17 / 524288 /
2^20 columns against this path's 19.88 / 24.77 / 52.19 / 84.36 in the same run (H200, T = 1, k = 512,
``benchmarks/results/kernels_s12_dropped_indexer_fused.json``): the pre-pass sits on the critical path (it must wait
for the upstream kernel before it can score, and the score kernel waits for it) and costs more than the filter
launch it removes. racecheck also reported 100 potential shared-memory writes into a peer CTA that "might not have
entered yet" in the pre-pass (its CTAs wrote their sampled keys to the first CTA's shared memory without a cluster
barrier first), a bug of that attempt, not of the paths above.
"""

from __future__ import annotations

import functools
import itertools
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
CTA_COLUMNS = 4096  # columns a select CTA takes before a row's cluster grows
MAX_CLUSTER = 16  # CTAs of a row's select cluster (Hopper's non-portable maximum)
MAX_SPAN = MAX_COLUMNS // MAX_CLUSTER  # the most columns of one select CTA (their prefixes: 128 KB of shared memory)
MAX_RESIDENT_SPAN = 2 * CTA_COLUMNS  # the widest span a cluster CTA holds in registers (8 keys a thread)
_WARPS = 4  # per score CTA
_TILE = 8  # key columns per MMA (its N)
_TILES = 4  # MMA tiles per warp per round
_ROUND_COLS = _WARPS * _TILES * _TILE  # 128 columns per CTA round
SCORE_CTAS_PER_SM = 3  # resident score CTAs an SM: 168 registers x 128 threads (ptxas, below)
_CHUNKS = HEAD_DIM // 32  # 32-column chunks of a head: 4 lanes x one 16-byte vector each
_VEC = 8  # bf16 per 16-byte vector
_SEL_WARPS = THREADS // 32
_BINS = 256
_ROUNDS = 4  # of 8-bit digits, at most
_GROUP = 8  # elements per select thread and pass step (8 prefixes: one 16-byte shared load)
_RESIDENT = CTA_COLUMNS // THREADS  # keys a thread of the one-CTA (capacity 0) select holds in registers
_CHUNK = _GROUP * THREADS  # elements per select pass step
_INT_MIN = -(2**31)
_PAD = _INT_MIN  # the key of an element past a CTA's columns: below every score's key
_KEY_NEG_INF = -(0x7F800000) - 1  # the key of -inf (and NaN): the float bits 0xFF800000 ^ 0x7FFFFFFF
SAMPLE_SIZES = (THREADS, 2 * THREADS, 4 * THREADS)  # strided scores a row's sampled threshold may take (sample_plan)
CANDIDATES = _GROUP * THREADS  # the most candidates the sampled path selects from (8 a thread of one CTA)
MAX_SEGMENTS = MAX_COLUMNS // _CHUNK  # filter CTAs a row: each at least one chunk of _CHUNK columns
SAMPLED_MIN_COLUMNS = 1 << 17  # path "auto": rows wider take the sampled path, narrower ones the cluster (below)
MISS_TARGET = 1e-9  # sample_plan: the binomial miss probability under which fewer samples and candidates win


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
        stride = ctas_per_row * _ROUND_COLS  # round rnd of the CTA: columns col0 + rnd * stride + [0, 128)
        col0 = (cta % ctas_per_row) * _ROUND_COLS
        n_cap = mKeys.shape[1]
        vec = (_VEC,)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        n_c = Int32(cutlass.max(cutlass.min(mNc[t], Int64(n_cap)), Int64(-1)))
        n_read = cutlass.max(n_c, Int32(0))  # the columns whose keys are read: the others score -inf

        # A operand: a[m][h][c] = the 4 bf16 pairs of head 16m + 8h + r in chunk c; w of the same heads
        a = [[cute_utils.load_bf16_pairs(cute.tiled_divide(mQ[t, 16 * m + 8 * h + r, None], vec)[None, 4 * c + q])
              for c in range(_CHUNKS)] for m in range(2) for h in range(2)]
        w = [mW[t, 16 * m + 8 * h + r] for m in range(2) for h in range(2)]

        for rnd in cutlass.range(rounds):
            base = col0 + rnd * stride + warp * (_TILES * _TILE)
            b_tiles = []  # every tile's B operand, requested before the first MMA (none past n_c: zeros)
            for i in cutlass.range_constexpr(_TILES):
                n = base + i * _TILE + r
                gK = cute.tiled_divide(mKeys[t, cutlass.min(n, n_cap - 1), None], vec)
                b_tiles.append([cute_utils.load_bf16_pairs(gK[None, 4 * c + q], n < n_read) for c in range(_CHUNKS)])
            for i in cutlass.range_constexpr(_TILES):
                n0 = base + i * _TILE
                if n0 < n_cap:  # warp-uniform
                    if n0 < n_read:
                        self.tile(t, n0, n_cap, n_c, q, a, w, b_tiles[i], mCand, mScores, mBlocks)
                    else:
                        self.hidden_tile(t, n0, n_cap, q, mScores, mBlocks)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def hidden_tile(self, t: Int32, n0: Int32, n_cap: Int32, q: Int32, mScores: cute.Tensor, mBlocks: cute.Tensor):
        """A tile of columns [n0, n0 + 8) at or past n_c (one warp): -inf scores, stored as ``tile`` stores them, and
        -inf block maximum (never the newest block, which holds column n_c - 1), without its keys or MMAs."""
        lane = cute.arch.lane_idx()
        for e in cutlass.range_constexpr(2):
            col = n0 + 2 * q + e
            if (lane < 4) & (col < n_cap):
                mScores[t, col] = Float32(-math.inf)
        if const_expr(self.blocks):
            if lane == 0:
                mBlocks[t, n0 // BLOCK] = Float32(-math.inf)

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
    """The exact top-``k`` of rows of scores: one thread-block cluster of ``cluster_n`` CTAs per row (module
    docstring), each CTA ``span`` consecutive columns of the row (its cluster rank r: columns [r * span, (r + 1) *
    span)), their 16-bit key prefixes in ``capacity`` >= span slots of shared memory; ``capacity`` 0: one CTA a row of
    at most CTA_COLUMNS columns, its keys in registers (_RESIDENT consecutive columns a thread), no cluster.
    ``sampled`` (a cluster build): the last launch of the sampled path, which first sums the row's candidate counts
    mCounts [T, P] of ``CandidateFilter``; when k <= total <= CANDIDATES (every CTA of the cluster sees the same sum)
    the cluster's rank-0 CTA selects among the candidates (mCols, mKeys [T, P * seg]: segment p holds CTA p's) and
    the other CTAs exit, else the cluster selects from the scores as the plain build does. Writes mOut [T, k] int64.
    """

    def __init__(self, k: int, capacity: int, pdl: bool, sampled: bool = False):
        self.k = k
        self.capacity = capacity
        self.resident = capacity == 0
        # a cluster whose spans fit registers: capacity / THREADS (4 or 8) keys a thread, rows of N <= 2^17
        self.resident_cluster = CTA_COLUMNS <= capacity <= MAX_RESIDENT_SPAN
        self.pdl = pdl
        self.sampled = sampled
        if sampled and self.resident:
            raise ValueError("TopkSelect: sampled needs a cluster build (capacity > 0)")

    @cute.jit
    def __call__(self, mScores: cute.Tensor, mOut: cute.Tensor, mCounts: cute.Tensor, mCols: cute.Tensor,
                 mKeys: cute.Tensor, offset: Int64, cluster_n: Int32, span: Int32, seg: Int32, n_ctas: Int32, stream):
        if const_expr(self.resident):
            self.kernel(mScores, mOut, mCounts, mCols, mKeys, offset, cluster_n, span, seg).launch(
                grid=[n_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)
        else:
            self.kernel(mScores, mOut, mCounts, mCols, mKeys, offset, cluster_n, span, seg).launch(
                grid=[n_ctas, 1, 1], block=[THREADS, 1, 1], cluster=[cluster_n, 1, 1], stream=stream,
                use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mScores: cute.Tensor, mOut: cute.Tensor, mCounts: cute.Tensor, mCols: cute.Tensor,
               mKeys: cute.Tensor, offset: Int64, cluster_n: Int32, span: Int32, seg: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        rank = Int32(0)
        if const_expr(not self.resident):
            rank = Int32(cute.arch.block_idx_in_cluster())
        smem = cutlass.memory.SmemAllocator()
        sHist, sScan, sPick = _select_smem(smem, tidx)
        sTotal = None
        sPrefix = None
        if const_expr(not self.resident):
            sTotal = smem.allocate_tensor(Int32, cute.make_layout((_BINS, 2)), byte_alignment=16)  # cluster sums
            if const_expr(not self.resident_cluster):
                sPrefix = smem.allocate_tensor(cutlass.Uint16, cute.make_layout(self.capacity), byte_alignment=16)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        t = cta // cluster_n
        gRow = mScores[t, None]
        cute.arch.barrier()

        if const_expr(self.resident):
            keys, _ = _resident_keys(gRow, Int32(0), cutlass.min(mScores.shape[1], span), _RESIDENT, tidx)
            lo, hi, remaining = _register_select(keys, Int32(self.k), sHist, sPick, tidx, warp, lane)
            self.collect(keys, [tidx * _RESIDENT + j for j in range(_RESIDENT)], Int32(0), Int32(0), Int32(0), lo,
                         hi, remaining, mOut, t, offset, sScan, warp, lane)
            if const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
        elif const_expr(self.sampled):
            # the row's candidate count (every CTA of the cluster the same sum) and, for the r-th non-empty segment,
            # its index sSegs[0, r] and first candidate sSegs[1, r] (strictly increasing in r)
            sSegs = smem.allocate_tensor(Int32, cute.make_layout((2, MAX_SEGMENTS)), byte_alignment=16)
            mine = Int32(0)
            if tidx < mCounts.shape[1]:
                mine = mCounts[t, tidx]
            before, total = _block_scan(mine, sScan, Int32(1), warp, lane)
            r, n_filled = _block_scan(cutlass.select_(mine > 0, Int32(1), Int32(0)), sScan, Int32(0), warp, lane)
            if mine > 0:
                sSegs[0, r] = tidx
                sSegs[1, r] = before
            cute.arch.barrier()
            if (total >= self.k) & (total <= CANDIDATES):  # cluster-uniform
                if rank == 0:
                    self.select_candidates(total, n_filled, seg, sSegs, mCols, mKeys, mOut, t, offset, sHist, sScan,
                                           sPick, tidx, warp, lane)
            else:
                self.select_cluster(gRow, mScores.shape[1], rank, cluster_n, span, offset, mOut, t, sHist, sTotal,
                                    sPrefix, sScan, sPick, tidx, warp, lane)
        else:
            self.select_cluster(gRow, mScores.shape[1], rank, cluster_n, span, offset, mOut, t, sHist, sTotal,
                                sPrefix, sScan, sPick, tidx, warp, lane)

    @cute.jit
    def select_candidates(self, total: Int32, n_filled: Int32, seg: Int32, sSegs: cute.Tensor, mCols: cute.Tensor,
                          mKeys: cute.Tensor, mOut: cute.Tensor, t: Int32, offset: Int64, sHist: cute.Tensor,
                          sScan: cute.Tensor, sPick: cute.Tensor, tidx: Int32, warp: Int32, lane: Int32):
        """The sampled path's select on one CTA: candidate i (of ``total`` <= CANDIDATES, in column order) is entry
        i - sSegs[1, r] of segment sSegs[0, r], r the last of the ``n_filled`` non-empty segments with sSegs[1, r]
        <= i; thread tidx holds candidates [_GROUP * tidx, _GROUP * tidx + _GROUP) in registers (_PAD past the
        total): r by a binary search for the first, then at most one step a candidate (a non-empty segment holds at
        least one); the register select and one collection step run over them, each key's column from mCols."""
        i0 = tidx * _GROUP
        keys = [Int32(_PAD)] * _GROUP
        cols = [Int32(0)] * _GROUP
        if i0 < total:  # the threads past the candidates hold _PAD only
            keys, cols = self.gather(i0, total, n_filled, seg, sSegs, mCols, mKeys, t)
        lo, hi, remaining = _register_select(keys, Int32(self.k), sHist, sPick, tidx, warp, lane)
        self.collect(keys, cols, Int32(0), Int32(0), Int32(0), lo, hi, remaining, mOut, t, offset, sScan, warp, lane)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def gather(self, i0: Int32, total: Int32, n_filled: Int32, seg: Int32, sSegs: cute.Tensor, mCols: cute.Tensor,
               mKeys: cute.Tensor, t: Int32):
        """(keys, cols) of candidates [i0, i0 + _GROUP) (_PAD, 0 past the total; ``select_candidates``)."""
        keys = []
        cols = []
        r = Int32(0)
        for step in cutlass.range_constexpr(MAX_SEGMENTS.bit_length() - 2, -1, -1):  # binary search
            probe = r + (1 << step)
            r = cutlass.select_((probe < n_filled) & (sSegs[1, cutlass.min(probe, MAX_SEGMENTS - 1)] <= i0), probe, r)
        for j in cutlass.range_constexpr(_GROUP):
            i = i0 + j
            if const_expr(j > 0):
                step_on = (r + 1 < n_filled) & (sSegs[1, cutlass.min(r + 1, MAX_SEGMENTS - 1)] <= i)
                r = cutlass.select_(step_on, r + 1, r)
            slot = sSegs[0, r] * seg + cutlass.min(i - sSegs[1, r], seg - 1)
            key = Int32(_PAD)
            col = Int32(0)
            if i < total:
                key = mKeys[t, slot]
                col = mCols[t, slot]
            keys.append(key)
            cols.append(col)
        return keys, cols

    @cute.jit
    def select_cluster(self, gRow: cute.Tensor, n: Int32, rank: Int32, cluster_n: Int32, span: Int32, offset: Int64,
                       mOut: cute.Tensor, t: Int32, sHist: cute.Tensor, sTotal: cute.Tensor, sPrefix,
                       sScan: cute.Tensor, sPick: cute.Tensor, tidx: Int32, warp: Int32, lane: Int32):
        """The cluster's select of its row (module docstring), CTA ``rank`` on columns [rank * span, ...): from
        registers when a span fits them (``resident_cluster``), else through the shared prefixes."""
        if const_expr(self.resident_cluster):
            self.select_cluster_registers(gRow, n, rank, cluster_n, span, offset, mOut, t, sHist, sTotal, sScan,
                                          sPick, tidx, warp, lane)
        else:
            self.select_cluster_prefixes(gRow, n, rank, cluster_n, span, offset, mOut, t, sHist, sTotal, sPrefix,
                                         sScan, sPick, tidx, warp, lane)

    @cute.jit
    def select_cluster_registers(self, gRow: cute.Tensor, n: Int32, rank: Int32, cluster_n: Int32, span: Int32,
                                 offset: Int64, mOut: cute.Tensor, t: Int32, sHist: cute.Tensor, sTotal: cute.Tensor,
                                 sScan: cute.Tensor, sPick: cute.Tensor, tidx: Int32, warp: Int32, lane: Int32):
        """The cluster select of a span of at most ``capacity`` <= MAX_RESIDENT_SPAN columns: thread tidx holds the
        keys of the CTA's columns [r * tidx, r * tidx + r), r = capacity / THREADS, in registers, as the one-CTA
        select does, so no pass writes prefixes and no round or collection re-reads global memory; the rounds end as
        the prefix build's do (``_cluster_pick``), and one collection step writes the CTA's keys."""
        per_thread = self.capacity // THREADS
        first = rank * span
        keys, lives = _resident_keys(gRow, first, cutlass.max(cutlass.min(n - first, span), Int32(0)), per_thread,
                                     tidx)
        prefix, remaining, level, done, gt_before, eq_before = _first_round_state(self.k)
        for rnd in cutlass.range_constexpr(_ROUNDS):
            if done == 0:
                _histogram_add(sHist[None, rnd % 2], [_digit(key, rnd) for key in keys],
                               [_matches(key, rnd, prefix) & live for key, live in zip(keys, lives)])
                prefix, remaining, done, gt_before, eq_before = _cluster_pick(
                    rnd, rank, cluster_n, prefix, remaining, gt_before, sHist, sTotal, sPick, tidx, warp, lane)
                level = Int32(8 * (rnd + 1))
        cute.arch.cluster_arrive()  # the peers' histogram reads are done; matched by the wait before the exit
        lo, hi = _bin_edges(prefix, level)
        self.collect(keys, [first + tidx * per_thread + j for j in range(per_thread)], Int32(0), gt_before,
                     eq_before, lo, hi, remaining, mOut, t, offset, sScan, warp, lane)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        cute.arch.cluster_wait()

    @cute.jit
    def select_cluster_prefixes(self, gRow: cute.Tensor, n: Int32, rank: Int32, cluster_n: Int32, span: Int32,
                                offset: Int64, mOut: cute.Tensor, t: Int32, sHist: cute.Tensor, sTotal: cute.Tensor,
                                sPrefix: cute.Tensor, sScan: cute.Tensor, sPick: cute.Tensor, tidx: Int32, warp: Int32,
                                lane: Int32):
        """The cluster select through the shared 16-bit prefixes (module docstring)."""
        first = rank * span  # the CTA's first column
        count = cutlass.max(cutlass.min(n - first, span), Int32(0))  # its columns
        groups = cute.tiled_divide(sPrefix, (_GROUP,))  # thread-owned runs of _GROUP consecutive slots
        # Pass 1 (global, coalesced: element e = base + j * THREADS + thread): each key's top 16 bits (unsigned
        # order) to shared memory, and round 0's histogram.
        for base in cutlass.range(0, count, _CHUNK):
            # the _GROUP loads unpredicated (past the columns: the last column's again), so all are in flight
            keys = [_order_key(gRow[first + cutlass.min(base + j * THREADS + tidx, count - 1)]) for j in range(_GROUP)]
            lives = [base + j * THREADS + tidx < count for j in range(_GROUP)]
            for j in cutlass.range_constexpr(_GROUP):
                if lives[j]:
                    sPrefix[base + j * THREADS + tidx] = cutlass.Uint16(_top16(keys[j]))
            _histogram_add(sHist[None, 0], [_digit(key, 0) for key in keys], lives)

        # Radix select, 8-bit digits from the top, over the cluster: a round's histograms (one per CTA, of its keys
        # matching the digits chosen so far) are summed through DSMEM after a cluster barrier, so every CTA picks
        # the same digit; `prefix` = the top `level` bits of the take-th largest key, `remaining` = how many keys
        # with those bits are still to take; the rounds stop once they are all of that bin's keys. `gt_before`,
        # `eq_before`: the keys above the bin and in it of the CTAs before this one (in column order).
        prefix, remaining, level, done, gt_before, eq_before = _first_round_state(self.k)
        for rnd in cutlass.range_constexpr(_ROUNDS):
            if done == 0:
                if const_expr(rnd > 0):
                    for base in cutlass.range(0, count, _CHUNK):
                        e0 = base + tidx * _GROUP
                        tops = self.prefixes(groups, e0)
                        digits = []
                        lives = []
                        for j in cutlass.range_constexpr(_GROUP):
                            if const_expr(rnd == 1):
                                live = (tops[j] >> 8) == prefix
                            else:
                                live = tops[j] == (prefix >> (8 * rnd - 16))
                            live = live & (e0 + j < count)
                            digit = tops[j] & Int32(_BINS - 1)
                            if const_expr(rnd > 1):  # the lower 16 bits: the full key, from global memory (L2)
                                raw = Float32(-math.inf)  # the load alone under the branch: ptxas predicates it
                                if live:
                                    raw = gRow[first + e0 + j]
                                full = _order_key(raw)
                                live = live & _matches(full, rnd, prefix)
                                digit = _digit(full, rnd)
                            digits.append(digit)
                            lives.append(live)
                        _histogram_add(sHist[None, rnd % 2], digits, lives)
                prefix, remaining, done, gt_before, eq_before = _cluster_pick(
                    rnd, rank, cluster_n, prefix, remaining, gt_before, sHist, sTotal, sPick, tidx, warp, lane)
                level = Int32(8 * (rnd + 1))
        cute.arch.cluster_arrive()  # the peers' histogram reads are done; matched by the wait before the exit
        lo, hi = _bin_edges(prefix, level)

        # Collection in column order: each thread's _GROUP consecutive prefixes a chunk, one block scan a step. A
        # key is the lowest with its 16-bit prefix, which decides unless the bin is narrower (level > 16) and the
        # prefix is the bin's: then the full key is re-read.
        for base in cutlass.range(0, count, _CHUNK):
            e0 = base + tidx * _GROUP
            tops = self.prefixes(groups, e0)
            keys = []
            for j in cutlass.range_constexpr(_GROUP):
                bound = (tops[j] << 16) ^ Int32(_INT_MIN)  # the lowest key with this prefix
                if (level > 16) & (tops[j] == _top16(lo)) & (e0 + j < count):
                    bound = _order_key(gRow[first + e0 + j])
                keys.append(cutlass.select_(e0 + j < count, bound, Int32(_PAD)))
            gt_before, eq_before = self.collect(keys, [first + e0 + j for j in range(_GROUP)], (base // _CHUNK) % 2,
                                                gt_before, eq_before, lo, hi, remaining, mOut, t, offset, sScan, warp,
                                                lane)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        cute.arch.cluster_wait()

    @cute.jit
    def collect(self, keys: list, cols: list, parity: Int32, gt_before: Int32, eq_before: Int32, lo: Int32, hi: Int32,
                remaining: Int32, mOut: cute.Tensor, t: Int32, offset: Int64, sScan: cute.Tensor, warp: Int32,
                lane: Int32):
        """One collection step of the CTA: ``keys`` of this thread's consecutive elements in column order (_PAD
        past them; a key may be the lowest of its 16-bit prefix, which is above -inf's key exactly when the score
        is not -inf), ``cols`` their columns, a block scan on sScan's half ``parity``; key > hi goes to (keys > hi
        before it) + min(bin keys before it, remaining), a bin key too while that min is below remaining. Returns
        (gt_before, eq_before) past the CTA's step."""
        gts = [cutlass.select_(key > hi, Int32(1), Int32(0)) for key in keys]
        eqs = [cutlass.select_((key >= lo) & (key <= hi) & (key != Int32(_PAD)), Int32(1), Int32(0)) for key in keys]
        mine = cute_utils.tree_sum(gts) + (cute_utils.tree_sum(eqs) << 16)
        before, total = _block_scan(mine, sScan, parity, warp, lane)
        if mine != 0:  # most threads hold no key >= lo
            n_gt = gt_before + (before & Int32(0xFFFF))
            n_eq = eq_before + (before >> 16)
            for j in cutlass.range_constexpr(len(keys)):
                if (gts[j] == 1) | ((eqs[j] == 1) & (n_eq < remaining)):
                    mOut[t, n_gt + cutlass.min(n_eq, remaining)] = cutlass.select_(
                        keys[j] > Int32(_KEY_NEG_INF), Int64(cols[j]) + offset, Int64(-1))
                n_gt = n_gt + gts[j]
                n_eq = n_eq + eqs[j]
        return gt_before + (total & Int32(0xFFFF)), eq_before + (total >> 16)

    @cute.jit
    def prefixes(self, groups: cute.Tensor, e0: Int32):
        """The _GROUP shared prefixes from slot e0 (a multiple of _GROUP) as Int32 (16-byte load; slots past the
        capacity read the last group's, which the callers mask)."""
        return cute_utils.load_vec(groups[None, cutlass.min(e0, self.capacity - _GROUP) // _GROUP], Int32)


class CandidateFilter:
    """The sampled path's first launch (module docstring): CTA (t, p) of ``ctas_per_row`` a row computes the row's
    threshold tau from its ``samples`` strided scores (every CTA of the row the same), then writes the columns of
    [p * width, min((p + 1) * width, N)) whose key is >= tau and above -inf's, in column order, and their keys to
    the first ``seg`` slots of segment p of mCols, mKeys [T, P * seg] int32, and how many there are (all of them,
    also past seg) to mCounts [T, P] int32. ``samples``, ``take``: the sample's size and the rank j of tau in it
    (``sample_plan``)."""

    def __init__(self, pdl: bool):
        self.pdl = pdl

    @cute.jit
    def __call__(self, mScores: cute.Tensor, mCols: cute.Tensor, mKeys: cute.Tensor, mCounts: cute.Tensor,
                 samples: Int32, take: Int32, width: Int32, seg: Int32, ctas_per_row: Int32, n_ctas: Int32, stream):
        self.kernel(mScores, mCols, mKeys, mCounts, samples, take, width, seg, ctas_per_row).launch(
            grid=[n_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mScores: cute.Tensor, mCols: cute.Tensor, mKeys: cute.Tensor, mCounts: cute.Tensor,
               samples: Int32, take: Int32, width: Int32, seg: Int32, ctas_per_row: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        sHist, sScan, sPick = _select_smem(cutlass.memory.SmemAllocator(), tidx)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            # the select may launch now: its griddepcontrol.wait still waits for this whole grid and its writes
            cute.arch.griddepcontrol_launch_dependents()
        t = cta // ctas_per_row
        p = cta % ctas_per_row
        n = mScores.shape[1]
        gRow = mScores[t, None]
        first = p * width  # the CTA's first column
        count = cutlass.min(n - first, width)  # its columns (>= 1: sampled_plan)
        # the sample's loads (sample i = j * THREADS + thread, column i * stride; CTA-uniform predicates) and the
        # first chunk's, all in flight before tau's rounds
        stride = n // samples
        sample = []
        for j in cutlass.range_constexpr(SAMPLE_SIZES[-1] // THREADS):
            raw = Float32(0.0)
            if j * THREADS < samples:
                raw = gRow[(j * THREADS + tidx) * stride]
            sample.append(raw)
        e0 = tidx * _GROUP
        raws = [gRow[first + cutlass.min(e0 + j, count - 1)] for j in range(_GROUP)]
        cute.arch.barrier()
        sample_keys = [cutlass.select_(j * THREADS < samples, _order_key(x), Int32(_PAD)) for j, x in enumerate(sample)]
        lo, _, _ = _register_select(sample_keys, take, sHist, sPick, tidx, warp, lane)
        tau = cutlass.max(lo, Int32(_KEY_NEG_INF + 1))  # never an -inf (or NaN) score
        dest = p * seg
        written = self.compact([_order_key(x) for x in raws], e0, count, tau, Int32(0), Int32(0), mCols, mKeys, t,
                               first, dest, seg, sScan, warp, lane)
        for base in cutlass.range(_CHUNK, count, _CHUNK):
            e0 = base + tidx * _GROUP
            keys = [_order_key(gRow[first + cutlass.min(e0 + j, count - 1)]) for j in range(_GROUP)]
            written = self.compact(keys, e0, count, tau, written, (base // _CHUNK) % 2, mCols, mKeys, t, first, dest,
                                   seg, sScan, warp, lane)
        if tidx == 0:
            mCounts[t, p] = written

    @cute.jit
    def compact(self, keys: list, e0: Int32, count: Int32, tau: Int32, written: Int32, parity: Int32,
                mCols: cute.Tensor, mKeys: cute.Tensor, t: Int32, first: Int32, dest: Int32, seg: Int32,
                sScan: cute.Tensor, warp: Int32, lane: Int32) -> Int32:
        """One chunk: the keys >= tau of this thread's _GROUP consecutive elements from e0 (those below ``count``)
        to slots written + (such keys before them in the CTA's columns) of the segment from ``dest``, those below
        ``seg``; a block scan on sScan's half ``parity``. Returns ``written`` past the chunk."""
        flags = [cutlass.select_((e0 + j < count) & (keys[j] >= tau), Int32(1), Int32(0)) for j in range(_GROUP)]
        mine = cute_utils.tree_sum(flags)
        before, total = _block_scan(mine, sScan, parity, warp, lane)
        if mine != 0:  # most threads hold no candidate
            slot = written + before
            for j in cutlass.range_constexpr(_GROUP):
                if (flags[j] == 1) & (slot < seg):
                    mCols[t, dest + slot] = first + e0 + j
                    mKeys[t, dest + slot] = keys[j]
                slot = slot + flags[j]
        return written + total


@cute.jit
def _select_smem(smem, tidx: Int32):
    """(sHist [256, 2] Int32, both halves zeroed (visible after the caller's next barrier), sScan [2, 32], sPick [5]):
    the shared buffers of a select's rounds and block scans, allocated first from ``smem``."""
    sHist = smem.allocate_tensor(Int32, cute.make_layout((_BINS, 2)), byte_alignment=16)
    sScan = smem.allocate_tensor(Int32, cute.make_layout((2, _SEL_WARPS)), byte_alignment=16)
    sPick = smem.allocate_tensor(Int32, cute.make_layout(5), byte_alignment=8)
    if tidx < _BINS:
        sHist[tidx, 0] = Int32(0)
        sHist[tidx, 1] = Int32(0)
    return sHist, sScan, sPick


@cute.jit
def _resident_keys(gRow: cute.Tensor, first: Int32, count: Int32, per_thread: cutlass.Constexpr[int], tidx: Int32):
    """(keys, lives): the order keys of columns first + per_thread * tidx + j, j < per_thread, of a row held in
    registers (_PAD, not live, at and past ``count`` columns from ``first``)."""
    keys = []
    lives = []
    for j in cutlass.range_constexpr(per_thread):
        e = tidx * per_thread + j
        key = Int32(_PAD)
        if e < count:
            key = _order_key(gRow[first + e])
        keys.append(key)
        lives.append(e < count)
    return keys, lives


@cute.jit
def _register_select(keys: list, take: Int32, sHist: cute.Tensor, sPick: cute.Tensor, tidx: Int32, warp: Int32,
                     lane: Int32):
    """(lo, hi, remaining): the bin [lo, hi] of the take-th largest of the keys the CTA's threads hold in registers
    (``keys`` this thread's, _PAD for none) and how many of its keys are to take; the radix rounds from the top (one
    histogram a round in sHist [256, 2], both halves zero on entry; warp 0 picks into sPick), stopping once the bin
    holds exactly the keys still to take (then lo <= the take-th largest key <= hi; after 4 rounds lo = hi = it)."""
    prefix = Int32(0)
    remaining = take
    level = Int32(0)
    done = Int32(0)
    for rnd in cutlass.range_constexpr(_ROUNDS):
        if done == 0:
            _histogram_add(sHist[None, rnd % 2], [_digit(key, rnd) for key in keys],
                           [_matches(key, rnd, prefix) for key in keys])
            cute.arch.barrier()
            if tidx < _BINS:
                sHist[tidx, (rnd + 1) % 2] = Int32(0)  # the next round's (last read a round ago)
            if warp == 0:
                _pick_digit(sHist[None, rnd % 2], None, sPick, prefix, remaining, lane)
            cute.arch.barrier()
            prefix = sPick[0]
            remaining = sPick[1]
            done = cutlass.select_(remaining == sPick[2], Int32(1), Int32(0))
            level = Int32(8 * (rnd + 1))
    lo, hi = _bin_edges(prefix, level)
    return lo, hi, remaining


@cute.jit
def _relu(x: Float32) -> Float32:
    """max(x, 0) that keeps NaN (as torch.relu)."""
    return cutlass.select_(x < Float32(0.0), Float32(0.0), x)


@cute.jit
def _is_nan(x: Float32):
    return (cute_utils.float_bits(x) & Int32(0x7FFFFFFF)) > Int32(0x7F800000)


@cute.jit
def _order_key(x: Float32) -> Int32:
    """An Int32 whose signed order is the score order: the bits of x + 0 (-0 + 0 = +0 under round to nearest), a
    negative score's flipped; NaN and -inf both the key of -inf."""
    bits = cute_utils.float_bits(x + Float32(0.0))
    return cutlass.select_(_is_nan(x), Int32(_KEY_NEG_INF), bits ^ ((bits >> 31) & Int32(0x7FFFFFFF)))


@cute.jit
def _top16(key: Int32) -> Int32:
    """The top 16 bits of ``key`` in unsigned order (the prefix shared memory keeps)."""
    return ((key ^ Int32(_INT_MIN)) >> 16) & Int32(0xFFFF)


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
def _histogram_add(sHist: cute.Tensor, digits: list, lives: list):
    """sHist[digits[j]] += 1 for every live (lane, j) of the warp: straight-line predicated ``red.shared.add`` of 1,
    which ptxas emits as ``ATOMS.POPC.INC`` (the increment form meant for lanes that share an address; it replaces
    the match.any warp aggregation of the earlier build: whether it is as cheap when a warp's keys crowd one bin is
    for the GPU bench to show); nothing when no lane has a live key (most warps after the first round)."""
    if cute.arch.vote_any_sync(_any(lives)):
        for digit, live in zip(digits, lives):
            cute.arch.inline_ptx("{ .reg .pred p; setp.ne.s32 p, {$r1}, 0; @p red.shared.add.u32 [{$r0}], 1; }",
                                 read_only_args=[Int32((sHist.iterator + digit).toint()),
                                                 cutlass.select_(live, Int32(1), Int32(0))])


def _any(flags: list):
    """The OR of a list of flags."""
    out = flags[0]
    for flag in flags[1:]:
        out = out | flag
    return out


@cute.jit
def _warp_suffix_sum(val: Int32, lane: Int32) -> Int32:
    """The sum of ``val`` over the lanes >= this one."""
    for off in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_down(val, offset=1 << off)
        val = val + cutlass.select_(lane + (1 << off) < 32, other, Int32(0))
    return val


@cute.jit
def _pick_digit(sBins: cute.Tensor, sEarlier, sPick: cute.Tensor, prefix: Int32, remaining: Int32, lane: Int32):
    """One warp: the digit d whose bin holds the cluster's remaining-th largest key (#keys in higher bins <
    remaining <= that + bins[d]). sBins [256]: the cluster's histogram; sEarlier [256]: that of the CTAs before this
    one (None: no such CTAs); sPick[0:5] = (prefix extended by d, remaining - #keys in higher bins, bins[d], the
    earlier CTAs' keys in bins above d, theirs in bin d). Lane l owns bins [8l, 8l + 8)."""
    bins = [sBins[8 * lane + i] for i in range(8)]
    earlier = [Int32(0)] * 8 if const_expr(sEarlier is None) else [sEarlier[8 * lane + i] for i in range(8)]
    lane_bins = cute_utils.tree_sum(bins)
    lane_earlier = cute_utils.tree_sum(earlier)
    above = _warp_suffix_sum(lane_bins, lane) - lane_bins  # the keys in the bins of the lanes above this one
    earlier_above = _warp_suffix_sum(lane_earlier, lane) - lane_earlier
    for i in cutlass.range_constexpr(7, -1, -1):
        if (above < remaining) & (remaining <= above + bins[i]):
            sPick[0] = (prefix << 8) | (8 * lane + i)
            sPick[1] = remaining - above
            sPick[2] = bins[i]
            sPick[3] = earlier_above
            sPick[4] = earlier[i]
        above = above + bins[i]
        earlier_above = earlier_above + earlier[i]


def _first_round_state(k: int):
    """(prefix, remaining, level, done, gt_before, eq_before) of a cluster select before its first round
    (``_cluster_pick`` returns them past each round)."""
    return Int32(0), Int32(k), Int32(0), Int32(0), Int32(0), Int32(0)


@cute.jit
def _cluster_pick(rnd: cutlass.Constexpr[int], rank: Int32, cluster_n: Int32, prefix: Int32, remaining: Int32,
                  gt_before: Int32, sHist: cute.Tensor, sTotal: cute.Tensor, sPick: cute.Tensor, tidx: Int32,
                  warp: Int32, lane: Int32):
    """The end of a cluster select's round ``rnd``, once this CTA's histogram is in sHist[:, rnd % 2]: a cluster
    barrier (release / acquire), the 256 bins summed over the cluster's CTAs through DSMEM (``ld.shared::cluster``)
    and over the CTAs before this one, into sTotal [256, 2]; sHist's other half cleared for the next round (the
    peers read it a round ago); warp 0 picks the digit. Returns (prefix, remaining, done, gt_before, eq_before)
    past the round (``_pick_digit``; done: the bin holds exactly the keys still to take)."""
    cute.arch.cluster_arrive()  # release: this CTA's histogram; acquire: every peer's
    cute.arch.cluster_wait()
    if tidx < _BINS:
        total = Int32(0)
        before = Int32(0)
        for peer in cutlass.range_constexpr(MAX_CLUSTER):  # 16 independent loads, none predicated
            n_peer = cute_utils.load_shared_remote(cute_utils.elem_ptr(sHist, (tidx, rnd % 2)),
                                                   cutlass.min(Int32(peer), cluster_n - 1))
            total = total + cutlass.select_(peer < cluster_n, n_peer, Int32(0))
            before = before + cutlass.select_(peer < rank, n_peer, Int32(0))
        sTotal[tidx, 0] = total
        sTotal[tidx, 1] = before
        sHist[tidx, (rnd + 1) % 2] = Int32(0)
    cute.arch.barrier()
    if warp == 0:
        _pick_digit(sTotal[None, 0], sTotal[None, 1], sPick, prefix, remaining, lane)
    cute.arch.barrier()
    return (sPick[0], sPick[1], cutlass.select_(sPick[1] == sPick[2], Int32(1), Int32(0)), gt_before + sPick[3],
            sPick[4])


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


def select_plan(n: int) -> tuple[int, int, int]:
    """(cluster_n, span, capacity) of the select of rows of n columns: ceil(n / CTA_COLUMNS) CTAs a row, at most
    MAX_CLUSTER, of span = ceil(n / cluster_n) columns each (the last one's the rest), their prefixes in capacity
    shared slots (the power of two >= span, at least CTA_COLUMNS: one build a capacity); capacity 0 for a row of
    one CTA, which holds its keys in registers."""
    cluster_n = min(MAX_CLUSTER, -(-n // CTA_COLUMNS))
    span = -(-n // cluster_n)
    return cluster_n, span, 0 if cluster_n == 1 else max(CTA_COLUMNS, 1 << (span - 1).bit_length())


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


def _binomial_pmf(m: int, p: float) -> list[float]:
    """P(Bin(m, p) = i) for i = 0..m."""
    if p <= 0.0 or p >= 1.0:
        return [float(i == (0 if p <= 0.0 else m)) for i in range(m + 1)]
    logs = [math.lgamma(m + 1) - math.lgamma(i + 1) - math.lgamma(m - i + 1) + i * math.log(p)
            + (m - i) * math.log1p(-p) for i in range(m + 1)]
    return [math.exp(x) for x in logs]


@functools.lru_cache(maxsize=None)
def sample_miss(n: int, k: int, samples: int) -> list[float]:
    """miss[j - 1] for j = 1..samples: the binomial probability that the sampled path misses on a row of n distinct
    scores when tau is the j-th largest of ``samples`` sampled keys (the sample taken as independent uniform draws):
    too few candidates, P(Bin(samples, (k - 1) / n) >= j) (j samples among the k - 1 keys above the k-th largest),
    plus too many, P(Bin(samples, CANDIDATES / n) < j) (fewer than j samples among the CANDIDATES largest keys).
    For tau below the j-th largest sample (the early stop, module docstring) the second term is a lower bound."""
    low = _binomial_pmf(samples, (k - 1) / n)
    high = _binomial_pmf(samples, min(1.0, CANDIDATES / n)) if n > CANDIDATES else [0.0] * (samples + 1)
    at_least = list(itertools.accumulate(reversed(low)))[::-1]  # at_least[j] = P(X >= j)
    below = [0.0, *itertools.accumulate(high)]  # below[j] = P(Y < j)
    return [min(1.0, at_least[j] + below[j]) for j in range(1, samples + 1)]


@functools.lru_cache(maxsize=None)
def sample_plan(n: int, k: int) -> tuple[int, int]:
    """(samples, j) of the sampled threshold of a row of n scores, for the top k: tau is the j-th largest of the keys
    at columns i * floor(n / samples), i < samples. The fewest samples of SAMPLE_SIZES and then the smallest j whose
    miss probability (``sample_miss``) is at most MISS_TARGET (fewer scattered reads; fewer candidates: the expected
    count is about j * n / samples); else all of them and the j of the smallest miss probability."""
    for samples in SAMPLE_SIZES:
        miss = sample_miss(n, k, samples)
        fine = [j for j, m in enumerate(miss, 1) if m <= MISS_TARGET]
        if fine:
            return samples, fine[0]
    return samples, 1 + min(range(samples), key=miss.__getitem__)


def sampled_plan(t: int, n: int, sms: int) -> tuple[int, int, int]:
    """(ctas_per_row P, width, seg) of the sampled path's filter for T = t rows of n > CTA_COLUMNS columns on
    ``sms`` SMs: P CTAs a row, as many as one CTA an SM gives each row (at least 1) but no more than one a chunk of
    _CHUNK columns, each ``width`` (a multiple of _CHUNK) consecutive columns (the last CTA the rest, never none), its
    candidates in a segment of seg = min(width, CANDIDATES) slots (a CTA with more makes the row's total exceed
    CANDIDATES: the fallback)."""
    ctas = max(1, min(-(-n // _CHUNK), sms // t))
    width = -(-n // (ctas * _CHUNK)) * _CHUNK
    ctas = -(-n // width)
    return ctas, width, min(width, CANDIDATES)


@cached_kernel(__file__, cute_utils.__file__)
def _compile_topk_select(k: int, capacity: int, pdl: bool, sampled: bool = False):
    t, m = cute.sym_int(), cute.sym_int()
    return compile_tvm_ffi(
        TopkSelect(k, capacity, pdl, sampled), fake_tensor(Float32, (cute.sym_int(), cute.sym_int()), 4),
        fake_tensor(Int64, (cute.sym_int(), k), 8), fake_tensor(Int32, (cute.sym_int(), cute.sym_int()), 4),
        fake_tensor(Int32, (t, m), 4), fake_tensor(Int32, (t, m), 4), Int64(0), Int32(1), Int32(1), Int32(1),
        Int32(1), env_stream(),
    )


@cached_kernel(__file__, cute_utils.__file__)
def _compile_candidate_filter(pdl: bool):
    t, m = cute.sym_int(), cute.sym_int()
    return compile_tvm_ffi(
        CandidateFilter(pdl), fake_tensor(Float32, (cute.sym_int(), cute.sym_int()), 4),
        fake_tensor(Int32, (t, m), 4), fake_tensor(Int32, (t, m), 4),
        fake_tensor(Int32, (cute.sym_int(), cute.sym_int()), 4), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1),
        Int32(1), env_stream(),
    )


def compile_scores(masked: bool, blocks: bool, pdl: bool = True):
    """The compiled score launch of a mode (``masked``: candidate-masked; ``blocks``: with the block maxima), from
    memory, disk or a fresh compile."""
    return _compile_index_score(masked, blocks, pdl)


PATHS = ("auto", "sampled", "cluster")


def _sampled(n_cols: int, path: str) -> bool:
    """Whether rows of n_cols columns take the sampled path under ``path`` (validated by the caller). "auto" takes
    it above SAMPLED_MIN_COLUMNS: on the H200 (2026-12-02, T = 1, k = 512) the sampled select took 12.19 us at 65536
    columns against the cluster's 10.73 (its three launches' chain), 14.25 against 26.04 at 524288 and 14.48 against
    46.66 at 2^20."""
    return path == "sampled" or (path == "auto" and n_cols > SAMPLED_MIN_COLUMNS)


def select_launch(n_cols: int, k: int, pdl: bool = True, path: str = "auto"):
    """The compiled select launch (the last of the sampled path's two) for rows of ``n_cols`` scores and ``k`` on
    ``path`` (``topk_indices``), from memory, disk or a fresh compile."""
    return _compile_topk_select(k, select_plan(n_cols)[2], pdl, _sampled(n_cols, path))


def filter_launch(pdl: bool = True):
    """The compiled candidate filter of the sampled path (memory, disk or a fresh compile)."""
    return _compile_candidate_filter(pdl)


def select_reason(scores: torch.Tensor, k: int, path: str = "auto") -> str | None:
    """None when ``topk_indices`` takes these arguments, else the reason it cannot."""
    if path not in PATHS:
        return f"path must be one of {PATHS}, got {path!r}"
    if scores.dtype != torch.float32 or scores.dim() != 2:
        return f"scores must be a 2-D torch.float32 tensor [T, N], got {scores.dtype} of shape {list(scores.shape)}"
    n = scores.shape[1]
    if not 1 <= n <= MAX_COLUMNS:
        return f"N must be in [1, {MAX_COLUMNS}], got {n}"
    if not 1 <= k <= min(n, MAX_K):
        return f"k must be in [1, min(N, {MAX_K})] = [1, {min(n, MAX_K)}], got {k}"
    if path == "sampled" and n <= CTA_COLUMNS:
        return f"path 'sampled' needs N > {CTA_COLUMNS} (one CTA takes a narrower row), got N = {n}"
    return hopper_reason(scores=scores)


def topk_indices(scores: torch.Tensor, k: int, offset: int = 0, *, out: torch.Tensor | None = None,
                 pdl: bool = True, path: str = "auto") -> torch.Tensor:
    """idx [T, k] int64: per row the k columns of the largest scores (NaN as -inf; equal scores: the lower column
    first), sorted ascending, + offset; -1 where the score is -inf. scores [T, N] fp32 contiguous on a Hopper
    device, 1 <= k <= min(N, 2048), N <= 2^20. ``out`` optionally supplies the output. ``path``: "auto" (the
    sampled path for N > SAMPLED_MIN_COLUMNS, else one CTA or one cluster a row), "sampled" (N > CTA_COLUMNS) or
    "cluster" (the select without the sample: one CTA or one cluster a row); every path gives the same result."""
    reason = select_reason(scores, k, path)
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
    cluster_n, span, _ = select_plan(n)
    if _sampled(n, path):
        counts, cols, keys, seg = filter_candidates(scores, k, pdl)
    else:
        counts = cols = keys = scores.new_empty((1, 1), dtype=torch.int32)  # not read
        seg = 1
    select_launch(n, k, pdl, path)(scores, out, counts, cols, keys, offset, cluster_n, span, seg, t * cluster_n)
    return out


def filter_candidates(scores: torch.Tensor, k: int, pdl: bool = True):
    """(counts [T, P], cols [T, P * seg], keys [T, P * seg] int32, seg): the sampled path's candidates of the top k
    of scores [T, N] (N > CTA_COLUMNS, as ``topk_indices`` checks), CTA p's in the first min(counts[t, p], seg)
    slots of segment p (``CandidateFilter``, ``sampled_plan``)."""
    t, n = scores.shape
    ctas, width, seg = sampled_plan(t, n, torch.cuda.get_device_properties(scores.device).multi_processor_count)
    counts = scores.new_empty((t, ctas), dtype=torch.int32)
    cols = scores.new_empty((t, ctas * seg), dtype=torch.int32)
    keys = scores.new_empty((t, ctas * seg), dtype=torch.int32)
    filter_launch(pdl)(scores, cols, keys, counts, *sample_plan(n, k), width, seg, ctas, t * ctas)
    return counts, cols, keys, seg


def score_grid(t: int, n_cap: int, sms: int) -> tuple[int, int]:
    """(rounds, CTAs a row) of the score kernel: the fewest rounds of 128 columns a CTA that keep the T x CTAs
    within one wave of SCORE_CTAS_PER_SM CTAs on each of ``sms`` SMs; at least one CTA a row. (The grid it
    replaces, 4 x 132 CTAs' worth of rounds, at most 8, launched 586 CTAs of 7 rounds at 2^19 columns: 1.5 waves,
    measured at 57% of DRAM peak; whether one wave reads faster is not measured yet.)"""
    ctas_per_row = max(1, SCORE_CTAS_PER_SM * sms // t)
    rounds = -(-n_cap // (ctas_per_row * _ROUND_COLS))
    return rounds, -(-n_cap // (rounds * _ROUND_COLS))


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_c: torch.Tensor,
                 candidates: torch.Tensor | None = None, blocks: bool = False, pdl: bool = True):
    """(s [T, Ncap] fp32, bs [T, ceil(Ncap / 8)] fp32 or None): the score kernel (module docstring); arguments as
    ``supports`` takes them."""
    t, n_cap = keys.shape[0], keys.shape[1]
    scores = q.new_empty((t, n_cap), dtype=torch.float32)
    block_max = q.new_empty((t, -(-n_cap // BLOCK)) if blocks else (1, 1), dtype=torch.float32)
    cand = (candidates if candidates is not None else scores.new_empty((1, 1), dtype=torch.bool)).view(torch.uint8)
    if t > 0:
        rounds, ctas_per_row = score_grid(t, n_cap, torch.cuda.get_device_properties(q.device).multi_processor_count)
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
