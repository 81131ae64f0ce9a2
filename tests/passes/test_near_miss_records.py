"""Failure records name the first op, inside the site's own region, where the site and the pattern differ
(`dsv41.passes.matcher`: `_Matcher.in_site`, `run_toward`, `diverge`), never an op of another sublayer.

Each site here is written as the pattern writes it up to a point, then goes on another way, and is followed by
another sublayer's computation that holds ops of the kind the pattern's output has (a where, a mul, a convert):
a walk back from those starts in that sublayer. The record must name the op where the site's own code goes on
another way (`blocking`, `found`), next to a matched op of the site (`beside`: the blocking op reads it or is read
by it), with the pattern's op there (`expected`); and no op that depends on the other sublayer's weights. The
matcher-level cases use a pattern of their own (an indexer's scores, top-k, sort, validity and offset) so that
they do not follow the fusions' pattern lists; the others go through the fusion passes and the report's text.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from dsv41.models import functional as fn
from dsv41.passes.matcher import MatchFailure, Pattern, PatternSet
from dsv41.passes.normalize import normalize_graph

from . import test_mhc_post_pre as mhc_case
from . import test_moe_route as route_case
from .harness import BF16, NORM_EPS, aten_graph, gen, rand, run_passes

aten = torch.ops.aten
T, H, HD, N, K, OFFSET, BLOCK = 4, 4, 32, 40, 8, 8, 4  # tokens, heads, head dim, rows, top-k, offset, block size
D, E = 32, 16  # the other sublayer's width and experts


# ---- helpers -----------------------------------------------------------------------------------------------------
def traced(fn_, args) -> fx.GraphModule:
    """fn_ traced and normalised as the backend does."""
    gm = aten_graph(fn_, *args)
    normalize_graph(gm.graph)
    gm.recompile()
    return gm


def node(graph: fx.Graph, name: str) -> fx.Node:
    return next(n for n in graph.nodes if n.name == name)


def descendants(starts) -> set[fx.Node]:
    """The nodes that depend on any of `starts` (them included)."""
    seen, stack = set(starts), list(starts)
    while stack:
        for u in stack.pop().users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def assert_in_region(graph: fx.Graph, f: MatchFailure, anchor: fx.Node, other_sublayer: set[fx.Node]):
    """f names a graph op (`blocking`) next to a matched op of the site (`beside`), neither of them an op that
    depends on the other sublayer's inputs, and beside connected to the anchor (an ancestor or a descendant)."""
    blocking, beside = node(graph, f.blocking), node(graph, f.beside)
    assert blocking in beside.users or blocking in beside.all_input_nodes, (f, beside.users, beside.all_input_nodes)
    assert blocking not in other_sublayer and beside not in other_sublayer, f
    assert beside is anchor or beside in descendants([anchor]) or anchor in descendants([beside]), f


