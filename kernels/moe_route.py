"""The MoE router of one layer (spec section 2.6): ``dsv41::moe_route`` in one launch.

h [T, D] bf16, gate_weight W [E, D] bf16, bias [E] fp32 -> weights [T, k] fp32, experts [T, k] int64:

    logits  = h @ W^T                                       fp32 accumulation            [T, E]
    score   = sqrt(softplus(logits / gate_temp))            torch's softplus (threshold 20)
    experts = the k largest score + bias, in descending order; equal biased scores: the lower expert index first
    weights = score[experts] / (sum_k score[experts] + 1e-20) * route_scale

Work split: CTA (g, s) owns the 16 weight rows [16g, 16g + 16) and the 1024 columns [1024s, 1024s + 1024), so the
3.9 MB weight at E = 384, D = 5120 is spread over 24 x 5 = 120 CTAs, 32 KB each, all requested up front. Each of
the CTA's 16 warps holds 64 columns of those rows in registers as the A operand of ``mma.sync.m16n8k16`` (bf16 in,
fp32 accumulation); tokens are the N operand, 8 per MMA and 32 per pass, read straight from global memory (every
CTA reads a different column slice of h, so there is nothing to share). The MMA's k order is a relabelling of the
columns that lets each lane load 16-byte vectors of both operands: lane (r, q) = (lane / 4, lane % 4) owns columns
[8q, 8q + 8) of each 32-column chunk, for rows r and r + 8 of W and token r of the tile.

The reduction over D is deterministic (no atomics on data, so CUDA-graph replays are bit-identical):

1. each CTA sums its 16 warps' accumulators in shared memory, in warp order, and stores its partial logits in the
   fp32 workspace ``ws[s, t, e]``;
2. tickets: thread 0 of each CTA adds 1 to a counter (release and acquire at GPU scope; the CTA's barriers carry
   them to its other threads, as a cooperative grid sync does, so no other thread fences). Up to ONE_HOP_TOKENS
   tokens there is one ticket for all 120 CTAs and its last CTA sums the partials itself; above, where that CTA's
   score math (~100 SASS per (token, expert)) would outweigh a second ticket, the last of the 5 CTAs of each row
   group scores its group's 16 experts and ranks them (level 1 below) into the workspace, and the last of those 24
   goes on;
3. the selection, in two levels. Level 1 ranks a segment of experts, one per lane in index order, into its k best
   (a list, best first): k rounds of a ``redux.sync`` max of the order keys of score + bias and a ballot for the
   lowest lane holding it. Level 2 merges a token's lists (lane g: list g) the same way, its winners' heads
   dropping. Either round is ~15-35 SASS, where a warp ranking all E experts in its lanes spent 76 per round.
   One ticket: the last CTA spreads the T x E / 32 (token, segment of 32) units over its 16 warps (only real
   tokens' units run; at T = 1 twelve warps share the token), each lane summing its partials in split order into
   the score (temperature, softplus, sqrt); lists in shared memory; after a barrier warp t merges token t.
   Two tickets: a row group's finisher ranks its 16 experts (lanes 16.. out) per token into the lists
   ``ws[S:S + 2]`` (key, expert, score [T, E / 16, k]); the last CTA's warp w merges tokens w, w + 16, ... from
   them (E / 16 <= 32 lists).
   Equal biased scores: the lower index first (within a segment the lower lane, across them the lower segment);
   NaN above every number, as torch's sort ranks them. The weights come from the winners' unbiased scores, summed
   in round order.

The summation order and math are the same on both paths (their results are bit-identical). The last CTA of each
ticket resets its counter, so every launch (CUDA-graph replays included) finds them zero; launches that share the
counters (one set per device) must therefore be stream-ordered.

Measured on the H200 (2026-12-02, `benchmarks/results/kernels_s10.json`, us under CUDA graphs at T = 1 / 2 / 4 / 8 /
16 / 32 / 64): 4.99 / 5.63 / 6.37 / 6.37 / 7.54 / 10.86 / 18.21, against the one-warp selection's 5.18 / 5.48 / 5.64 /
7.10 / 8.74 / 12.85 / 22.10 (session 9): faster at T = 1 and from T = 8, slower at T = 2 and 4, where a warp runs its
2-3 (token, block) units one after another. Two later variants were measured and dropped (branch `route`, 2026-12-02):
the units interleaved with a branch-free score chain, plus the tickets replaced by polling on marker words and 8
merger CTAs above 4 tokens: 4.28 / 5.53 / 6.81 / 15.72 / 17.64 / 21.99 / 29.22 (T = 1 best, T >= 8 two to three
times slower, and slower with PDL than without). ncu (base clocks, T = 1 / 8): 8.58 / 9.31 us, the average SM active
4.5K / 5.5K of 12.3K / 13.4K cycles, DRAM 9.6% of peak, 38% of stalls on shared-memory scoreboards.
Static evidence (sm_90a, ptxas -v, nvdisasm): 64 registers, no spills. From the last
partial store to the output stores at T <= 4: thread 0's fence and atomic, then one batch of L2 loads. At E = 384,
k = 6, after the ticket, the critical warp at T = 1 runs ~550 SASS (loads and one score chain 182, level 1 84 = 6
rounds x 14, level 2 ~270 = 34 + 6 rounds x 33 + ~40), where the one-warp selection before ran ~870 (three score
chains in series 288, selection 586 = 98 + 6 rounds x 76 + 32) and one more barrier; above 4 tokens the last CTA
spends ~270 SASS per token (the merge, after one batch of L2 loads of its 24 lists) instead of 586 plus staging the
scores in shared memory, and a finisher's warp ~230 per token (loads, score, level 1 = 115 + 6 x 19) instead of
one score chain per thread.

With ``pdl`` the kernel is a programmatic dependent launch: it lets the next kernel launch at once, loads its slice
of the weight, and only then waits for the preceding kernel before reading h.

The grouped-GEMM metadata of the routing (row order, offsets, row weights) is ``dsv41::moe_metadata``'s kernel
(``dsv41.kernels.moe_metadata``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from dsv41.kernels import cute_utils
from dsv41.kernels.compile_cache import (cached_kernel, compile_tvm_ffi, env_stream, fake_tensor, hopper_reason,
                                         shape_reason)

ROWS = 16  # weight rows per CTA: the MMA's M
K_PER_CTA = 1024  # columns per CTA
MAX_EXPERTS = 512  # the two-ticket merge: one lane per row group of 16 experts
MAX_TOPK = 8
ONE_HOP_TOKENS = 4  # up to this many tokens the last CTA sums the split partials itself (one ticket), else two
_WARPS = 16
_CHUNKS = 2  # 32-column chunks per warp: K_PER_CTA = _WARPS * _CHUNKS * 32
_VEC = 8  # bf16 per 16-byte vector
_TILE_N = 8  # tokens per MMA
_TILES = 4  # MMA token tiles per pass
_TOK_PASS = _TILE_N * _TILES  # = _WARPS * 32 / ROWS: one thread per (token, row) of a pass
_SEG = 32  # experts per selection segment: one per lane
_SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus: x above it is returned as is
_LOWEST = -(2**31)  # the order key of a retired slot: below every score's key
_NAN_KEY = 2**31 - 1  # the order key of a NaN score: above +inf's
assert MAX_EXPERTS // ROWS <= 32
# sAcc's storage holds the merges' winners (expert, score of 16 warps x k) and the one-ticket selection's lists (key,
# expert, score of each token's E / 32 segments x k)
assert 2 * _WARPS * MAX_TOPK + 3 * ONE_HOP_TOKENS * (MAX_EXPERTS // _SEG) * MAX_TOPK <= _WARPS * _TOK_PASS * (ROWS + 1)


class MoeRoute:
    """The router kernel for a static hidden size, expert count and k."""

    def __init__(self, dim: int, experts: int, topk: int, pdl: bool):
        self.dim = dim
        self.experts = experts
        self.topk = topk
        self.pdl = pdl
        self.splits = dim // K_PER_CTA
        self.groups = experts // ROWS
        self.segs = experts // _SEG

    @cute.jit
    def __call__(self, mH: cute.Tensor, mW: cute.Tensor, mBias: cute.Tensor, mWeights: cute.Tensor,
                 mExperts: cute.Tensor, mWs: cute.Tensor, mCount: cute.Tensor, route_scale: Float32,
                 gate_temp: Float32, stream):
        self.kernel(mH, mW, mBias, mWeights, mExperts, mWs, mCount, route_scale, gate_temp).launch(
            grid=[self.groups * self.splits, 1, 1], block=[_WARPS * 32, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mH: cute.Tensor, mW: cute.Tensor, mBias: cute.Tensor, mWeights: cute.Tensor,
               mExperts: cute.Tensor, mWs: cute.Tensor, mCount: cute.Tensor, route_scale: Float32,
               gate_temp: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        group = cta // self.splits
        split = cta % self.splits
        r = lane // 4  # row (and row + 8) of the A operand, token of the B operand
        q = lane % 4  # which 8 columns of each 32-column chunk
        n_tok = mH.shape[0]
        vec = (_VEC,)

        smem = cutlass.memory.SmemAllocator()
        sAcc = smem.allocate_tensor(Float32, cute.make_layout((_WARPS, _TOK_PASS, ROWS),
                                                              stride=(_TOK_PASS * (ROWS + 1), ROWS + 1, 1)),
                                    byte_alignment=16)
        s_last = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()

        # The A operand for the whole pass: a_lo[c] / a_hi[c] = the 4 bf16 pairs of rows r / r + 8 in chunk c.
        # A weight, so it is read before waiting for the preceding kernel.
        vecs = [split * (K_PER_CTA // _VEC) + warp * (_CHUNKS * 32 // _VEC) + c * (32 // _VEC) + q
                for c in range(_CHUNKS)]
        gW_lo = cute.tiled_divide(mW[group * ROWS + r, None], vec)
        gW_hi = cute.tiled_divide(mW[group * ROWS + r + 8, None], vec)
        a_lo = [cute_utils.load_bf16_pairs(gW_lo[None, vecs[c]]) for c in range(_CHUNKS)]
        a_hi = [cute_utils.load_bf16_pairs(gW_hi[None, vecs[c]]) for c in range(_CHUNKS)]
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        for t0 in cutlass.range(0, n_tok, _TOK_PASS):
            b_tiles = []  # the B operand of every token tile, requested before the first MMA
            for n in cutlass.range_constexpr(_TILES):
                tok = t0 + n * _TILE_N + r
                gH = cute.tiled_divide(mH[cutlass.min(tok, n_tok - 1), None], vec)
                b_tiles.append([cute_utils.load_bf16_pairs(gH[None, vecs[c]], tok < n_tok) for c in range(_CHUNKS)])
            for n in cutlass.range_constexpr(_TILES):
                if t0 + n * _TILE_N < n_tok:  # (tiles past the last token are never read back)
                    b = b_tiles[n]
                    acc = [Float32(0.0)] * 4
                    for c in cutlass.range_constexpr(_CHUNKS):
                        for j in cutlass.range_constexpr(2):  # the chunk's two k-steps of 16 (relabelled) columns
                            acc = cute_utils.mma_m16n8k16(acc, [a_lo[c][2 * j], a_hi[c][2 * j], a_lo[c][2 * j + 1],
                                                      a_hi[c][2 * j + 1]], [b[c][2 * j], b[c][2 * j + 1]])
                    # accumulator fragment: (row r, tokens 2q, 2q + 1) and (row r + 8, the same tokens)
                    for i in cutlass.range_constexpr(4):
                        sAcc[warp, n * _TILE_N + 2 * q + i % 2, r + 8 * (i // 2)] = acc[i]
            cute.arch.barrier()
            # thread = (token, row) of the pass; the CTA's partial logit, summed over its warps in order
            row = tidx % ROWS
            tok = t0 + tidx // ROWS
            if tok < n_tok:
                part = sAcc[0, tidx // ROWS, row]
                for w in cutlass.range_constexpr(1, _WARPS):
                    part = part + sAcc[w, tidx // ROWS, row]
                mWs[split, tok, group * ROWS + row] = part
            cute.arch.barrier()  # sAcc is rewritten by the next pass

        plane = n_tok * self.experts  # ws[s] holds (token, expert) f = t * E + e at s * plane + f
        lane_masks = self.lane_masks()
        outs = self.winners_smem(sAcc)
        if n_tok <= ONE_HOP_TOKENS:
            if self.last_to_arrive(mCount, 0, self.groups * self.splits, tidx, s_last) != 0:
                # warp w: the (token, segment) units w, w + 16, ... of the T x E / 32; lane l: expert l of each unit's
                # segment (every unit's partials and bias requested first). Then warp w merges token w's lists.
                units = [warp + _WARPS * u for u in range(-(-ONE_HOP_TOKENS * self.segs // _WARPS))]
                tokens = [cutlass.min(u // self.segs, n_tok - 1) for u in units]
                segs = [u % self.segs for u in units]
                biases = [mBias[g * _SEG + lane] for g in segs]
                parts = [self.partials(mWs, plane, t * self.experts + g * _SEG + lane) for t, g in zip(tokens, segs)]
                lists = self.lists_smem(sAcc)
                for u in cutlass.range_constexpr(len(units)):
                    if units[u] < n_tok * self.segs:  # (warp-uniform: only the tokens' units run)
                        self.select_segment(tokens[u], segs[u], segs[u] * _SEG + lane, lane < _SEG,
                                            self.score(parts[u], gate_temp), biases[u], *lane_masks, *lists)
                cute.arch.barrier()  # every token's lists are written
                if warp < n_tok:
                    g = cutlass.min(lane, self.segs - 1)
                    self.merge_lists(warp, warp, lane, lane < self.segs,
                                     [[lst[warp, g, j] for j in range(self.topk)] for lst in lists], *lane_masks,
                                     *outs, mWeights, mExperts, route_scale)
        elif self.last_to_arrive(mCount, 1 + group, self.splits, tidx, s_last) != 0:
            # the row group's finisher, warp w: tokens w, w + 16, ...; lane r < 16: expert 16 group + r, its score from
            # the split partials, ranked (lanes 16.. out) into the group's list of the token in ws
            lists = self.lists_global(mWs, n_tok)
            expert = group * ROWS + cutlass.min(lane, ROWS - 1)
            bias = mBias[expert]
            for t in cutlass.range(warp, n_tok, _WARPS):
                score = self.score(self.partials(mWs, plane, t * self.experts + expert), gate_temp)
                self.select_segment(t, group, expert, lane < ROWS, score, bias, *lane_masks, *lists)
            if self.last_to_arrive(mCount, 0, self.groups, tidx, s_last) != 0:
                # warp w: tokens w, w + 16, ..., each the merge of its E / 16 groups' lists (lane g: group g's)
                g = cutlass.min(lane, self.groups - 1)
                for t in cutlass.range(warp, n_tok, _WARPS):
                    self.merge_lists(warp, t, lane, lane < self.groups,
                                     [[cute.arch.load(cute_utils.elem_ptr(lst, (t, g, j)), lst.element_type,
                                                      sem="relaxed", scope="gpu") for j in range(self.topk)]
                                      for lst in lists], *lane_masks, *outs, mWeights, mExperts, route_scale)
                    cute.arch.sync_warp()  # the warp's winners are rewritten next

    @cute.jit
    def last_to_arrive(self, mCount: cute.Tensor, slot: Int32, arrivals: cutlass.Constexpr[int], tidx: Int32,
                       s_last: cute.Tensor) -> Int32:
        """Nonzero in every thread of the CTA that is the last of ``arrivals`` to reach counter ``slot``; that CTA
        resets the counter and sees every store the others made before arriving.

        Thread 0 alone adds 1 (release and acquire at GPU scope); the barriers around it carry both to the CTA's
        other threads, as a cooperative grid sync does, so no thread but it fences.
        """
        cute.arch.barrier()
        if tidx == 0:
            ticket = cute.arch.atomic_add(cute_utils.elem_ptr(mCount, (slot,)), Int32(1), sem="acq_rel", scope="gpu")
            s_last[0] = Int32(ticket == arrivals - 1)
            if ticket == arrivals - 1:
                mCount[slot] = Int32(0)
        cute.arch.barrier()
        return s_last[0]

    @cute.jit
    def partials(self, mWs: cute.Tensor, plane: Int32, f: Int32) -> list:
        """The split partial logits of flat (token, expert) ``f``, loaded from L2."""
        return [cute.arch.load(mWs.iterator + (s * plane + f), Float32, sem="relaxed", scope="gpu")
                for s in range(self.splits)]

    @cute.jit
    def score(self, parts: list, gate_temp: Float32) -> Float32:
        """The score of a logit's split partials, summed in split order."""
        logit = parts[0]
        for s in cutlass.range_constexpr(1, self.splits):
            logit = logit + parts[s]
        return _score(logit / gate_temp)

    def lane_masks(self) -> tuple:
        """(lanes up to this one, this lane): the lane masks that pick a ballot's lowest lane."""
        return Int32(cute.arch.lanemask_le()), Int32(cute.arch.lanemask_eq())

    def lists_smem(self, sAcc: cute.Tensor) -> tuple:
        """The one-ticket selection's lists key / expert / score [ONE_HOP_TOKENS, E / 32 segments, k] in sAcc's
        storage, after the winners (lane-contiguous per place)."""
        layout = cute.make_layout((ONE_HOP_TOKENS, self.segs, self.topk), stride=(self.segs * self.topk, 1, self.segs))
        n = ONE_HOP_TOKENS * self.segs * self.topk
        base = sAcc.iterator + 2 * _WARPS * self.topk
        return (cute.make_tensor(cute.recast_ptr(base, dtype=Int32), layout),
                cute.make_tensor(cute.recast_ptr(base + n, dtype=Int32), layout),
                cute.make_tensor(base + 2 * n, layout))

    def lists_global(self, mWs: cute.Tensor, n_tok: Int32) -> tuple:
        """The two-ticket selection's lists key / expert / score [T, E / 16 row groups, k] in the workspace's
        planes S and S + 1 (3 T E / 16 k <= 2 T E words)."""
        layout = cute.make_layout((n_tok, self.groups, self.topk), stride=(self.groups * self.topk, 1, self.groups))
        n = n_tok * self.groups * self.topk
        base = mWs.iterator + self.splits * n_tok * self.experts
        return (cute.make_tensor(cute.recast_ptr(base, dtype=Int32), layout),
                cute.make_tensor(cute.recast_ptr(base + n, dtype=Int32), layout),
                cute.make_tensor(base + 2 * n, layout))

    def winners_smem(self, sAcc: cute.Tensor) -> tuple:
        """The merges' winners expert / score [16 warps, k] at the start of sAcc's storage."""
        layout = cute.make_layout((_WARPS, self.topk), stride=(self.topk, 1))
        return (cute.make_tensor(cute.recast_ptr(sAcc.iterator, dtype=Int32), layout),
                cute.make_tensor(sAcc.iterator + _WARPS * self.topk, layout))

    @cute.jit
    def select_segment(self, row: Int32, g: Int32, expert: Int32, in_segment, score: Float32, bias: Float32,
                       lane_le: Int32, lane_bit: Int32, lKey: cute.Tensor, lExpert: cute.Tensor, lScore: cute.Tensor):
        """Level 1 of the selection, by one warp: the experts of segment g, one per lane (this lane's ``expert``,
        ``score`` and ``bias``; lanes in expert order; lanes not ``in_segment`` take no part), ranked into their k
        best, written to the list [row, g, 0:k], best first.

        Round i: the largest order key of score + bias (``redux.sync`` max), then the lowest lane holding it (a
        ballot: equal biased scores go to the lower index; NaN ranks above every number), which writes place i and
        retires its key. A segment holds 16 or 32 >= k experts, so no retired key (nor a lane out of it) is taken.
        """
        key = cutlass.select_(in_segment, _order_key(score + bias), Int32(_LOWEST))
        for i in cutlass.range(self.topk, unroll=1):  # rolled: code that runs once per launch is fetched cold
            top = cute.arch.warp_redux_sync(key, "max")
            won = (cute.arch.vote_ballot_sync(key == top) & lane_le) == lane_bit
            if won:
                lKey[row, g, i] = key
                lExpert[row, g, i] = expert
                lScore[row, g, i] = score
            key = cutlass.select_(won, Int32(_LOWEST), key)

    @cute.jit
    def merge_lists(self, row: Int32, t: Int32, lane: Int32, has_list, lists: list, lane_le: Int32, lane_bit: Int32,
                    sOutExpert: cute.Tensor, sOutScore: cute.Tensor, mWeights: cute.Tensor, mExperts: cute.Tensor,
                    route_scale: Float32):
        """Level 2, by one warp: token t's segments' lists, lane g holding list g's keys / experts / scores
        (``lists``, best first; ``has_list`` False past the last segment), merged into the token's k experts, which
        it writes with their weights (winners staged in row ``row`` of sOut).

        Round i: the largest head key (``redux.sync`` max), then the lowest lane holding it (a ballot: segments are
        in expert order and each list breaks its own ties by index, so this is the lower expert index of equal
        biased scores); that lane writes place i's expert and score and drops its head. Every lane then sums
        the winners' scores in round order, and lane i < k writes place i.
        """
        keys = [cutlass.select_(has_list, key, Int32(_LOWEST)) for key in lists[0]]
        experts = lists[1]
        scores = lists[2]
        for i in cutlass.range(self.topk, unroll=1):
            top = cute.arch.warp_redux_sync(keys[0], "max")
            won = (cute.arch.vote_ballot_sync(keys[0] == top) & lane_le) == lane_bit
            if won:
                sOutExpert[row, i] = experts[0]
                sOutScore[row, i] = scores[0]
            # the list with its head taken (each list assigned by name: the loop carries what it assigns)
            keys_after, experts_after, scores_after = keys[1:] + [Int32(_LOWEST)], experts[1:], scores[1:]
            for j in cutlass.range_constexpr(self.topk - 1):
                keys[j] = cutlass.select_(won, keys_after[j], keys[j])
                experts[j] = cutlass.select_(won, experts_after[j], experts[j])
                scores[j] = cutlass.select_(won, scores_after[j], scores[j])
            keys[self.topk - 1] = cutlass.select_(won, keys_after[self.topk - 1], keys[self.topk - 1])
        cute.arch.sync_warp()
        total = Float32(0.0)
        for i in cutlass.range_constexpr(self.topk):
            total = total + sOutScore[row, i]
        total = total + 1e-20
        if lane < self.topk:
            mExperts[t, lane] = Int64(sOutExpert[row, lane])
            mWeights[t, lane] = sOutScore[row, lane] / total * route_scale

