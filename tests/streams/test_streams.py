"""The side-stream schedule on synthetic graphs (CPU): invariants, golden, execution."""

import torch
import torch.fx as fx
from expecttest import assert_expected_inline
from torch.fx.experimental.proxy_tensor import make_fx

import dsv41.lowerings  # noqa: F401
from dsv41.passes.printing import graph_code
from dsv41.passes.streams import STREAM, check_schedule, record_event, schedule_streams, wait_event
from dsv41 import stream_executor
from dsv41.stream_executor import StreamExecutor, serialized_streams

T, HC, D = 2, 4, 32
ops = torch.ops.dsv41


def layer(x, fn_w, base, scale, w1, w2, y):
    """A sublayer: mHC coefficients, main work (two GEMMs), a shared-expert-like branch into moe_finalize."""
    pre, post, comb = ops.mhc_coeffs(x, fn_w, base, scale, 1e-20, 1e-6, 20)
    h = torch.mm(y, w1)
    shared = torch.mm(torch.relu(torch.mm(y, w2)), w2.t()[:, :D].t())
    routed = torch.mm(h, w1.t())
    out = ops.moe_finalize(routed, torch.arange(T), shared, T)
    x_new, h2 = ops.mhc_post_pre(out, x, post, comb, pre, torch.ones(D, dtype=torch.bfloat16), 1e-20)
    return x_new, h2


def inputs():
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    return (torch.randn(T, HC, D, generator=g).to(bf), torch.randn(24, HC * D, generator=g) * 0.05, torch.randn(24, generator=g),
            torch.randn(3, generator=g), (torch.randn(D, D, generator=g) * 0.1).to(bf), (torch.randn(D, D, generator=g) * 0.1).to(bf),
            torch.randn(T, D, generator=g).to(bf))


def traced() -> fx.GraphModule:
    return make_fx(layer, tracing_mode="fake")(*inputs())


def test_schedule_invariants_and_golden():
    gm = traced()
    result = schedule_streams(gm.graph, max_tokens=16)
    assert result.matches == 2, [r["pattern"] for r in result.replaced]
    assert sorted(r["pattern"] for r in result.replaced) == ["mhc_coeffs", "shared_expert"]
    assert check_schedule(gm.graph) == []
    gm.graph.lint()
    code = "\n".join(line for line in graph_code(gm.graph).splitlines() if "stream" in line or "event" in line)
    assert_expected_inline(code, """\
%record_event_2 = record_event(2)
%wait_event_2 = wait_event(2)  @stream1
%mm_1: bf16[2, 32] = aten.mm(%y_1, %w2_1)  @stream1
%relu: bf16[2, 32] = aten.relu(%mm_1)  @stream1
%t: bf16[32, 32] = aten.t(%w2_1)  @stream1
%alias: bf16[32, 32] = aten.alias(%t)  @stream1
%t_1: bf16[32, 32] = aten.t(%alias)  @stream1
%mm_2: bf16[2, 32] = aten.mm(%relu, %t_1)  @stream1
%record_event_3 = record_event(3)  @stream1
%record_event = record_event(0)
%wait_event = wait_event(0)  @stream2
%mhc_coeffs: (f32[2, 4], f32[2, 4], f32[2, 4, 4]) = dsv41.mhc_coeffs(%x_1, %fn_w_1, %base_1, %scale_1, 1e-20, 1e-06, 20)  @stream2
%getitem: f32[2, 4] = getitem(%mhc_coeffs, 0)  @stream2
%getitem_1: f32[2, 4] = getitem(%mhc_coeffs, 1)  @stream2
%getitem_2: f32[2, 4, 4] = getitem(%mhc_coeffs, 2)  @stream2
%record_event_1 = record_event(1)  @stream2
%wait_event_3 = wait_event(3)
%wait_event_1 = wait_event(1)""")


def test_only_the_configured_branch_kinds_move():
    gm = traced()
    result = schedule_streams(gm.graph, max_tokens=16, branches=frozenset({"shared_expert"}))
    assert result.matches == 1 and [r["pattern"] for r in result.replaced] == ["shared_expert"]
    assert check_schedule(gm.graph) == []
    coeffs = next(n for n in gm.graph.nodes if n.target is ops.mhc_coeffs.default)
    assert coeffs.meta[STREAM] == 0
    assert schedule_streams(traced().graph, max_tokens=16, branches=frozenset()).matches == 0


