"""One-shot TP all-reduce of a sublayer output fused with the mHC post, collapse and RMSNorm (spec 2.1, 2.8).

Math, per token t and world size W (ranks 0..W-1 of the group), y_p the partial output of rank p:

    ys     = bf16( ((fp32(y_0) + fp32(y_1)) + ... + fp32(y_{W-1})) [+ fp32(y_add)] )     [T, D]
    x_new, h = mhc_post_pre(ys, x, post, comb, pre, norm_weight, eps)                     (dsv41.kernels.mhc_post_pre)

y [T, D] bf16 (attention) or fp32 (the routed-MoE sum), y_add [T, D] bf16 (the shared expert, replicated) or None.
The partials are summed in rank order in fp32 on every rank, so every rank gets the same bits. At W = 2 this is
bitwise NCCL's result: an fp32 sum of two terms is one correctly rounded, commutative addition, whatever NCCL's
algorithm. At W > 2 NCCL's order differs by chunk and algorithm: the fp32 sums then differ by a few ulps of
sum |y_p|, and ys by one bf16 ulp where that moves the rounding, which `compare_kernel` of
dsv41.lowerings.mhc_post_pre admits (its tolerance for a kernel against the reference; the tests run W <= 2 only). The post/pre part is the mhc_post_pre kernel's arithmetic in its
launch layout (``cluster_for``), so with the same ys it gives the same bits.

Protocol (Lamport one-shot, no barrier; NVLink multicast is not used):

- Buffers. Each rank owns one symmetric buffer (torch.distributed._symmetric_memory, rendezvoused once per group,
  hidden size and device) of 32-bit words, [3 generations][W sources][64 rows][D words]; an fp32 row fills its D
  words, a bf16 row the first D / 2. The kernel gets the W ranks' buffer addresses as an int64 tensor ``peers``
  (``get_remote_tensor(p).data_ptr()``; this rank's own slot is written and read through ``peers[rank]``).
- Sentinel. Every word is armed with 0xFFFFFFFF, a NaN in fp32 and a pair of NaNs in bf16. A writer whose word is
  0xFFFFFFFF (only a NaN input can be) stores 0x7FFFFFFF instead, still NaN in every element, so no real word
  equals the sentinel and NaN still propagates into the sum.
- Generation. ``state`` [2] int32 on each rank: the generation g in {0, 1, 2} of the next call and a CTA
  arrival count. Every thread reads g after the grid-dependency wait; after its last store each CTA takes a ticket
  (atomic add, acq_rel, gpu scope) after a CTA barrier, and the last CTA of the grid resets the count and stores
  (g + 1) % 3. Every CTA has read g before any CTA can arrive last, so a call uses one generation throughout, and
  it lives in device memory, so a CUDA graph replays the sequence without host state.
- Phases of one call, per thread (one ``vec``-wide column slice of one token row, as in mhc_post_pre):
  (1) load its slice of y, store it (st.volatile.global.v4, i.e. relaxed at system scope) into slot
      [g][rank][t] of every rank's buffer, its own included; (2) for p = 0..W-1, spin on ld.volatile.global.v4 of
      its own buffer's slot [g][p][t] until no word is the sentinel (32-bit words are single-copy atomic, so a
      16-byte vector may land word by word and is re-read until whole), then store the sentinel back into those
      words (re-arm); (3) sum in rank order, add y_add, round to bf16, then the mhc_post_pre math.
- Why any replay order and rank skew is safe. A word is written by exactly one writer (rank p, for its slot in
  rank q's buffer) and read and re-armed by exactly one reader (rank q) in the same call, so the rows a call does not
  use (T changes from call to call) stay armed. Rank p's next write of a generation-g word is at call n + 3. To be
  there p must have finished call n + 2, i.e. read q's call-(n + 2) data, which q stores only after its grid
  dependency wait in call n + 2, i.e. after q's call n + 1 and hence call n -- re-arm stores included -- completed.
  So the re-arm of call n precedes, in causal order, p's next write to that word, however far apart the ranks run;
  two generations would already suffice by this chain, three leave a whole call of slack. A rank that runs ahead
  stores into generation g + 1 (a different slot) and spins there until its peer arrives.
- Memory ordering. The data words are their own flags, so no release/acquire pairs are needed within a call: a
  reader accepts a word only once it holds the writer's value (volatile loads are not served from L1). Across calls
  the order comes from kernel completion (all of a grid's stores performed) and the causal chain above. Both ranks
  must make the same sequence of calls with the same T (and dtype) on one stream; a rank that skips a call leaves
  its peers spinning.
- Residency. A spinning CTA must not wait for a peer CTA that cannot be scheduled, so ``supports`` requires the
  whole grid to fit on the GPU at once with room to spare (at most 1024 threads per SM). At D = 5120 the grid is at
  most 315 CTAs of 128 threads (T = 63) or 128 of 320 (T = 64): about a third of an H200's 132 SMs x 1024. PDL: the
  kernel lets its dependents launch at once -- the trigger fires only once every CTA of this grid is running, and
  they wait for its completion before reading -- and reads only the norm weight before its own grid-dependency
  wait.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr

from dsv41.kernels import cute_utils, mhc_post_pre
from dsv41.kernels.compile_cache import (cached_kernel, compile_tvm_ffi, env_stream, fake_tensor, hopper_reason,
                                         shape_reason)
from dsv41.kernels.mhc_post_pre import (HC, _config, cluster_for, norm_sum_buffers, norm_weight_then_wait,
                                        post_collapse_norm)
from dsv41.lowerings.allreduce_mhc import symmetric_memory_enabled

MAX_TOKENS = 64
MAX_WORLD = 8
GENERATIONS = 3
SENTINEL = 0xFFFFFFFF  # an armed word; a writer stores NOT_SENTINEL in its place
NOT_SENTINEL = 0x7FFFFFFF
_VEC = 8  # columns per thread: 16-byte bf16 vectors (D % 256 == 0)
_RESIDENT_THREADS_PER_SM = 1024  # half of Hopper's 2048: the grid must fit at once with room for registers


@cute.jit
def _store_volatile_v4(addr: Int64, words: list):
    cute.arch.inline_ptx("st.volatile.global.v4.u32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[addr, *words])


@cute.jit
def _load_volatile_v4(addr: Int64) -> tuple:
    return cute.arch.inline_ptx("ld.volatile.global.v4.u32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[Uint32] * 4, read_only_args=[addr])


@cute.jit
def _wait_words(addr: Int64) -> tuple:
    """The 4 words at ``addr`` once none of them is the sentinel (spinning on volatile loads)."""
    w0, w1, w2, w3 = _load_volatile_v4(addr)
    while (w0 == Uint32(SENTINEL)) | (w1 == Uint32(SENTINEL)) | (w2 == Uint32(SENTINEL)) | (w3 == Uint32(SENTINEL)):
        w0, w1, w2, w3 = _load_volatile_v4(addr)
    return w0, w1, w2, w3


class AllReduceMhc:
    """The fused kernel for a static hidden size, world size, y dtype and y_add presence; T is a runtime dimension."""

    def __init__(self, dim: int, world: int, y_fp32: bool, has_add: bool, pdl: bool, cluster_n: int):
        self.dim, self.world, self.y_fp32, self.has_add, self.pdl = dim, world, y_fp32, has_add, pdl
        self.vec, self.num_warps, self.cluster_n = _config(dim, cluster_n)
        self.words = self.vec * (4 if y_fp32 else 2) // 4  # 32-bit words of a thread's y slice

    @cute.jit
    def __call__(self, mY: cute.Tensor, mYAdd: cute.Tensor, mX: cute.Tensor, mPost: cute.Tensor,
                 mComb: cute.Tensor, mPre: cute.Tensor, mW: cute.Tensor, mXo: cute.Tensor, mH: cute.Tensor,
                 mPeers: cute.Tensor, mState: cute.Tensor, rank: Int32, eps: Float32, stream):
        self.kernel(mY, mYAdd, mX, mPost, mComb, mPre, mW, mXo, mH, mPeers, mState, rank, eps).launch(
            grid=[mY.shape[0], self.cluster_n, 1],
            block=[self.num_warps * 32, 1, 1],
            cluster=[1, self.cluster_n, 1] if const_expr(self.cluster_n > 1) else None,
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mYAdd: cute.Tensor, mX: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor,
               mPre: cute.Tensor, mW: cute.Tensor, mXo: cute.Tensor, mH: cute.Tensor, mPeers: cute.Tensor,
               mState: cute.Tensor, rank: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        red_buf, mbar = norm_sum_buffers(self.num_warps, self.cluster_n)
        col, w = norm_weight_then_wait(mW, self.vec, self.num_warps, self.pdl)
        vec = (self.vec,)
        gen = cute.arch.load(mState.iterator, Int32, sem="relaxed", scope="gpu")

        # (1) this rank's slice of y into slot [gen][rank][t] of every rank's buffer
        y_src = cute.tiled_divide(mY[t, None], vec)[None, col]
        y_reg = cute.make_rmem_tensor(y_src.shape, y_src.element_type)
        cute.autovec_copy(y_src, y_reg)
        y_words = cute.recast_tensor(y_reg, Uint32)
        sent = [cutlass.select_(y_words[i] == Uint32(SENTINEL), Uint32(NOT_SENTINEL), y_words[i])
                for i in range(self.words)]
        word0 = Int64(col * self.words)
        for q in cutlass.range_constexpr(self.world):
            dst = mPeers[q] + 4 * (self._slot(gen, rank, t) + word0)
            for c in cutlass.range_constexpr(self.words // 4):
                _store_volatile_v4(dst + 16 * c, sent[4 * c:4 * c + 4])

        # the local operands, loaded while the peers' stores are in flight
        y_add = None
        if const_expr(self.has_add):
            y_add = cute_utils.load_vec(cute.tiled_divide(mYAdd[t, None], vec)[None, col], Float32)
        xs = [cute_utils.load_vec(cute.tiled_divide(mX[t, j, None], vec)[None, col], Float32) for j in range(HC)]
        post = cute_utils.load_vec(mPost[t, None])
        comb = cute_utils.load_vec(mComb[t, None, None])
        pre = cute_utils.load_vec(mPre[t, None])

        # (2) every rank's slice from this rank's buffer, in rank order; re-arm what was read
        own = mPeers[rank]
        total = None
        for p in cutlass.range_constexpr(self.world):
            src = own + 4 * (self._slot(gen, Int32(p), t) + word0)
            got = cute.make_rmem_tensor(y_src.shape, y_src.element_type)
            got_words = cute.recast_tensor(got, Uint32)
            for c in cutlass.range_constexpr(self.words // 4):
                ws = _wait_words(src + 16 * c)
                for i in cutlass.range_constexpr(4):
                    got_words[4 * c + i] = ws[i]
            for c in cutlass.range_constexpr(self.words // 4):
                _store_volatile_v4(src + 16 * c, [Uint32(SENTINEL)] * 4)
            part = got.load().to(Float32)
            total = part if const_expr(p == 0) else total + part

        # (3) + y_add, bf16, then the mhc_post_pre math
        if const_expr(self.has_add):
            total = total + y_add
        y = total.to(BFloat16).to(Float32)
        post_collapse_norm(y, xs, post, comb, pre, w, eps, mXo, mH, t, col, red_buf, mbar, self.vec, self.num_warps,
                           self.cluster_n, self.dim)

        # the grid's last CTA moves the generation on (every thread of every CTA has read it by then)
        cute.arch.barrier()
        if tidx == 0:
            ticket = cute.arch.atomic_add(cute_utils.elem_ptr(mState, (1,)), Int32(1), sem="acq_rel", scope="gpu")
            if ticket == mY.shape[0] * self.cluster_n - 1:
                mState[1] = Int32(0)
                mState[0] = (gen + 1) % GENERATIONS

    @cute.jit
    def _slot(self, gen: Int32, src: Int32, t: Int32) -> Int64:
        """Word offset of row ``t`` of source ``src`` in generation ``gen`` of a buffer."""
        return Int64(((gen * self.world + src) * MAX_TOKENS + t) * self.dim)


def buffer_words(world: int, dim: int) -> int:
    """32-bit words of one rank's symmetric buffer."""
    return GENERATIONS * world * MAX_TOKENS * dim


