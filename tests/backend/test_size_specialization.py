"""Graphs whose sizes Dynamo made symbolic are compiled statically per set of sizes that recurs
(`dsv41.size_specialization`), so the decode fusions fire at every batch size of `torch.compile(model, backend=...)`
that recurs, not only the first.

The graph is a small MoE tail (`moe_finalize`'s site: M = T * k routed rows, T tokens), compiled in `fx` mode;
outputs are compared with eager bit for bit (the op's reference is the same torch ops on the CPU)."""

from __future__ import annotations

import logging

import pytest
import torch

from dsv41.backend import Dsv41Backend, make_backend


def moe_tail(out, token, shared):
    y = torch.zeros(shared.shape, dtype=torch.float32, device=shared.device).index_add_(0, token, out.float())
    return (y + shared.float()).to(shared.dtype)


def moe_tail_at(out, token, shared, position: int):
    """moe_tail plus an int argument that changes every call (a decode position passed as a Python int)."""
    return moe_tail(out, token, shared) + position


def tail_args(tokens: int, seed: int, k: int = 6, dim: int = 16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens * k, dim, generator=g).bfloat16(), torch.randperm(tokens * k, generator=g) // k,
            torch.randn(tokens, dim, generator=g).bfloat16())


def run(fn, backend, calls, **compile_kw):
    """fn compiled with `backend`, called on each args of `calls`; every output checked against eager."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, **compile_kw)
    with torch.no_grad():
        for args in calls:
            assert torch.equal(compiled(*args), fn(*args))
    torch._dynamo.reset()


def fused(reports):
    return [r.matches.get("moe_finalize") for r in reports]


def test_a_second_batch_size_is_compiled_statically_once_it_recurs():
    """Default dynamic: Dynamo compiles T = 2 statically, then (automatic dynamic) T symbolic at T = 3, which the
    backend compiles as given (the fusion declined) and runs for T = 3 and T = 4 once each; the second call at each
    compiles it statically for those sizes, with the fusion, and later calls reuse that."""
    backend = make_backend(mode="fx")
    run(moe_tail, backend, [tail_args(t, seed) for seed, t in enumerate((2, 3, 4, 3, 4, 3, 4))])
    reports = backend.reports
    assert fused(reports) == [1, 0, 1, 1] and [r.fallback for r in reports] == [None] * 4
    assert [r.sizes for r in reports[:2]] == [None, None]
    (reason,) = reports[1].declined["moe_finalize"]
    assert ": symbolic shape: " in reason
    assert [sorted(set(r.sizes.values())) for r in reports[2:]] == [[3, 18], [4, 24]]  # T and M = T * k


def test_dynamic_true_fuses_from_the_second_call():
    backend = make_backend(mode="fx")
    run(moe_tail, backend, [tail_args(t, seed) for seed, t in enumerate((3, 5, 3, 5, 5))], dynamic=True)
    assert fused(backend.reports) == [0, 1, 1]
    assert [r.sizes is not None for r in backend.reports] == [False, True, True]


def test_sizes_that_never_recur_never_compile():
    """A size new at every call (a cache grown by torch.cat) keeps the symbolic compile: no compile per call."""
    backend = make_backend(mode="fx")
    run(moe_tail, backend, [tail_args(t, t) for t in range(2, 8)], dynamic=True)
    assert fused(backend.reports) == [0]


def test_no_compile_while_capturing(monkeypatch):
    from dsv41 import size_specialization

    monkeypatch.setattr(size_specialization, "_capturing", lambda: True)
    backend = make_backend(mode="fx")
    run(moe_tail, backend, [tail_args(3, seed) for seed in range(3)], dynamic=True)
    assert fused(backend.reports) == [0]


def test_specialize_sizes_0_keeps_the_symbolic_graph_and_says_why(caplog):
    """`specialize_sizes=0`: the graph is compiled as Dynamo gives it, and only so; the fusion is declined as a
    symbolic shape (named in report.declined, with the fix) and a warning says so; the output is eager's."""
    backend = make_backend(mode="fx", specialize_sizes=0)
    run(moe_tail, backend, [tail_args(2, 0), tail_args(3, 1), tail_args(3, 2)], dynamic=True)
    (report,) = backend.reports
    assert report.fallback is None and report.sizes is None and report.matches["moe_finalize"] == 0
    (reason,) = report.declined["moe_finalize"]
    assert ": symbolic shape: " in reason and "dynamic=False" in reason, reason
    assert "has a symbolic token count, so the decode fusions declined" in caplog.text


