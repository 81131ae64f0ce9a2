"""mHC post of one sublayer fused with the collapse and RMSNorm of the next (spec sections 2.2, 3(d)).

Per token t, with y [T, D], X [T, 4, D] bf16, post [T, 4], comb [T, 4, 4] (comb[j, k]: source j, target k),
pre [T, 4] fp32 and the norm weight w [D] bf16:

    X'[k]  = bf16( post[k] * y + sum_j comb[j, k] * X[j] )            (fp32 math)      -> x_new [T, 4, D]
    u      = bf16( sum_k pre[k] * X'[k] )                              (from the stored bf16 X')
    h      = bf16( (u * rsqrt(mean(u^2) + eps)) * w )                  (fp32 interior)  -> h [T, D]

which is ``rms_norm(hc_collapse(hc_post(y, X, post, comb), pre), w, eps)`` of ``dsv41.models.functional``
with the same rounding points.

Layout: one token per ``cluster_n`` CTAs along grid y (a cluster when ``cluster_n > 1``); each thread owns one
``vec``-wide column slice of y, of the four streams and of the outputs, so all loads are issued up front and every
byte is read or written once. The sum of u^2 is reduced over the warps and, in a cluster, over its CTAs through
DSMEM. ``cluster_for`` picks the layout from the token count (measured).

With ``pdl`` the kernel is a programmatic dependent launch: it lets the next kernel launch at once, loads its
slice of the norm weight, and only then waits for the preceding kernel before reading anything else.
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
_MAX_CLUSTER = 8
_MAX_WARPS = 4  # per CTA in the default cluster layout
_MAX_CTA_WARPS = 32  # a CTA of at most 1024 threads in any layout
LARGE_TOKENS = 64  # from this many tokens on, 2 CTAs per token (``cluster_for``)


def _vec(dim: int) -> int | None:
    """16-byte vectors when dim % 256 == 0, else 8-byte ones (dim % 128 == 0), else None."""
    return next((vec for vec in (8, 4) if dim % (32 * vec) == 0), None)


def _config(dim: int, cluster_n: int | None = None) -> tuple[int, int, int] | None:
    """(vec, warps per CTA, cluster_n) for hidden size ``dim``, or None when unsupported.

    Each thread owns one ``vec``-wide column slice. ``cluster_n=None`` gives the cluster layout: the row is split
    over the smallest cluster that leaves at most 4 warps per CTA (D = 5120: 5 CTAs x 4 warps x 8 columns x 32
    lanes), which spreads a token's bytes over several SMs. Any other ``cluster_n`` that divides the row's warps
    into CTAs of at most 32 warps is accepted too (``cluster_n=1``: one CTA per token, no cluster launch).
    """
    vec = _vec(dim)
    if vec is None:
        return None
    warps_total = dim // (32 * vec)
    if cluster_n is None:
        cluster_n = next((c for c in range(1, _MAX_CLUSTER + 1)
                          if warps_total % c == 0 and warps_total // c <= _MAX_WARPS), None)
        if cluster_n is None:
            return None
    if not 1 <= cluster_n <= _MAX_CLUSTER or warps_total % cluster_n or warps_total // cluster_n > _MAX_CTA_WARPS:
        return None
    return vec, warps_total // cluster_n, cluster_n


def cluster_for(dim: int, tokens: int) -> int:
    """The CTAs per token the entry point launches with: the cluster layout of ``_config`` below ``LARGE_TOKENS``
    tokens, 2 CTAs per token from there on (when the row splits so).

    Measured on the H200 at D = 5120 (benchmarks/results/post_pre_layouts.json, us per call with PDL, CTAs per token
    1 / 2 / 4 / 5): T = 1: 3.29 / 2.75 / 2.42 / 2.33; T = 16: 3.56 / 3.33 / 2.95 / 2.80; T = 32: 3.80 / 3.53 / 3.45 /
    3.30; T = 64: 4.11 / 3.84 / 4.11 / 4.08. Few tokens are latency-bound and gain from spreading a token's 100 KB
    (read and written) over more SMs; at 64 tokens 2 CTAs of 10 warps (128 CTAs, one wave) beat 320 CTAs of 4 warps.
    """
    if tokens >= LARGE_TOKENS and _config(dim, 2) is not None:
        return 2
    return _config(dim)[2]


class MhcPostPre:
    """The fused kernel for a static hidden size; the token count is a runtime dimension."""

    def __init__(self, dim: int, pdl: bool, cluster_n: int):
        self.dim = dim
        self.pdl = pdl
        self.vec, self.num_warps, self.cluster_n = _config(dim, cluster_n)

    @cute.jit
    def __call__(self, mY: cute.Tensor, mX: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor,
                 mPre: cute.Tensor, mW: cute.Tensor, mXo: cute.Tensor, mH: cute.Tensor, eps: Float32,
                 stream):
        self.kernel(mY, mX, mPost, mComb, mPre, mW, mXo, mH, eps).launch(
            grid=[mY.shape[0], self.cluster_n, 1],
            block=[self.num_warps * 32, 1, 1],
            cluster=[1, self.cluster_n, 1] if const_expr(self.cluster_n > 1) else None,
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mX: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor,
               mPre: cute.Tensor, mW: cute.Tensor, mXo: cute.Tensor, mH: cute.Tensor, eps: Float32):
        t, _, _ = cute.arch.block_idx()
        red_buf, mbar = norm_sum_buffers(self.num_warps, self.cluster_n)
        col, w = norm_weight_then_wait(mW, self.vec, self.num_warps, self.pdl)
        vec = (self.vec,)
        y = cute_utils.load_vec(cute.tiled_divide(mY[t, None], vec)[None, col], Float32)
        xs = [cute_utils.load_vec(cute.tiled_divide(mX[t, j, None], vec)[None, col], Float32) for j in range(HC)]
        post = cute_utils.load_vec(mPost[t, None])
        comb = cute_utils.load_vec(mComb[t, None, None])
        pre = cute_utils.load_vec(mPre[t, None])

        post_collapse_norm(y, xs, post, comb, pre, w, eps, mXo, mH, t, col, red_buf, mbar, self.vec, self.num_warps,
                           self.cluster_n, self.dim)


@cute.jit
def norm_sum_buffers(num_warps: cutlass.Constexpr[int], cluster_n: cutlass.Constexpr[int]):
    """The shared memory of the RMSNorm's sum (``cute_utils.cta_or_cluster_sum``): the fp32 partials and, for a
    cluster, its initialised mbarrier (else None). At the kernel's start, before any other shared allocation."""
    smem = cutlass.memory.SmemAllocator()
    red_buf = smem.allocate_tensor(Float32, cute.make_layout(num_warps * cluster_n), byte_alignment=16)
    mbar = smem.allocate_array(cutlass.Int64, num_elems=1, byte_alignment=8) if const_expr(cluster_n > 1) else None
    if const_expr(cluster_n > 1):
        cute_utils.init_cluster_mbarrier(mbar)
    return red_buf, mbar


