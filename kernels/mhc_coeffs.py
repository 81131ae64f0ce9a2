"""mHC coefficients of one site (spec section 2.2): ``hc_mixes`` of ``dsv41.models.functional`` in one launch.

X [T, 4, D] bf16, fn [24, 4D], base [24], scale [3] fp32 -> pre [T, 4], post [T, 4], comb [T, 4, 4] fp32:

    x  = X.reshape(T, K).float(),  K = 4D
    r  = rsqrt(mean(x^2) + norm_eps)                      one statistic per token over all four streams
    m  = (x @ fn^T) * r                                   [T, 24]
    pre  = sigmoid(m[:, 0:4] * scale[0] + base[0:4]) + hc_eps
    post = 2 * sigmoid(m[:, 4:8] * scale[1] + base[4:8])
    comb = softmax(m[:, 8:24].view(4, 4) * scale[2] + base[8:24], over targets) + hc_eps
    comb /= column sums + hc_eps; then (iters - 1) x (row, column) normalisations

Work split: the product is split over K. CTA c owns columns [128c, 128c + 128) of x and fn (D = 5120: 160
CTAs), so the 1.97 MB fp32 weight is read once, spread over the whole GPU, and all of it is requested up
front. Warp w holds rows 6w..6w+5 of its fn slice in registers (16 columns per lane); lanes form groups of
8 that each take one token from the CTA's shared-memory copy of x, form the 6 partial dots and the partial
sum of squares, reduce them over the group with one reduce-scatter butterfly and add them into an fp32
workspace [T, 16, 32] with ``red.global.add`` (CTA c into replica c % 16, which keeps the number of CTAs
adding into one address, and so the serialisation at the L2, small). The last CTA to finish (a device-scope
ticket counter) sums the replicas, runs the sigmoids, the softmax and the Sinkhorn iterations (one thread
per token) and writes the outputs; it zeroes the workspace rows and the counter, so every launch, CUDA-graph
replays included, finds them zero. Launches that share a workspace must therefore be stream-ordered.

With ``pdl`` the kernel is a programmatic dependent launch: it lets the next kernel launch at once, loads its
fn slice (a weight), and only then waits for the preceding kernel before touching x or the workspace.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, const_expr

from dsv41.kernels import cute_utils
from dsv41.kernels.compile_cache import (cached_kernel, compile_tvm_ffi, env_stream, fake_tensor, hopper_reason,
                                         shape_reason)

HC = 4
N_MIX = (2 + HC) * HC  # 24 = 4 pre + 4 post + 16 comb
WS_COLS = 32  # workspace row: 24 dots, the sum of squares, padding

_K_PER_CTA = 128
_GROUP = 8  # lanes per token
_VEC = 8  # columns per vector (16 B of bf16, 32 B of fp32)
_WARPS = 4
_ROWS_PER_WARP = N_MIX // _WARPS  # 6
_TOKENS_PER_BLOCK = 64  # tokens staged in shared memory at a time
_REPLICAS = 16  # workspace copies: CTA c adds into copy c % 16, so ~S/16 CTAs contend for each address


class MhcCoeffs:
    """The coefficient kernel for a static hidden size and Sinkhorn iteration count."""

    def __init__(self, dim: int, iters: int, pdl: bool):
        self.dim = dim
        self.k = HC * dim
        self.iters = iters
        self.pdl = pdl
        self.splits = self.k // _K_PER_CTA

    @cute.jit
    def __call__(self, mX: cute.Tensor, mFn: cute.Tensor, mBase: cute.Tensor, mScale: cute.Tensor,
                 mPre: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor, mWs: cute.Tensor, mCount: cute.Tensor,
                 norm_eps: Float32, hc_eps: Float32, stream):
        self.kernel(mX, mFn, mBase, mScale, mPre, mPost, mComb, mWs, mCount, norm_eps, hc_eps).launch(
            grid=[self.splits, 1, 1], block=[_WARPS * 32, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mFn: cute.Tensor, mBase: cute.Tensor, mScale: cute.Tensor,
               mPre: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor, mWs: cute.Tensor, mCount: cute.Tensor,
               norm_eps: Float32, hc_eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        g = lane % _GROUP  # lane in the token group
        slot = lane // _GROUP  # token group in the warp
        n_tok = mX.shape[0]
        vec = (_VEC,)
        vecs_per_cta = _K_PER_CTA // _VEC  # 16
        halves = _K_PER_CTA // (_GROUP * _VEC)  # 2 vectors per lane and row

        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(BFloat16, cute.make_layout((_TOKENS_PER_BLOCK, _K_PER_CTA), stride=(_K_PER_CTA, 1)),
                                  byte_alignment=16)
        sSums = smem.allocate_tensor(Float32, cute.make_layout((_TOKENS_PER_BLOCK, WS_COLS), stride=(WS_COLS + 1, 1)),
                                     byte_alignment=16)
        s_last = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()

        # This warp's rows of the fn slice, in registers: fn_r[o][h] = fn[6w + o, cols of vector h of this lane].
        # A weight, so it is read before waiting for the preceding kernel.
        fn_r = []
        for o in cutlass.range_constexpr(_ROWS_PER_WARP):
            gFn = cute.tiled_divide(mFn[warp * _ROWS_PER_WARP + o, None], vec)
            fn_r.append([cute_utils.load_vec(gFn[None, cta * vecs_per_cta + h * _GROUP + g]) for h in range(halves)])
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()

        x_flat = cute.make_tensor(mX.iterator, cute.make_layout((n_tok, self.k), stride=(self.k, 1)))
        copy_atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), BFloat16, num_bits_per_copy=128)
        rows_per_pass = _WARPS * 32 // vecs_per_cta  # 8 rows of 16 vectors per pass of the CTA

        for t0 in cutlass.range(0, n_tok, _TOKENS_PER_BLOCK):
            for i in cutlass.range_constexpr(_TOKENS_PER_BLOCK // rows_per_pass):
                r = i * rows_per_pass + tidx // vecs_per_cta
                v = tidx % vecs_per_cta
                if t0 + r < n_tok:
                    cute.copy(copy_atom, cute.tiled_divide(x_flat[t0 + r, None], vec)[None, cta * vecs_per_cta + v],
                              cute.tiled_divide(sX[r, None], vec)[None, v])
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()

            n_blk = cutlass.min(n_tok - t0, _TOKENS_PER_BLOCK)
            for p in cutlass.range(0, n_blk, 32 // _GROUP):
                r = p + slot
                valid = r < n_blk
                sXr = cute.tiled_divide(sX[r, None], vec)
                xs = [cute_utils.load_vec(sXr[None, h * _GROUP + g], Float32, valid) for h in range(halves)]
                parts = []
                for o in cutlass.range_constexpr(_ROWS_PER_WARP):
                    acc = (fn_r[o][0] * xs[0]).reduce(cute.ReductionOp.ADD, 0.0, 0)
                    for h in cutlass.range_constexpr(1, halves):
                        acc = acc + (fn_r[o][h] * xs[h]).reduce(cute.ReductionOp.ADD, 0.0, 0)
                    parts.append(acc)
                sq = (xs[0] * xs[0]).reduce(cute.ReductionOp.ADD, 0.0, 0)
                for h in cutlass.range_constexpr(1, halves):
                    sq = sq + (xs[h] * xs[h]).reduce(cute.ReductionOp.ADD, 0.0, 0)
                parts.append(sq)
                parts.append(Float32(0.0))
                total = cute_utils.transpose_sum(parts, lane, _GROUP)  # lane g: sum of parts[g]
                if valid:
                    t = t0 + r
                    replica = cta % _REPLICAS
                    if g < _ROWS_PER_WARP:
                        cute.arch.red(cute_utils.elem_ptr(mWs, (t, replica, warp * _ROWS_PER_WARP + g)), total,
                                      op="add", dtype=Float32, sem="relaxed", scope="gpu")
                    if g == _ROWS_PER_WARP and warp == 0:
                        cute.arch.red(cute_utils.elem_ptr(mWs, (t, replica, N_MIX)), total,
                                      op="add", dtype=Float32, sem="relaxed", scope="gpu")
            cute.arch.barrier()  # sX is refilled by the next block

        # Ticket: the CTA that takes the last one sees every other CTA's sums.
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        if tidx == 0:
            ticket = cute.arch.atomic_add(mCount.iterator, Int32(1), sem="acq_rel", scope="gpu")
            s_last[0] = Int32(ticket == self.splits - 1)
        cute.arch.barrier()
        if s_last[0] != 0:
            cute.arch.fence_acq_rel_gpu()
            # all of base and scale in flight at once, before any output store could alias them
            base = [mBase[i] for i in range(N_MIX)]
            scale = [mScale[i] for i in range(3)]
            for t0 in cutlass.range(0, n_tok, _TOKENS_PER_BLOCK):
                # Warp w sums the replicas of tokens t0 + w, t0 + w + 4, ... (lane = column, coalesced; read from
                # L2 with relaxed gpu-scope loads), zeroes them and stages the sums in shared memory.
                n_blk = cutlass.min(n_tok - t0, _TOKENS_PER_BLOCK)
                for r in cutlass.range(warp, n_blk, _WARPS):
                    parts = [cute.arch.load(cute_utils.elem_ptr(mWs, (t0 + r, rep, lane)), Float32, sem="relaxed",
                                            scope="gpu") for rep in range(_REPLICAS)]
                    for rep in cutlass.range_constexpr(_REPLICAS):
                        mWs[t0 + r, rep, lane] = Float32(0.0)
                    sSums[r, lane] = cute_utils.tree_sum(parts)
                cute.arch.barrier()
                if tidx < n_blk:
                    self.epilogue(t0 + tidx, [sSums[tidx, i] for i in range(N_MIX + 1)], base, scale, mPre, mPost,
                                  mComb, norm_eps, hc_eps)
                cute.arch.barrier()
            if tidx == 0:
                mCount[0] = Int32(0)

    @cute.jit
    def epilogue(self, t: Int32, sums: list, base: list, scale: list, mPre: cute.Tensor, mPost: cute.Tensor,
                 mComb: cute.Tensor, norm_eps: Float32, hc_eps: Float32):
        """Token t from its 24 dot products and sum of squares: sigmoids, softmax, Sinkhorn; writes the outputs.

        The Sinkhorn iterations are a rolled loop: one thread of one CTA runs this once per launch, so unrolled
        straight-line code would be fetched from L2 line by line (on the H200 that tail took ~25K of the kernel's
        ~34K cycles in ncu at T = 1 and 8).
        """
        r = cute.math.rsqrt(sums[N_MIX] * (1.0 / self.k) + norm_eps, fastmath=True)
        m = [s * r for s in sums[:N_MIX]]
        for i in cutlass.range_constexpr(HC):
            mPre[t, i] = _sigmoid(m[i] * scale[0] + base[i]) + hc_eps
            mPost[t, i] = 2.0 * _sigmoid(m[HC + i] * scale[1] + base[HC + i])

        # c[HC * j + k]: source j, target k; softmax over k, then column / row normalisations.
        c = []
        for j in cutlass.range_constexpr(HC):
            logits = [m[2 * HC + HC * j + k] * scale[2] + base[2 * HC + HC * j + k] for k in range(HC)]
            mx = logits[0]
            for k in cutlass.range_constexpr(1, HC):
                mx = cute.arch.fmax(mx, logits[k])
            e = [cute.math.exp(v - mx) for v in logits]
            den = (e[0] + e[1]) + (e[2] + e[3])
            c += [v / den + hc_eps for v in e]
        c = _normalize_cols(c, hc_eps)
        for _ in cutlass.range(self.iters - 1, unroll=1):
            c = _normalize_cols(_normalize_rows(c, hc_eps), hc_eps)
        for i in cutlass.range_constexpr(HC * HC):
            mComb[t, i // HC, i % HC] = c[i]


def _sigmoid(z: Float32) -> Float32:
    return 1.0 / (1.0 + cute.math.exp(-z))


def _normalize_rows(c: list, eps: Float32) -> list:
    """c [HC * HC] row-major: each row j divided by its sum + eps (as a multiply by the reciprocal)."""
    out = []
    for j in range(HC):
        row = c[HC * j:HC * j + HC]
        inv = 1.0 / (((row[0] + row[1]) + (row[2] + row[3])) + eps)
        out += [v * inv for v in row]
    return out


def _normalize_cols(c: list, eps: Float32) -> list:
    """c [HC * HC] row-major: each column k divided by its sum + eps (as a multiply by the reciprocal)."""
    inv = [1.0 / (((c[k] + c[HC + k]) + (c[2 * HC + k] + c[3 * HC + k])) + eps) for k in range(HC)]
    return [c[i] * inv[i % HC] for i in range(HC * HC)]


def supports(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, norm_eps: float,
             hc_eps: float, iters: int) -> str | None:
    """None when the kernel computes ``hc_mixes`` of these arguments, else the reason it cannot."""
    if x.dim() != 3 or x.shape[1] != HC:
        return f"x must be [T, {HC}, D], got {list(x.shape)}"
    t, _, d = x.shape
    k = HC * d
    for reason in (shape_reason("x", x, torch.bfloat16, (t, HC, d)), shape_reason("fn", fn, torch.float32, (N_MIX, k)),
                   shape_reason("base", base, torch.float32, (N_MIX,)),
                   shape_reason("scale", scale, torch.float32, (3,))):
        if reason is not None:
            return reason
    if k % _K_PER_CTA:
        return f"4 * D must be a multiple of {_K_PER_CTA}, got D = {d}"
    if t * k >= 2**31:
        return f"T * 4 * D = {t * k} overflows the kernel's 32-bit indexing"
    if iters < 1:
        return f"iters must be >= 1, got {iters}"
    return hopper_reason(x=x, fn=fn, base=base, scale=scale)


@cached_kernel(__file__, cute_utils.__file__)
def _compile_mhc_coeffs(dim: int, iters: int, pdl: bool):
    t, cap = cute.sym_int(), cute.sym_int()
    f32 = Float32
    return compile_tvm_ffi(
        MhcCoeffs(dim, iters, pdl),
        fake_tensor(BFloat16, (t, HC, dim)), fake_tensor(f32, (N_MIX, HC * dim)), fake_tensor(f32, (N_MIX,), 4),
        fake_tensor(f32, (3,), 4), fake_tensor(f32, (t, HC)), fake_tensor(f32, (t, HC)), fake_tensor(f32, (t, HC, HC)),
        fake_tensor(f32, (cap, _REPLICAS, WS_COLS)), fake_tensor(Int32, (1,), 4), f32(0.0), f32(0.0), env_stream(),
    )


def compile_for(dim: int, iters: int, pdl: bool = True):
    """The compiled kernel for hidden size ``dim``, ``iters`` Sinkhorn iterations and programmatic dependent
    launch on or off (memory, disk or a fresh compile)."""
    return _compile_mhc_coeffs(dim, iters, pdl)


class _Workspace:
    """Per-device zeroed fp32 sums [capacity, 16 replicas, 32] and the ticket counter; kernels leave both zeroed.

    Grown (never freed, since captured graphs keep the old addresses) when T exceeds the capacity; growing
    allocates and zero-fills, so it must happen outside CUDA-graph capture: call once with the largest T
    before capturing, as a warm-up does.
    """

    def __init__(self):
        self.by_device: dict[int, list[torch.Tensor]] = {}
        self.counters: dict[int, torch.Tensor] = {}

    def get(self, device: torch.device, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        bufs = self.by_device.setdefault(idx, [])
        if not bufs or bufs[-1].shape[0] < t:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"mhc_coeffs: the workspace for T={t} must be allocated before CUDA-graph "
                                   f"capture; call mhc_coeffs once with T >= {t} first")
            cap = max(64, 1 << (t - 1).bit_length())
            bufs.append(torch.zeros((cap, _REPLICAS, WS_COLS), dtype=torch.float32, device=device))
            if idx not in self.counters:
                self.counters[idx] = torch.zeros(1, dtype=torch.int32, device=device)
        return bufs[-1], self.counters[idx]


_WORKSPACE = _Workspace()


def mhc_coeffs(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, norm_eps: float,
               hc_eps: float, iters: int, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               pdl: bool = True):
    """(pre [T, 4], post [T, 4], comb [T, 4, 4]) fp32 = ``hc_mixes(x, fn, base, scale, ...)`` (module docstring).

    x [T, 4, D] bf16; fn [24, 4D], base [24], scale [3] fp32; all contiguous on one CUDA device.
    ``out`` optionally supplies the three output tensors. ``pdl``: launch as a programmatic dependent of the
    preceding kernel (fn, base and scale, being weights, are read before waiting for it).
    """
    reason = supports(x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, iters=iters)
    if reason is not None:
        raise ValueError(f"mhc_coeffs: {reason}")
    t, _, d = x.shape
    if out is None:
        pre = x.new_empty((t, HC), dtype=torch.float32)
        post = x.new_empty((t, HC), dtype=torch.float32)
        comb = x.new_empty((t, HC, HC), dtype=torch.float32)
    else:
        pre, post, comb = out
        for name, o, shape in (("out[0]", pre, (t, HC)), ("out[1]", post, (t, HC)), ("out[2]", comb, (t, HC, HC))):
            reason = shape_reason(name, o, torch.float32, shape) or hopper_reason(x=x, **{name: o})
            if reason is not None:
                raise ValueError(f"mhc_coeffs: {reason}")
    if t > 0:
        ws, count = _WORKSPACE.get(x.device, t)
        compile_for(d, iters, pdl)(x, fn, base, scale, pre, post, comb, ws, count, norm_eps, hc_eps)
    return pre, post, comb