def test_past_the_limit_sizes_keep_the_symbolic_compile(caplog):
    backend = make_backend(mode="fx", specialize_sizes=2)
    with caplog.at_level(logging.WARNING, logger="dsv41"):
        run(moe_tail, backend, [tail_args(t, seed) for seed, t in enumerate((2, 2, 3, 3, 4, 4, 5, 5, 5))],
            dynamic=True)
    reports = backend.reports
    assert fused(reports) == [0, 1, 1, None, None]
    for r in reports[3:]:
        assert r.fallback == ("runs the symbolic compile: more sets of sizes than specialize_sizes = 2 (raise it, "
                              "or compile with dynamic=False)")
    assert "runs the symbolic compile" in caplog.text


def test_a_symbolic_int_argument_keeps_the_graph_as_dynamo_gives_it():
    """A position passed as an int changes every call, so Dynamo makes it symbolic; specialising on it would
    compile every step, so the graph is compiled as given (its shapes are static here: the fusion still fires)."""
    backend = make_backend(mode="fx")
    args = tail_args(3, 0)
    run(moe_tail_at, backend, [(*args, p) for p in (5, 6, 7, 7)])
    assert fused(backend.reports) == [1, 1] and [r.sizes for r in backend.reports] == [None, None]


def test_a_dynamo_signal_while_specialising_keeps_the_symbolic_compile(monkeypatch):
    """A static compile runs outside Dynamo, where a restart signal cannot restart anything: those sizes keep the
    symbolic compile, on record, and the calls still return eager's output."""
    backend = make_backend(mode="fx")
    real = Dsv41Backend._compile

    def restart_when_specialised(self, gm, inputs, report):
        if report.sizes is not None:
            raise torch._dynamo.exc.TensorifyScalarRestartAnalysis()
        return real(self, gm, inputs, report)

    monkeypatch.setattr(Dsv41Backend, "_compile", restart_when_specialised)
    run(moe_tail, backend, [tail_args(2, seed) for seed in range(3)], dynamic=True)
    assert [r.fallback for r in backend.reports] == [
        None, "runs the symbolic compile: TensorifyScalarRestartAnalysis while compiling for these sizes"]


@pytest.mark.parametrize("value", [-1, True, "8"])
def test_a_bad_limit_names_the_setting(value):
    with pytest.raises((TypeError, ValueError), match="specialize_sizes"):
        make_backend(specialize_sizes=value)



@pytest.mark.gpu
def test_cuda_graph_capture_compiles_nothing_and_replays_eager_values():
    """On CUDA, default (inductor) mode, dynamic=True: T = 3 runs the symbolic compile, its second call compiles T = 3
    statically with the fusion (the moe_finalize kernel); then one CUDA graph captures T = 3 and, twice, T = 5, a size
    seen first inside the capture: nothing is compiled while capturing (T = 5 runs the symbolic compile both times),
    and replays on fresh inputs copied into the captured buffers equal eager within one bf16 ulp (the kernel sums
    the rows in another fp32 order before the rounding)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    backend = make_backend()
    torch._dynamo.reset()
    compiled = torch.compile(moe_tail, backend=backend, fullgraph=True, dynamic=True)

    def cuda_args(tokens, seed):
        return tuple(a.cuda() for a in tail_args(tokens, seed))

    def close(got, args):
        torch.testing.assert_close(got, moe_tail(*args), rtol=2.0**-7, atol=2.0**-7)

    with torch.no_grad():
        compiled(*cuda_args(3, 0))
        at3, at5 = cuda_args(3, 1), cuda_args(5, 2)
        close(compiled(*at3), at3)
        assert fused(backend.reports) == [0, 1]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [compiled(*at3), compiled(*at5), compiled(*at5)]
        assert fused(backend.reports) == [0, 1], "compiled while capturing"
        for seed in (3, 4):
            for buffers, tokens in ((at3, 3), (at5, 5)):
                for buf, new in zip(buffers, cuda_args(tokens, 10 * seed + tokens)):
                    buf.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            for out, args in zip(outs, (at3, at5, at5)):
                close(out, args)
    torch._dynamo.reset()