def other_sublayer(graph: fx.Graph, *inputs: int) -> set[fx.Node]:
    """The nodes that depend on the graph's placeholders at positions `inputs` (the other sublayer's weights)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return descendants([placeholders[i] for i in inputs])


# ---- an indexer's top-k, then a block-table translation, then a router ---------------------------------------------
def index_scores(q, w, keys, n_c):
    """s[t, n] = sum_h w[t, h] relu(q[t, h] . keys[t, n]), -inf at rows n >= n_c[t]: [T, N] fp32."""
    s = (torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu() * w.unsqueeze(-1)).sum(dim=1)
    return s.masked_fill(torch.arange(keys.shape[1]) >= n_c.unsqueeze(-1), -math.inf)


def selection(q, w, keys, n_c):
    """The pattern: the top-k rows in ascending order, offset, -1 where the row scores -inf."""
    s = index_scores(q, w, keys, n_c)
    sel = torch.sort(torch.topk(s, K, dim=-1, sorted=False).indices, dim=-1).values
    return torch.where(s.gather(-1, sel) > -math.inf, sel + OFFSET, -1)


def selection_examples():
    return [torch.empty(T, H, HD, dtype=BF16), torch.empty(T, H), torch.empty(T, N, HD, dtype=BF16),
            torch.empty(T, dtype=torch.int64)]


SELECTION = Pattern("selection", selection, selection_examples, anchor=(aten.sort.default, aten.sort.stable))


def router(x, router_w, bias):
    """Another sublayer: a router on x (its GEMM, softplus, sqrt, biased top-k, gathered weights, a where)."""
    sc = F.softplus(torch.mm(x.float(), router_w.float().t())).sqrt()
    ids = (sc + bias).topk(2, dim=-1).indices
    wts = sc.gather(1, ids)
    return torch.where(wts > 0, wts, 0.0), ids


def paged_then_router(q, w, keys, n_c, table, pool, x, router_w, bias):
    """The indexer's top-k rows translated through a block table (`table[b, sel // bs] * bs + sel % bs`, a serving
    engine's paged cache) instead of the validity and offset, the selected rows attended, then a router on the
    residual."""
    s = index_scores(q, w, keys, n_c)
    sel = torch.sort(torch.topk(s, K, dim=-1, sorted=False).indices, dim=-1).values
    slots = table[torch.arange(T).unsqueeze(-1), sel // BLOCK] * BLOCK + sel % BLOCK
    kv = pool.view(-1, pool.shape[-1])[slots].float()
    o = torch.einsum("tk,tkd->td", torch.softmax(torch.einsum("td,tkd->tk", x.float(), kv), -1), kv)
    return (slots, *router((x.float() + o).to(x.dtype), router_w, bias))


def paged_reading_scores_then_router(q, w, keys, n_c, table, pool, x, router_w, bias):
    """paged_then_router whose scores are also read outside the site (their row maximum, returned)."""
    s = index_scores(q, w, keys, n_c)
    sel = torch.sort(torch.topk(s, K, dim=-1, sorted=False).indices, dim=-1).values
    slots = table[torch.arange(T).unsqueeze(-1), sel // BLOCK] * BLOCK + sel % BLOCK
    return (slots, s.amax(-1), *router(x, router_w, bias))


def scaled_scores_then_router(q, w, keys, n_c, x, router_w, bias):
    """The scores scaled before the head weights (written another way than the pattern, before the top-k), the
    pattern's validity and offset, then a router on x."""
    s = (torch.einsum("thd,tnd->thn", q.float(), keys.float()).relu() * 0.125 * w.unsqueeze(-1)).sum(dim=1)
    s = s.masked_fill(torch.arange(keys.shape[1]) >= n_c.unsqueeze(-1), -math.inf)
    sel = torch.sort(torch.topk(s, K, dim=-1, sorted=False).indices, dim=-1).values
    return (torch.where(s.gather(-1, sel) > -math.inf, sel + OFFSET, -1), *router(x, router_w, bias))


def indexer_inputs(seed):
    g = gen(seed)
    return [rand(g, T, H, HD), torch.rand(T, H, generator=g), rand(g, T, N, HD),
            torch.randint(0, N + 1, (T,), generator=g)]


def router_inputs(seed):
    g = gen(seed)
    return [rand(g, T, D), rand(g, E, D, scale=D ** -0.5), rand(g, E, dtype=torch.float32, scale=0.1)]


def match_at_sort(fn_, args):
    """(graph, anchor, SELECTION's op-for-op failure at fn_'s one sort)."""
    gm = traced(fn_, args)
    patterns = PatternSet([SELECTION])
    (anchor,) = patterns.anchors(gm.graph, 0)
    return gm.graph, anchor, patterns.match_one(0, anchor, islands=False)