class Workspace:
    """One rank's symmetric buffer for (group, hidden size, device), its peers' addresses and its generation state.

    Created collectively (every rank of the group at the same call, outside CUDA-graph capture): allocated, armed
    with the sentinel, rendezvoused, then a device barrier over the group so no peer writes into a buffer before it
    is armed. Kept for the process's life: captured graphs hold its addresses.
    """

    def __init__(self, group_name: str, dim: int, device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group_name)
        self.world, self.rank = group.size(), group.rank()
        self.buffer = symm_mem.empty(buffer_words(self.world, dim), dtype=torch.int32, device=device)
        self.buffer.fill_(-1)  # 0xFFFFFFFF: SENTINEL
        self.handle = symm_mem.rendezvous(self.buffer, group_name)
        self.remote = [self.handle.get_remote_tensor(p, self.buffer.size(), self.buffer.dtype) for p in range(self.world)]
        self.peers = torch.tensor([r.data_ptr() for r in self.remote], dtype=torch.int64, device=device)
        self.state = torch.zeros(2, dtype=torch.int32, device=device)
        self.handle.barrier()


_WORKSPACES: dict[tuple[str, int, int], Workspace] = {}  # (group_name, D, device index) -> workspace


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def workspace(group_name: str, dim: int, device: torch.device) -> Workspace:
    """The group's workspace for hidden size ``dim`` on ``device``, created (collectively) at the first call."""
    key = (group_name, dim, _device_index(device))
    ws = _WORKSPACES.get(key)
    if ws is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"allreduce_mhc: no symmetric workspace for group {group_name!r} at D = {dim} yet; "
                               "call the op once before CUDA-graph capture (warm-up)")
        ws = _WORKSPACES[key] = Workspace(group_name, dim, device)
    return ws


