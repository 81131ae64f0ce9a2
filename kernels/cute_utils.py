"""Device helpers shared by the dsv41 CuTe DSL kernels: vector copies, reductions and warp-level bf16 MMA.

All helpers are ``@cute.jit`` functions traced into the calling kernel; none launches anything.
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr

FP8_MAX = 448.0  # the largest e4m3 value
FP8_AMAX_FLOOR = 1e-4  # the amax clamp of the model's ``fp8_fake_quant``


@cute.jit
def elem_ptr(t: cute.Tensor, coord: tuple) -> cute.Pointer:
    """Pointer to element ``coord`` of ``t`` (for atomics and scoped loads)."""
    return t.iterator + cute.crd2idx(coord, t.layout)


@cute.jit
def float_bits(x: Float32) -> Int32:
    """The bit pattern of the fp32 ``x`` as an Int32 (a register reinterpretation, no conversion)."""
    t = cute.make_rmem_tensor((1,), Float32)
    t[0] = x
    return cute.recast_tensor(t, Int32)[0]


@cute.jit
def load_vec(src: cute.Tensor, dtype: cutlass.Constexpr = None, pred=None) -> cute.TensorSSA:
    """Copy a small statically shaped global/shared tensor to registers (vectorised as its alignment
    allows) and return it as a TensorSSA, converted to ``dtype`` if given; zeros where ``pred`` is False."""
    r = cute.make_rmem_tensor(src.shape, src.element_type)
    if const_expr(pred is None):
        cute.autovec_copy(src, r)
    else:
        r.fill(0.0)
        if pred:
            cute.autovec_copy(src, r)
    v = r.load()
    if const_expr(dtype is not None):
        v = v.to(dtype)
    return v


@cute.jit
def store_vec(val: cute.TensorSSA, dst: cute.Tensor):
    """Round ``val`` to ``dst``'s element type (round to nearest even) and store it, vectorised."""
    r = cute.make_rmem_tensor(dst.shape, dst.element_type)
    r.store(val.to(dst.element_type))
    cute.autovec_copy(r, dst)


def tree_sum(vals: list):
    """Pairwise sum of a list of scalars (independent loads stay in flight together)."""
    vals = list(vals)
    while len(vals) > 1:
        vals = [vals[i] + vals[i + 1] if i + 1 < len(vals) else vals[i] for i in range(0, len(vals), 2)]
    return vals[0]


@cute.jit
def warp_sum(val: Float32, width: cutlass.Constexpr[int] = 32) -> Float32:
    """Butterfly sum over aligned groups of ``width`` lanes; every lane of a group gets the group's sum."""
    return cute.arch.warp_reduction(val, operator.add, threads_in_group=width)


@cute.jit
def transpose_sum(vals: list, lane: Int32, width: cutlass.Constexpr[int]) -> Float32:
    """Reduce ``width`` values held by each of ``width`` lanes: lane ``g`` of every aligned group of
    ``width`` lanes returns ``sum over the group's lanes of vals[g]``.

    A reduce-scatter butterfly: at each level a lane keeps the half of its values that its side of the
    split owns, sends the other half to its partner and adds what it receives, so ``width - 1`` shuffles
    replace the ``width * log2(width)`` of ``width`` separate butterflies.
    """
    vals = list(vals)
    for level in cutlass.range_constexpr(width.bit_length() - 1):
        n = width >> (level + 1)
        upper = (lane & n) != 0
        kept = []
        for i in cutlass.range_constexpr(n):
            send = cutlass.select_(upper, vals[i], vals[i + n])
            keep = cutlass.select_(upper, vals[i + n], vals[i])
            kept.append(Float32(keep) + cute.arch.shuffle_sync_bfly(Float32(send), offset=n))
        vals = kept
    return vals[0]


@cute.jit
def store_shared_remote(val: Float32, smem_ptr: cute.Pointer, mbar_ptr: cute.Pointer, peer: Int32):
    """``st.async`` of one fp32 into CTA ``peer``'s copy of ``smem_ptr``, completing 4 bytes of the
    transaction count of that CTA's mbarrier ``mbar_ptr``."""
    dst = cute.arch.map_dsmem_ptr(smem_ptr, peer).toint()
    mbar = cute.arch.map_dsmem_ptr(mbar_ptr, peer).toint()
    cute.arch.inline_ptx(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [{$r0}], {$r1}, [{$r2}];",
        read_only_args=[Int32(dst), val, Int32(mbar)],
    )


@cute.jit
def load_shared_remote(smem_ptr: cute.Pointer, peer: Int32) -> Int32:
    """``ld.shared::cluster`` of the Int32 at CTA ``peer``'s copy of ``smem_ptr`` (``peer`` may be this CTA)."""
    src = cute.arch.map_dsmem_ptr(smem_ptr, peer).toint()
    return cute.arch.inline_ptx("ld.shared::cluster.u32 {$w0}, [{$r0}];", write_only_types=[Int32],
                                read_only_args=[Int32(src)])