def cached_layer(x, fn_w, base, scale, w1, w2, y, cache, side_reads_cache):
    """`layer` plus a decode cache update on the main path (`cache[0] = h[0]`, read back after the update), as the
    model writes its KV caches; with `side_reads_cache` the shared-expert branch also reads the old cache."""
    pre, post, comb = ops.mhc_coeffs(x, fn_w, base, scale, 1e-20, 1e-6, 20)
    w2_in = w2 + cache[:1].sum() if side_reads_cache else w2
    h = torch.mm(y, w1)
    cache.index_put_((torch.zeros(1, dtype=torch.int64),), h[:1])
    shared = torch.mm(torch.relu(torch.mm(y, w2_in)), w2.t()[:, :D].t())
    routed = torch.mm(h + cache[:T], w1.t())
    out = ops.moe_finalize(routed, torch.arange(T), shared, T)
    return ops.mhc_post_pre(out, x, post, comb, pre, torch.ones(D, dtype=torch.bfloat16), 1e-20)


def traced_cached(side_reads_cache: bool) -> fx.GraphModule:
    """Functionalised, decomposed and dead-code-eliminated like AOT (so Inductor can compile it): the cache update
    becomes index_put plus a write-back copy_ at the end."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.func import functionalize

    def fn(*args):
        return cached_layer(*args, side_reads_cache=side_reads_cache)
    cache = torch.zeros(8, D, dtype=torch.bfloat16)
    gm = make_fx(functionalize(fn, remove="mutations"), tracing_mode="fake",
                 decomposition_table=select_decomp_table())(*inputs(), cache)
    gm.graph.eliminate_dead_code()  # the decompositions leave unused converts; AOT removes them too
    gm.recompile()
    return gm


def _write_back(gm):
    return next(n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default)


def test_write_back_moves_to_its_producer():
    gm = traced_cached(side_reads_cache=False)
    copy = _write_back(gm)
    assert copy.next.op == "output"  # functionalisation writes back at the end
    result = schedule_streams(gm.graph, max_tokens=16)
    assert result.matches == 3
    assert [r["pattern"] for r in result.replaced] == ["mhc_coeffs", "shared_expert", "write-back"]
    assert copy.prev.target is torch.ops.aten.index_put.default and copy.prev is copy.args[1]
    assert check_schedule(gm.graph) == []
    gm.graph.lint()
    gm.recompile()
    args = (*inputs(), torch.zeros(8, D, dtype=torch.bfloat16))
    want_cache = args[-1].clone()
    want = cached_layer(*inputs(), want_cache, side_reads_cache=False)
    executor = StreamExecutor(gm, lambda sub, fake: (lambda a: sub(*a)))
    got = executor(list(args))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(args[-1], want_cache)


def test_hoisted_write_back_lets_inductor_update_the_cache_in_place(monkeypatch):
    """The point of the hoist: with the write-back in its update's segment, Inductor reinplaces the update into the
    cache; left at the end it emits a full copy of the cache and a copy back, two more kernels (CPU Inductor)."""
    from torch._inductor import metrics

    from dsv41.backend import make_backend
    from dsv41.passes import streams

    def kernels(hoist: bool) -> int:
        gm = traced_cached(side_reads_cache=False)
        with monkeypatch.context() as m:
            if not hoist:
                m.setattr(streams, "hoist_write_backs", lambda graph, result: None)
            schedule_streams(gm.graph, max_tokens=16)
        gm.recompile()
        metrics.reset()
        StreamExecutor(gm, make_backend(mode="inductor")._compile_graph)
        return metrics.generated_kernel_count

    assert kernels(hoist=True) == kernels(hoist=False) - 2


def test_write_back_stays_when_a_side_stream_reads_the_old_value():
    gm = traced_cached(side_reads_cache=True)
    result = schedule_streams(gm.graph, max_tokens=16)
    assert result.matches == 2 and sorted(r["pattern"] for r in result.replaced) == ["mhc_coeffs", "shared_expert"]
    assert _write_back(gm).next.op == "output"
    assert check_schedule(gm.graph) == []


def test_check_schedule_finds_a_write_back_racing_a_side_reader():
    gm = traced_cached(side_reads_cache=True)
    schedule_streams(gm.graph, max_tokens=16)
    copy = _write_back(gm)
    copy.args[1].append(copy)  # what hoisting must not do: the side branch may still read the old cache
    problems = check_schedule(gm.graph)
    assert any("while its write-back" in p for p in problems), problems


def test_token_limit_declines():
    gm = traced()
    result = schedule_streams(gm.graph, max_tokens=1)
    assert result.matches == 0
    assert {d.kind for d in result.declined} == {"token limit"}
    assert not any(n.target in (record_event, wait_event) for n in gm.graph.nodes)


def test_check_schedule_finds_violations():
    gm = traced()
    schedule_streams(gm.graph, max_tokens=16)
    join_wait = [n for n in gm.graph.nodes if n.target is wait_event and n.meta[STREAM] == 0][-1]
    gm.graph.erase_node(join_wait)
    problems = check_schedule(gm.graph)
    assert any("never waited for" in p for p in problems), problems
    assert any("has no record -> wait" in p for p in problems), problems


def test_check_schedule_rejects_side_stream_collective():
    gm = fx.symbolic_trace(lambda x: torch.ops._c10d_functional.all_reduce.default(x, "sum", "0"))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta[STREAM] = 1
    assert any("collective" in p for p in check_schedule(gm.graph))


def test_executor_runs_the_schedule_like_the_plain_graph():
    args = inputs()
    want = traced()(*args)
    gm = traced()
    schedule_streams(gm.graph, max_tokens=16)
    gm.recompile()
    executor = StreamExecutor(gm, lambda sub, fake: (lambda a: sub(*a)))
    assert [k for k, *_ in executor.plan].count("run") >= 5
    got = executor(list(args))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_serialized_streams_nests_and_restores():
    """The GPU stress test captures a serialised control inside this context; it must end with its block."""
    assert not stream_executor._serialized
    try:
        with serialized_streams():
            with serialized_streams():
                assert stream_executor._serialized
            assert stream_executor._serialized
            raise KeyError("leave the block by an exception")
    except KeyError:
        pass
    assert not stream_executor._serialized


def layer_with_a_constant(x, fn_w, base, scale, w1, w2, y):
    """`layer` whose shared-expert branch (the side stream's) scales by a tensor literal, held by the graph as a
    constant (`get_attr`), which split_module hands the segment as an argument."""
    pre, post, comb = ops.mhc_coeffs(x, fn_w, base, scale, 1e-20, 1e-6, 20)
    h = torch.mm(y, w1)
    scale_literal = torch.tensor([0.5, 2.0], dtype=torch.bfloat16)
    shared = torch.mm(torch.relu(torch.mm(y, w2)), w2.t()[:, :D].t()) * scale_literal.repeat(D // 2)
    routed = torch.mm(h, w1.t())
    out = ops.moe_finalize(routed, torch.arange(T), shared, T)
    return ops.mhc_post_pre(out, x, post, comb, pre, torch.ones(D, dtype=torch.bfloat16), 1e-20)


def test_executor_passes_the_graphs_constants_to_its_segments():
    """A tensor constant of the graph reaches the segment that reads it (the executor ran only placeholders and
    segment outputs, so a constant split_module passes as a segment argument was missing: a KeyError at Flash
    sizes on a GPU, where a paged-KV block's literal sat on a side stream)."""
    args = inputs()
    gm = make_fx(layer_with_a_constant, tracing_mode="fake")(*args)
    want = gm(*args)
    assert gm.graph.find_nodes(op="get_attr")
    schedule_streams(gm.graph, max_tokens=16)
    gm.recompile()
    executor = StreamExecutor(gm, lambda sub, fake: (lambda a: sub(*a)))
    assert executor.constants
    got = executor(list(args))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
