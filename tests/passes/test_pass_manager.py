"""The pass manager: order, traced patterns shared per model constants, the DSV41_DISABLE_PASSES override, debug
invariant checks, before/after snapshots, normalisation, defunctionalisation, and the fallback to plain Inductor.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import expecttest
import pytest
import torch
import torch.fx as fx
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dsv41.backend import make_backend
from dsv41.config import FUSIONS
from dsv41.passes import FUSION_ORDER, fusion_pass_class
from dsv41.passes.fusion import GraphPass, PassResult
from dsv41.passes.manager import ACTIVE_RECORDERS, CompileReport, PassManager
from dsv41.passes.printing import graph_code
from dsv41.passes.wo_a import WoAPass

from . import test_moe_route as route_case
from . import test_wo_a as wo_a_case
from .harness import assert_close, compile_fx, config, graph_text, op_counts, run_passes

aten, prims = torch.ops.aten, torch.ops.prims


# ---- order --------------------------------------------------------------------------------------------------------
def test_pass_order():
    names = [p.name for p in PassManager(config()).passes]
    assert names[0] == "normalize" and names[-1] == "defunctionalize"  # nothing runs after defunctionalisation
    assert names[1:1 + len(FUSIONS)] == list(FUSION_ORDER) and set(FUSION_ORDER) == set(FUSIONS)
    assert FUSION_ORDER.index("allreduce_mhc") < FUSION_ORDER.index("mhc_post_pre")  # the specific one first
    assert FUSION_ORDER.index("moe_finalize") < FUSION_ORDER.index("allreduce_mhc")  # combine-only before the TP tail
    # the stable sorts no fusion took restored, scheduling after every fusion, then the choice of implementation
    # (inlined nodes keep the op's stream)
    # (and the decomposition of what the passes wrote, before any scheduling)
    assert names[-5:] == ["restore_stable_sorts", "decompose", "streams", "lower_references", "defunctionalize"]


# ---- names and shared patterns ------------------------------------------------------------------------------------
def test_every_pass_has_a_name():
    pm = PassManager(config())
    names = [p.name for p in pm.passes]
    assert all(names) and len(set(names)) == len(names) and all(isinstance(p, GraphPass) for p in pm.passes)
    assert {name: fusion_pass_class(name).name for name in FUSIONS} == {name: name for name in FUSIONS}


def test_traced_patterns_are_shared_by_passes_of_the_same_model_constants():
    graph = fx.Graph()
    graph.output(None)
    a, b, c = WoAPass(config()), WoAPass(config(max_tokens=8)), WoAPass(config(fp8_block=64))
    for p in (a, b, c):
        p(graph)
    assert a._patterns is b._patterns and a._patterns is not c._patterns


# ---- the report ---------------------------------------------------------------------------------------------------
def test_report_names_each_near_miss_with_its_first_differing_op():
    """A lone RMSNorm (HF's, rounding twice) then relu: the sites that qkv_norm and mhc_post_pre find by their
    distinctive op (rsqrt) match the norm of their double-rounding formulations and stop where this graph lacks the
    rest (mhc_post_pre's collapse: the graph input; qkv_norm's second norm); the report lists each with the step
    that failed, and declines none (nothing matched)."""
    def norm_relu(x, w):
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-20)
        return ((xf * r).to(torch.bfloat16) * w).relu()

    x, w = torch.randn(2, 64).bfloat16(), torch.randn(64).bfloat16()
    torch._dynamo.utils.counters["graph_break"].clear()  # (breaks an earlier test recorded: test_graph_breaks.py)
    _, report = run_passes(norm_relu, [x, w])
    misses = {name: m for name, m in report.near_misses.items() if m}
    assert set(misses) == {"qkv_norm", "mhc_post_pre"} and all(len(m) == 1 for m in misses.values()), misses
    assert re.fullmatch(r"post_pre\w*_bf16_then_weight at %rsqrt: graph input after \d+ of \d+ pattern ops: expected "
                        r"prims::convert_element_type, found %arg0_1 = placeholder \(an input of this graph\)",
                        misses["mhc_post_pre"][0]), misses
    assert re.fullmatch(r"q_kv_norm\w*_bf16_then_weight at %rsqrt: wrong op after \d+ of \d+ pattern ops: no "
                        r"aten::mul\.Tensor downstream of the match for output \w+", misses["qkv_norm"][0]), misses
    assert not any(report.declined.values()) and not any(report.matches.values())
    (miss,) = next(p for p in report.passes if p.name == "mhc_post_pre").attempts  # the op pair, as data too
    assert (miss.anchor, miss.expected, miss.found) == ("rsqrt", "prims::convert_element_type", "placeholder"), miss


def route_exp(h, gate_w, bias, k=route_case.K, scale=route_case.ROUTE_SCALE, temp=1.0):
    """moe_route's `route` formulation (route_with_temperature) with one op changed: the scores' sqrt is an exp."""
    scores = torch.nn.functional.softplus(torch.mm(h.float(), gate_w.float().t()) / temp).exp()
    experts = (scores + bias).topk(k, dim=-1).indices
    w = scores.gather(1, experts)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale, experts


def test_a_planted_miss_is_recorded_once_with_the_changed_op():
    """The route with its sqrt changed to exp does not fuse; its one anchor (the topk) has one record, which names
    the site, the pattern op and the graph op that differ (the part computed another way, which the semantic check
    rejects); nothing else is reported for it and the graph is left as it was."""
    gm, report = run_passes(route_exp, route_case.inputs(0), "moe_route")
    assert report.matches == {"moe_route": 0} and op_counts(gm)["aten.topk"] == 1
    result = next(p for p in report.passes if p.name == "moe_route")
    records = [*result.declined, *result.attempts, *result.unrelated]
    (topk,) = [n.name for n in gm.graph.nodes if n.target is aten.topk.default]
    assert [(r.anchor, r.expected, r.found) for r in records] == [(topk, "aten::sqrt", "aten::exp")], records
    (line,) = report.declined["moe_route"]
    assert re.match(rf"route\w* at %{topk}: semantic: %exp\w* computes the pattern's aten::sqrt another way", line), line
    assert not report.near_misses["moe_route"] and not report.unrelated["moe_route"] and not report.narrowed["moe_route"]


def test_every_anchor_is_fused_or_recorded_once_in_debug_mode():
    """The pass manager's debug check (on in every pass test: harness.config) holds each fusion to its report's
    promise; a pass that loses a record, or records a node twice, is caught there."""
    from dsv41.passes.manager import check_records

    _, report = run_passes(route_exp, route_case.inputs(0), "moe_route")  # the check ran and passed
    result = next(p for p in report.passes if p.name == "moe_route")
    (anchor,) = [f.anchor for f in result.declined]
    check_records([anchor], result)
    for broken in (dataclasses.replace(result, declined=[]), dataclasses.replace(result, attempts=result.declined)):
        with pytest.raises(RuntimeError, match=rf"%{anchor} \(not fused\): [02] records"):
            check_records([anchor], broken)
    with pytest.raises(RuntimeError, match=rf"%{anchor}: a record, not an anchor"):
        check_records([], result)
    fused = dataclasses.replace(result, declined=[], replaced=[{"erased": [anchor]}])
    check_records([anchor], fused)
    with pytest.raises(RuntimeError, match=rf"%{anchor} \(replaced\): 1 records"):
        check_records([anchor], dataclasses.replace(fused, unrelated=result.declined))


def test_every_anchor_of_the_model_is_fused_or_recorded_once():
    """The model's layers 2 and 4 (compressed attention of both ratios, the indexer, the MoE) compiled in debug mode,
    where the pass manager checks after each fusion that every anchor is replaced or has one record (a breach is an
    error, so the backend would fall back): no fallback, and the records name each anchor's module, but for the one
    anchor in the model's own forward, which no submodule holds: the final hc collapse's sum, another computation
    for moe_finalize's per-slot sum."""
    from dsv41.models import TINY, DSV41Model

    torch.manual_seed(0)
    compiled, backend = compile_fx(DSV41Model(TINY, [2, 4], max_batch=4, max_context=128))
    assert backend.config.debug
    with torch.no_grad():
        compiled(torch.tensor([1, 2, 3]), torch.tensor([5, 9, 17]))
    torch._dynamo.reset()
    (report,) = backend.reports
    assert report.fallback is None and report.matches["indexer_topk"] == 2 and report.matches["qkv_norm"] == 2
    records = [(p.name, f) for p in report.passes for f in (*p.attempts, *p.unrelated)]
    at_root = [(name, f.pattern) for name, f in records if f.module is None]
    assert at_root == [("moe_finalize", "slots_unweighted_shared")], at_root
    assert all(f.module.startswith(("layers.2", "layers.4")) for _, f in records if f.module is not None), records
    assert any(report.unrelated.values()) and not any(report.declined.values())


def test_anchors_of_another_computation_are_unrelated_and_grouped():
    """Two routes fused, beside a topk of other math (no softplus/sqrt before it): its anchor is recorded as another
    computation, compactly (one line per pattern op and graph op that differ), and not as a near miss."""
    def two_routes_and_a_topk(h, gate_w, bias, x):
        a = route_case.route_with_temperature(h, gate_w, bias)
        b = route_case.route_with_temperature(h * 2, gate_w, bias)
        return a, b, x.abs().topk(2, dim=-1).indices

    _, report = run_passes(two_routes_and_a_topk, route_case.inputs(0) + [torch.randn(3, 16)], "moe_route")
    result = next(p for p in report.passes if p.name == "moe_route")
    assert report.matches["moe_route"] == 2 and not result.declined and not result.attempts
    (other,) = result.unrelated
    assert other.progress < 2 and other.expected is not None, other
    (line,) = report.unrelated["moe_route"]
    assert line.startswith(f"another computation at %{other.anchor}: ") and f"pattern op {other.expected}" in line, line
    assert report.notes.get("moe_route") is None
    _, report = run_passes(lambda x: x.abs().topk(2, dim=-1).indices, [torch.randn(3, 16)], "moe_route")
    assert report.notes["moe_route"] == "no candidate: the graph's 1 aten::topk is another computation (unrelated)"
    assert len(report.unrelated["moe_route"]) == 1 and not report.near_misses["moe_route"]


# ---- the environment override -------------------------------------------------------------------------------------
def test_disable_passes_env_removes_the_pass(monkeypatch):
    monkeypatch.setenv("DSV41_DISABLE_PASSES", "wo_a, qkv_norm")
    backend = make_backend(mode="fx")
    assert backend.config.fusions == frozenset(FUSIONS) - {"wo_a", "qkv_norm"}
    names = [p.name for p in backend.pass_manager.passes]
    assert "wo_a" not in names and "qkv_norm" not in names and "moe_route" in names

    def f(o, cos, sin, w, h, gate_w, bias):
        return wo_a_case.grouped_einsum(o, cos, sin, w), route_case.route_with_temperature(h, gate_w, bias)

    gm, report = run_passes(f, wo_a_case.inputs(0) + route_case.inputs(0), fusions=backend.config.fusions)
    assert "wo_a" not in report.matches and report.matches["moe_route"] == 1
    assert op_counts(gm)["dsv41.wo_a"] == 0 and op_counts(gm)["aten.bmm"] == 1


def test_disable_passes_env_unknown_name_raises(monkeypatch):
    monkeypatch.setenv("DSV41_DISABLE_PASSES", "wo_a,no_such_pass")
    with pytest.raises(ValueError, match="no_such_pass"):
        make_backend(mode="fx")


def test_disable_passes_env_streams(monkeypatch):
    monkeypatch.setenv("DSV41_DISABLE_PASSES", "streams")
    cfg = make_backend(mode="fx").config
    assert cfg.streams is False and cfg.fusions == frozenset(FUSIONS)


def test_stream_branches_env_and_validation(monkeypatch):
    monkeypatch.setenv("DSV41_STREAM_BRANCHES", "mhc_coeffs, indexer")
    assert make_backend(mode="fx").config.stream_branches == frozenset({"mhc_coeffs", "indexer"})
    monkeypatch.setenv("DSV41_STREAM_BRANCHES", "mhc_coeffs,router")
    with pytest.raises(ValueError, match=r"stream_branches: unknown branch\(es\) \['router'\]"):
        make_backend(mode="fx")


# ---- debug invariant checks ----------------------------------------------------------------------------------------
class DropsMetaPass(GraphPass):
    """Broken on purpose: inserts a node without meta['val']."""

    name = "drops_meta"

    def __call__(self, graph):
        x = next(iter(graph.find_nodes(op="placeholder")))
        with graph.inserting_after(x):
            neg = graph.call_function(aten.neg.default, (x,))
        x.replace_all_uses_with(neg, delete_user_cb=lambda user: user is not neg)
        return PassResult(self.name, matches=1)


class UseBeforeDefPass(GraphPass):
    """Broken on purpose: moves the last compute node to the front, before its inputs."""

    name = "use_before_def"

    def __call__(self, graph):
        last = [n for n in graph.nodes if n.op == "call_function"][-1]
        first = next(n for n in graph.nodes if n.op == "call_function")
        first.prepend(last)
        return PassResult(self.name, matches=1)


def small(x):
    return (x * 2).sin() + 1


@pytest.mark.parametrize("broken, message", [(DropsMetaPass, r"after pass 'drops_meta': nodes without meta\['val'\]"),
                                             (UseBeforeDefPass, r"graph invalid after pass 'use_before_def'")])
def test_debug_mode_names_the_pass_that_broke_the_graph(broken, message):
    from .harness import aten_graph

    pm = PassManager(config(debug=True))
    pm.passes.insert(1, broken(pm.config))
    with pytest.raises(RuntimeError, match=message):
        pm.run(aten_graph(small, torch.randn(4)).graph, CompileReport(graph_id=0))


def test_invariant_checks_are_off_without_debug():
    from .harness import aten_graph

    pm = PassManager(config(debug=False))
    pm.passes.insert(1, DropsMetaPass(pm.config))
    gm = aten_graph(small, torch.randn(4))
    report = pm.run(gm.graph, CompileReport(graph_id=0))
    assert report.passes[1].name == "drops_meta"
    gm.recompile()
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), small(-x))