@cute.jit
def cta_or_cluster_sum(val: Float32, buf: cute.Tensor, mbar_ptr: cute.Pointer, num_warps: cutlass.Constexpr[int],
                       cluster_n: cutlass.Constexpr[int]) -> Float32:
    """Sum ``val`` over every thread of the CTA, or of the whole cluster when ``cluster_n > 1``.

    ``buf``: shared fp32 [num_warps * cluster_n] (at most 32). With a cluster, ``mbar_ptr`` is an mbarrier
    initialised with arrival count 1, fenced and followed by ``cluster_arrive_relaxed`` at kernel start
    (``init_cluster_mbarrier``); each warp's sum goes to slot ``warp * cluster_n + rank`` of every CTA of
    the cluster through ``st.async``, and each CTA waits for all ``num_warps * cluster_n`` slots. A CTA
    therefore cannot exit before its peers' stores into it have landed. Single use per kernel (phase 0).
    """
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    val = warp_sum(val)
    if const_expr(cluster_n == 1):
        if lane == 0:
            buf[warp] = val
        cute.arch.barrier()
    else:
        cute.arch.cluster_wait()  # every peer's mbarrier is initialised
        if warp == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbar_ptr, num_warps * cluster_n * 4)
        if lane < cluster_n:
            rank = cute.arch.block_idx_in_cluster()
            store_shared_remote(val, buf.iterator + (warp * cluster_n + rank), mbar_ptr, lane)
        cute.arch.mbarrier_wait(mbar_ptr, 0)
    total = Float32(0.0)
    if lane < num_warps * cluster_n:
        total = buf[lane]
    return warp_sum(total)


@cute.jit
def init_cluster_mbarrier(mbar_ptr: cute.Pointer):
    """Prologue of ``cta_or_cluster_sum`` with a cluster: initialise its mbarrier and arrive on the
    cluster barrier (the matching wait is inside ``cta_or_cluster_sum``)."""
    if cute.arch.thread_idx()[0] == 0:
        cute.arch.mbarrier_init(mbar_ptr, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.cluster_arrive_relaxed()


@cute.jit
def load_bf16_pairs(src: cute.Tensor, pred=None) -> list:
    """The 8 bf16 of a 16-byte global vector `src` as 4 Int32 registers (bf16 pairs, the lower address in the low
    half), as ``mma.sync`` takes its operands; zeros where ``pred`` is False."""
    r = cute.make_rmem_tensor(src.shape, src.element_type)
    r.store(load_vec(src, pred=pred))
    pairs = cute.recast_tensor(r, Int32)
    return [pairs[i] for i in range(8 // 2)]


@cute.jit
def mma_m16n8k16(acc: list, a: list, b: list) -> list:
    """acc += A @ B for one warp: A 16 x 16 and B 16 x 8 bf16 fragments (4 and 2 pair registers per lane), acc the
    16 x 8 fp32 fragment (4 per lane), in the PTX ISA's fragment layouts for ``mma.m16n8k16``."""
    d = cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, "
        "{{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, {{$r6}, {$r7}, {$r8}, {$r9}};",
        write_only_types=[Float32] * 4, read_only_args=[*a, *b, *acc])
    return list(d)


@cute.jit
def bf16_round(v: Float32) -> Float32:
    """v rounded to bf16 (round to nearest even) and back."""
    return Float32(BFloat16(v))


@cute.jit
def exponent_up(x: Float32) -> Int32:
    """The biased exponent of 2^ceil(log2(x)) for a positive normal fp32 x (the model's ``_pow2_ceil``)."""
    bits = float_bits(x)
    return ((bits >> 23) & Int32(0xFF)) + Int32((bits & Int32(0x7FFFFF)) != 0)


@cute.jit
def pow2(exponent: Int32) -> Float32:
    """The fp32 2^(exponent - 127) (a biased exponent in [1, 254])."""
    t = cute.make_rmem_tensor((1,), Int32)
    t[0] = exponent << 23
    return cute.recast_tensor(t, Float32)[0]


@cute.jit
def fp8_fake_quant(vals: cute.Tensor, lanes: cutlass.Constexpr[int]) -> cute.TensorSSA:
    """The model's ``fp8_fake_quant`` of one quantisation block held by ``lanes`` aligned lanes (a power of two),
    each holding the fp32 register tensor ``vals`` [n] (overwritten): amax over the block (butterfly over the
    lanes), s = 2^ceil(log2(max(amax, 1e-4) / 448)) from the bit pattern, and e4m3(clamp(v / s, +-448)) * s as
    fp32 (v / s computed as v * 2^-e, the same exact value). Every lane of the warp must call it."""
    amax = cute.math.absf(vals[0])
    for i in cutlass.range_constexpr(1, cute.size(vals)):
        amax = cute.arch.fmax(amax, cute.math.absf(vals[i]))
    for level in cutlass.range_constexpr(lanes.bit_length() - 1):
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << level))
    scaled = cute.arch.fmax(amax, Float32(FP8_AMAX_FLOOR)) * Float32(1.0 / FP8_MAX)
    exponent = exponent_up(scaled)
    scale = pow2(exponent)
    inv_scale = pow2(Int32(254) - exponent)
    for i in cutlass.range_constexpr(cute.size(vals)):
        vals[i] = cute.arch.fmin(cute.arch.fmax(vals[i] * inv_scale, Float32(-FP8_MAX)), Float32(FP8_MAX))
    return vals.load().to(cutlass.Float8E4M3FN).to(Float32) * scale