@cute.jit
def _score(x: Float32) -> Float32:
    """sqrt(softplus(x)) as torch computes softplus: x above the threshold as is, else log1p(exp(x))."""
    soft = cute.math.log1p(cute.math.exp(x))
    if x > _SOFTPLUS_THRESHOLD:
        soft = x
    return cute.math.sqrt(soft)


@cute.jit
def _order_key(v: Float32) -> Int32:
    """An Int32 whose signed order is v's float order (-0 below +0), every NaN above +inf as torch's sort ranks
    it; every key is above ``_LOWEST``."""
    bits = cute_utils.float_bits(v)
    key = cutlass.select_(bits < 0, bits ^ Int32(0x7FFFFFFF), bits)
    return cutlass.select_(v != v, Int32(_NAN_KEY), key)


def config_reason(dim: int, experts: int, topk: int) -> str | None:
    """Why the kernel has no build for hidden size ``dim``, ``experts`` experts and ``topk`` (None when it has)."""
    if dim % K_PER_CTA:
        return f"D must be a multiple of {K_PER_CTA}, got {dim}"
    if experts % 32 or not 32 <= experts <= MAX_EXPERTS:
        return f"E must be a multiple of 32 in [32, {MAX_EXPERTS}], got {experts}"
    if not 1 <= topk <= MAX_TOPK:
        return f"topk must be in [1, {MAX_TOPK}], got {topk}"
    return None


