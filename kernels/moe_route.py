"""The MoE router of one layer (spec section 2.6): ``dsv41::moe_route`` in one launch.

h [T, D] bf16, gate_weight W [E, D] bf16, bias [E] fp32 -> weights [T, k] fp32, experts [T, k] int64:

    logits  = h @ W^T                                       fp32 accumulation            [T, E]
    score   = sqrt(softplus(logits * (1 / gate_temp)))      torch's softplus (threshold 20)
    experts = the k largest score + bias, in descending order; equal biased scores: the lower expert index first
    weights = score[experts] / (sum_k score[experts] + 1e-20) * route_scale

The score chain has no branch: 1 / gate_temp is rounded to fp32 once on the host (exact at the model's 1.0, within
an ulp of the division otherwise) and the square root is ``sqrt.approx`` (MUFU.SQRT, ~1 ulp), where the IEEE
division and square root each carried a slow-path call that kept chains from interleaving.

Work split: producer CTA (g, s) owns the 16 weight rows [16g, 16g + 16) and the columns [1024s, 1024s + 1024), so the
3.9 MB weight at E = 384, D = 5120 is spread over 24 x 5 = 120 producers, 32 KB each, all requested up front. Each of
the CTA's 16 warps holds 64 columns of those rows in registers as the A operand of ``mma.sync.m16n8k16`` (bf16 in,
fp32 accumulation); tokens are the N operand, 8 per MMA and 32 per pass, read straight from global memory (every
CTA reads a different column slice of h, so there is nothing to share). The MMA's k order is a relabelling of the
columns that lets each lane load 16-byte vectors of both operands: lane (r, q) = (lane / 4, lane % 4) owns columns
[8q, 8q + 8) of each 32-column chunk, for rows r and r + 8 of W and token r of the tile.

The reduction over D is deterministic (no atomics, so CUDA-graph replays are bit-identical):

1. each CTA sums its 16 warps' accumulators in shared memory, in warp order, and stores its partial logits in the
   fp32 workspace ``ws[s, t, e]`` (relaxed stores at GPU scope);
2. the words are their own flags: between launches every workspace word holds ``_EMPTY``, a NaN pattern that no
   arithmetic returns, so a consumer requests all its words at once and loads a word again only while it is still
   ``_EMPTY``, then writes ``_EMPTY`` back. The last partial reaches its consumer one L2 round trip after it is
   stored, where a ticket took three in series (the fence's wait for the stores, the atomic, then the loads).
   Consumers are fixed CTAs that wait only on lower-indexed ones (CTAs are dispatched in index order, which a
   decoupled look-back scan relies on too), so the wait ends even if CTAs ran one after another. Up to
   ONE_HOP_TOKENS tokens the last producer (CTA 119 at E = 384, D = 5120) takes every partial itself; above,
   where its score math would outweigh a second hop, the last producer of each row group (split S - 1) takes its
   group's partials, scores its 16 experts and ranks them (level 1 below) into the workspace, and MERGERS = 8
   more CTAs (after the producers, on SMs they leave idle; they read no weight) take those lists;
3. the selection, in two levels. Level 1 ranks a segment of experts, one per lane in index order, into its k best
   (a list, best first): k rounds of a ``redux.sync`` max of the order keys of score + bias and a ballot for the
   lowest lane holding it. Level 2 merges a token's lists (lane g: list g) the same way, its winners' heads
   dropping. Either round is ~15-35 SASS, where a warp ranking all E experts in its lanes spent 76 per round.
   One hop: the last producer spreads the T x E / 32 (token, segment of 32) units over its 16 warps (only real
   tokens' units run; at T = 1 twelve warps share the token), each lane summing its partials in split order into
   the score (temperature, softplus, sqrt); lists in shared memory; after a barrier warp t merges token t. A
   warp's live units (up to 3 at E = 384 and T = 4) run interleaved, in a variant per count: their score chains
   and selection rounds are independent, so T = 2..4 cost about one unit's latency, not one per unit in series.
   Two hops: a row group's finisher ranks its 16 experts (lanes 16.. out) per token into the lists
   ``ws[S:S + 2]`` (key, expert, score [T, E / 16, k]; neither a key nor an expert id is ``_EMPTY``); merger
   m's warp w merges tokens m + MERGERS w, m + MERGERS (w + 16), ... from them (E / 16 <= 32 lists): up to 128
   tokens a warp merges one at most, and a merger's scheduler runs one warp at T = 16 (the last producer's 16
   warps merging all 16 tokens ran four: ~1080 issue cycles, not ~270).
   Equal biased scores: the lower index first (within a segment the lower lane, across them the lower segment);
   NaN above every number, as torch's sort ranks them. The weights come from the winners' unbiased scores, summed
   in round order.

The summation order and math are the same on both paths (their results are bit-identical). Every word a launch
stores is consumed and reset by it, so every launch (CUDA-graph replays included) finds the workspace empty;
launches that share it (one per device) must therefore be stream-ordered.

Measured (H200, 2026-12-02, the commit before the interleaved units; the timings are in the README): T = 2 and 4
paid a warp's second and third unit in series (a score chain with two slow-path calls, then 6 selection rounds
each). The weight read is not where the time goes: with PDL it overlaps the predecessor, and without PDL the kernel
takes 0.86 us more at T = 1 (the read plus the launch PDL hides), under the 0.94 us the read takes at copy
bandwidth. Every thread's four 16-byte weight loads are issued before its first wait, so the CTA's whole 32 KB slice
is in flight at once (``cp.async.bulk`` into shared memory would put no more bytes in flight). The rest is a chain
of latencies: the predecessor's completion, h from HBM, the ticket (fence, atomic, the partials from L2; now one
round trip, item 2), the tail.

Static evidence (sm_90a, ptxas -v, nvdisasm; not yet timed): 64 registers, 8 bytes of spills (one address around the
three-unit variant's reload loops). A producer's path ends at its partial stores (STG.E.STRONG.GPU; no fence, atomic
or barrier after them). A consumer issues all its loads (LDG.E.STRONG.GPU) back to back, then per word a compare
with 0x7fbadbad and a branch around its reload loop. At E = 384, k = 6 a one-hop warp's variants: one unit 136 SASS
(take 5 words, the score chain, level 1 in a rolled 13-SASS round, 5 resets), two units 28 SASS per round, three
units 40 per round with the three score chains' MUFUs back to back; each unit took ~98 SASS with two slow-path calls
before its 6 rounds, in series, before. The score chain is ~45 SASS, one MUFU.EX2 and one MUFU.SQRT. Level 2 (the
merge) is ~110 SASS with a rolled 6-round loop.

With ``pdl`` the kernel is a programmatic dependent launch: it lets the next kernel launch at once, loads its slice
of the weight, and only then waits for the preceding kernel before reading h; a merger waits before touching the
workspace (the preceding launch may still be consuming it).

The grouped-GEMM metadata of the routing (row order, offsets, row weights) is ``dsv41::moe_metadata``'s kernel
(``dsv41.kernels.moe_metadata``).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from dsv41.kernels import cute_utils
from dsv41.kernels.compile_cache import (cached_kernel, compile_tvm_ffi, env_stream, fake_tensor, hopper_reason,
                                         shape_reason)

ROWS = 16  # weight rows per CTA: the MMA's M
K_PER_CTA = 1024  # columns per CTA
MAX_EXPERTS = 512  # the two-hop merge: one lane per row group of 16 experts
MAX_TOPK = 8
MERGERS = 8  # CTAs after the producers that merge the two-hop lists (on SMs the producers leave idle)
ONE_HOP_TOKENS = 4  # up to this many tokens the last producer takes the split partials itself (one hop), else two
_WARPS = 16
_CHUNKS = 2  # 32-column chunks per warp: K_PER_CTA = _WARPS * _CHUNKS * 32
_VEC = 8  # bf16 per 16-byte vector
_TILE_N = 8  # tokens per MMA
_TILES = 4  # MMA token tiles per pass
_TOK_PASS = _TILE_N * _TILES  # = _WARPS * 32 / ROWS: one thread per (token, row) of a pass
_SEG = 32  # experts per selection segment: one per lane
_SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus: x above it is returned as is
_MIN_GATE_TEMP = 2.0**-126  # the smallest gate_temp whose reciprocal is a finite fp32 number
# a workspace word not yet stored: an fp32 NaN that no arithmetic returns (theirs is 0x7FFFFFFF), nor an order key
_EMPTY = 0x7FBADBAD
_LOWEST = -(2**31)  # the order key of a retired slot: below every score's key
_NAN_KEY = 2**31 - 1  # the order key of a NaN score: above +inf's
assert MAX_EXPERTS // ROWS <= 32
# sAcc's storage holds the merges' winners (expert, score of 16 warps x k) and the one-hop selection's lists (key,
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
        self.producers = self.groups * self.splits

    @cute.jit
    def __call__(self, mH: cute.Tensor, mW: cute.Tensor, mBias: cute.Tensor, mWeights: cute.Tensor,
                 mExperts: cute.Tensor, mWs: cute.Tensor, route_scale: Float32, inv_temp: Float32, stream):
        self.kernel(mH, mW, mBias, mWeights, mExperts, mWs, route_scale, inv_temp).launch(
            grid=[self.producers + MERGERS, 1, 1], block=[_WARPS * 32, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mH: cute.Tensor, mW: cute.Tensor, mBias: cute.Tensor, mWeights: cute.Tensor,
               mExperts: cute.Tensor, mWs: cute.Tensor, route_scale: Float32, inv_temp: Float32):
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        n_tok = mH.shape[0]
        smem = cutlass.memory.SmemAllocator()
        sAcc = smem.allocate_tensor(Float32, cute.make_layout((_WARPS, _TOK_PASS, ROWS),
                                                              stride=(_TOK_PASS * (ROWS + 1), ROWS + 1, 1)),
                                    byte_alignment=16)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        lane_masks = self.lane_masks()
        outs = self.winners_smem(sAcc)
        if cta < self.producers:
            self.partial_logits(mH, mW, mWs, sAcc, cta // self.splits, cta % self.splits, warp, lane)
            if n_tok <= ONE_HOP_TOKENS:
                if cta == self.producers - 1:
                    self.one_hop(mBias, mWeights, mExperts, mWs, sAcc, warp, lane, lane_masks, outs, route_scale,
                                 inv_temp)
            elif cta % self.splits == self.splits - 1:
                self.rank_group(mBias, mWs, cta // self.splits, warp, lane, lane_masks, inv_temp)
        else:
            if const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # the preceding launch may still be consuming the workspace
            if n_tok > ONE_HOP_TOKENS:
                self.merge_groups(mWeights, mExperts, mWs, cta - self.producers, warp, lane, lane_masks, outs,
                                  route_scale)

    @cute.jit
    def partial_logits(self, mH: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor, sAcc: cute.Tensor, group: Int32,
                       split: Int32, warp: Int32, lane: Int32):
        """CTA (group, split)'s partial logits ws[split, t, 16 group + row] of every token (the work split above)."""
        tidx, _, _ = cute.arch.thread_idx()
        r = lane // 4  # row (and row + 8) of the A operand, token of the B operand
        q = lane % 4  # which 8 columns of each 32-column chunk
        n_tok = mH.shape[0]
        vec = (_VEC,)
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
                cute.arch.store(cute_utils.elem_ptr(mWs, (split, tok, group * ROWS + row)), part, sem="relaxed",
                                scope="gpu")
            cute.arch.barrier()  # sAcc is rewritten by the next pass

    @cute.jit
    def one_hop(self, mBias: cute.Tensor, mWeights: cute.Tensor, mExperts: cute.Tensor, mWs: cute.Tensor,
                sAcc: cute.Tensor, warp: Int32, lane: Int32, lane_masks: tuple, outs: tuple, route_scale: Float32,
                inv_temp: Float32):
        """The last producer, up to ONE_HOP_TOKENS tokens: warp w takes the (token, segment) units w, w + 16, ... of
        the T x E / 32; lane l: expert l of each unit's segment. The warp's live units (those of real tokens) are its
        first n_live: their partials taken at once, their score chains and rankings interleaved, in a variant per
        count (warp-uniform). Then warp w merges token w's lists."""
        n_tok = mWeights.shape[0]
        plane = n_tok * self.experts  # ws[s] holds (token, expert) f = t * E + e at s * plane + f
        units = [warp + _WARPS * u for u in range(-(-ONE_HOP_TOKENS * self.segs // _WARPS))]
        tokens = [cutlass.min(u // self.segs, n_tok - 1) for u in units]
        segs = [u % self.segs for u in units]
        biases = [mBias[g * _SEG + lane] for g in segs]
        lists = self.lists_smem(sAcc)
        n_live = (n_tok * self.segs - warp + _WARPS - 1) // _WARPS
        for n in cutlass.range_constexpr(1, len(units) + 1):
            if n_live == n:
                parts = self.take(mWs.iterator, [s * plane + t * self.experts + g * _SEG + lane
                                                 for t, g in zip(tokens[:n], segs[:n]) for s in range(self.splits)],
                                  True)
                scores = [self.score(parts[u * self.splits:(u + 1) * self.splits], inv_temp) for u in range(n)]
                self.select_segments(tokens[:n], segs[:n], [g * _SEG + lane for g in segs[:n]], lane < _SEG, scores,
                                     biases[:n], *lane_masks, *lists)
        cute.arch.barrier()  # every token's lists are written
        if warp < n_tok:
            g = cutlass.min(lane, self.segs - 1)
            self.merge_lists(warp, warp, lane, lane < self.segs,
                             [[lst[warp, g, j] for j in range(self.topk)] for lst in lists], *lane_masks, *outs,
                             mWeights, mExperts, route_scale)

    @cute.jit
    def rank_group(self, mBias: cute.Tensor, mWs: cute.Tensor, group: Int32, warp: Int32, lane: Int32,
                   lane_masks: tuple, inv_temp: Float32):
        """The row group's last producer, above ONE_HOP_TOKENS tokens: warp w takes tokens w, w + 16, ...; lane r < 16
        expert 16 group + r, its score from the split partials, ranked (lanes 16.. out) into the group's list of the
        token in ws."""
        n_tok = mWs.shape[1]
        plane = n_tok * self.experts
        lists = self.lists_global(mWs, n_tok)
        expert = group * ROWS + cutlass.min(lane, ROWS - 1)
        bias = mBias[expert]
        for t in cutlass.range(warp, n_tok, _WARPS):
            parts = self.take(mWs.iterator, [s * plane + t * self.experts + expert for s in range(self.splits)],
                              lane < ROWS)
            self.select_segments([t], [group], [expert], lane < ROWS, [self.score(parts, inv_temp)], [bias],
                                 *lane_masks, *lists)

    @cute.jit
    def merge_groups(self, mWeights: cute.Tensor, mExperts: cute.Tensor, mWs: cute.Tensor, m: Int32, warp: Int32,
                     lane: Int32, lane_masks: tuple, outs: tuple, route_scale: Float32):
        """Merger m (CTA producers + m), above ONE_HOP_TOKENS tokens: warp w takes tokens m + MERGERS w,
        m + MERGERS (w + 16), ..., each the merge of its E / 16 groups' lists (lane g: group g's)."""
        n_tok = mWeights.shape[0]
        g = cutlass.min(lane, self.groups - 1)
        layout, firsts = self.lists_global_words(n_tok)
        for t in cutlass.range(m + MERGERS * warp, n_tok, MERGERS * _WARPS):
            taken = self.take(mWs.iterator, [first + cute.crd2idx((t, g, j), layout) for first in firsts
                                             for j in range(self.topk)], lane < self.groups)
            fields = [taken[f * self.topk:(f + 1) * self.topk] for f in range(3)]
            self.merge_lists(warp, t, lane, lane < self.groups,
                             [[cute_utils.float_bits(v) for v in fields[0]],
                              [cute_utils.float_bits(v) for v in fields[1]], fields[2]], *lane_masks, *outs,
                             mWeights, mExperts, route_scale)
            cute.arch.sync_warp()  # the warp's winners are rewritten next

    @cute.jit
    def take(self, base: cute.Pointer, offsets: list, active) -> list:
        """The 32-bit words at ``base + offsets`` (the workspace, read as fp32) once their producers, other CTAs,
        have stored them, each then reset to ``_EMPTY`` for the next launch. All are requested at once (relaxed
        GPU-scope loads); a word still ``_EMPTY`` is loaded again until it is not. Lanes not ``active`` read nothing
        and get zeros. A word is consumed by one lane only, and producers never wait, so this ends."""
        vals = [Float32(0.0) for _ in offsets]
        if active:
            vals = [cute.arch.load(base + off, Float32, sem="relaxed", scope="gpu") for off in offsets]
            for i in cutlass.range_constexpr(len(offsets)):
                val = vals[i]
                while cute_utils.float_bits(val) == _EMPTY:
                    val = cute.arch.load(base + offsets[i], Float32, sem="relaxed", scope="gpu")
                vals[i] = val
            for off in offsets:
                cute.arch.store(cute.recast_ptr(base + off, dtype=Int32), Int32(_EMPTY), sem="relaxed", scope="gpu")
        return vals

    @cute.jit
    def score(self, parts: list, inv_temp: Float32) -> Float32:
        """The score of a logit's split partials, summed in split order, times 1 / gate_temp."""
        logit = parts[0]
        for s in cutlass.range_constexpr(1, self.splits):
            logit = logit + parts[s]
        return _score(logit * inv_temp)

    def lane_masks(self) -> tuple:
        """(lanes up to this one, this lane): the lane masks that pick a ballot's lowest lane."""
        return Int32(cute.arch.lanemask_le()), Int32(cute.arch.lanemask_eq())

    def lists_smem(self, sAcc: cute.Tensor) -> tuple:
        """The one-hop selection's lists key / expert / score [ONE_HOP_TOKENS, E / 32 segments, k] in sAcc's
        storage, after the winners (lane-contiguous per place)."""
        layout = cute.make_layout((ONE_HOP_TOKENS, self.segs, self.topk), stride=(self.segs * self.topk, 1, self.segs))
        n = ONE_HOP_TOKENS * self.segs * self.topk
        base = sAcc.iterator + 2 * _WARPS * self.topk
        return (cute.make_tensor(cute.recast_ptr(base, dtype=Int32), layout),
                cute.make_tensor(cute.recast_ptr(base + n, dtype=Int32), layout),
                cute.make_tensor(base + 2 * n, layout))

    def lists_global_words(self, n_tok: Int32) -> tuple:
        """The two-hop selection's lists key / expert / score [T, E / 16 row groups, k] in the workspace's
        planes S and S + 1 (3 T E / 16 k <= 2 T E words): (their layout, each list's first word)."""
        layout = cute.make_layout((n_tok, self.groups, self.topk), stride=(self.groups * self.topk, 1, self.groups))
        n = n_tok * self.groups * self.topk
        first = self.splits * n_tok * self.experts
        return layout, [first, first + n, first + 2 * n]

    def lists_global(self, mWs: cute.Tensor, n_tok: Int32) -> tuple:
        """The two-hop selection's lists (``lists_global_words``) as tensors."""
        layout, firsts = self.lists_global_words(n_tok)
        return (cute.make_tensor(cute.recast_ptr(mWs.iterator + firsts[0], dtype=Int32), layout),
                cute.make_tensor(cute.recast_ptr(mWs.iterator + firsts[1], dtype=Int32), layout),
                cute.make_tensor(mWs.iterator + firsts[2], layout))

    def winners_smem(self, sAcc: cute.Tensor) -> tuple:
        """The merges' winners expert / score [16 warps, k] at the start of sAcc's storage."""
        layout = cute.make_layout((_WARPS, self.topk), stride=(self.topk, 1))
        return (cute.make_tensor(cute.recast_ptr(sAcc.iterator, dtype=Int32), layout),
                cute.make_tensor(sAcc.iterator + _WARPS * self.topk, layout))

    @cute.jit
    def select_segments(self, rows: list, gs: list, experts: list, in_segment, scores: list, biases: list,
                        lane_le: Int32, lane_bit: Int32, lKey: cute.Tensor, lExpert: cute.Tensor, lScore: cute.Tensor):
        """Level 1 of the selection, by one warp, for each unit u of the lists (rows, gs, experts, scores, biases):
        the experts of segment gs[u], one per lane (this lane's experts[u], scores[u] and biases[u]; lanes in expert
        order; lanes not ``in_segment`` take no part), ranked into their k best, written to the list
        [rows[u], gs[u], 0:k], best first. The units' rounds are interleaved (independent chains).

        Round i: the largest order key of score + bias (``redux.sync`` max), then the lowest lane holding it (a
        ballot: equal biased scores go to the lower index; NaN ranks above every number), which writes place i and
        retires its key. A segment holds 16 or 32 >= k experts, so no retired key (nor a lane out of it) is taken.
        """
        keys = [cutlass.select_(in_segment, _order_key(score + bias), Int32(_LOWEST))
                for score, bias in zip(scores, biases)]
        for i in cutlass.range(self.topk, unroll=1):  # rolled: code that runs once per launch is fetched cold
            tops = [cute.arch.warp_redux_sync(key, "max") for key in keys]
            won = [(cute.arch.vote_ballot_sync(key == top) & lane_le) == lane_bit for key, top in zip(keys, tops)]
            for u in cutlass.range_constexpr(len(keys)):
                if won[u]:
                    for lst, val in zip((lKey, lExpert, lScore), (keys[u], experts[u], scores[u])):
                        if const_expr(lst.memspace == cute.AddressSpace.gmem):  # read by other CTAs (take)
                            cute.arch.store(cute_utils.elem_ptr(lst, (rows[u], gs[u], i)), val, sem="relaxed",
                                            scope="gpu")
                        else:
                            lst[rows[u], gs[u], i] = val
                keys[u] = cutlass.select_(won[u], Int32(_LOWEST), keys[u])

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
    return cute.math.sqrt(soft, fastmath=True)


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
    if not _MIN_GATE_TEMP <= gate_temp < math.inf:
        return f"gate_temp must be finite and >= 2^-126 (the kernel multiplies by its fp32 reciprocal), got {gate_temp}"
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
        fake_tensor(Float32, (splits + 2, t, experts), 4), Float32(1.0), Float32(1.0), env_stream(),
    )


def compile_for(dim: int, experts: int, topk: int, pdl: bool = True):
    """The compiled kernel for hidden size ``dim``, ``experts`` experts, ``topk`` and programmatic dependent launch
    on or off (memory, disk or a fresh compile)."""
    return _compile_moe_route(dim, experts, topk, pdl)


_WORKSPACES: dict[int, torch.Tensor] = {}  # device index -> the workspace, every word _EMPTY between launches
_MIN_WORKSPACE_WORDS = 7 * 256 * 512  # (splits + 2) T E at D = 5120, T = 256, E = 512: decode sizes never regrow it


def _workspace(device: torch.device, words: int) -> torch.Tensor:
    """The device's fp32 workspace of at least ``words`` words, each holding ``_EMPTY``; kernels leave it so.
    Grown (never freed: captured graphs keep the old address) outside CUDA-graph capture only."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ws = _WORKSPACES.get(idx)
    if ws is None or ws.numel() < words:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moe_route: the workspace must be allocated before CUDA-graph capture; call "
                               "moe_route once first with at least as many tokens")
        ws = _WORKSPACES[idx] = torch.full((max(words, _MIN_WORKSPACE_WORDS),), _EMPTY, dtype=torch.int32,
                                           device=device).view(torch.float32)
    return ws


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
        shape = (d // K_PER_CTA + 2, t, e)
        ws = _workspace(h.device, math.prod(shape))[:math.prod(shape)].view(shape)
        compile_for(d, e, topk, pdl)(h, gate_weight, bias, weights, experts, ws, route_scale, 1.0 / gate_temp)
    return weights, experts