# ---- snapshots -------------------------------------------------------------------------------------------------------
class Recorder:
    def __init__(self):
        self.graphs, self.snapshots = [], []

    def begin_graph(self, graph_id, passes):
        self.graphs.append((graph_id, [p.name for p in passes]))

    def capture(self, graph):
        return graph_code(graph)

    def snapshot(self, graph_id, index, p, before, after, result):
        self.snapshots.append((graph_id, index, p.name, before, after, result))


def test_snapshots_before_and_after_every_pass():
    pm = PassManager(config())
    assert pm.recorder is None and not ACTIVE_RECORDERS  # off by default: nothing is captured
    pm.recorder = rec = Recorder()
    from .harness import aten_graph

    gm = aten_graph(wo_a_case.grouped_einsum, *wo_a_case.inputs(0))
    pm.run(gm.graph, CompileReport(graph_id=7))
    assert rec.graphs == [(7, [p.name for p in pm.passes])]
    assert [s[2] for s in rec.snapshots] == [p.name for p in pm.passes]
    for (_, _, name, before, after, result), nxt in zip(rec.snapshots, rec.snapshots[1:] + [None]):
        assert result.name == name
        if nxt is not None:
            assert after == nxt[3]  # one pass's after is the next one's before
        assert (before != after) == (name in ("normalize", "wo_a")), name  # normalize canonicalises negative dims
    assert rec.snapshots[-1][4] == graph_code(gm.graph)