def group_reason(group_name: str) -> str | None:
    """Why the kernel cannot serve this group (None when it can): opted in, NCCL on CUDA, 1..8 ranks."""
    if not symmetric_memory_enabled(group_name):
        return (f"symmetric memory is not enabled for group {group_name!r} "
                "(dsv41.lowerings.allreduce_mhc.enable_symmetric_memory)")
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(group_name)
    except RuntimeError:
        return f"group {group_name!r} is not a registered process group"
    if group.size() > MAX_WORLD:
        return f"the group has {group.size()} ranks; the kernel serves at most {MAX_WORLD}"
    if "nccl" not in str(torch.distributed.get_backend(group)).lower():
        return f"group {group_name!r} has no CUDA (NCCL) backend"
    return None


def supports(y: torch.Tensor, y_add: torch.Tensor | None, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             pre: torch.Tensor, norm_weight: torch.Tensor, *, eps: float, group_name: str) -> str | None:
    """None when the kernel computes ``dsv41::allreduce_mhc`` of these arguments, else the reason it cannot."""
    if x.dim() != 3 or x.shape[1] != HC:
        return f"x must be [T, {HC}, D], got {list(x.shape)}"
    t, _, d = x.shape
    if y.dtype not in (torch.bfloat16, torch.float32):
        return f"y must be torch.bfloat16 or torch.float32, got {y.dtype}"
    for reason in (shape_reason("y", y, y.dtype, (t, d)),
                   None if y_add is None else shape_reason("y_add", y_add, torch.bfloat16, (t, d)),
                   shape_reason("post", post, torch.float32, (t, HC)),
                   shape_reason("comb", comb, torch.float32, (t, HC, HC)),
                   shape_reason("pre", pre, torch.float32, (t, HC)),
                   shape_reason("norm_weight", norm_weight, torch.bfloat16, (d,))):
        if reason is not None:
            return reason
    if not 1 <= t <= MAX_TOKENS:
        return f"T = {t} tokens; the one-shot kernel serves 1..{MAX_TOKENS}"
    if d % (32 * _VEC) or _config(d) is None:
        return f"D = {d} is not a multiple of 256 that splits into mhc_post_pre's cluster layout"
    reason = group_reason(group_name)
    if reason is not None:
        return reason
    tensors = dict(y=y, x=x, post=post, comb=comb, pre=pre, norm_weight=norm_weight)
    reason = hopper_reason(**tensors, **({} if y_add is None else dict(y_add=y_add)))
    if reason is not None:
        return reason
    cluster_n = cluster_for(d, t)
    threads = t * cluster_n * _config(d, cluster_n)[1] * 32
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    if threads > sms * _RESIDENT_THREADS_PER_SM:
        return (f"the grid ({t * cluster_n} CTAs, {threads} threads) may not be resident at once on {sms} SMs, "
                "which the spinning CTAs need")
    if (group_name, d, _device_index(x.device)) not in _WORKSPACES and torch.cuda.is_current_stream_capturing():
        return (f"no symmetric workspace for group {group_name!r} at D = {d} yet, and it cannot be allocated during "
                "CUDA-graph capture (call the op once before capture)")
    return None


