"""The one-shot all-reduce + mHC post/pre kernel (dsv41.kernels.allreduce_mhc).

CPU: it compiles for sm_90a for both y dtypes, with and without y_add and PDL, at world sizes 1, 2 and 8 and in both
mhc_post_pre layouts; its PTX holds exactly the protocol's memory operations (volatile 16-byte stores to every
rank's buffer, volatile spin loads and re-arm stores of its own, one ticket atomic, no multimem); `supports` and the
entry explain what they decline.
1 GPU (gpu, a 1-rank NCCL group: the protocol through the rank's own buffer) and 2 GPUs (multi_gpu, one process
per GPU), NCCL: against NCCL all-reduce + the mhc_post_pre kernel, bit for bit
(W <= 2: an fp32 sum of two terms is one correctly rounded addition, in any order, and the post/pre is the same
arithmetic in the same layout), and against the plain-torch reference within mhc_post_pre's kernel tolerance; T
grows and shrinks from call to call and one rank (alternating) is delayed before every call; attention (bf16 y) and
MoE (fp32 y + bf16 y_add) calls interleave. The CUDA-graph stress test is test_allreduce_mhc_stress.py.
"""

import os
import re
import socket
import time

import pytest
import torch

from tests.kernels.support import assert_compiles_fresh, require_cute_dsl, tokens_from_env

require_cute_dsl()

from dsv41.kernels import allreduce_mhc as K  # noqa: E402
from dsv41.lowerings import allreduce_mhc as L  # noqa: E402

EPS = 1e-20
# (dim, world, y_fp32, has_add, pdl, cluster_n): the Flash layouts below and at 64 tokens, the MoE form, 8 ranks,
# without PDL, one rank at a small D
BUILDS = [(5120, 2, False, False, True, 5), (5120, 2, True, True, True, 2), (5120, 8, False, True, True, 5),
          (5120, 2, True, False, False, 5), (256, 1, False, False, True, 1)]


@pytest.mark.parametrize("build", BUILDS, ids=lambda b: "D{}-W{}-{}{}-pdl{}-c{}".format(
    b[0], b[1], "fp32" if b[2] else "bf16", "+add" if b[3] else "", int(b[4]), b[5]))
def test_compiles_for_sm90a(build, monkeypatch, tmp_path):
    assert_compiles_fresh(monkeypatch, tmp_path, K._compile_allreduce_mhc, build, K.compile_for)


@pytest.mark.parametrize(("world", "y_fp32"), [(2, True), (3, False)])
def test_ptx_holds_the_protocol(world, y_fp32, monkeypatch, tmp_path):
    """Per thread: one 16-byte volatile store per 16 bytes of y to each of the W buffers, and for each source its
    spin (the first load and the loop's reload) and re-arm of the same words; one relaxed load of the generation and
    one acq_rel ticket; NVLink multicast never appears."""
    import cutlass.cute as cute

    from dsv41.kernels import compile_cache

    monkeypatch.setattr(K, "compile_tvm_ffi", lambda kernel, *args: cute.compile(
        kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {compile_cache.target_arch()} --keep-ptx "
                              f"--dump-dir {tmp_path}"))
    ptx = K._compile_allreduce_mhc.__wrapped__(5120, world, y_fp32, True, True, 5).__ptx__
    vectors = 2 if y_fp32 else 1  # 16-byte vectors of a thread's 8 columns of y
    stores = re.findall(r"st\.volatile\.global\.v4\.u32 \[%rd\d+\], \{([^}]*)\}", ptx)
    rearm = [s for s in stores if s.replace(" ", "") == "-1,-1,-1,-1"]
    assert len(stores) - len(rearm) == world * vectors
    assert len(rearm) == world * vectors
    assert len(re.findall(r"ld\.volatile\.global\.v4\.u32", ptx)) == 2 * world * vectors
    assert len(re.findall(r"ld\.relaxed\.gpu\.global\.b32", ptx)) == 1
    assert len(re.findall(r"atom\.global\.acq_rel\.add", ptx)) == 1
    assert "multimem" not in ptx and "griddepcontrol.wait" in ptx