# ---- normalisation ---------------------------------------------------------------------------------------------------
def normalisation_graph() -> fx.GraphModule:
    """A graph with every no-op form normalisation removes, plus a reshape form and views that are not no-ops."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    outs = [
        g.call_function(aten.mul.Tensor, (g.call_function(aten.view.default, (x, [2, 4])), 2)),
        g.call_function(aten.add.Tensor, (g.call_function(aten.expand.default, (x, [2, 4])), y)),
        g.call_function(aten.sub.Tensor, (g.call_function(aten.slice.Tensor, (x, 1, 0, 9223372036854775807)), 1)),
        g.call_function(aten.div.Tensor, (g.call_function(prims.convert_element_type.default, (x, torch.float32)), 2)),
        g.call_function(aten.mul.Tensor, (g.call_function(aten.alias.default, (y,)), 3)),
        g.call_function(aten.sum.dim_IntList, (g.call_function(aten._unsafe_view.default, (x, [4, 2])), [0])),
        g.call_function(aten.neg.default, (g.call_function(aten.slice.Tensor, (x, 1, 1, 9223372036854775807)),)),
        g.call_function(prims.convert_element_type.default, (y, torch.bfloat16)),
    ]
    g.output(tuple(outs))
    gm = fx.GraphModule({}, g)
    with FakeTensorMode() as mode:
        FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.randn(2, 4)), mode.from_tensor(torch.randn(2, 4)))
    return gm


def test_normalisation_removes_no_op_views():
    gm = normalisation_graph()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    want = gm(x, y)
    pm = PassManager(config(fusions=frozenset()))
    report = pm.run(gm.graph, CompileReport(graph_id=0))
    assert report.passes[0].name == "normalize" and report.passes[0].matches == 7  # 5 no-ops + 1 reshape form + 1 default written out
    gm.recompile()
    assert_close(gm(x, y), want, atol=0, rtol=0)
    expecttest.assert_expected_inline(graph_text(gm), """\