@cached_kernel(__file__, cute_utils.__file__, mhc_post_pre.__file__)  # the layouts come from mhc_post_pre
def _compile_allreduce_mhc(dim: int, world: int, y_fp32: bool, has_add: bool, pdl: bool, cluster_n: int):
    t = cute.sym_int()
    bf16 = BFloat16
    return compile_tvm_ffi(
        AllReduceMhc(dim, world, y_fp32, has_add, pdl, cluster_n),
        fake_tensor(Float32 if y_fp32 else bf16, (t, dim)), fake_tensor(bf16, (t, dim)) if has_add else None,
        fake_tensor(bf16, (t, HC, dim)), fake_tensor(Float32, (t, HC)), fake_tensor(Float32, (t, HC, HC)),
        fake_tensor(Float32, (t, HC)), fake_tensor(bf16, (dim,)), fake_tensor(bf16, (t, HC, dim)),
        fake_tensor(bf16, (t, dim)), fake_tensor(Int64, (world,), 8), fake_tensor(Int32, (2,), 4), Int32(0),
        Float32(0.0), env_stream(),
    )


def compile_for(dim: int, world: int, y_fp32: bool, has_add: bool, pdl: bool = True, cluster_n: int | None = None):
    """The compiled kernel for these static settings (default ``cluster_n``: mhc_post_pre's cluster layout)."""
    layout = _config(dim, cluster_n)
    if layout is None or dim % (32 * _VEC) or not 1 <= world <= MAX_WORLD:
        raise ValueError(f"allreduce_mhc: no build for D = {dim}, world = {world}, cluster_n = {cluster_n}")
    return _compile_allreduce_mhc(dim, world, y_fp32, has_add, pdl, layout[2])