@cute.jit
def norm_weight_then_wait(mW: cute.Tensor, vec: cutlass.Constexpr[int], num_warps: cutlass.Constexpr[int],
                          pdl: cutlass.Constexpr[bool]):
    """(col, w): this thread's vector index along D (CTA y-index ``rank`` of the token's cluster, ``vec`` columns
    per thread) and its RMSNorm weight vector, fp32. With ``pdl`` the kernel lets its dependents launch and loads
    the weight before it waits for the preceding kernel (a weight is not that kernel's output)."""
    tidx, _, _ = cute.arch.thread_idx()
    _, rank, _ = cute.arch.block_idx()
    if const_expr(pdl):
        cute.arch.griddepcontrol_launch_dependents()
    col = rank * (num_warps * 32) + tidx
    w = cute_utils.load_vec(cute.tiled_divide(mW, (vec,))[None, col], Float32)
    if const_expr(pdl):
        cute.arch.griddepcontrol_wait()
    return col, w


@cute.jit
def post_collapse_norm(y, xs: list, post, comb, pre, w, eps: Float32, mXo: cute.Tensor, mH: cute.Tensor, t: Int32,
                       col: Int32, red_buf: cute.Tensor, mbar, vec: cutlass.Constexpr[int],
                       num_warps: cutlass.Constexpr[int], cluster_n: cutlass.Constexpr[int],
                       dim: cutlass.Constexpr[int]):
    """The post, collapse and RMSNorm of the module docstring for one thread's ``vec`` columns (vector ``col``) of
    token ``t``: y, xs[j] (the HC streams), w as fp32 register vectors, post / comb / pre the token's
    coefficients; stores x_new into mXo[t, :, cols] and h into mH[t, cols]. Every thread of the CTA (or the
    cluster) calls it once: the norm's sum spans them."""
    tile = (vec,)
    u = None
    for k in cutlass.range_constexpr(HC):
        mixed = comb[0, k] * xs[0]
        for j in cutlass.range_constexpr(1, HC):
            mixed = mixed + comb[j, k] * xs[j]
        xk = (post[k] * y + mixed).to(BFloat16)
        cute_utils.store_vec(xk, cute.tiled_divide(mXo[t, k, None], tile)[None, col])
        term = pre[k] * xk.to(Float32)
        u = term if const_expr(k == 0) else u + term
    u = u.to(BFloat16).to(Float32)
    ss = cute_utils.cta_or_cluster_sum((u * u).reduce(cute.ReductionOp.ADD, 0.0, 0), red_buf, mbar, num_warps,
                                       cluster_n)
    rstd = cute.math.rsqrt(ss * (1.0 / dim) + eps, fastmath=True)
    cute_utils.store_vec((u * rstd) * w, cute.tiled_divide(mH[t, None], tile)[None, col])


