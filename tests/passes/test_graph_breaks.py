"""A fusion's subgraph split by a Dynamo graph break: the compile report's note for the fusion says so, names the
site (a fused op whose result is an output of its graph) and names the break (the first line of Dynamo's reason,
with the operator of its developer debug context where Dynamo gives one).
The MoE combine is cut from its shared-expert add by `torch._dynamo.graph_break()` or by a `bincount` of the
tokens' rows (a data-dependent shape: the break of Hugging Face's MoE); the outputs still equal eager exactly.
A candidate whose walk reaches an input of its graph is a near miss of kind "graph input"; only where Dynamo has
recorded graph breaks is it "graph break", saying the site may be split by one."""

from __future__ import annotations

import pytest
import torch

from dsv41.backend import make_backend

from .harness import BF16, config, gen, rand

T, K, D = 3, 2, 32


def combine(out, token, shared):
    return torch.zeros(shared.shape[0], out.shape[1], dtype=torch.float32).index_add_(0, token, out.float())


def broken_by_call(out, token, shared):
    y = combine(out, token, shared)
    torch._dynamo.graph_break()
    return (y + shared.float()).to(shared.dtype)


def broken_by_bincount(out, token, shared):
    y = combine(out, token, shared)
    rows = torch.bincount(token, minlength=shared.shape[0])
    return (y + shared.float()).to(shared.dtype), rows


def inputs(seed):
    g = gen(seed)
    return [rand(g, T * K, D), torch.arange(T).repeat_interleave(K), rand(g, T, D)]


@pytest.mark.parametrize("fn, named", [(broken_by_call, "torch._dynamo.graph_break()"), (broken_by_bincount, "Dynamic shape operator (aten.bincount.default)")],
                         ids=["graph_break", "bincount"])
def test_split_combine_is_noted_with_its_break(fn, named):
    torch._dynamo.reset()
    backend = make_backend(config())
    compiled = torch.compile(fn, backend=backend)
    x = inputs(1)
    with torch.no_grad():
        got, want = compiled(*x), fn(*x)
    for g, w in zip(*(v if isinstance(v, tuple) else (v,) for v in (got, want))):
        assert torch.equal(g, w)
    first = backend.reports[0]
    assert first.matches["moe_finalize"] == 1  # the combine alone (fp32 out), its result an output of the graph
    note = first.notes["moe_finalize"]
    assert note.startswith("split by a graph break? %moe_finalize") and "(index_add_only) is an output of this graph" in note
    assert named in note.split("Dynamo's latest graph breaks: ")[1], note
    later = backend.reports[1:]
    assert later and all(r.matches["moe_finalize"] == 0 for r in later)
    torch._dynamo.reset()


def test_no_note_without_a_split():
    """A whole combine in one graph: fused, and no graph-break note however many breaks Dynamo recorded before."""
    torch._dynamo.reset()
    backend = make_backend(config())
    compiled = torch.compile(lambda o, t, s: (combine(o, t, s) + s.float()).to(BF16), backend=backend, fullgraph=True)
    with torch.no_grad():
        compiled(*inputs(2))
    report = backend.reports[-1]
    assert report.matches["moe_finalize"] == 1 and "moe_finalize" not in report.notes
    torch._dynamo.reset()


def norm_relu(x, w):
    """HF's RMSNorm (rounding twice) then relu: mhc_post_pre's double-rounding formulations match the norm and stop
    at x, an input of the graph, where they have the collapse of the mHC streams."""
    xf = x.float()
    return ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-20)).to(BF16) * w).relu()


def scaled_then_broken(x, w):
    x = x * 2
    torch._dynamo.graph_break()
    return norm_relu(x, w)


@pytest.mark.parametrize("fn, kind", [(norm_relu, "graph input"), (scaled_then_broken, "graph break")],
                         ids=["whole", "broken"])
def test_a_candidate_at_a_graph_input_says_graph_break_only_after_a_break(fn, kind):
    torch._dynamo.reset()
    torch._dynamo.utils.counters["graph_break"].clear()
    backend = make_backend(config("mhc_post_pre"))
    g = gen(3)
    with torch.no_grad():
        torch.compile(fn, backend=backend)(rand(g, 2, D), rand(g, D))
    report = backend.reports[-1]
    ((line,),) = (m for name, m in report.near_misses.items() if name == "mhc_post_pre")
    assert f": {kind} after " in line and "found %" in line and "= placeholder (an input of this graph)" in line, line
    assert ("may be split by one" in line) == (kind == "graph break"), line
    note = report.notes.get("mhc_post_pre", "")
    assert note.startswith("split by a graph break? the candidate at %rsqrt") if kind == "graph break" else not note, note
    torch._dynamo.reset()