def allreduce_mhc(y: torch.Tensor, y_add: torch.Tensor | None, x: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor, *, eps: float, group_name: str,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_new [T, 4, D] bf16, h [T, D] bf16) = ``dsv41::allreduce_mhc`` (module docstring), one kernel.

    Every rank of ``group_name`` must make the same call (same T, y dtype and y_add presence) in the same order.
    The first call for a (group, D, device) allocates the symmetric workspace collectively, so it must run outside
    CUDA-graph capture. ``out`` optionally supplies the two outputs; ``pdl``: programmatic dependent launch.
    """
    reason = supports(y, y_add, x, post, comb, pre, norm_weight, eps=eps, group_name=group_name)
    if reason is not None:
        raise ValueError(f"allreduce_mhc: {reason}")
    t, _, d = x.shape
    if out is None:
        x_new, h = torch.empty_like(x), torch.empty((t, d), dtype=torch.bfloat16, device=x.device)
    else:
        x_new, h = out
        for name, o, shape in (("out[0]", x_new, x.shape), ("out[1]", h, (t, d))):
            reason = shape_reason(name, o, torch.bfloat16, shape) or hopper_reason(x=x, **{name: o})
            if reason is not None:
                raise ValueError(f"allreduce_mhc: {reason}")
    ws = workspace(group_name, d, x.device)
    kernel = compile_for(d, ws.world, y.dtype == torch.float32, y_add is not None, pdl, cluster_for(d, t))
    kernel(y, y_add, x, post, comb, pre, norm_weight, x_new, h, ws.peers, ws.state, ws.rank, eps)
    return x_new, h