%x: f32[2, 4] = input
%y: f32[2, 4] = input
%mul_tensor: f32[2, 4] = aten.mul.Tensor(%x, 2)
%add_tensor: f32[2, 4] = aten.add.Tensor(%x, %y)
%sub_tensor: f32[2, 4] = aten.sub.Tensor(%x, 1)
%div_tensor: f32[2, 4] = aten.div.Tensor(%x, 2)
%mul_tensor_1: f32[2, 4] = aten.mul.Tensor(%y, 3)
%_unsafe_view_default: f32[4, 2] = aten.view(%x, [4, 2])
%sum_dim_int_list: f32[2] = aten.sum.dim_IntList(%_unsafe_view_default, [0], False)
%slice_tensor_1: f32[2, 3] = aten.slice.Tensor(%x, 1, 1, 9223372036854775807)
%neg_default: f32[2, 3] = aten.neg(%slice_tensor_1)
%convert_element_type_default_1: bf16[2, 4] = prims.convert_element_type(%y, bf16)
return [%mul_tensor, %add_tensor, %sub_tensor, %div_tensor, %mul_tensor_1, %sum_dim_int_list, %neg_default, %convert_element_type_default_1]
""")


# ---- defunctionalisation -----------------------------------------------------------------------------------------
@torch.library.custom_op("dsv41_test::accumulate_", mutates_args=("acc",))
def accumulate_(acc: Tensor, x: Tensor, alpha: float) -> None:
    """acc += alpha * x (returns nothing)."""
    acc.add_(x, alpha=alpha)


@accumulate_.register_fake
def _(acc, x, alpha):
    return None


@torch.library.custom_op("dsv41_test::add_and_sum_", mutates_args=("acc",))
def add_and_sum_(acc: Tensor, x: Tensor) -> Tensor:
    """acc += x; returns x.sum()."""
    acc.add_(x)
    return x.sum()


@add_and_sum_.register_fake
def _(acc, x):
    return x.new_empty(())


def accumulate_twice(buf, x):
    torch.ops.dsv41_test.accumulate_(buf, x * 2, 0.5)
    torch.ops.dsv41_test.accumulate_(buf, x, 1.0)
    return buf + 1


def add_and_sum(buf, x):
    s = torch.ops.dsv41_test.add_and_sum_(buf, x)
    return buf + 1, s


def compile_and_record(fn, v2: bool):
    """Compile fn in fx mode (auto_functionalized v1 or v2 from AOT), run it once; (backend, recorder, outputs, buf)."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(enable_auto_functionalized_v2=v2):
        compiled, backend = compile_fx(fn)
        backend.pass_manager.recorder = rec = Recorder()
        buf, x = torch.arange(4.0), torch.tensor([1.0, -2.0, 3.0, 0.5])
        with torch.no_grad():
            out = compiled(buf, x)
    torch._dynamo.reset()
    want_buf, xr = torch.arange(4.0), torch.tensor([1.0, -2.0, 3.0, 0.5])
    want = fn(want_buf, xr)
    return backend, rec, out, buf, want, want_buf