@pytest.mark.parametrize("has_add", [False, True])
def test_compiled_entry_takes_the_launch_arguments(has_add):
    """The binary's calling convention is the entry's: 13 arguments, y_add None when absent (CPU tensors pass the
    arity and reach the device check)."""
    t, d = 2, 256
    f = K.compile_for(d, 2, has_add, has_add, True, 1)
    bf16 = dict(dtype=torch.bfloat16)
    y = torch.zeros(t, d) if has_add else torch.zeros(t, d, **bf16)
    args = [y, torch.zeros(t, d, **bf16) if has_add else None, torch.zeros(t, 4, d, **bf16), torch.zeros(t, 4),
            torch.zeros(t, 4, 4), torch.zeros(t, 4), torch.zeros(d, **bf16), torch.zeros(t, 4, d, **bf16),
            torch.zeros(t, d, **bf16), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), 0, EPS]
    with pytest.raises(ValueError, match="expected device_type=cuda"):
        f(*args)
    with pytest.raises(TypeError, match="Expects 13 parameters"):
        f(*args[:-1])


def _inputs(t, dim, seed, moe, device="cpu", rank=0):
    """Stream operands shared by every rank (seed) and y (and y_add) as rank ``rank``'s partial."""
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(t, 4, dim, generator=g)).bfloat16()
    post = 2 * torch.sigmoid(torch.randn(t, 4, generator=g))
    comb = torch.softmax(torch.randn(t, 4, 4, generator=g), dim=-1)
    pre = torch.sigmoid(torch.randn(t, 4, generator=g)) + 1e-6
    w = (1 + 0.1 * torch.randn(dim, generator=g)).bfloat16()
    y_add = torch.randn(t, dim, generator=g).bfloat16() if moe else None
    gy = torch.Generator().manual_seed(seed * 1009 + rank + 1)
    y = torch.randn(t, dim, generator=gy)
    y = y if moe else y.bfloat16()
    return [None if a is None else a.to(device) for a in (y, y_add, x, post, comb, pre, w)]


def test_supports_explains(gloo_group, monkeypatch):
    args = _inputs(2, 256, 0, moe=True)
    y, y_add, x, post, comb, pre, w = args
    kw = dict(eps=EPS, group_name=gloo_group)
    assert K.supports(*args, **kw).startswith("symmetric memory is not enabled for group")
    L.enable_symmetric_memory(gloo_group)
    try:
        assert K.supports(*args, **kw) == f"group {gloo_group!r} has no CUDA (NCCL) backend"
        big = _inputs(65, 256, 0, moe=False)
        assert K.supports(*big, **kw) == "T = 65 tokens; the one-shot kernel serves 1..64"
        assert "not a multiple of 256" in K.supports(y[:, :128], y_add[:, :128], x[..., :128], post, comb, pre,
                                                     w[:128], **kw)
        assert K.supports(y.double(), *args[1:], **kw) == "y must be torch.bfloat16 or torch.float32, got torch.float64"
        assert "y_add must have shape [2, 256]" in K.supports(y, y_add[:1], *args[2:], **kw)
        assert "comb must have shape [2, 4, 4]" in K.supports(y, y_add, x, post, comb[:, :3], pre, w, **kw)

        class NineRanks:
            def size(self):
                return 9

        monkeypatch.setattr("torch.distributed.distributed_c10d._resolve_process_group", lambda name: NineRanks())
        assert K.supports(*args, **kw) == "the group has 9 ranks; the kernel serves at most 8"
        monkeypatch.undo()
        with pytest.raises(ValueError, match="allreduce_mhc: group .* has no CUDA \\(NCCL\\) backend"):
            K.allreduce_mhc(*args, **kw)
    finally:
        L.enable_symmetric_memory(gloo_group, enabled=False)
    assert not L.symmetric_memory_enabled(gloo_group)


