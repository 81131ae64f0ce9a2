"""The routed experts of one MoE layer at small row counts (spec section 2.6): ``dsv41::moe_experts`` in two launches.

x [T, D] bf16, token [M] int64, row_weights [M] fp32, offsets [E] int32 (expert e owns the expert-sorted rows
[offsets[e - 1], offsets[e])), w2 [E, D, I] bf16, and the gate / up weights W1, W3 of expert e either stacked, w13
[E, 2I, D] with W1 = w13[e, :I], W3 = w13[e, I:], or held apart, w1 = w13 [E, I, D] and w3 [E, I, D] with
W1 = w1[e], W3 = w3[e] (``split``: the same math and order, only the addresses differ) -> out [M, D] bf16:

    GEMM1 (launch 1)   g, u = bf16(x[token[m]] @ W1^T), bf16(x[token[m]] @ W3^T)                       fp32 accumulation
                       a[m] = bf16(silu(min(g, limit)) * clamp(u, -limit, limit) * row_weights[m])   in the epilogue
    GEMM2 (launch 2)   a[m] <- fp8_fake_quant(a[m], 32) as it is loaded (if quant_block = 32)
                       out[m] = bf16(a[m] @ w2[e]^T)                                                  fp32 accumulation

Only the selected experts' weights are read, each once from HBM. Work split (both launches): CTA (s, j) takes the
s-th expert that has rows (s < min(M, E); CTAs past the last such expert exit at once) and weight rows tile j: in
GEMM1 the 8 w1 rows [8j, 8j + 8) and the 8 w3 rows of the same columns of a (I / 8 tiles: 288 CTAs per expert at
Flash sizes), in GEMM2 the 16 w2 rows [16j, 16j + 16) (D / 16 tiles: 320 per expert). The CTA's warps split K
(the full D or I) into equal contiguous ranges, and each warp runs ``mma.sync.m16n8k16`` (bf16 in, fp32 accumulation)
with its 16 weight rows as A and 8 expert rows at a time as B, both loaded as 16-byte vectors (the column
relabelling of ``dsv41.kernels.moe_route``), GROUP 32-column chunks of loads in flight before their MMAs. The warps'
partial sums are added in shared memory in warp order (deterministic: no atomics, so CUDA-graph replays are
bit-identical), then the epilogue runs one thread per (row, output column). GEMM1's MMA rows r and r + 8 are w1 and
w3 of the same column, so g and u of a column meet in one lane's accumulators before the shared-memory sum.

The FP8 fake quantisation (per 32 columns of a row: s = 2^ceil(log2(max(amax, 1e-4) / 448)), a <- e4m3(clamp(a / s,
+-448)) * s) is applied where GEMM2 loads its B operand: a 32-column chunk of a row is one quantisation block, held
by the four lanes of a quad (amax by two shuffles); s is a power of two, so a / s is a * (1 / s), both exact.

Rows beyond the first 8 of an expert run further passes over the CTA's weight slice (its re-reads hit L2). With
``pdl`` each launch is a programmatic dependent: it lets the next kernel launch at once and waits for the preceding
one before it reads anything.

Tried and dropped (H200, 2026-12-02, ``dsv41 bench kernels --op moe_experts``, Flash sizes): GEMM2 holding its whole
w2 slice in registers (9 chunks a warp at I = 2304), loaded before its ``griddepcontrol.wait`` so that w2 streams
during GEMM1's last wave. It needed 128 registers a thread, halving GEMM2's occupancy, and was slower at every T:
121.35 / 225.17 / 426.74 / 826.79 / 1549.92 / 4698.59 us at T = 1 / 2 / 4 / 8 / 16 / 64 (83.5 / 89.0 / 92.0 / 93.7 /
93.4 / 86.5% of copy bandwidth on the distinct experts' bytes) against this streamed loop's 119.6 / 222.5 / 419.9 /
814.2 / 1501.2 / 4278.2 us (session 9); without PDL it was no faster (about 3 us slower at T = 1, equal at T = 64),
so the loss was the register-resident operand, not the early launch.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from dsv41.kernels import cute_utils
from dsv41.kernels.compile_cache import (cached_kernel, compile_tvm_ffi, env_stream, fake_tensor, hopper_reason,
                                         shape_reason)
from dsv41.lowerings.moe_experts import MAX_ROWS  # the fusion's row limit is the kernel's

MAX_EXPERTS = 1024
QUANT_BLOCK = 32  # the one FP8 block size the kernel fuses (a 32-column chunk)
ROWS = 16  # weight rows per CTA: the MMA's M
_TILE_N = 8  # expert rows per MMA (its N)
_CHUNK = 32  # columns per k-chunk: 4 lanes x one 16-byte vector
_VEC = 8  # bf16 per 16-byte vector
_MAX_WARPS = 8
_MAX_GROUP = 4  # chunks of loads in flight per warp


def _warps(k: int) -> int:
    """Warps splitting a K of ``k`` columns: the most (up to 8) that divide it into whole 32-column chunks."""
    return next(w for w in (8, 4, 2, 1) if k % (w * _CHUNK) == 0)


def _group(chunks: int) -> int:
    """Chunks loaded before their MMAs: the largest of 4..1 that divides a warp's ``chunks``."""
    return next(g for g in range(_MAX_GROUP, 0, -1) if chunks % g == 0)