def after(rec, name):
    return next(s[4] for s in rec.snapshots if s[2] == name)


def test_defunctionalize_v1_tensor_returning_op():
    backend, rec, out, buf, want, want_buf = compile_and_record(add_and_sum, v2=False)
    report = backend.reports[-1]
    assert report.fallback is None and report.passes[-1].name == "defunctionalize" and report.passes[-1].matches == 1
    code = after(rec, "defunctionalize")
    assert "auto_functionalized" not in code and "dsv41_test.add_and_sum_(acc=%arg0_1" in code
    assert torch.equal(buf, want_buf) and all(torch.equal(a, b) for a, b in zip(out, want))


def test_defunctionalize_golden():
    """The wrapper and its getitems become one in-place call; the mutated buffer's new value is the buffer itself
    (the trailing copy_ into the input is then a self-copy). NB the call's type is the wrapper's tuple: see
    test_defunctionalized_call_carries_its_own_value checks the call's own value (third line)."""
    backend, rec, *_ = compile_and_record(add_and_sum, v2=False)
    expecttest.assert_expected_inline(after(rec, "defunctionalize"), """\
%arg0_1: f32[4] = input
%arg1_1: f32[4] = input
%add_and_sum__default: f32[] = dsv41_test.add_and_sum_(acc=%arg0_1, x=%arg1_1)
%add: f32[4] = aten.add.Tensor(%arg0_1, 1)
%copy_: f32[4] = aten.copy_(%arg0_1, %arg0_1)
return [%add, %add_and_sum__default]
""")


