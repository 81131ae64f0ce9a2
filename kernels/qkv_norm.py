"""The q and kv RMSNorms of the merged wq_a|wkv output, with the KV RoPE and FP8 fake-quant (spec 2.3), in one launch.

Per token t, with qkv [T, q_dim + kv_dim] bf16 (q_dim = q_lora_rank, kv_dim = head_dim), the norm weights
wq [q_dim], wkv [kv_dim] bf16, optionally cos, sin [T, rd/2] fp32, and quant_block >= 0:

    qr  = rms_norm(qkv[t, :q_dim], wq, eps)                  -> qr [T, q_dim] bf16
    kv  = rms_norm(qkv[t, q_dim:], wkv, eps)                 (bf16)
    kv[-rd:] = bf16(rope(kv[-rd:], cos[t], sin[t]))          interleaved pairs, if cos is given
    kv  = fp8_fake_quant(kv, quant_block)                    ue8m0 scale per block, if quant_block > 0
                                                             -> kv [T, kv_dim] bf16

with the rounding points of ``dsv41.lowerings.qkv_norm.reference`` (``dsv41.models.functional``): fp32 interior,
``rms_norm`` = bf16(w * (x * rsqrt(mean(x^2) + eps))) ("fp32_weight") or bf16(w * bf16(x * rsqrt(...)))
("bf16_then_weight"), the RoPE on the stored bf16 norm output with each product rounded on its own (``mul.rn``:
no fused multiply-add, as torch computes it), its result rounded to bf16, and the quantisation of that.

Layout: one CTA per token (grid x = T); thread i owns the ``vec`` columns [i * vec, (i + 1) * vec) of the token's
qkv row (16-byte vectors at Flash sizes: 1792 columns = 224 threads = 7 warps), so threads below q_dim / vec are
q threads and the rest kv threads, and one vector load per thread brings the whole row in. The two sums of
squares are reduced together: every warp butterflies its q and its kv partial (a warp may hold both parts at
small sizes), one barrier, then every warp sums the per-warp partials of both. A quantisation block is held by
quant_block / vec aligned lanes of one warp, whose amax is a butterfly over them. The weights are read before
the programmatic-dependent-launch wait (they are not the preceding kernel's output); qkv, cos and sin after it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, const_expr

from dsv41.kernels import cute_utils
from dsv41.kernels.compile_cache import (cached_kernel, compile_tvm_ffi, env_stream, fake_tensor, hopper_reason,
                                         shape_reason)

NORM_ROUNDINGS = ("fp32_weight", "bf16_then_weight")  # as dsv41.models.functional.NORM_ROUNDINGS
_VECS = (8, 4, 2)  # columns per thread, widest first (8 bf16: 16-byte loads)
_MAX_THREADS = 1024


def layout(q_dim: int, kv_dim: int, rd: int, quant_block: int) -> tuple[int, int] | str:
    """(vec, threads) of the launch for these sizes (rd = 0: no RoPE; quant_block = 0: no quantisation), or the
    reason there is none. ``vec``: the widest of 8, 4, 2 columns per thread that divides q_dim, kv_dim, rd and
    quant_block (a RoPE pair, and a quantisation block, never straddles two threads)."""
    if q_dim < 1 or kv_dim < 1:
        return f"q_dim and kv_dim must be >= 1, got {q_dim} and {kv_dim}"
    if rd % 2 or not 0 <= rd <= kv_dim:
        return f"rd must be even and in [0, kv_dim = {kv_dim}], got {rd}"
    if quant_block:
        if kv_dim % quant_block:
            return f"quant_block = {quant_block} must divide kv_dim = {kv_dim}"
        if q_dim % quant_block:
            return f"quant_block = {quant_block} must divide q_dim = {q_dim} (a block's lanes are aligned in a warp)"
    for vec in _VECS:
        if q_dim % vec or kv_dim % vec or rd % vec or quant_block % vec:
            continue
        lanes = quant_block // vec
        if lanes & (lanes - 1) or lanes > 32:
            return (f"quant_block = {quant_block} spans {lanes} threads of {vec} columns; the kernel takes a power of "
                    f"two <= 32")
        threads = (q_dim + kv_dim) // vec
        if threads > _MAX_THREADS:
            return (f"q_dim + kv_dim = {q_dim + kv_dim} needs {threads} threads of {vec} columns, more than one CTA "
                    f"holds")
        return vec, threads
    return (f"q_dim = {q_dim}, kv_dim = {kv_dim}, rd = {rd} and quant_block = {quant_block} have no common vector "
            f"width among {_VECS}")


class QkvNorm:
    """The kernel for static sizes and options; the token count is a runtime dimension."""

    def __init__(self, q_dim: int, kv_dim: int, rd: int, quant_block: int, norm_rounding: str, pdl: bool):
        self.q_dim, self.kv_dim, self.rd, self.quant_block = q_dim, kv_dim, rd, quant_block
        self.bf16_then_weight = norm_rounding == "bf16_then_weight"
        self.pdl = pdl
        self.vec, self.threads = layout(q_dim, kv_dim, rd, quant_block)
        self.num_warps = -(-self.threads // 32)

    @cute.jit
    def __call__(self, mQkv: cute.Tensor, mQw: cute.Tensor, mKvw: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor,
                 mQ: cute.Tensor, mKv: cute.Tensor, eps: Float32, stream):
        self.kernel(mQkv, mQw, mKvw, mCos, mSin, mQ, mKv, eps).launch(
            grid=[mQkv.shape[0], 1, 1], block=[self.num_warps * 32, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mQkv: cute.Tensor, mQw: cute.Tensor, mKvw: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor,
               mQ: cute.Tensor, mKv: cute.Tensor, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        vec = self.vec
        tile = (vec,)
        q_vecs = self.q_dim // vec
        kv_vecs = self.kv_dim // vec
        smem = cutlass.memory.SmemAllocator()
        red_buf = smem.allocate_tensor(Float32, cute.make_layout(2 * self.num_warps), byte_alignment=16)

        active = tidx < self.threads
        is_q = tidx < q_vecs
        is_kv = active & (tidx >= q_vecs)
        qc = cutlass.min(tidx, q_vecs - 1)  # in-range indices for the predicated loads
        kc = cutlass.max(cutlass.min(tidx - q_vecs, kv_vecs - 1), 0)

        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        w = (cute_utils.load_vec(cute.tiled_divide(mQw, tile)[None, qc], Float32, pred=is_q)
             + cute_utils.load_vec(cute.tiled_divide(mKvw, tile)[None, kc], Float32, pred=is_kv))
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        x = cute_utils.load_vec(cute.tiled_divide(mQkv[t, None], tile)[None, cutlass.min(tidx, self.threads - 1)],
                                Float32, pred=active)
        cs = None
        if const_expr(self.rd > 0):
            tail0 = (self.kv_dim - self.rd) // vec  # the first kv vector of the RoPE tail
            in_tail = is_kv & (tidx - q_vecs >= tail0)
            pc = cutlass.max(cutlass.min(tidx - q_vecs - tail0, self.rd // vec - 1), 0)
            half = (vec // 2,)
            cs = [_regs(cute_utils.load_vec(cute.tiled_divide(m[t, None], half)[None, pc], pred=in_tail), vec // 2)
                  for m in (mCos, mSin)]

        # the two sums of squares: per warp, then over the warps
        ss = (x * x).reduce(cute.ReductionOp.ADD, 0.0, 0)
        ss_q = cute_utils.warp_sum(cutlass.select_(is_q, ss, Float32(0.0)))
        ss_kv = cute_utils.warp_sum(cutlass.select_(is_q, Float32(0.0), ss))
        if lane == 0:
            red_buf[warp] = ss_q
            red_buf[self.num_warps + warp] = ss_kv
        cute.arch.barrier()
        part_q, part_kv = Float32(0.0), Float32(0.0)
        if lane < self.num_warps:
            part_q = red_buf[lane]
            part_kv = red_buf[self.num_warps + lane]
        total_q = cute_utils.warp_sum(part_q)
        total_kv = cute_utils.warp_sum(part_kv)
        rstd = cutlass.select_(is_q, cute.math.rsqrt(total_q * (1.0 / self.q_dim) + eps, fastmath=True),
                               cute.math.rsqrt(total_kv * (1.0 / self.kv_dim) + eps, fastmath=True))
        v = x * rstd
        if const_expr(self.bf16_then_weight):
            y = w * v.to(BFloat16).to(Float32)
        else:
            y = v * w
        y = _regs(y.to(BFloat16).to(Float32), vec)  # the stored norm output
        if is_q:
            cute_utils.store_vec(y.load(), cute.tiled_divide(mQ[t, None], tile)[None, qc])

        if const_expr(self.rd > 0):
            cos, sin = cs
            for j in cutlass.range_constexpr(vec // 2):
                a, b = y[2 * j], y[2 * j + 1]
                r0 = _mul_rn(a, cos[j]) - _mul_rn(b, sin[j])
                r1 = _mul_rn(a, sin[j]) + _mul_rn(b, cos[j])
                y[2 * j] = cutlass.select_(in_tail, cute_utils.bf16_round(r0), a)
                y[2 * j + 1] = cutlass.select_(in_tail, cute_utils.bf16_round(r1), b)
        out = y.load()
        if const_expr(self.quant_block > 0):
            out = cute_utils.fp8_fake_quant(y, self.quant_block // vec)
        if is_kv:
            cute_utils.store_vec(out, cute.tiled_divide(mKv[t, None], tile)[None, kc])


@cute.jit
def _regs(val: cute.TensorSSA, n: cutlass.Constexpr[int]) -> cute.Tensor:
    """The fp32 vector ``val`` [n] in a register tensor (element access)."""
    r = cute.make_rmem_tensor((n,), Float32)
    r.store(val)
    return r


@cute.jit
def _mul_rn(a: Float32, b: Float32) -> Float32:
    """a * b rounded to fp32 on its own (``mul.rn`` is never contracted into a fused multiply-add)."""
    return cute.arch.inline_ptx("mul.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32],
                                read_only_args=[Float32(a), Float32(b)])


def _rd(cos: torch.Tensor | None) -> int:
    return 0 if cos is None else 2 * cos.shape[-1]


def supports(qkv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor, cos: torch.Tensor | None,
             sin: torch.Tensor | None, *, eps: float, quant_block: int,
             norm_rounding: str = "fp32_weight") -> str | None:
    """None when the kernel computes ``dsv41::qkv_norm`` of these arguments, else the reason it cannot. cos and sin
    may be strided views (the entry point copies them)."""
    if norm_rounding not in NORM_ROUNDINGS:
        return f"norm_rounding must be one of {NORM_ROUNDINGS}, got {norm_rounding!r}"
    if q_weight.dim() != 1 or kv_weight.dim() != 1 or qkv.dim() != 2:
        return (f"q_weight and kv_weight must be 1-D and qkv 2-D, got {list(q_weight.shape)}, {list(kv_weight.shape)} "
                f"and {list(qkv.shape)}")
    if (cos is None) != (sin is None):
        return "cos and sin must both be tensors or both be None"
    t, q_dim, kv_dim = qkv.shape[0], q_weight.shape[0], kv_weight.shape[0]
    checks = [shape_reason("qkv", qkv, torch.bfloat16, (t, q_dim + kv_dim)),
              shape_reason("q_weight", q_weight, torch.bfloat16, (q_dim,)),
              shape_reason("kv_weight", kv_weight, torch.bfloat16, (kv_dim,))]
    if cos is not None:
        checks += [shape_reason(name, x, torch.float32, (t, cos.shape[-1])) for name, x in (("cos", cos), ("sin", sin))]
    for reason in checks:
        if reason is not None:
            return reason
    if not quant_block >= 0:
        return f"quant_block must be >= 0, got {quant_block}"
    config = layout(q_dim, kv_dim, _rd(cos), quant_block)
    if isinstance(config, str):
        return config
    if t * (q_dim + kv_dim) >= 2**31:
        return f"T * (q_dim + kv_dim) = {t * (q_dim + kv_dim)} overflows the kernel's 32-bit indexing"
    reason = hopper_reason(qkv=qkv, q_weight=q_weight, kv_weight=kv_weight)
    for name, x in (("cos", cos), ("sin", sin)):
        if reason is None and x is not None and x.device != qkv.device:
            reason = f"{name} is on {x.device}, not {qkv.device}"
    return reason


@cached_kernel(__file__, cute_utils.__file__)
def _compile_qkv_norm(q_dim: int, kv_dim: int, rd: int, quant_block: int, norm_rounding: str, pdl: bool):
    t = cute.sym_int()
    bf16 = BFloat16
    if rd:
        cos = sin = fake_tensor(Float32, (t, rd // 2))
    else:  # absent: qkv stands in, never read
        cos = sin = fake_tensor(bf16, (cute.sym_int(), q_dim + kv_dim))
    return compile_tvm_ffi(
        QkvNorm(q_dim, kv_dim, rd, quant_block, norm_rounding, pdl),
        fake_tensor(bf16, (t, q_dim + kv_dim)), fake_tensor(bf16, (q_dim,)), fake_tensor(bf16, (kv_dim,)), cos, sin,
        fake_tensor(bf16, (t, q_dim)), fake_tensor(bf16, (t, kv_dim)), Float32(0.0), env_stream(),
    )


def compile_for(q_dim: int, kv_dim: int, rd: int, quant_block: int, norm_rounding: str = "fp32_weight",
                pdl: bool = True):
    """The compiled kernel for these sizes (rd = 0: no RoPE; quant_block = 0: no quantisation), norm rounding and
    programmatic dependent launch on or off (memory, disk or a fresh compile)."""
    config = layout(q_dim, kv_dim, rd, quant_block)
    if isinstance(config, str):
        raise ValueError(f"qkv_norm: {config}")
    if norm_rounding not in NORM_ROUNDINGS:
        raise ValueError(f"qkv_norm: norm_rounding must be one of {NORM_ROUNDINGS}, got {norm_rounding!r}")
    return _compile_qkv_norm(q_dim, kv_dim, rd, quant_block, norm_rounding, pdl)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x itself when contiguous and 16-byte aligned, else a contiguous copy (cos and sin may be strided views)."""
    return x if x.is_contiguous() and x.data_ptr() % 16 == 0 else x.clone(memory_format=torch.contiguous_format)