def supports(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
             norm_weight: torch.Tensor, *, eps: float, norm_rounding: str = "fp32_weight") -> str | None:
    """None when the kernel computes the fused post + pre of these arguments, else the reason it cannot."""
    if norm_rounding != "fp32_weight":
        return f"norm_rounding={norm_rounding!r}: the kernel rounds the RMSNorm once, after the fp32 weight multiply"
    if x.dim() != 3 or x.shape[1] != HC:
        return f"x must be [T, {HC}, D], got {list(x.shape)}"
    t, _, d = x.shape
    for reason in (shape_reason("y", y, torch.bfloat16, (t, d)), shape_reason("x", x, torch.bfloat16, (t, HC, d)),
                   shape_reason("post", post, torch.float32, (t, HC)),
                   shape_reason("comb", comb, torch.float32, (t, HC, HC)),
                   shape_reason("pre", pre, torch.float32, (t, HC)),
                   shape_reason("norm_weight", norm_weight, torch.bfloat16, (d,))):
        if reason is not None:
            return reason
    if _config(d) is None:
        return f"D = {d} is not a multiple of 128 that splits into at most {_MAX_CLUSTER} CTAs of <= {_MAX_WARPS} warps"
    if t * HC * d >= 2**31:
        return f"T * 4 * D = {t * HC * d} overflows the kernel's 32-bit indexing"
    return hopper_reason(y=y, x=x, post=post, comb=comb, pre=pre, norm_weight=norm_weight)


@cached_kernel(__file__, cute_utils.__file__)
def _compile_mhc_post_pre(dim: int, pdl: bool, cluster_n: int):
    t = cute.sym_int()
    bf16 = BFloat16
    return compile_tvm_ffi(
        MhcPostPre(dim, pdl, cluster_n),
        fake_tensor(bf16, (t, dim)), fake_tensor(bf16, (t, HC, dim)), fake_tensor(Float32, (t, HC)),
        fake_tensor(Float32, (t, HC, HC)), fake_tensor(Float32, (t, HC)), fake_tensor(bf16, (dim,)),
        fake_tensor(bf16, (t, HC, dim)), fake_tensor(bf16, (t, dim)), Float32(0.0), env_stream(),
    )


def compile_for(dim: int, pdl: bool = True, cluster_n: int | None = None):
    """The compiled kernel for hidden size ``dim`` with programmatic dependent launch on or off and ``cluster_n``
    CTAs per token (default: the cluster layout of ``_config``), from memory, disk or a fresh compile."""
    layout = _config(dim, cluster_n)
    if layout is None:
        raise ValueError(f"mhc_post_pre: no launch layout for D = {dim} with cluster_n = {cluster_n}")
    return _compile_mhc_post_pre(dim, pdl, layout[2])


def mhc_post_pre(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
                 norm_weight: torch.Tensor, *, eps: float, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 pdl: bool = True, cluster_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_new [T, 4, D] bf16, h [T, D] bf16) = the fused post + collapse + RMSNorm (module docstring).

    y [T, D], x [T, 4, D], norm_weight [D] bf16; post [T, 4], comb [T, 4, 4], pre [T, 4] fp32; all
    contiguous on one CUDA device. ``out`` optionally supplies the two output tensors. ``pdl``: launch as a
    programmatic dependent of the preceding kernel (norm_weight, a weight, is read before waiting for it).
    ``cluster_n``: CTAs per token; default ``cluster_for(D, T)``.
    """
    reason = supports(y, x, post, comb, pre, norm_weight, eps=eps)
    if reason is not None:
        raise ValueError(f"mhc_post_pre: {reason}")
    t, _, d = x.shape
    if out is None:
        x_new, h = torch.empty_like(x), torch.empty_like(y)
    else:
        x_new, h = out
        for name, o, ref in (("out[0]", x_new, x), ("out[1]", h, y)):
            reason = shape_reason(name, o, torch.bfloat16, ref.shape) or hopper_reason(x=x, **{name: o})
            if reason is not None:
                raise ValueError(f"mhc_post_pre: {reason}")
    if t > 0:
        compile_for(d, pdl, cluster_for(d, t) if cluster_n is None else cluster_n)(
            y, x, post, comb, pre, norm_weight, x_new, h, eps)
    return x_new, h