def test_compile_for_rejects():
    with pytest.raises(ValueError, match="no build for D = 128, world = 2"):
        K.compile_for(128, 2, False, False)
    with pytest.raises(ValueError, match="no build for D = 5120, world = 9"):
        K.compile_for(5120, 9, False, False)


def test_bench_needs_two_gpus(capsys, tmp_path):
    from dsv41.tools.bench_kernels import main

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found >= 2:
        pytest.skip("two GPUs present: the benchmark would run")
    assert main(["--op", "allreduce_mhc", "--out", str(tmp_path)]) == 1
    assert f"needs 2 CUDA devices (one TP rank each), found {found}" in capsys.readouterr().out


# ---- 2 GPUs ------------------------------------------------------------------------------------------------------

# token counts call by call: growing and shrinking, both layouts (5 CTAs per token below 64, 2 at 64)
CALL_TOKENS = tokens_from_env("1,7,64,3,16,64,1,33,2,64,5")
DIM = 5120
# one rank on one GPU (gpu: the whole protocol through its own buffer) and two ranks (multi_gpu)
WORLDS = [pytest.param(1, marks=pytest.mark.gpu, id="1rank"),
          pytest.param(2, marks=pytest.mark.multi_gpu, id="2ranks")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, fn, *args):
    """One spawned rank: ``backend`` (NCCL on GPU ``rank``, or gloo), the WORLD group opted in to the fused kernel,
    then fn(rank, world, group_name, *args); the group is torn down however fn ends."""
    import torch.distributed as dist

    device = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = dict(device_id=torch.device("cuda", rank))
    dist.init_process_group(backend, rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", **device)
    try:
        group_name = dist.group.WORLD.group_name
        L.enable_symmetric_memory(group_name)
        fn(rank, world, group_name, *args)
        if backend == "nccl":
            torch.cuda.synchronize()
        dist.barrier()
    finally:
        dist.destroy_process_group()


_HUNG: list[str] = []  # a spawn that did not finish: later ones skip (a hung kernel would hang each in turn)


def spawn(fn, *args, world=2, timeout_s=None, backend="nccl"):
    """Run fn on ``world`` GPUs, one process each; an exception in any rank fails the test, and so does a run past
    ``timeout_s`` (default $DSV41_SPAWN_TIMEOUT_S or 120 s: a protocol hang), after which its ranks are killed and the
    remaining spawning tests of the session skip."""
    import torch.multiprocessing as mp

    if _HUNG:
        pytest.skip(f"an earlier allreduce_mhc run hung ({_HUNG[0]}); not starting another")
    timeout_s = timeout_s or float(os.environ.get("DSV41_SPAWN_TIMEOUT_S", "120"))
    ranks = mp.spawn(_worker, args=(world, _free_port(), backend, fn, *args), nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not ranks.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in ranks.processes:
                process.kill()
            _HUNG.append(f"{fn.__name__} on {world} rank(s), {timeout_s:.0f} s")
            pytest.fail(f"{fn.__name__} on {world} rank(s) did not finish in {timeout_s:.0f} s; its ranks were killed")


def _sleep_forever(rank, world, group_name):
    time.sleep(3600)


def test_a_hung_run_fails_and_is_killed(monkeypatch):
    """The watchdog of `spawn` (CPU, gloo): a run past its deadline fails the test, its ranks are killed, and later
    spawns skip."""
    monkeypatch.setattr(f"{__name__}._HUNG", [])
    with pytest.raises(pytest.fail.Exception, match="_sleep_forever on 2 rank\\(s\\) did not finish in 2 s"):
        spawn(_sleep_forever, timeout_s=2, backend="gloo")
    assert _HUNG == ["_sleep_forever on 2 rank(s), 2 s"]
    with pytest.raises(pytest.skip.Exception, match="an earlier allreduce_mhc run hung"):
        spawn(_sleep_forever, timeout_s=2, backend="gloo")


def _delay(rank, call):
    """Rank call % 2 sleeps on the GPU before the call (about 20 us at H200 clocks), so its peer waits for it."""
    if rank == call % 2:
        torch.cuda._sleep(40_000)


def _check_against_nccl(rank, world, group_name):
    from dsv41.kernels.mhc_post_pre import mhc_post_pre
    from dsv41.lowerings.allreduce_mhc import reduce, reference
    from dsv41.lowerings.mhc_post_pre import compare_kernel

    for call, t in enumerate(CALL_TOKENS * 2):
        moe = call % 3 == 1
        y, y_add, x, post, comb, pre, w = _inputs(t, DIM, call, moe, device="cuda", rank=rank)
        out = (torch.full_like(x, float("nan")), torch.full((t, DIM), float("nan"), dtype=torch.bfloat16,
                                                              device="cuda"))
        _delay(rank, call)
        got = K.allreduce_mhc(y, y_add, x, post, comb, pre, w, eps=EPS, group_name=group_name, out=out)
        ys = reduce(y, y_add, group_name)
        nccl = mhc_post_pre(ys, x, post, comb, pre, w, eps=EPS)
        for name, g, n in zip(("x_new", "h"), got, nccl, strict=True):
            assert torch.equal(g, n), (f"rank {rank} call {call} (T={t}, moe={moe}): {name} differs from NCCL + "
                                       f"mhc_post_pre at {(g != n).sum().item()} of {n.numel()} elements")
        mismatch = compare_kernel(got, reference(y, y_add, x, post, comb, pre, w, EPS, group_name))
        assert mismatch is None, f"rank {rank} call {call} (T={t}): against the reference: {mismatch}"


@pytest.mark.parametrize("world", WORLDS)
def test_matches_nccl_with_delayed_ranks(world):
    spawn(_check_against_nccl, world=world)


def _check_op_choice(rank, world, group_name):
    """The op picks the kernel (impl auto and cute) once the group is opted in, the NCCL path with impl reference,
    and all three agree; inside `checking()` the kernel call is judged against the reference."""
    from dsv41.lowerings import ALL_OPS, _kernels

    op = ALL_OPS["allreduce_mhc"]
    y, y_add, x, post, comb, pre, w = _inputs(4, DIM, 11, True, device="cuda", rank=rank)
    args = (y, y_add, x, post, comb, pre, w, EPS, group_name)
    with _kernels.checking() as calls:
        auto = op(*args, impl="auto")
    assert [c.kernel for c in calls] == ["allreduce_mhc"] and calls[0].mismatch is None, calls
    cute_out, ref = op(*args, impl="cute"), op(*args, impl="reference")
    assert all(torch.equal(a, b) for a, b in zip(auto, cute_out))
    assert L.compare_kernel(auto, ref) is None


@pytest.mark.parametrize("world", WORLDS)
def test_op_chooses_the_kernel(world):
    spawn(_check_op_choice, world=world)


def _check_graph_capture(rank, world, group_name):
    """Captured after a warm-up call (the workspace exists), replayed with fresh inputs and one rank delayed."""
    from dsv41.kernels.mhc_post_pre import mhc_post_pre
    from dsv41.lowerings.allreduce_mhc import reduce

    t = 16
    static = _inputs(t, DIM, 0, False, device="cuda", rank=rank)
    K.allreduce_mhc(*static, eps=EPS, group_name=group_name)  # warm-up: compile, workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _delay(rank, 0)
        outs = K.allreduce_mhc(*static, eps=EPS, group_name=group_name)
    for seed in range(1, 6):
        for dst, src in zip(static, _inputs(t, DIM, seed, False, device="cuda", rank=rank), strict=True):
            if dst is not None:
                dst.copy_(src)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        want = mhc_post_pre(reduce(static[0], None, group_name), *static[2:], eps=EPS)
        assert all(torch.equal(g, n) for g, n in zip(outs, want)), f"rank {rank} replay {seed}"


@pytest.mark.parametrize("world", WORLDS)
def test_captured_replays_with_fresh_inputs(world):
    spawn(_check_graph_capture, world=world)