def test_paged_selection_names_the_translation_not_the_router():
    """The first op where the site goes on another way reads the sorted rows: the block index `sel // bs` where the
    pattern gathers the scores at them (the first pattern op that reads them); the walk back from the router's
    where, the nearest where downstream of the sort, named the router's sqrt before."""
    g = gen(1)
    table = torch.randperm(T * N // BLOCK, generator=g).view(T, N // BLOCK)
    args = indexer_inputs(0) + [table, rand(g, T * N // BLOCK, BLOCK, D)] + router_inputs(2)
    graph, anchor, f = match_at_sort(paged_then_router, args)
    assert isinstance(f, MatchFailure), f
    (rows,) = [u for u in anchor.users if u.args[1] == 0]  # the sorted values
    (block,) = [u for u in rows.users if u.target is aten.div.Tensor_mode]
    assert (f.kind, f.expected, f.found, f.blocking, f.beside) == (
        "wrong op", "aten::gather", "aten::div.Tensor_mode", block.name, rows.name), f
    assert f.reason == f"expected aten::gather reading %{rows.name} = getitem, found %{block.name} = div.Tensor_mode"
    # every pattern op but those after the sorted rows: the gather, the comparison, the offset, the -1 and the where
    ops = [n for n in SELECTION.trace(SELECTION.inputs()).graph.nodes if n.op == "call_function"]
    assert (f.progress, f.total) == (len(ops) - 5, len(ops)), f
    assert_in_region(graph, f, anchor, other_sublayer(graph, 6, 7, 8))


def test_paged_selection_whose_scores_are_read_outside_names_the_translation():
    """Where the pattern's gather reads both the scores and the sorted rows, and the graph reads the scores
    elsewhere too (their maximum), the record is at the rows, past the anchor's op: the block index, not the
    maximum."""
    g = gen(1)
    table = torch.randperm(T * N // BLOCK, generator=g).view(T, N // BLOCK)
    args = indexer_inputs(0) + [table, rand(g, T * N // BLOCK, BLOCK, D)] + router_inputs(2)
    graph, anchor, f = match_at_sort(paged_reading_scores_then_router, args)
    (rows,) = [u for u in anchor.users if u.args[1] == 0]
    (block,) = [u for u in rows.users if u.target is aten.div.Tensor_mode]
    assert isinstance(f, MatchFailure) and (f.expected, f.blocking, f.beside) == ("aten::gather", block.name, rows.name), f
    assert_in_region(graph, f, anchor, other_sublayer(graph, 6, 7, 8))


def test_scores_written_another_way_are_named_in_the_scores():
    """Preceded by code written another way (the scores scaled before the head weights), followed by a router:
    the record names the scale's multiply, which the head weights' multiply reads where the pattern has the relu."""
    args = indexer_inputs(0) + router_inputs(2)
    graph, anchor, f = match_at_sort(scaled_scores_then_router, args)
    assert isinstance(f, MatchFailure), f
    scaled, weighted = node(graph, f.blocking), node(graph, f.beside)
    assert scaled.target is aten.mul.Tensor and 0.125 in scaled.args and weighted.args[0] is scaled, (scaled, weighted)
    assert (f.kind, f.expected, f.found) == ("wrong op", "aten::relu", "aten::mul.Tensor"), f
    assert f.reason == f"expected aten::relu, found %{scaled.name} = mul.Tensor"
    # found from the site's own where, walked toward the sort first (`run_toward`: walked as written, the scores'
    # branch comes first and fails before the sort is matched): 13 of 22 pattern ops (from the sort alone,
    # `diverge`: 9)
    assert (f.progress, f.total) == (13, 22), f
    assert_in_region(graph, f, anchor, other_sublayer(graph, 4, 5, 6))


# ---- the router's top-k, then weights normalised another way, then another sublayer --------------------------------
def route_softmax_then_next(h, gate_w, bias, gate_next, w_next):
    """The router's top-k with its weights softmaxed over the chosen scores (no sum normalisation, no scale), their
    sum scaling h into the residual, then the next sublayer: its own router (softplus, sqrt, top-k, gathered weights
    normalised and scaled) and a projection."""
    scores = torch.sqrt(F.softplus(torch.mm(h.float(), gate_w.float().t())))
    experts = torch.topk(scores + bias, route_case.K, dim=-1).indices
    weights = torch.softmax(scores.gather(1, experts), dim=-1)
    y = h + (weights.sum(-1, keepdim=True) * h.float()).to(h.dtype)
    s2 = torch.sqrt(F.softplus(torch.mm(y.float(), gate_next.float().t())))
    w2 = s2.gather(1, torch.topk(s2, 2, dim=-1).indices)
    return w2 / (w2.sum(-1, keepdim=True) + 1e-20) * 2.0, experts, torch.mm(y.float(), w_next.float().t())


def test_route_with_another_normalisation_names_its_softmax():
    """The route's near miss names the softmax's max over the gathered weights (where the pattern sums them), not the
    next sublayer's sqrt, which the walk back from the nearest mul downstream (the next router's) named before; the
    next router's own top-k (no bias before it) is recorded at its own sqrt."""
    g = gen(3)
    args = route_case.inputs(0) + [rand(g, E, route_case.D), rand(g, 24, route_case.D)]
    gm, report = run_passes(route_softmax_then_next, args, "moe_route")
    graph = gm.graph
    topks = list(graph.find_nodes(op="call_function", target=aten.topk.default))
    assert report.matches == {"moe_route": 0} and len(topks) == 2
    gather = next(n for n in graph.nodes if n.target is aten.gather.default)
    amax = next(n for n in graph.nodes if n.target is aten.amax.default)
    sqrt_next = topks[1].args[0]
    assert report.near_misses["moe_route"] == [
        f"route_no_temperature at %{topks[0].name}: wrong op after 13 of 17 pattern ops: expected "
        f"aten::sum.dim_IntList reading %{gather.name} = gather.default, found %{amax.name} = amax.default",
        f"route_no_temperature at %{topks[1].name}: wrong op after 14 of 17 pattern ops: expected aten::add.Tensor, "
        f"found %{sqrt_next.name} = sqrt.default"]
    assert not report.declined["moe_route"] and not report.unrelated["moe_route"]
    first, second = next(p for p in report.passes if p.name == "moe_route").attempts
    assert (first.expected, first.found, second.expected, second.found) == (
        "aten::sum.dim_IntList", "aten::amax", "aten::add.Tensor", "aten::sqrt")
    assert_in_region(graph, first, topks[0], other_sublayer(graph, 3, 4))
    assert_in_region(graph, second, topks[1], set())


# ---- an mHC site whose norm stays in fp32, then the next sublayer's projection -------------------------------------
def post_pre_fp32_norm_then_projection(y, x, post, comb, pre, w, wq):
    """The model's post and collapse, the RMSNorm's weight multiply left in fp32 (not rounded to bf16), read by the
    next sublayer's projection, which rounds to bf16."""
    x_new = fn.hc_post(y, x, post, comb)
    u = fn.hc_collapse(x_new, pre).float()
    h = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w.float()
    return x_new, torch.mm(h, wq.float().t()).to(torch.bfloat16)


def test_post_pre_without_the_rounding_names_the_reader_of_the_norm():
    """The record is at the norm's weight multiply: the pattern rounds it to bf16, the graph reads it in the
    projection (the op at the site's boundary). No walk back from an output candidate downstream of the rsqrt
    reaches it (the site has no bf16 cast after the norm: the one downstream is the projection's), so the walk
    from the rsqrt itself names it, after all but that one pattern op (before: another formulation's record, after
    2 of its 22 ops)."""
    g = gen(4)
    gm, report = run_passes(post_pre_fp32_norm_then_projection, mhc_case.inputs(0) + [rand(g, 24, mhc_case.D)],
                            "mhc_post_pre")
    graph = gm.graph
    (rsqrt,) = graph.find_nodes(op="call_function", target=aten.rsqrt.default)
    (mm,) = graph.find_nodes(op="call_function", target=aten.mm.default)
    norm = mm.args[0]  # the weight multiply
    assert report.matches == {"mhc_post_pre": 0} and norm.target is aten.mul.Tensor
    assert report.near_misses["mhc_post_pre"] == [
        f"post_pre at %{rsqrt.name}: wrong op after 24 of 25 pattern ops: expected prims::convert_element_type "
        f"reading %{norm.name} = mul.Tensor, found %{mm.name} = mm.default"]
    (miss,) = next(p for p in report.passes if p.name == "mhc_post_pre").attempts
    assert (miss.expected, miss.found, miss.blocking, miss.beside) == (
        "prims::convert_element_type", "aten::mm", mm.name, norm.name), miss
    # the projection reads the site's output: the op at the site's boundary, the only one that depends on wq's
    # site-side operand; no op that reads wq without the site
    assert_in_region(graph, miss, rsqrt, other_sublayer(graph, 6) - {mm})


# ---- a part computed another way, declined by the semantic check ---------------------------------------------------
def route_exp(h, gate_w, bias):
    """The route with its scores' sqrt written as an exp (another value): the router's op-for-op walk stops there."""
    scores = F.softplus(torch.mm(h.float(), gate_w.float().t()) / 1.0).exp()  # (the model's gate_temp of 1)
    experts = (scores + bias).topk(route_case.K, dim=-1).indices
    w = scores.gather(1, experts)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * route_case.ROUTE_SCALE, experts


def test_a_declined_island_names_the_op_and_its_reader():
    """The decline of a match with a part computed another way names the island's first differing op (the exp where
    the pattern has the sqrt) and the matched op that reads it, in the site."""
    gm, report = run_passes(route_exp, route_case.inputs(0), "moe_route")
    graph = gm.graph
    (topk,) = graph.find_nodes(op="call_function", target=aten.topk.default)
    (decline,) = next(p for p in report.passes if p.name == "moe_route").declined
    exp, reader = node(graph, decline.blocking), node(graph, decline.beside)
    assert (decline.kind, decline.expected, decline.found) == ("semantic", "aten::sqrt", "aten::exp"), decline
    # the scores' exp (softplus decomposes with an exp of its own, below it), read by the bias add or the gather
    assert exp.users.keys() >= {reader} and reader.target in (aten.add.Tensor, aten.gather.default), (exp, reader)
    assert exp.args[0].target is not aten.exp.default and topk in descendants([exp]), exp
    assert_in_region(graph, decline, topk, set())
