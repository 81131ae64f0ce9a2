"""Dynamo's restart signals pass through the backend untouched: they are not failures, so no fallback to plain
Inductor, and Dynamo's retrace reaches the backend again.

Under `dynamic=True` the TINY model's trace raises TensorifyScalarRestartAnalysis inside the backend (measured:
once, then the retrace compiles; ~90 s for one layer, so not run here). The test raises the same signal from the
backend's first compile of a small MoE tail and lets real Dynamo handle it.
"""

from __future__ import annotations

import pytest
import torch

from dsv41.backend import Dsv41Backend, make_backend


def moe_tail(out, token, shared):
    y = torch.zeros(shared.shape, dtype=torch.float32).index_add_(0, token, out.float())
    return (y + shared.float()).to(shared.dtype)


@torch.no_grad()
def test_restart_signal_reaches_dynamo_and_the_retrace_compiles(monkeypatch):
    backend = make_backend(mode="fx")
    real, calls = Dsv41Backend._compile, []

    def compile_once_restarting(self, gm, inputs, report):
        calls.append(len(self.reports))
        if len(calls) == 1:
            raise torch._dynamo.exc.TensorifyScalarRestartAnalysis()
        return real(self, gm, inputs, report)

    monkeypatch.setattr(Dsv41Backend, "_compile", compile_once_restarting)
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(12, 16, generator=g).bfloat16(), torch.randperm(12, generator=g) // 6,
            torch.randn(2, 16, generator=g).bfloat16())
    torch._dynamo.reset()
    got = torch.compile(moe_tail, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    assert calls == [1, 1], "the backend was not called again after the restart"
    assert len(backend.reports) == 1 and backend.reports[0].graph_id == 0
    assert backend.reports[0].fallback is None and backend.reports[0].matches["moe_finalize"] == 1
    assert torch.equal(got, moe_tail(*args))


@pytest.mark.parametrize("signal", [torch._dynamo.exc.RestartAnalysis, torch._dynamo.exc.SpeculationRestartAnalysis,
                                    torch._dynamo.exc.SkipFrame])
def test_every_signal_passes_through(monkeypatch, signal):
    backend = make_backend(mode="fx")

    def raise_signal(self, gm, inputs, report):
        raise signal("signal")

    monkeypatch.setattr(Dsv41Backend, "_compile", raise_signal)
    with pytest.raises(signal):
        backend(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), [])
    assert backend.reports == []


def test_a_real_failure_still_falls_back(monkeypatch, caplog):
    backend = make_backend(mode="fx")

    def broken(self, gm, inputs, report):
        raise RuntimeError("pass bug")

    monkeypatch.setattr(Dsv41Backend, "_compile", broken)
    with torch.no_grad():
        torch._dynamo.reset()
        x = torch.randn(4)
        assert torch.equal(torch.compile(lambda t: t * 2, backend=backend, fullgraph=True)(x), x * 2)
        torch._dynamo.reset()
    assert backend.reports[-1].fallback == "RuntimeError: pass bug" and "falls back to plain Inductor" in caplog.text