def test_defunctionalized_call_carries_its_own_value():
    backend, rec, *_ = compile_and_record(add_and_sum, v2=False)
    assert "%add_and_sum__default: f32[] = dsv41_test.add_and_sum_(" in after(rec, "defunctionalize")


def test_defunctionalize_v1_op_returning_nothing():
    backend, rec, out, buf, want, want_buf = compile_and_record(accumulate_twice, v2=False)
    assert torch.equal(buf, want_buf) and torch.equal(out, want)  # right either way (the fallback is correct)
    assert backend.reports[-1].fallback is None, backend.reports[-1].fallback
    code = after(rec, "defunctionalize")
    assert "auto_functionalized" not in code and code.count("dsv41_test.accumulate_(") == 2


def test_defunctionalize_default_pipeline():
    backend, rec, out, buf, want, want_buf = compile_and_record(accumulate_twice, v2=True)
    assert torch.equal(buf, want_buf) and torch.equal(out, want)
    assert backend.reports[-1].fallback is None
    code = after(rec, "defunctionalize")
    assert "auto_functionalized" not in code and code.count("dsv41_test.accumulate_(") == 2


def test_inductor_mode_leaves_wrappers_to_inductor():
    pm = PassManager(config(mode="inductor"))
    defunc = pm.passes[-1]
    g = fx.Graph()
    g.output(())
    assert defunc.name == "defunctionalize" and defunc(g).matches == 0


# ---- fallback ------------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_failing_pass_falls_back_to_plain_inductor(monkeypatch, caplog):
    def broken(self, graph):
        raise RuntimeError("injected wo_a failure")

    monkeypatch.setattr(WoAPass, "__call__", broken)
    torch._dynamo.reset()
    f = wo_a_case.grouped_einsum
    compiled, backend = compile_fx(f)
    with caplog.at_level("WARNING", logger="dsv41"):
        x = wo_a_case.inputs(3)
        got = compiled(*x)
    report = backend.reports[-1]
    assert report.fallback == "RuntimeError: injected wo_a failure"
    assert "falls back to plain Inductor" in caplog.text and "injected wo_a failure" in caplog.text
    assert_close(got, f(*x), atol=1.6e-2, rtol=1.6e-2)  # plain Inductor: bf16 tolerance (bit-exact here)
    x = wo_a_case.inputs(4)
    assert_close(compiled(*x), f(*x), atol=1.6e-2, rtol=1.6e-2)
    torch._dynamo.reset()


# ---- the registry -------------------------------------------------------------------------------------------------
def test_every_name_list_derives_from_the_registry():
    import dsv41.lowerings
    from dsv41.passes.registry import FUSIONS as DECLARED, FUSION_NAMES

    assert FUSIONS == FUSION_ORDER == FUSION_NAMES == tuple(f.name for f in DECLARED)
    assert tuple(dsv41.lowerings.ALL_OPS) == FUSION_NAMES
    for f in DECLARED:
        assert str(dsv41.lowerings.ALL_OPS[f.name].default._schema.name) == f.op
        if f.kernel is not None:  # the kernel module of the op exists (imported on CUDA only)
            assert importlib.util.find_spec(f"dsv41.kernels.{f.kernel}") is not None, f.kernel


# ---- a replacement that cannot be built ---------------------------------------------------------------------------
def test_a_replacement_that_raises_declines_its_site_and_raises_in_debug_mode(monkeypatch):
    """A fusion whose replacement raises on a match (a bug of the pass on a spelling it did not foresee) declines that
    site with the error as its reason, the graph left correct; in debug mode (the tests') it raises instead."""
    def broken(self, m):
        raise ValueError("not foreseen")

    monkeypatch.setattr(fusion_pass_class("moe_route"), "replacement", broken)
    f = route_case.route_without_temperature
    gm, report = run_passes(f, route_case.inputs(0), "moe_route", debug=False)
    assert report.matches["moe_route"] == 0 and op_counts(gm)["dsv41.moe_route"] == 0
    (reason,) = report.declined["moe_route"]
    assert "check: the replacement could not be built: ValueError: not foreseen" in reason, reason
    x = route_case.inputs(1)
    assert_close(gm(*x), f(*x), atol=0, rtol=0)
    with pytest.raises(ValueError, match="not foreseen"):
        run_passes(f, route_case.inputs(0), "moe_route")