class ExpertGemm:
    """One grouped expert GEMM for small row counts: GEMM1 (``swiglu``: gathered x rows, w13 or (``split``) w1 and
    w3, the clamped SwiGLU x row weight epilogue) or GEMM2 (a rows, w2, optional FP8 fake quantisation of a on load).
    The launch takes a second weight ``mW3``, read only when ``split`` (otherwise any tensor: the entry passes mW)."""

    def __init__(self, k: int, n_out: int, experts: int, swiglu: bool, split: bool, quant: bool, pdl: bool):
        assert swiglu or not split, "only GEMM1 reads two weights"
        self.k = k
        self.n_out = n_out  # output columns: I (GEMM1) or D (GEMM2)
        self.experts = experts
        self.swiglu = swiglu
        self.split = split
        self.quant = quant
        self.pdl = pdl
        self.cols = ROWS // 2 if swiglu else ROWS  # output columns per CTA
        self.tiles = n_out // self.cols
        self.warps = _warps(k)
        self.chunks = k // (self.warps * _CHUNK)  # per warp
        self.group = _group(self.chunks)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mToken: cute.Tensor, mRowW: cute.Tensor, mOffsets: cute.Tensor,
                 mW: cute.Tensor, mW3: cute.Tensor, mOut: cute.Tensor, slots: Int32, limit: Float32, stream):
        self.kernel(mX, mToken, mRowW, mOffsets, mW, mW3, mOut, limit).launch(
            grid=[slots * self.tiles, 1, 1], block=[self.warps * 32, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mToken: cute.Tensor, mRowW: cute.Tensor, mOffsets: cute.Tensor,
               mW: cute.Tensor, mW3: cute.Tensor, mOut: cute.Tensor, limit: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        slot = cta // self.tiles
        tile = cta % self.tiles
        r = lane // 4  # weight rows r and r + 8 of the A operand, expert row r of the B operand
        q = lane % 4  # which 8 columns of each 32-column chunk

        smem = cutlass.memory.SmemAllocator()
        sAcc = smem.allocate_tensor(Float32, cute.make_layout((self.warps, _TILE_N, ROWS),
                                                              stride=(_TILE_N * (ROWS + 1), ROWS + 1, 1)),
                                    byte_alignment=16)
        sExpert = smem.allocate_tensor(Int32, cute.make_layout(3), byte_alignment=4)  # expert, first row, end row
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()
        if tidx == 0:
            sExpert[0] = Int32(-1)
        cute.arch.barrier()
        if warp == 0:
            self.find_expert(slot, lane, mOffsets, sExpert)
        cute.arch.barrier()
        expert = sExpert[0]
        if expert >= 0:
            first, end = sExpert[1], sExpert[2]
            n0 = tile * self.cols
            row_lo = n0 + r
            mWe = _expert_slice(mW, expert)
            mWe_hi, row_hi = mWe, row_lo + 8  # GEMM2: the next 8 w2 rows
            if const_expr(self.split):
                mWe_hi, row_hi = _expert_slice(mW3, expert), row_lo  # the w3 row of w1 row row_lo
            elif const_expr(self.swiglu):
                row_hi = self.n_out + row_lo  # the w3 row of w1 row row_lo, in w13
            vec = (_VEC,)
            gW_lo = cute.tiled_divide(mWe[row_lo, None], vec)
            gW_hi = cute.tiled_divide(mWe_hi[row_hi, None], vec)
            for t0 in cutlass.range(first, end, _TILE_N):
                m = t0 + r
                valid = m < end
                src = cutlass.min(m, end - 1)
                if const_expr(self.swiglu):
                    src = Int32(mToken[src])
                gB = cute.tiled_divide(mX[src, None], vec)
                acc = [Float32(0.0)] * 4
                for g in cutlass.range(0, self.chunks // self.group):
                    a_lo, a_hi, b = [], [], []
                    for c in cutlass.range_constexpr(self.group):
                        v = (warp * self.chunks + g * self.group + c) * (_CHUNK // _VEC) + q
                        a_lo.append(cute_utils.load_bf16_pairs(gW_lo[None, v]))
                        a_hi.append(cute_utils.load_bf16_pairs(gW_hi[None, v]))
                        if const_expr(self.quant):
                            b.append(_quantised_pairs(gB[None, v], valid))
                        else:
                            b.append(cute_utils.load_bf16_pairs(gB[None, v], valid))
                    for c in cutlass.range_constexpr(self.group):
                        for j in cutlass.range_constexpr(2):  # the chunk's two k-steps of 16 (relabelled) columns
                            acc = cute_utils.mma_m16n8k16(acc, [a_lo[c][2 * j], a_hi[c][2 * j], a_lo[c][2 * j + 1],
                                                      a_hi[c][2 * j + 1]], [b[c][2 * j], b[c][2 * j + 1]])
                # accumulator fragment: (weight row r, expert rows 2q, 2q + 1) and (weight row r + 8, the same)
                for i in cutlass.range_constexpr(4):
                    sAcc[warp, 2 * q + i % 2, r + 8 * (i // 2)] = acc[i]
                cute.arch.barrier()
                for i in cutlass.range(tidx, _TILE_N * self.cols, self.warps * 32):
                    row = t0 + i // self.cols
                    col = i % self.cols
                    if row < end:
                        if const_expr(self.swiglu):
                            g_val = cute_utils.bf16_round(self.warp_sum(sAcc, i // self.cols, col))
                            u_val = cute_utils.bf16_round(self.warp_sum(sAcc, i // self.cols, col + 8))
                            g_val = cute.arch.fmin(g_val, limit)
                            u_val = cute.arch.fmin(cute.arch.fmax(u_val, -limit), limit)
                            silu = g_val / (Float32(1.0) + cute.math.exp(-g_val))
                            mOut[row, n0 + col] = BFloat16(silu * u_val * mRowW[row])
                        else:
                            mOut[row, n0 + col] = BFloat16(self.warp_sum(sAcc, i // self.cols, col))
                cute.arch.barrier()  # sAcc is rewritten by the next pass

    @cute.jit
    def find_expert(self, slot: Int32, lane: Int32, mOffsets: cute.Tensor, sExpert: cute.Tensor):
        """One warp: sExpert = (e, first row, end row) of the slot-th expert that has rows (left at -1 if none)."""
        seen = Int32(0)  # experts with rows before this group of 32
        below_lane = (Int32(1) << lane) - Int32(1)
        for j in cutlass.range_constexpr((self.experts + 31) // 32):
            e = lane + 32 * j
            inside = e < self.experts
            end = mOffsets[cutlass.min(e, self.experts - 1)]
            first = Int32(0)
            if e > 0:
                first = mOffsets[cutlass.min(e - 1, self.experts - 1)]
            has_rows = inside & (end > first)
            mask = cute.arch.vote_ballot_sync(has_rows)
            if has_rows & (seen + cute.arch.popc(mask & below_lane) == slot):
                sExpert[1] = first
                sExpert[2] = end
                sExpert[0] = e
            seen = seen + cute.arch.popc(mask)

    @cute.jit
    def warp_sum(self, sAcc: cute.Tensor, n: Int32, row: Int32) -> Float32:
        """The warps' partial sums of (expert row n, weight row ``row``), added in warp order."""
        total = sAcc[0, n, row]
        for w in cutlass.range_constexpr(1, self.warps):
            total = total + sAcc[w, n, row]
        return total


@cute.jit
def _expert_slice(mW: cute.Tensor, expert: Int32) -> cute.Tensor:
    """Expert ``expert``'s [rows, K] matrix of the row-major [E, rows, K] weight mW, located from a 64-bit offset
    (E x 2I x D passes 2^31 elements at Flash sizes)."""
    rows, k = mW.shape[1], mW.shape[2]
    return cute.make_tensor(mW.iterator + cute.assume(Int64(expert) * Int64(rows * k), divby=_VEC),
                            cute.make_layout((rows, k), stride=(k, 1)))


@cute.jit
def _quantised_pairs(src: cute.Tensor, pred) -> list:
    """The lane's 8 bf16 of a row's 32-column chunk (zeros where ``pred`` is False) after the FP8 fake quantisation
    of the chunk, as 4 Int32 bf16-pair registers; the chunk's amax is shared over the lane's quad."""
    vals = cute.make_rmem_tensor((_VEC,), Float32)
    vals.store(cute_utils.load_vec(src, Float32, pred=pred))
    out = cute.make_rmem_tensor((_VEC,), BFloat16)
    out.store(cute_utils.fp8_fake_quant(vals, 4).to(BFloat16))
    pairs = cute.recast_tensor(out, Int32)
    return [pairs[i] for i in range(_VEC // 2)]


def config_reason(dim: int, inter: int, experts: int, quant_block: int) -> str | None:
    """Why the kernel has no build for hidden size ``dim``, inner size ``inter``, ``experts`` experts and
    ``quant_block`` (None when it has)."""
    if dim % _CHUNK or inter % _CHUNK:
        return f"D and I must be multiples of {_CHUNK}, got D = {dim}, I = {inter}"
    if not 1 <= experts <= MAX_EXPERTS:
        return f"E must be in [1, {MAX_EXPERTS}], got {experts}"
    if quant_block not in (0, QUANT_BLOCK):
        return f"quant_block must be 0 or {QUANT_BLOCK}, got {quant_block}"
    return None


def supports(x: torch.Tensor, token: torch.Tensor, row_weights: torch.Tensor, offsets: torch.Tensor,
             w13: torch.Tensor, w2: torch.Tensor, *, swiglu_limit: float, quant_block: int,
             w3: torch.Tensor | None = None) -> str | None:
    """None when the kernel computes ``dsv41::moe_experts`` of these arguments (w3 given: w13 is w1), else the
    reason it cannot."""
    if x.dim() != 2 or w2.dim() != 3 or token.dim() != 1:
        return f"x, token and w2 must be 2-D, 1-D and 3-D, got shapes {list(x.shape)}, {list(token.shape)}, {list(w2.shape)}"
    (t, d), m, (e, _, inter) = x.shape, token.shape[0], w2.shape
    gate_rows = 2 * inter if w3 is None else inter
    for reason in (shape_reason("x", x, torch.bfloat16, (t, d)), shape_reason("token", token, torch.int64, (m,)),
                   shape_reason("row_weights", row_weights, torch.float32, (m,)),
                   shape_reason("offsets", offsets, torch.int32, (e,)),
                   shape_reason("w13", w13, torch.bfloat16, (e, gate_rows, d)),
                   shape_reason("w2", w2, torch.bfloat16, (e, d, inter)),
                   None if w3 is None else shape_reason("w3", w3, torch.bfloat16, (e, inter, d))):
        if reason is not None:
            return reason
    reason = config_reason(d, inter, e, quant_block)
    if reason is not None:
        return reason
    if not 1 <= m <= MAX_ROWS:
        return f"M = {m} rows, the kernel takes 1 to {MAX_ROWS}"
    weights = dict(w13=w13, w2=w2) if w3 is None else dict(w13=w13, w2=w2, w3=w3)
    return hopper_reason(x=x, token=token, row_weights=row_weights, offsets=offsets, **weights)


@cached_kernel(__file__, cute_utils.__file__)
def _compile_moe_experts(k: int, n_out: int, experts: int, swiglu: bool, split: bool, quant: bool, pdl: bool):
    """GEMM1 (swiglu: k = D, n_out = I; split: w1 and w3 [E, I, D] apart, else w13 [E, 2I, D] and a stand-in for
    mW3 that is never read) or GEMM2 (k = I, n_out = D)."""
    t, m = cute.sym_int(), cute.sym_int()
    n_w = 2 * n_out if swiglu and not split else n_out
    n_in = t if swiglu else m  # GEMM1 reads x [T, D], GEMM2 a [M, I]
    weight = fake_tensor(BFloat16, (experts, n_w, k))
    return compile_tvm_ffi(
        ExpertGemm(k, n_out, experts, swiglu, split, quant, pdl),
        fake_tensor(BFloat16, (n_in, k)), fake_tensor(Int64, (m,), 8), fake_tensor(Float32, (m,), 4),
        fake_tensor(Int32, (experts,), 4), weight, fake_tensor(BFloat16, (experts, n_out, k)) if split else weight,
        fake_tensor(BFloat16, (m, n_out)), Int32(1), Float32(1.0), env_stream(),
    )


def compile_for(dim: int, inter: int, experts: int, quant_block: int, pdl: bool = True, split: bool = False):
    """The two compiled launches (GEMM1, GEMM2) for these sizes, GEMM1 with w1 and w3 apart if ``split`` (memory,
    disk or a fresh compile)."""
    return (_compile_moe_experts(dim, inter, experts, True, split, False, pdl),
            _compile_moe_experts(inter, dim, experts, False, False, quant_block == QUANT_BLOCK, pdl))


def moe_experts(x: torch.Tensor, token: torch.Tensor, row_weights: torch.Tensor, offsets: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, *, swiglu_limit: float, quant_block: int,
                w3: torch.Tensor | None = None, out: torch.Tensor | None = None, pdl: bool = True) -> torch.Tensor:
    """out [M, D] bf16 = ``dsv41::moe_experts`` (module docstring); w3 given: w13 is w1 [E, I, D], w3 [E, I, D].

    Contiguous tensors on one Hopper device; D, I multiples of 32, 1 <= E <= 1024, 1 <= M <= 384, quant_block 0 or
    32; offsets as the op requires (non-decreasing, offsets[E - 1] = M; not checked here: no host sync). ``out``
    optionally supplies the output. ``pdl``: launch both GEMMs as programmatic dependents.
    """
    reason = supports(x, token, row_weights, offsets, w13, w2, swiglu_limit=swiglu_limit, quant_block=quant_block,
                      w3=w3)
    if reason is not None:
        raise ValueError(f"moe_experts: {reason}")
    (_, d), m, (e, _, inter) = x.shape, token.shape[0], w2.shape
    if out is None:
        out = x.new_empty((m, d))
    else:
        reason = shape_reason("out", out, torch.bfloat16, (m, d)) or hopper_reason(x=x, out=out)
        if reason is not None:
            raise ValueError(f"moe_experts: {reason}")
    gemm1, gemm2 = compile_for(d, inter, e, quant_block, pdl, split=w3 is not None)
    a = x.new_empty((m, inter))
    slots = min(m, e)
    gemm1(x, token, row_weights, offsets, w13, w13 if w3 is None else w3, a, slots, swiglu_limit)
    gemm2(a, token, row_weights, offsets, w2, w2, out, slots, swiglu_limit)
    return out
