"""The matcher's input binding (`dsv41.passes.matcher`) on small traced graphs, matched by a one-pattern
`PatternSet` directly: what each pattern input binds, and that the pattern computed on the bound inputs (reshaped
as the op would take them) is the graph's value, bit for bit; and the operand order of a commutative op, where only
the order the walk does not prefer first is correct (op for op, and with parts computed another way through a
fusion pass and its semantic check)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from dsv41.passes.fusion import FusionPass, Replacement
from dsv41.passes.matcher import Derived, MatchFailure, MatchResult, Pattern, PatternSet, evaluate
from dsv41.passes.normalize import normalize_graph

from .harness import aten_graph, config, gen, rand

aten = torch.ops.aten
H, D = 4, 16


def values(gm: fx.GraphModule, *args) -> dict:
    """Every node of gm -> its value on args."""
    seen = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            seen[n] = super().run_node(n)
            return seen[n]

    Recorder(gm).run(*args)
    return seen


def traced(fn, args) -> fx.GraphModule:
    """fn traced and normalised as the backend does."""
    gm = aten_graph(fn, *args)
    normalize_graph(gm.graph)
    gm.recompile()
    return gm


def match(fn, args, search, example, islands=True):
    """search as a pattern traced at example() and anchored on its sum; (its match at the one sum of fn `traced`,
    the values of the graph's nodes on args)."""
    gm = traced(fn, args)
    patterns = PatternSet([Pattern("p", search, example, anchor=aten.sum.dim_IntList)])
    (anchor,) = patterns.anchors(gm.graph, 0)
    return patterns.match_one(0, anchor, islands), values(gm, *args)


def weighted_sum(y, z):
    """y [T, D] broadcast against weights z [T, H, 1], summed over H: [T, D] fp32."""
    return (y.float() * z).sum(1)


def one_token(dtype=torch.bfloat16):
    return [torch.empty(1, D, dtype=dtype), torch.empty(1, H, 1)]


def read_directly(y, z):
    """[B=1, L=1, D] fp32 graph input, broadcast as it is (a cast of it would run at [1, D]: its unit dim sinks)."""
    return (y * z).sum(1)


def computed_and_viewed(a, z):
    """a [1, D] computed on and viewed to [B=1, L=1, D], then cast."""
    return (torch.tanh(a).view(1, 1, D).float() * z).sum(1)


def check_values(m, seen):
    """The pattern on the bound inputs (Derived ones computed) is the graph's output, shape and values."""
    got = weighted_sum(*evaluate(m.inputs, seen.__getitem__))
    want = seen[m.outputs[0]]
    assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("fn, y, dtype", [(read_directly, (1, 1, D), torch.float32),
                                          (computed_and_viewed, (1, D), torch.bfloat16)])
def test_an_input_with_leading_unit_dims_that_broadcasting_adds_binds_without_them(fn, y, dtype):
    """At T = 1 a [1, 1, D] value (maybe cast) times [1, H, 1] weights is the product the pattern's [1, D] gives:
    the input binds without the leading unit dim (the op takes [T, D]), a graph input and a value computed in the
    graph alike."""
    g = gen(0)
    args = (rand(g, *y, dtype=dtype), torch.rand(1, H, 1, generator=g))
    m, seen = match(fn, args, weighted_sum, lambda: one_token(dtype))
    assert isinstance(m, MatchResult), m
    bound = m.inputs[0]
    assert isinstance(bound, Derived) and bound.op is aten.reshape.default and list(bound.meta["val"].shape) == [1, D]
    check_values(m, seen)


def test_an_input_keeps_its_unit_dims_where_no_other_operand_has_the_products_rank():
    """Weights given as [H, 1]: the [1, 1, D] input's leading unit dim is what gives the product its [1, H, D] rank
    (and the sum over dim 1 sums the heads); without it the product would be [H, D] and the sum another one. The input
    binds as it is, and the pattern on the bound inputs is the graph's value."""
    g = gen(1)
    args = (rand(g, 1, D), torch.rand(H, 1, generator=g))
    m, seen = match(computed_and_viewed, args, weighted_sum, one_token)
    assert isinstance(m, MatchResult), m
    assert isinstance(m.inputs[0], fx.Node) and list(m.inputs[0].meta["val"].shape) == [1, 1, D]
    check_values(m, seen)


def product_plus_first(a, b):
    """(a * b + a) summed over the last dim: a is read twice, so the product's operand order decides a's binding."""
    return (a * b + a).sum(-1)


def two_inputs():
    return [torch.empty(3, D), torch.empty(3, D)]


@pytest.mark.parametrize("islands", [False, True])
def test_a_product_paired_the_other_way_round_is_retried_when_a_later_input_disagrees(islands):
    """The graph writes `y * x + x`: the product's operands in written order bind a = y, b = x, and the add's
    second operand then finds a bound to y (an input bound twice). The match is retried with the product's other
    order (a = x, b = y), which is the only consistent binding, op for op; the pattern on it is the graph's value."""
    g = gen(2)
    args = (torch.randn(3, D, generator=g), torch.randn(3, D, generator=g))
    m, seen = match(lambda y, x: (y * x + x).sum(-1), args, product_plus_first, two_inputs, islands)
    assert isinstance(m, MatchResult) and not m.islands, m
    y, x = (n for n in seen if n.op == "placeholder")
    assert m.inputs == [x, y]
    assert torch.equal(product_plus_first(seen[x], seen[y]), seen[m.outputs[0]])


def test_no_order_binds_an_input_to_two_values():
    """`y * x + z`: a would be y or x in the product and z in the add; no operand order is consistent, so there is
    no match (the retry does not accept a pairing that binds one input to two values)."""
    g = gen(3)
    args = tuple(torch.randn(3, D, generator=g) for _ in range(3))
    m, _ = match(lambda y, x, z: (y * x + z).sum(-1), args, product_plus_first, two_inputs)
    assert isinstance(m, MatchFailure) and m.kind == "inconsistent input", m


def test_maximum_is_not_paired_the_other_way_round():
    """maximum is not commutative bit for bit (torch returns its first operand where the operands are zeros of
    opposite sign), so the graph's `maximum(y, exp(x))` is no op-for-op match of the pattern's `maximum(exp(a), b)`."""
    assert torch.maximum(torch.tensor(-0.0), torch.tensor(0.0)).signbit()
    assert not torch.maximum(torch.tensor(0.0), torch.tensor(-0.0)).signbit()
    g = gen(4)
    args = (torch.randn(3, D, generator=g), torch.randn(3, D, generator=g))
    m, _ = match(lambda x, y: torch.maximum(y, x.exp()).sum(-1), args, lambda a, b: torch.maximum(a.exp(), b).sum(-1),
                 two_inputs, islands=False)
    assert isinstance(m, MatchFailure), m


# -- a pass whose parts computed another way tie in both orders of a product: the semantic check picks the order ---
def abs_times_exp2(x, s):
    """|x| * 2^s summed over the last dim: x, s [T, D] fp32 -> [T]."""
    return (torch.abs(x) * torch.exp2(s)).sum(-1)


@torch.library.custom_op("dsv41_test::abs_times_exp2", mutates_args=())
def abs_times_exp2_op(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return abs_times_exp2(x, s)


@abs_times_exp2_op.register_fake
def _(x, s):
    return x.new_empty(x.shape[:-1])


class AbsTimesExp2Pass(FusionPass):
    """A fusion of `abs_times_exp2`; its semantic check's tolerance: a few fp32 ulps (`pow(2, s)` against exp2)."""

    name = "abs_times_exp2"
    tolerance = {torch.float32: (0.0, 2.0**-20)}

    def patterns(self):
        return [Pattern("abs_times_exp2", abs_times_exp2, two_inputs, anchor=aten.sum.dim_IntList)]

    def replacement(self, m):
        return Replacement(torch.ops.dsv41_test.abs_times_exp2.default, tuple(m.inputs), (None,))


def exp2_written_first(x, s):
    """The same math with both factors computed another way and the product written the other way round:
    `pow(2, s) * where(x < 0, -x, x)`. Either order has two parts computed another way, and the tie goes to the
    written order, which pairs |x| with pow(2, s): a part that then binds x to s and s to x."""
    return (torch.pow(2.0, s) * torch.where(x < 0, -x, x)).sum(-1)


def test_a_product_paired_the_wrong_way_is_declined_and_the_other_order_fuses():
    g = gen(5)
    gm = traced(exp2_written_first, (torch.randn(3, D, generator=g), torch.randn(3, D, generator=g)))
    x, s = gm.graph.find_nodes(op="placeholder")
    fusion = AbsTimesExp2Pass(config())
    (anchor,) = fusion.anchors(gm.graph)
    first = fusion.pattern_set().match_one(0, anchor)
    assert isinstance(first, MatchResult) and first.inputs == [s, x]  # the written order's pairing
    reason, _ = fusion.semantic_check(first, fusion.replacement(first))
    assert reason is not None and "differs from dsv41::abs_times_exp2's reference" in reason, reason

    result = fusion(gm.graph)
    gm.recompile()
    assert result.matches == 1 and not result.declined and not result.attempts, result
    (fused,) = gm.graph.find_nodes(op="call_function", target=torch.ops.dsv41_test.abs_times_exp2.default)
    assert list(fused.args) == [x, s]
    assert "checked on" in result.replaced[0]["verified"]
    for seed in (6, 7):
        g = gen(seed)
        args = (torch.randn(3, D, generator=g) * 4, torch.randn(3, D, generator=g) * 4)
        got, want = gm(*args), exp2_written_first(*args)
        assert not got.isnan().any() and torch.allclose(got, want, rtol=2.0**-20, atol=0.0), (got - want).abs().max()


# -- a pattern output the graph reads through a view of another shape: the op's output viewed so -------------------
T, K, I = 3, 2, 8


def scaled_slot_rows(a, s, w):
    """a, s [T, K, I] fp32: a * 2^s times each (token, slot)'s own weight w [T, K, D, I] -> [T, K, D] fp32 (the
    einsum's output is a view of its bmm, the pattern's output)."""
    return torch.einsum("tki,tkdi->tkd", a * torch.exp2(s), w)


@torch.library.custom_op("dsv41_test::scaled_slot_rows", mutates_args=())
def scaled_slot_rows_op(a: torch.Tensor, s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return scaled_slot_rows(a, s, w)


@scaled_slot_rows_op.register_fake
def _(a, s, w):
    return a.new_empty(w.shape[:-1])


class ScaledSlotRowsPass(FusionPass):
    """A fusion of `scaled_slot_rows`, anchored on its bmm; its semantic check's tolerance: a few fp32 ulps
    (`pow(2, s)` against exp2)."""

    name = "scaled_slot_rows"
    tolerance = {torch.float32: (0.0, 2.0**-20)}

    def patterns(self):
        example = lambda: [torch.empty(T, K, I), torch.empty(T, K, I), torch.empty(T, K, D, I)]  # noqa: E731
        return [Pattern("scaled_slot_rows", scaled_slot_rows, example, anchor=aten.bmm.default)]

    def replacement(self, m):
        return Replacement(torch.ops.dsv41_test.scaled_slot_rows.default, tuple(m.inputs), (None,))


@pytest.mark.parametrize("read", [
    lambda y: y.reshape(-1, D),                         # the [T k, D] rows a per-slot combine takes
    lambda y: y.flatten(0, 1)[None],                    # rows with a leading unit dim
    lambda y: y.view(T, K * D),                         # the trailing dims merged
])
@pytest.mark.parametrize("scale", [torch.exp2, lambda s: torch.pow(2.0, s)], ids=["op_for_op", "another_way"])
def test_a_pattern_output_read_through_a_view_of_another_shape_is_the_ops_output_viewed_so(read, scale):
    """The graph reads the pattern's [T, K, D] output only through a view to another shape of its elements: that
    view is the op's output viewed so (a view of a view is the view of the root), found once, op for op and with
    the scale computed another way (where the semantic check compares the region's view with the op's output
    viewed to it); the fused graph equals eager to a few fp32 ulps on fresh inputs."""
    def graph(a, s, w):
        return read(torch.einsum("tki,tkdi->tkd", a * scale(s), w))

    def draw(seed):
        g = gen(seed)
        return (torch.randn(T, K, I, generator=g), torch.randn(T, K, I, generator=g) * 4,
                torch.randn(T, K, D, I, generator=g))

    gm = traced(graph, draw(0))
    result = ScaledSlotRowsPass(config())(gm.graph)
    gm.recompile()
    assert result.matches == 1 and not result.declined, (result.declined, result.attempts)
    assert not gm.graph.find_nodes(op="call_function", target=aten.bmm.default)
    (fused,) = gm.graph.find_nodes(op="call_function", target=torch.ops.dsv41_test.scaled_slot_rows.default)
    (view,) = fused.users
    assert view.target is aten.view.default and list(view.args[1]) == list(read(torch.empty(T, K, D)).shape)
    for seed in (1, 2):
        args = draw(seed)
        got, want = gm(*args), graph(*args)
        assert got.shape == want.shape and not got.isnan().any()
        assert torch.allclose(got, want, rtol=2.0**-20, atol=1e-6), (got - want).abs().max()


# -- structural traces of one pattern compared by their own costs ---------------------------------------------------
E = 5


def scaled_pair_rows(x, idx, w, s):
    """Each (token, slot) pair's row x[t] times its expert's row w[idx[t, j]] times 2^s, summed over D: x [T, D],
    idx [T, K] int64, w [E, D], s [T K, D] fp32 -> [T K] fp32 (T and K read from idx's shape)."""
    t, k = idx.shape
    return (x.repeat_interleave(k, 0) * w[idx.reshape(t * k)] * torch.exp2(s)).sum(-1)


def pair_rows_inputs(tokens=T):
    return [torch.empty(tokens, D), torch.empty(tokens, K, dtype=torch.int64), torch.empty(E, D),
            torch.empty(tokens * K, D)]


def test_the_structural_trace_of_least_cost_is_taken_whatever_the_trace_order():
    """A pattern traced twice (at T and, as a variant, at one token) matches structurally in both traces with the
    scale computed another way (`pow(2, s)`), at equal cost. Each trace's match is costed by its own trace's ops:
    costed by the later trace's ops, the earlier one's match counts no pattern op matched and the later trace's
    wins, here the one-token trace, which reads idx [T, K] as [1, T K] (its one-token view [T K] of idx drops a
    unit dim) and so re-traces at T = 1, K = T K and fails (the gap that left HF's batched_mm experts unfused at
    B = 3). The match binds the graph's inputs as they are, and the pattern on them is the graph's value."""
    g = gen(8)
    args = (torch.randn(T, D, generator=g), torch.randint(0, E, (T, K), generator=g), torch.randn(E, D, generator=g),
            torch.randn(T * K, D, generator=g))

    def graph(x, idx, w, s):
        t, k = idx.shape
        return (x.repeat_interleave(k, 0) * w[idx.reshape(t * k)] * torch.pow(2.0, s)).sum(-1)

    gm = traced(graph, args)
    patterns = PatternSet([Pattern("p", scaled_pair_rows, pair_rows_inputs, variants=(lambda: pair_rows_inputs(1),),
                                   anchor=aten.sum.dim_IntList)])
    (anchor,) = patterns.anchors(gm.graph, 0)
    m = patterns.match_one(0, anchor)
    assert isinstance(m, MatchResult), m
    assert m.inputs == list(gm.graph.find_nodes(op="placeholder"))
    assert [t.target for _, t, _ in m.islands] == [aten.pow.Scalar]
    seen = values(gm, *args)
    got, want = scaled_pair_rows(*evaluate(m.inputs, seen.__getitem__)), seen[m.outputs[0]]
    assert got.shape == want.shape and torch.allclose(got, want, rtol=2.0**-20, atol=1e-6), (got - want).abs().max()
