"""Graphs whose sizes Dynamo made symbolic are compiled statically per set of sizes (`dsv41.size_specialization`),
so the decode fusions fire at every batch size of `torch.compile(model, backend=...)`, not only the first.

The graph is a small MoE tail (`moe_finalize`'s site: M = T * k routed rows, T tokens), compiled in `fx` mode;
outputs are compared with eager bit for bit (the op's reference is the same torch ops on the CPU)."""

from __future__ import annotations

import logging

import pytest
import torch

from dsv41.backend import Dsv41Backend, make_backend


def moe_tail(out, token, shared):
    y = torch.zeros(shared.shape, dtype=torch.float32).index_add_(0, token, out.float())
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


def test_a_second_batch_size_is_compiled_statically_and_fuses():
    """Default dynamic: Dynamo compiles T = 2 statically, then (automatic dynamic) T symbolic at T = 3; the backend
    compiles that graph for T = 3 and T = 4 at their first calls, each with the fusion, and reuses them."""
    backend = make_backend(mode="fx")
    run(moe_tail, backend, [tail_args(2, 0), tail_args(3, 1), tail_args(4, 2), tail_args(3, 3), tail_args(4, 4)])
    reports = backend.reports
    assert [r.matches["moe_finalize"] for r in reports] == [1, 1, 1]
    assert [r.fallback for r in reports] == [None, None, None]
    assert reports[0].sizes is None
    assert [sorted(set(r.sizes.values())) for r in reports[1:]] == [[3, 18], [4, 24]]  # T and M = T * k


def test_dynamic_true_fuses_from_the_first_call():
    backend = make_backend(mode="fx")
    run(moe_tail, backend, [tail_args(3, 0), tail_args(5, 1)], dynamic=True)
    assert [r.matches["moe_finalize"] for r in backend.reports] == [1, 1]
    assert all(r.sizes for r in backend.reports)


def test_specialize_sizes_0_keeps_the_symbolic_graph_and_says_why(caplog):
    """`specialize_sizes=0`: the graph is compiled as Dynamo gives it; the fusion is declined as a symbolic shape
    (named in report.declined, with the fix) and a warning says so; the output is eager's."""
    backend = make_backend(mode="fx", specialize_sizes=0)
    run(moe_tail, backend, [tail_args(2, 0), tail_args(3, 1)], dynamic=True)
    (report,) = backend.reports
    assert report.fallback is None and report.sizes is None and report.matches["moe_finalize"] == 0
    (reason,) = report.declined["moe_finalize"]
    assert ": symbolic shape: " in reason and "dynamic=False" in reason, reason
    assert "has a symbolic token count, so the decode fusions declined" in caplog.text


def test_past_the_limit_the_captured_graph_runs_uncompiled(caplog):
    backend = make_backend(mode="fx", specialize_sizes=2)
    with caplog.at_level(logging.WARNING, logger="dsv41"):
        run(moe_tail, backend, [tail_args(t, t) for t in (2, 3, 4, 5, 5)], dynamic=True)
    reports = backend.reports
    assert [r.matches.get("moe_finalize") for r in reports] == [1, 1, None, None]
    for r in reports[2:]:
        assert r.fallback == ("runs uncompiled: more sets of sizes than specialize_sizes = 2 (raise it, or compile "
                              "with dynamic=False)")
    assert "runs uncompiled" in caplog.text


def test_a_symbolic_int_argument_keeps_the_graph_as_dynamo_gives_it():
    """A position passed as an int changes every call, so Dynamo makes it symbolic; specialising on it would
    compile every step, so the graph is compiled as given (its shapes are static here: the fusion still fires)."""
    backend = make_backend(mode="fx")
    args = tail_args(3, 0)
    run(moe_tail_at, backend, [(*args, p) for p in (5, 6, 7)])
    reports = backend.reports
    assert len(reports) == 2 and [r.sizes for r in reports] == [None, None]
    assert [r.matches["moe_finalize"] for r in reports] == [1, 1]


def test_a_dynamo_signal_while_specialising_runs_uncompiled(monkeypatch):
    """A static compile runs outside Dynamo, where a restart signal cannot restart anything: those sizes run the
    captured graph, on record, and the call still returns eager's output."""
    backend = make_backend(mode="fx")
    real = Dsv41Backend._compile

    def restart_when_specialised(self, gm, inputs, report):
        if report.sizes is not None:
            raise torch._dynamo.exc.TensorifyScalarRestartAnalysis()
        return real(self, gm, inputs, report)

    monkeypatch.setattr(Dsv41Backend, "_compile", restart_when_specialised)
    run(moe_tail, backend, [tail_args(2, 0), tail_args(3, 1)], dynamic=True)
    assert [r.fallback for r in backend.reports] == [
        "runs uncompiled: TensorifyScalarRestartAnalysis while compiling for these sizes"] * 2


@pytest.mark.parametrize("value", [-1, True, "8"])
def test_a_bad_limit_names_the_setting(value):
    with pytest.raises((TypeError, ValueError), match="specialize_sizes"):
        make_backend(specialize_sizes=value)