def supports(h: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, *, topk: int, route_scale: float,
             gate_temp: float) -> str | None:
    """None when the kernel computes ``dsv41::moe_route`` of these arguments, else the reason it cannot."""
    if h.dim() != 2 or gate_weight.dim() != 2:
        return f"h and gate_weight must be 2-D, got shapes {list(h.shape)} and {list(gate_weight.shape)}"
    t, d = h.shape
    e = gate_weight.shape[0]
    for reason in (shape_reason("h", h, torch.bfloat16, (t, d)),
                   shape_reason("gate_weight", gate_weight, torch.bfloat16, (e, d)),
                   shape_reason("bias", bias, torch.float32, (e,))):
        if reason is not None:
            return reason
    reason = config_reason(d, e, topk)
    if reason is not None:
        return reason
    if t * d >= 2**31 or (d // K_PER_CTA + 2) * t * e >= 2**31:
        return f"T = {t} overflows the kernel's 32-bit indexing"
    return hopper_reason(h=h, gate_weight=gate_weight, bias=bias)


@cached_kernel(__file__, cute_utils.__file__)
def _compile_moe_route(dim: int, experts: int, topk: int, pdl: bool):
    t = cute.sym_int()
    splits = dim // K_PER_CTA
    return compile_tvm_ffi(
        MoeRoute(dim, experts, topk, pdl),
        fake_tensor(BFloat16, (t, dim)), fake_tensor(BFloat16, (experts, dim)), fake_tensor(Float32, (experts,), 4),
        fake_tensor(Float32, (t, topk), 4), fake_tensor(Int64, (t, topk), 8),
        fake_tensor(Float32, (splits + 2, t, experts), 4), fake_tensor(Int32, (experts // ROWS + 1,), 4),
        Float32(1.0), Float32(1.0), env_stream(),
    )


def compile_for(dim: int, experts: int, topk: int, pdl: bool = True):
    """The compiled kernel for hidden size ``dim``, ``experts`` experts, ``topk`` and programmatic dependent launch
    on or off (memory, disk or a fresh compile)."""
    return _compile_moe_route(dim, experts, topk, pdl)


_COUNTERS: dict[int, torch.Tensor] = {}  # device index -> the zeroed ticket counters (row groups + 1)


def _counters(device: torch.device, groups: int) -> torch.Tensor:
    """The device's ticket counters, at least ``groups + 1``; kernels leave them zeroed. Grown (never freed:
    captured graphs keep the old address) outside CUDA-graph capture only."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    count = _COUNTERS.get(idx)
    if count is None or count.numel() < groups + 1:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moe_route: the ticket counters must be allocated before CUDA-graph capture; "
                               "call moe_route once first")
        count = _COUNTERS[idx] = torch.zeros(max(64, groups + 1), dtype=torch.int32, device=device)
    return count


def moe_route(h: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, *, topk: int, route_scale: float,
              gate_temp: float, out: tuple[torch.Tensor, torch.Tensor] | None = None, pdl: bool = True):
    """(weights [T, topk] fp32, experts [T, topk] int64) = ``dsv41::moe_route`` (module docstring).

    h [T, D], gate_weight [E, D] bf16, bias [E] fp32, all contiguous on one Hopper device; D % 1024 == 0,
    E % 32 == 0 with 32 <= E <= 512, 1 <= topk <= 8. ``out`` optionally supplies the two outputs. ``pdl``: launch
    as a programmatic dependent of the preceding kernel (the weight is read before waiting for it).
    """
    reason = supports(h, gate_weight, bias, topk=topk, route_scale=route_scale, gate_temp=gate_temp)
    if reason is not None:
        raise ValueError(f"moe_route: {reason}")
    t, d = h.shape
    e = gate_weight.shape[0]
    if out is None:
        weights = h.new_empty((t, topk), dtype=torch.float32)
        experts = h.new_empty((t, topk), dtype=torch.int64)
    else:
        weights, experts = out
        for name, o, dtype in (("out[0]", weights, torch.float32), ("out[1]", experts, torch.int64)):
            reason = shape_reason(name, o, dtype, (t, topk)) or hopper_reason(h=h, **{name: o})
            if reason is not None:
                raise ValueError(f"moe_route: {reason}")
    if t > 0:
        splits, groups = d // K_PER_CTA, e // ROWS
        count = _counters(h.device, groups)
        ws = h.new_empty((splits + 2, t, e), dtype=torch.float32)
        compile_for(d, e, topk, pdl)(h, gate_weight, bias, weights, experts, ws, count[:groups + 1], route_scale,
                                     gate_temp)
    return weights, experts
