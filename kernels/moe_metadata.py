"""The routing metadata of one MoE layer (spec section 2.6): ``dsv41::moe_metadata`` in one CTA.

flat_experts [M] int64 (M = T * k (token, slot) pairs, pair p = t * k + slot), flat_weights [M] fp32 ->
token [M] int64, offsets [E] int32, row_weights [M] fp32; with key(p) = flat_experts[p] (an id outside [0, E)
counts as E: after every expert):

    start[e]   = #{p : key(p) < e}                                               e <= E   (shared memory)
    offsets[e] = #{p : key(p) <= e}                      the inclusive cumsum of the counts, e < E
    row(p)     = start[key(p)] + #{p' < p : key(p') == key(p)}                   the stable expert-sorted position
    token[row(p)] = p // k,  row_weights[row(p)] = flat_weights[p]

so rows [offsets[e - 1], offsets[e]) are expert e's in pair order, as a stable argsort of the ids orders them.
Thread e (e <= E) counts the keys below and equal to e, and thread p ranks pair p among the equal keys before it,
both by scans over the keys in shared memory: deterministic and free of atomics, so CUDA-graph replays are
bit-identical. Every row is written once (row() is a permutation of [0, M)), every offset once.

With ``pdl`` the kernel is a programmatic dependent launch: it lets the next kernel launch at once and waits for
the preceding one before it reads the ids.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from dsv41.kernels import cute_utils
from dsv41.kernels.compile_cache import (cached_kernel, compile_tvm_ffi, env_stream, fake_tensor, hopper_reason,
                                         shape_reason)

MAX_ROWS = 2048  # M = T * k: the keys held in shared memory
_THREADS = 1024
MAX_EXPERTS = _THREADS - 1  # threads 0..E count (thread E: the start of the ids outside [0, E))


class MoeMetadata:
    """The grouped-GEMM metadata of a routing for a static expert count and k (module docstring)."""

    def __init__(self, experts: int, topk: int, pdl: bool):
        self.experts = experts
        self.topk = topk
        self.pdl = pdl

    @cute.jit
    def __call__(self, mExperts: cute.Tensor, mWeights: cute.Tensor, mToken: cute.Tensor, mOffsets: cute.Tensor,
                 mRowWeights: cute.Tensor, stream):
        self.kernel(mExperts, mWeights, mToken, mOffsets, mRowWeights).launch(
            grid=[1, 1, 1], block=[_THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mExperts: cute.Tensor, mWeights: cute.Tensor, mToken: cute.Tensor, mOffsets: cute.Tensor,
               mRowWeights: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        n = mExperts.shape[0]
        smem = cutlass.memory.SmemAllocator()
        sKey = smem.allocate_tensor(Int32, cute.make_layout(MAX_ROWS), byte_alignment=16)
        sStart = smem.allocate_tensor(Int32, cute.make_layout(self.experts + 1), byte_alignment=16)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()
        for p in cutlass.range(tidx, n, _THREADS):
            e = mExperts[p]
            sKey[p] = cutlass.select_((e < 0) | (e >= self.experts), Int32(self.experts), Int32(e))
        cute.arch.barrier()
        if tidx <= self.experts:
            below, equal = Int32(0), Int32(0)
            for p in cutlass.range(0, n):
                key = sKey[p]
                below = below + Int32(key < tidx)
                equal = equal + Int32(key == tidx)
            sStart[tidx] = below
            if tidx < self.experts:
                mOffsets[tidx] = below + equal
        cute.arch.barrier()
        for p in cutlass.range(tidx, n, _THREADS):
            key = sKey[p]
            rank = Int32(0)
            for q in cutlass.range(0, p):
                rank = rank + Int32(sKey[q] == key)
            row = sStart[key] + rank
            mToken[row] = Int64(p // self.topk)
            mRowWeights[row] = mWeights[p]


def supports(flat_experts: torch.Tensor, flat_weights: torch.Tensor, *, topk: int, num_experts: int) -> str | None:
    """None when the kernel computes ``dsv41::moe_metadata`` of these arguments, else the reason it cannot."""
    if flat_experts.dim() != 1:
        return f"flat_experts must be 1-D [M], got shape {list(flat_experts.shape)}"
    m = flat_experts.shape[0]
    for reason in (shape_reason("flat_experts", flat_experts, torch.int64, (m,)),
                   shape_reason("flat_weights", flat_weights, torch.float32, (m,))):
        if reason is not None:
            return reason
    if m > MAX_ROWS:
        return f"M = T * k must be at most {MAX_ROWS} (the ids held in shared memory), got {m}"
    if not 1 <= num_experts <= MAX_EXPERTS:
        return f"num_experts must be in [1, {MAX_EXPERTS}] (one thread per expert and one more), got {num_experts}"
    if topk < 1:
        return f"topk must be >= 1, got {topk}"
    return hopper_reason(flat_experts=flat_experts, flat_weights=flat_weights)


@cached_kernel(__file__, cute_utils.__file__)
def _compile_moe_metadata(experts: int, topk: int, pdl: bool):
    m = cute.sym_int()
    return compile_tvm_ffi(
        MoeMetadata(experts, topk, pdl), fake_tensor(Int64, (m,), 8), fake_tensor(Float32, (m,), 4),
        fake_tensor(Int64, (m,), 8), fake_tensor(Int32, (experts,), 4), fake_tensor(Float32, (m,), 4), env_stream(),
    )


def compile_for(experts: int, topk: int, pdl: bool = True):
    """The compiled kernel for ``experts`` experts, ``topk`` and programmatic dependent launch on or off (memory,
    disk or a fresh compile)."""
    return _compile_moe_metadata(experts, topk, pdl)


def moe_metadata(flat_experts: torch.Tensor, flat_weights: torch.Tensor, *, topk: int, num_experts: int,
                 out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, pdl: bool = True):
    """(token [M] int64, offsets [E] int32, row_weights [M] fp32) = ``dsv41::moe_metadata`` (module docstring).

    flat_experts [M] int64, flat_weights [M] fp32, contiguous on one Hopper device, M <= 2048,
    1 <= num_experts <= 1023, topk >= 1. ``out`` optionally supplies the three outputs. ``pdl``: launch as a
    programmatic dependent of the preceding kernel.
    """
    reason = supports(flat_experts, flat_weights, topk=topk, num_experts=num_experts)
    if reason is not None:
        raise ValueError(f"moe_metadata: {reason}")
    m = flat_experts.shape[0]
    specs = (((m,), torch.int64), ((num_experts,), torch.int32), ((m,), torch.float32))
    if out is None:
        out = tuple(flat_experts.new_empty(shape, dtype=dtype) for shape, dtype in specs)
    for i, (o, (shape, dtype)) in enumerate(zip(out, specs, strict=True)):
        reason = shape_reason(f"out[{i}]", o, dtype, shape) or hopper_reason(flat_experts=flat_experts,
                                                                            **{f"out[{i}]": o})
        if reason is not None:
            raise ValueError(f"moe_metadata: {reason}")
    if m == 0:
        out[1].zero_()
    else:
        compile_for(num_experts, topk, pdl)(flat_experts, flat_weights, *out)
    return out