def qkv_norm(qkv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor, cos: torch.Tensor | None,
             sin: torch.Tensor | None, *, eps: float, quant_block: int, norm_rounding: str = "fp32_weight",
             out: tuple[torch.Tensor, torch.Tensor] | None = None,
             pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(qr [T, q_dim], kv [T, kv_dim]) bf16 = ``dsv41::qkv_norm`` (module docstring).

    qkv [T, q_dim + kv_dim], q_weight [q_dim], kv_weight [kv_dim] bf16, contiguous on one Hopper device; cos, sin
    [T, rd/2] fp32 or both None; quant_block 0 or a divisor of kv_dim and q_dim. ``out`` optionally supplies the
    two outputs. ``pdl``: launch as a programmatic dependent of the preceding kernel (the weights are read before
    waiting for it).
    """
    reason = supports(qkv, q_weight, kv_weight, cos, sin, eps=eps, quant_block=quant_block,
                      norm_rounding=norm_rounding)
    if reason is not None:
        raise ValueError(f"qkv_norm: {reason}")
    t, q_dim, kv_dim = qkv.shape[0], q_weight.shape[0], kv_weight.shape[0]
    if out is None:
        qr, kv = qkv.new_empty((t, q_dim)), qkv.new_empty((t, kv_dim))
    else:
        qr, kv = out
        for name, o, shape in (("out[0]", qr, (t, q_dim)), ("out[1]", kv, (t, kv_dim))):
            reason = shape_reason(name, o, torch.bfloat16, shape) or hopper_reason(qkv=qkv, **{name: o})
            if reason is not None:
                raise ValueError(f"qkv_norm: {reason}")
    if t > 0:
        rd = _rd(cos)
        cos, sin = (_aligned(cos), _aligned(sin)) if rd else (qkv, qkv)
        compile_for(q_dim, kv_dim, rd, quant_block, norm_rounding, pdl)(qkv, q_weight, kv_weight, cos, sin, qr, kv,
                                                                        eps)
    return qr, kv
