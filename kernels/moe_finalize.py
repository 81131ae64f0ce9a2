"""The combine of one MoE layer (spec section 2.6): ``dsv41::moe_finalize`` in one launch, without atomics.

expert_out [M, D] bf16 (the expert-sorted rows), token [M] int64 (row m belongs to token token[m]), optionally
weights [M] fp32 and shared [T, D] bf16 -> out [T, D]:

    y[t]   = (((0 + r(m_1)) + r(m_2)) + ... + r(m_n))     m_1 < m_2 < ... < m_n the rows with token[m] = t
    r(m)   = fp32(expert_out[m]) (* weights[m], rounded in fp32 first: vLLM's order)
    out[t] = bf16(y[t] + fp32(shared[t]))  with shared (rounded once),  else y[t] in fp32 (before a TP all-reduce)

the order and roundings of the reference's ``index_add_`` as the CPU runs it (row by row), so the results are
bit-identical to it there (on CUDA the reference's atomics add in any order) and every call, CUDA-graph replays
included, gives the same bits. The product is a ``mul.rn`` so that it is never contracted into an FMA with the sum.

Work split: CTA (t, b) computes token t's columns [1024 b, 1024 b + 1024), one 8-column vector a thread (128
threads). Its warps take turns scanning token 32 rows at a time, a ballot of token[m] == t giving each 32-row group's
mask of token t's rows (shared memory, M / 32 words); then every thread walks the masks alike (uniform, no
divergence), loading the rows they name BATCH at a time across masks (predicated, all in flight before their adds),
so a token's k rows cost one round trip wherever the expert order put them.

With ``pdl`` the kernel is a programmatic dependent launch: it lets the next kernel launch at once and waits for the
preceding one before it reads anything.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from dsv41.kernels import cute_utils
from dsv41.kernels.compile_cache import (cached_kernel, compile_tvm_ffi, env_stream, fake_tensor, hopper_reason,
                                         shape_reason)

MAX_ROWS = 4096  # M: each CTA scans every row's token and holds M / 32 masks in shared memory (decode's row counts)
_VEC = 8  # columns a thread: one 16-byte bf16 vector
_THREADS = 128
_COLS = _THREADS * _VEC  # columns a CTA
_BATCH = 8  # matching rows loaded before their adds


class MoeFinalize:
    """The combine for a static D, with or without ``weights`` and ``shared`` (module docstring)."""

    def __init__(self, dim: int, weighted: bool, with_shared: bool, pdl: bool):
        self.dim = dim
        self.weighted = weighted
        self.with_shared = with_shared
        self.pdl = pdl
        self.blocks = -(-dim // _COLS)  # column blocks a token

    @cute.jit
    def __call__(self, mRows: cute.Tensor, mToken: cute.Tensor, mShared: cute.Tensor, mWeights: cute.Tensor,
                 mOut: cute.Tensor, num_tokens: Int32, stream):
        self.kernel(mRows, mToken, mShared, mWeights, mOut).launch(
            grid=[num_tokens * self.blocks, 1, 1], block=[_THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mRows: cute.Tensor, mToken: cute.Tensor, mShared: cute.Tensor, mWeights: cute.Tensor,
               mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        t = cta // self.blocks
        v = (cta % self.blocks) * _THREADS + tidx  # the thread's 8-column vector
        active = v < self.dim // _VEC
        vc = cutlass.min(v, self.dim // _VEC - 1)
        n_rows = mToken.shape[0]
        vec = (_VEC,)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()

        # the scan: mask g of sMask = the rows 32g .. 32g + 31 that belong to token t (the warps take turns)
        groups = (n_rows + 31) // 32
        smem = cutlass.memory.SmemAllocator()
        sMask = smem.allocate_tensor(Int32, cute.make_layout(MAX_ROWS // 32), byte_alignment=4)
        for scan in cutlass.range(warp, groups, _THREADS // 32):
            m = scan * 32 + lane
            mine = (m < n_rows) & (mToken[cutlass.min(m, n_rows - 1)] == Int64(t))
            mask = cute.arch.vote_ballot_sync(mine)
            if lane == 0:
                sMask[scan] = mask
        cute.arch.barrier()

        # the sum: every thread walks the masks alike, BATCH rows at a time (across masks), in ascending row order
        acc = [Float32(0.0)] * _VEC
        g = Int32(0)
        mask = sMask[0]
        while g < groups:
            rows, present = [], []
            for _ in cutlass.range_constexpr(_BATCH):
                while (mask == 0) & (g < groups - 1):
                    g = g + 1
                    mask = sMask[g]
                present.append(mask != 0)
                rows.append(g * 32 + _lowest_bit(mask))
                mask = mask & (mask - Int32(1))
            if (mask == 0) & (g >= groups - 1):
                g = groups  # every row taken
            vals = [cute_utils.load_vec(cute.tiled_divide(mRows[cutlass.min(rows[j], n_rows - 1), None], vec)[None, vc],
                                        Float32, pred=present[j] & active) for j in range(_BATCH)]
            if const_expr(self.weighted):
                w = [cutlass.select_(present[j], mWeights[cutlass.min(rows[j], n_rows - 1)], Float32(0.0))
                     for j in range(_BATCH)]
            for j in cutlass.range_constexpr(_BATCH):
                # an absent row adds +0.0 (loaded as zeros): y never holds -0.0 (it starts at +0.0 and a
                # round-to-nearest sum is -0.0 only of two -0.0), so that leaves y's bits unchanged
                for i in cutlass.range_constexpr(_VEC):
                    r = vals[j][i]
                    if const_expr(self.weighted):
                        r = _mul_rn(r, w[j])
                    acc[i] = acc[i] + r
        if active:
            dst = cute.tiled_divide(mOut[t, None], vec)[None, v]
            y = cute.make_rmem_tensor(dst.shape, Float32)
            for i in cutlass.range_constexpr(_VEC):
                y[i] = acc[i]
            if const_expr(self.with_shared):
                shared = cute_utils.load_vec(cute.tiled_divide(mShared[t, None], vec)[None, v], Float32)
                cute_utils.store_vec(y.load() + shared, dst)
            else:
                cute_utils.store_vec(y.load(), dst)


@cute.jit
def _lowest_bit(mask: Int32) -> Int32:
    """The index of the lowest set bit of a nonzero ``mask`` (32 for zero, which callers mask off)."""
    return cute.arch.popc((mask & (Int32(0) - mask)) - Int32(1))


@cute.jit
def _mul_rn(a: Float32, b: Float32) -> Float32:
    """a * b rounded to fp32 (mul.rn: never contracted into an FMA with a following add)."""
    return cute.arch.inline_ptx("mul.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b])


def config_reason(dim: int) -> str | None:
    """Why the kernel has no build for hidden size ``dim`` (None when it has)."""
    if dim < _VEC or dim % _VEC:
        return f"D must be a positive multiple of {_VEC} (16-byte rows), got {dim}"
    return None


def supports(expert_out: torch.Tensor, token: torch.Tensor, shared: torch.Tensor | None, *, num_tokens: int,
             weights: torch.Tensor | None = None) -> str | None:
    """None when the kernel computes ``dsv41::moe_finalize`` of these arguments, else the reason it cannot."""
    if expert_out.dim() != 2 or token.dim() != 1:
        return f"expert_out and token must be 2-D and 1-D, got shapes {list(expert_out.shape)}, {list(token.shape)}"
    m, d = expert_out.shape
    checks = [shape_reason("expert_out", expert_out, torch.bfloat16, (m, d)),
              shape_reason("token", token, torch.int64, (m,))]
    if shared is not None:
        checks.append(shape_reason("shared", shared, torch.bfloat16, (num_tokens, d)))
    if weights is not None:
        checks.append(shape_reason("weights", weights, torch.float32, (m,)))
    for reason in checks:
        if reason is not None:
            return reason
    if not 1 <= m <= MAX_ROWS:
        return f"M = {m} rows, the kernel takes 1 to {MAX_ROWS}"
    if num_tokens < 1:
        return f"num_tokens must be >= 1, got {num_tokens}"
    reason = config_reason(d)
    if reason is not None:
        return reason
    optional = {name: x for name, x in (("shared", shared), ("weights", weights)) if x is not None}
    return hopper_reason(expert_out=expert_out, token=token, **optional)


@cached_kernel(__file__, cute_utils.__file__)
def _compile_moe_finalize(dim: int, weighted: bool, with_shared: bool, pdl: bool):
    m, t = cute.sym_int(), cute.sym_int()
    stand_in = fake_tensor(BFloat16, (cute.sym_int(), dim))  # an absent shared or weights: expert_out, never read
    return compile_tvm_ffi(
        MoeFinalize(dim, weighted, with_shared, pdl), fake_tensor(BFloat16, (m, dim)), fake_tensor(Int64, (m,), 8),
        fake_tensor(BFloat16, (t, dim)) if with_shared else stand_in,
        fake_tensor(Float32, (m,), 4) if weighted else stand_in,
        fake_tensor(BFloat16 if with_shared else Float32, (t, dim)), Int32(1), env_stream(),
    )


def compile_for(dim: int, weighted: bool, with_shared: bool, pdl: bool = True):
    """The compiled kernel for hidden size ``dim``, with or without weights and shared (memory, disk or a fresh
    compile)."""
    return _compile_moe_finalize(dim, weighted, with_shared, pdl)


def moe_finalize(expert_out: torch.Tensor, token: torch.Tensor, shared: torch.Tensor | None, *, num_tokens: int,
                 weights: torch.Tensor | None = None, out: torch.Tensor | None = None, pdl: bool = True):
    """out [num_tokens, D] = ``dsv41::moe_finalize`` (module docstring): bf16 with ``shared``, else fp32.

    Contiguous tensors on one Hopper device, 1 <= M <= 4096, num_tokens >= 1, D a multiple of 8; token values in
    [0, num_tokens) (not checked here: no host sync; a row of another value is in no token's sum). ``out``
    optionally supplies the output. ``pdl``: launch as a programmatic dependent of the preceding kernel.
    """
    reason = supports(expert_out, token, shared, num_tokens=num_tokens, weights=weights)
    if reason is not None:
        raise ValueError(f"moe_finalize: {reason}")
    d = expert_out.shape[1]
    dtype = torch.float32 if shared is None else torch.bfloat16
    if out is None:
        out = expert_out.new_empty((num_tokens, d), dtype=dtype)
    else:
        reason = shape_reason("out", out, dtype, (num_tokens, d)) or hopper_reason(expert_out=expert_out, out=out)
        if reason is not None:
            raise ValueError(f"moe_finalize: {reason}")
    kernel = compile_for(d, weights is not None, shared is not None, pdl)
    kernel(expert_out, token, expert_out if shared is None else shared, expert_out if weights is None else weights,
           out, num_tokens)
    return out
