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
ticket counter) finishes the tokens: a warp per token (four tokens per warp at a time), lane l summing
workspace column l over the replicas and computing pre / post (lanes 0..7) or the softmax of comb element
l - 8 (lanes 8..23, a source row per 4 lanes) into shared memory (``mix``); then one thread per token runs
the Sinkhorn iterations in registers (``finish_comb``) and stores the token's outputs. It zeroes the
workspace rows and the counter, so every launch, CUDA-graph replays included, finds them zero. Launches that
share a workspace must therefore be stream-ordered.

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
_MIN_NORMAL_F32 = 2.0**-126  # the smallest hc_eps finish_comb's rcp.approx.ftz argument holds for
_TAIL_ROWS = 4  # tokens a warp of the last CTA finishes at a time


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
        # the last CTA's per-token pre, post and softmaxed comb, one row per token (padded: thread t reads row t)
        sMix = smem.allocate_tensor(Float32, cute.make_layout((_TOKENS_PER_BLOCK, WS_COLS), stride=(WS_COLS + 1, 1)),
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
            # Lane l's coefficient: base[l] and the scale of its group (lanes 24..31 hold the sum of squares and
            # padding; what they compute is never used). Loaded before any output store could alias them.
            lane_base = mBase[cutlass.min(lane, N_MIX - 1)]
            lane_scale = mScale[cutlass.min(lane // HC, 2)]
            comb_flat = cute.make_tensor(mComb.iterator, cute.make_layout((n_tok, HC * HC), stride=(HC * HC, 1)))
            for t0 in cutlass.range(0, n_tok, _TOKENS_PER_BLOCK):
                n_blk = cutlass.min(n_tok - t0, _TOKENS_PER_BLOCK)
                # Warp w: rows 4w .. 4w + 3, then 16 further on, with no branch: all 64 replica loads in flight
                # together and the four tokens' arithmetic free to interleave. A row past the block works on the
                # block's last row, which this warp also holds (it zeroes that row again, after all the loads, and
                # fills a row of sMix that nothing reads).
                for r0 in cutlass.range(warp * _TAIL_ROWS, n_blk, _WARPS * _TAIL_ROWS):
                    rows = [cutlass.min(r0 + i, n_blk - 1) for i in range(_TAIL_ROWS)]
                    totals = [_replica_sum(mWs, t0 + r, lane) for r in rows]
                    for i in cutlass.range_constexpr(_TAIL_ROWS):
                        for rep in cutlass.range_constexpr(_REPLICAS):
                            mWs[t0 + rows[i], rep, lane] = Float32(0.0)
                        sMix[r0 + i, lane] = self.mix(totals[i], lane, lane_base, lane_scale, norm_eps, hc_eps)
                cute.arch.barrier()
                if tidx < n_blk:
                    pre_post = [sMix[tidx, i] for i in range(2 * HC)]
                    self.finish_comb([sMix[tidx, 2 * HC + i] for i in range(HC * HC)], comb_flat[t0 + tidx, None],
                                     hc_eps)
                    _store(pre_post[:HC], mPre[t0 + tidx, None])
                    _store(pre_post[HC:], mPost[t0 + tidx, None])
                cute.arch.barrier()
            if tidx == 0:
                mCount[0] = Int32(0)

    @cute.jit
    def mix(self, total: Float32, lane: Int32, lane_base: Float32, lane_scale: Float32, norm_eps: Float32,
            hc_eps: Float32) -> Float32:
        """One warp, one token, lane l holding ``total``, the sum of workspace column l: pre[l] (l < 4), post[l - 4]
        (l < 8) or comb element l - 8 after the softmax + hc_eps (source (l - 8) // 4, target l % 4: a source row
        is an aligned group of 4 lanes, so its max and sum are two butterfly shuffles each, the sum in the order
        (e0 + e1) + (e2 + e3)). Lanes 24..31 return values nothing uses."""
        sq = cute.arch.shuffle_sync(total, N_MIX)  # lane 24: the sum of squares
        z = total * cute.math.rsqrt(sq * (1.0 / self.k) + norm_eps, fastmath=True) * lane_scale + lane_base
        is_comb = lane >= 2 * HC
        mx = cute.arch.fmax(z, cute.arch.shuffle_sync_bfly(z, offset=1))
        mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
        e = cute.math.exp(cutlass.select_(is_comb, z - mx, -z))
        den = e + cute.arch.shuffle_sync_bfly(e, offset=1)
        den = den + cute.arch.shuffle_sync_bfly(den, offset=2)
        # pre = 1 / (1 + e) + hc_eps, post = 2 / (1 + e), comb = e / den + hc_eps (den >= 1: the row max gives 1),
        # through rcp.approx (<= 1 ulp: post, the largest, off by <= 2^-22 = 2.4e-7 against the 1e-5 tolerance)
        q = cute.arch.rcp_approx(cutlass.select_(is_comb, den, 1.0 + e))
        return cutlass.select_(is_comb, e * q + hc_eps, cutlass.select_(lane < HC, q + hc_eps, 2.0 * q))

    @cute.jit
    def finish_comb(self, c: list, gComb: cute.Tensor, hc_eps: Float32):
        """One thread: the Sinkhorn normalisations of one token's comb c [16] (softmax + hc_eps, row-major), in
        registers, stored to gComb [16] (vectorised). The iterations are a rolled loop: one CTA runs this once per
        launch, so unrolled code would be fetched from L2 line by line.

        Rows and columns are multiplied by ``rcp.approx.ftz`` reciprocals of their sums + hc_eps, at most 1 ulp
        (2^-23 relative) off; with hc_eps a normal fp32 (the model's is 1e-6) the sums lie in [hc_eps, ~4], clear
        of the subnormals that .ftz flushes and of overflow. Each of the 2 * iters - 1 normalisations (39 at the
        model's 20) thus scales an entry by a factor within 2^-23 of the exact one; even added up, ignoring the
        contraction Sinkhorn gives, that is 39 * 2^-23 = 4.6e-6 relative on entries <= 1 + hc_eps, a twentieth of
        the 1e-4 comb tolerance (the kernel test's plain-torch model, every reciprocal biased by 1 ulp, stays
        within a quarter of the tolerances of ``hc_mixes``).

        The IEEE reciprocal this replaces compiled to a branch to a slow path inside a convergence region of its
        own, which serialised the four independent reciprocals of each normalisation. SASS (sm_90a, D = 5120) of
        the last-CTA path, ticket to exit: before, 1163 instructions + 2 slow-path subroutines (36 call sites),
        the loop body 192 with 8 reciprocal regions one after another; now 562 with no call, the loop body 75,
        its dependent chain 2 x (3 FADD, MUFU.RCP, FMUL).
        """
        c = _normalize_cols(c, hc_eps)
        for _ in cutlass.range(self.iters - 1, unroll=1):
            c = _normalize_cols(_normalize_rows(c, hc_eps), hc_eps)
        _store(c, gComb)


@cute.jit
def _store(vals: list, dst: cute.Tensor):
    """The fp32 scalars ``vals`` into the contiguous ``dst`` of as many elements (vectorised)."""
    r = cute.make_rmem_tensor((len(vals),), Float32)
    for i in cutlass.range_constexpr(len(vals)):
        r[i] = vals[i]
    cute.autovec_copy(r, dst)


@cute.jit
def _replica_sum(mWs: cute.Tensor, t: Int32, lane: Int32) -> Float32:
    """Workspace column ``lane`` of token t summed over the replicas (relaxed gpu-scope loads, all in flight)."""
    return cute_utils.tree_sum([cute.arch.load(cute_utils.elem_ptr(mWs, (t, rep, lane)), Float32, sem="relaxed",
                                               scope="gpu") for rep in range(_REPLICAS)])


def _normalize_rows(c: list, eps: Float32) -> list:
    """c [HC * HC] row-major: each row j multiplied by the approximate reciprocal of its sum + eps."""
    out = []
    for j in range(HC):
        row = c[HC * j:HC * j + HC]
        inv = cute.arch.rcp_approx(((row[0] + row[1]) + (row[2] + row[3])) + eps)
        out += [v * inv for v in row]
    return out


def _normalize_cols(c: list, eps: Float32) -> list:
    """c [HC * HC] row-major: each column k multiplied by the approximate reciprocal of its sum + eps."""
    inv = [cute.arch.rcp_approx(((c[k] + c[HC + k]) + (c[2 * HC + k] + c[3 * HC + k])) + eps) for k in range(HC)]
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
    if not _MIN_NORMAL_F32 <= hc_eps < float("inf"):
        return f"hc_eps must be a normal fp32 (>= {_MIN_NORMAL_F32:.3g}) for the kernel's rcp.approx.ftz, got {hc_eps}"
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
