"""The normalisation's exact rewrites (`dsv41.passes.normalize`) on small traced graphs: each rewrite yields the
form stated, leaves what it must not touch alone, and the rewritten graph equals the traced one (or eager) on fresh
inputs bit for bit."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from dsv41.passes.normalize import normalize_graph, restore_stable_sorts

from .harness import as_tuple, aten_graph, gen, op_counts

aten = torch.ops.aten


def normalized(fn, *inputs):
    gm = aten_graph(fn, *inputs)
    normalize_graph(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


def wheres(gm):
    return [n for n in gm.graph.nodes if n.target is aten.where.self]


def test_integer_comparison_in_a_where_becomes_its_complement():
    """where(i >= n, a, b) is where(i < n, b, a) on integers (likewise > as <=, != as ==)."""
    def f(s, n):
        i = torch.arange(s.shape[1])[None, :]
        return (torch.where(i >= n[:, None], -torch.inf, s), torch.where(i > n[:, None], s, 0.0),
                torch.where(i != n[:, None], s, 1.0))

    g = gen(0)
    x = (torch.randn(3, 8, generator=g), torch.randint(0, 9, (3,), generator=g))
    gm = normalized(f, *x)
    assert [n.args[0].target for n in wheres(gm)] == [aten.lt.Tensor, aten.le.Tensor, aten.eq.Tensor]
    assert op_counts(gm)["aten.ge.Tensor"] == op_counts(gm)["aten.gt.Tensor"] == op_counts(gm)["aten.ne.Tensor"] == 0
    for got, want in zip(gm(*x), f(*x)):
        assert torch.equal(got, want)


def test_float_comparison_keeps_its_form():
    """On floats a >= b is not the negation of a < b (NaN): the where stays as written."""
    def f(s, t):
        return torch.where(s >= t, s, t)

    gm = normalized(f, torch.randn(4), torch.randn(4))
    assert [n.args[0].target for n in wheres(gm)] == [aten.ge.Tensor]


def test_view_moves_below_a_pointwise_op_by_a_scalar_and_a_reshaped_vector():
    """`m.view(T, 4, 4) * s + b.view(4, 4)` and `(m * s + b).view(T, 4, 4)` are one form: the ops at [T, 16], one
    view after them."""
    def views_first(m, s, b):
        return torch.softmax(m[:, 8:].view(m.shape[0], 4, 4) * s[2] + b[8:].view(4, 4), dim=-1)

    def views_last(m, s, b):
        return torch.softmax((m[:, 8:] * s[2] + b[8:]).view(m.shape[0], 4, 4), dim=-1)

    g = gen(1)
    x = (torch.randn(3, 24, generator=g), torch.randn(3, generator=g), torch.randn(24, generator=g))
    forms = [normalized(f, *x) for f in (views_first, views_last)]
    texts = [[(n.target, tuple(n.meta["val"].shape)) for n in gm.graph.nodes if n.op == "call_function"] for gm in forms]
    assert texts[0] == texts[1]
    add = next(n for n in forms[0].graph.nodes if n.target is aten.add.Tensor)
    assert tuple(add.meta["val"].shape) == (3, 16)
    for gm, f in zip(forms, (views_first, views_last)):
        assert torch.equal(gm(*x), aten_graph(f, *x)(*x))  # the traced decomposition, not eager's softmax kernel


def test_view_with_numbers_only_stays():
    """A cast or square of a view stays below it: such a view may be where a pattern's input enters."""
    def f(x):
        y = x.view(x.shape[0], -1)
        return torch.relu(y.float()) * 2.0

    gm = normalized(f, torch.randn(3, 4, 8).bfloat16())
    first = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert first.target is aten.view.default


def test_a_lookup_table_runs_below_unit_dims():
    """table[idx] is pointwise in idx: a size-1 dim a graph input adds sinks below it."""
    def f(idx, table):
        return table[idx] * 2.0

    g = gen(2)
    x = (torch.randint(0, 7, (3, 1, 32), generator=g), torch.randn(7, generator=g))
    gm = normalized(f, *x)
    index = next(n for n in gm.graph.nodes if n.target is aten.index.Tensor)
    assert tuple(index.meta["val"].shape) == (3, 32)
    assert torch.equal(gm(*x), f(*x))


def test_full_operand_of_a_where_becomes_a_scalar():
    """where(m, i, full_like(i, n)) is where(m, i, n): the filled operand adds no shape."""
    def filled(v, i):
        return torch.where(v > 0, i, torch.full_like(i, 7))

    def scalar(v, i):
        return torch.where(v > 0, i, 7)

    g = gen(3)
    x = (torch.randn(3, 4, generator=g), torch.randint(0, 5, (3, 4), generator=g))
    forms = [normalized(f, *x) for f in (filled, scalar)]
    assert [[n.target for n in gm.graph.nodes] for gm in forms][0] == [[n.target for n in gm.graph.nodes] for gm in forms][1]
    assert op_counts(forms[0])["aten.full"] == 0
    assert torch.equal(forms[0](*x), filled(*x))


def _ops(gm):
    return [(n.target, tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in gm.graph.nodes if n.op == "call_function"]


def test_split_chunk_and_unbind_pieces_are_slices_and_selects():
    """torch.split / chunk pieces are the slices they cover, unbind items are selects: one form with indexing."""
    def pieces(x, t):
        a, b = torch.split(x, [24, 40], dim=-1)
        c, d = x.chunk(2, dim=1)
        c0, s0 = t.unbind(-1)
        return a * 2.0, b + 1.0, c - d, c0 * s0

    def indexing(x, t):
        return x[:, :24] * 2.0, x[:, 24:] + 1.0, x[:, :32] - x[:, 32:], t[..., 0] * t[..., 1]

    g = gen(3)
    x = (torch.randn(3, 64, generator=g), torch.randn(3, 8, 2, generator=g))
    forms = [normalized(f, *x) for f in (pieces, indexing)]
    assert sorted(map(str, _ops(forms[0]))) == sorted(map(str, _ops(forms[1])))
    split_ops = {"aten.split_with_sizes", "aten.split.Tensor", "aten.unbind.int"}
    assert split_ops <= set(op_counts(aten_graph(pieces, *x))) and not split_ops & set(op_counts(forms[0]))
    for got, want in zip(forms[0](*x), pieces(*x)):
        assert torch.equal(got, want)


def test_implicit_promotion_is_an_explicit_cast_made_once():
    """xf * w for a bf16 w is xf * w.float(): the cast type promotion makes, one cast node for every use of w."""
    def implicit(x, w):
        xf = x.float()
        return xf * w, xf + w

    def explicit(x, w):
        xf, wf = x.float(), w.float()
        return xf * wf, xf + wf

    g = gen(4)
    x = (torch.randn(3, 32, generator=g).bfloat16(), torch.randn(32, generator=g).bfloat16())
    forms = [normalized(f, *x) for f in (implicit, explicit)]
    assert _ops(forms[0]) == _ops(forms[1])
    assert op_counts(forms[0])["prims.convert_element_type"] == 2  # x's and w's
    for got, want in zip(forms[0](*x), implicit(*x)):
        assert torch.equal(got, want)


def _quantised_rows(x):
    """x's last dim quantised in `reshape(-1, 32)` rows, cast back to bf16 in x's shape."""
    xf = x.float().reshape(-1, 32)
    s = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-4) / 448.0
    return ((xf / s).round() * s).to(torch.bfloat16).reshape(x.shape)


def _quantised_blocks(x):
    """The same math at `x.unflatten(-1, (-1, 32))` blocks."""
    xf = x.float().unflatten(-1, (-1, 32))
    s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4) / 448.0
    return ((xf / s).round() * s).flatten(-2).to(torch.bfloat16)


@pytest.mark.parametrize("shape, blocks", [((3, 96), (3, 3, 1)), ((3, 2, 32), (3, 2, 1, 1)), ((1, 2, 32), (1, 2, 1, 1))])
def test_blocked_rows_run_at_the_unflatten_layout(shape, blocks):
    """The reference's x.reshape(-1, k) blocks and the model's x.unflatten(-1, (-1, k)) are one form: the rows' ops
    run at [*A, n, k], and the cast after them moves below the merge view (`(q * s).flatten(-2).to(bf16)`); also with
    one block a row (n = 1), where the rows of a [T, k, 32] value merge its leading dims (also at T = 1: the leading
    dim is the token dim, which patterns keep): the block view is [T, k, 1, 32], the same elements in the same
    order."""
    x = (torch.randn(*shape, generator=gen(5)).bfloat16(),)
    forms = [normalized(f, *x) for f in (_quantised_rows, _quantised_blocks)]
    assert _ops(forms[0]) == _ops(forms[1])
    amax = next(n for n in forms[0].graph.nodes if n.target is aten.amax.default)
    assert tuple(amax.meta["val"].shape) == blocks
    assert torch.equal(forms[0](*x), _quantised_rows(*x)) and torch.equal(forms[1](*x), _quantised_blocks(*x))


@pytest.mark.parametrize("shape", [(3, 1, 32), (3, 32)])
def test_rows_of_one_block_that_only_drop_unit_dims_stay_rows(shape):
    """Where the rows view only drops a non-leading size-1 dim ([3, 1, 32] -> [3, 32]: one `_sink_units` sinks) or
    is no view ([3, 32]), the rows' ops run at [3, 32] (the form without such dims), not at a block view with a
    size-1 dim added."""
    x = (torch.randn(*shape, generator=gen(7)).bfloat16(),)
    gm = normalized(_quantised_rows, *x)
    amax = next(n for n in gm.graph.nodes if n.target is aten.amax.default)
    assert tuple(amax.meta["val"].shape) == (3, 1)
    assert torch.equal(gm(*x), _quantised_rows(*x))


def test_keepdim_reduction_viewed_without_its_dim_is_the_plain_reduction():
    """x.sum(0).unsqueeze(0).squeeze(0) (the unsqueeze folds into keepdim, the squeeze becomes a view dropping the
    kept dim) is x.sum(0); a view to any other shape stays."""
    def f(x):
        return x.sum(0).unsqueeze(0).squeeze(0), x.sum(0, keepdim=True).view(2, 4)

    x = torch.randn(5, 8, generator=gen(0))
    gm = normalized(f, x)
    sums = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]
    assert [n.args[2:] for n in sums] == [(False,), (True,)] and op_counts(gm)["aten.view"] == 1
    for got, want in zip(gm(x), f(x), strict=True):
        assert torch.equal(got, want)


def test_scalar_overloads_are_tensor_overloads():
    """add/sub/mul/div.Scalar (F.rms_norm's decomposition adds its eps so) are the .Tensor overloads."""
    def f(x):
        xf = x.float()
        return F.rms_norm(xf, (8,), eps=1e-20), torch.ops.aten.mul.Scalar(xf, 3.0) - 1.0

    x = torch.randn(3, 8, generator=gen(0)).bfloat16()
    gm = normalized(f, x)
    ops = op_counts(gm)
    assert not any(name.endswith(".Scalar") and name.split(".")[1] in ("add", "sub", "mul", "div") for name in ops), ops
    for got, want in zip(gm(x), f(x), strict=True):
        assert torch.equal(got, want)


def test_one_element_slice_in_arithmetic_is_a_select():
    """`m * s.tensor_split(3)[0]` is `m * s[0]` (same dtype: the values, shape and dtype agree); where no other
    operand has a dim (`s[0:1] * s[1]`, a [1] result) the slice stays."""
    def f(m, s):
        return m * s.tensor_split(3)[0] + s[1:2], s[0:1] * s[1]

    g = gen(1)
    x = (torch.randn(3, 4, generator=g), torch.randn(3, generator=g))
    gm = normalized(f, *x)
    ops = op_counts(gm)
    assert ops["aten.select.int"] == 3 and ops["aten.slice.Tensor"] == 1, ops
    for got, want in zip(gm(*x), f(*x), strict=True):
        assert torch.equal(got, want) and got.dtype == want.dtype


def test_unit_dims_sink_below_sort_and_gather():
    """At [B, S=1, N] (a graph input's unit dim), a sort along N and a gather along N run at [B, N]."""
    def f(s):
        sel = torch.sort(torch.topk(s, 3, dim=-1, sorted=False).indices, dim=-1).values
        return torch.gather(s, -1, sel) > 0

    x = torch.randn(4, 1, 8, generator=gen(2))
    gm = normalized(f, x)
    for target in (aten.sort.default, aten.gather.default):
        node = next(n for n in gm.graph.nodes if n.target is target)
        val = node.meta["val"][0] if target is aten.sort.default else node.meta["val"]
        assert val.dim() == 2, (target, val.shape)
    assert torch.equal(gm(x), f(x))


def test_einsum_layout_chains_at_a_unit_seq_dim_and_without_it_are_one_form():
    """einsum('bsgd,grd->bsgr') at [B, 1, G, D] and einsum('tgd,grd->tgr') at [T, G, D]: the S = 1 dim leaves the
    layout chain (a permute's unit dims right after the leading one, read only by views), so both contract in one
    form."""
    def seq(o, w):
        return torch.einsum("bsgd,grd->bsgr", o, w).flatten(-2)

    def flat(o, w):
        return torch.einsum("tgd,grd->tgr", o.view(o.shape[0], o.shape[2], -1), w).flatten(1)

    g = gen(3)
    x = (torch.randn(3, 1, 2, 16, generator=g), torch.randn(2, 8, 16, generator=g))
    forms = [normalized(f, *x) for f in (seq, flat)]
    chains = [[(n.target, list(n.args[1])) for n in gm.graph.nodes if n.target is aten.permute.default] for gm in forms]
    assert chains[0] == chains[1], chains
    assert torch.equal(forms[0](*x).flatten(1), flat(*x)) and torch.equal(forms[1](*x), flat(*x))


def test_fp8_cast_of_an_unclamped_value_is_the_cast_of_it_clamped():
    """(x / s).to(e4m3fn) is (x / s).clamp(-448, 448).to(e4m3fn): torch's conversion saturates (finite overflow and inf to
    +-448, NaN stays NaN), so both forms are one; checked on overflowing, infinite and NaN values."""
    def unclamped(x, s):
        return (x / s).to(torch.float8_e4m3fn).float()

    def clamped(x, s):
        return (x / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()

    x = torch.tensor([1e30, -500.0, 479.0, 480.0, 3.3, -0.0, float("inf"), -float("inf"), float("nan")])
    s = torch.ones(1)
    a, b = normalized(unclamped, x, s), normalized(clamped, x, s)
    assert op_counts(a) == op_counts(b) and op_counts(a)["aten.clamp_min"] == op_counts(a)["aten.clamp_max"] == 1
    assert torch.equal(a(x, s).nan_to_num(7.0), unclamped(x, s).nan_to_num(7.0))
    scale = normalized(lambda a: (a / 6.0).to(torch.float8_e4m3fn), x.abs())  # a scale cast (FP4's) stays
    assert op_counts(scale)["aten.clamp_min"] == 0


def test_fp8_cast_by_the_block_amax_scale_is_clamped_where_the_cast_does_not_saturate(monkeypatch):
    """Where torch's e4m3 conversion does not saturate (before 2.13: 464 and above become NaN), the cast of x / s
    still equals the clamped one when s = 2^ceil(log2(max(amax|x|, 1e-4) / 448)) over x's own blocks (then
    |x / s| <= 448): DeepSeek's and DeepGEMM's unclamped casts get the clamp; a scale from another tensor's amax, a
    divisor c above 448, or the amax of a part of x keeps the cast unclamped (any reduced dims the scale broadcasts
    back over bound every element: the amax over the blocks of a column clamps too)."""
    import dsv41.passes.normalize as normalize

    monkeypatch.setattr(normalize, "_SATURATES", False)

    def quant(x, other, c=448.0, dim=-1, pow_form=True):
        blocks = x.view(*x.shape[:-1], -1, 32)
        source = blocks if other is None else blocks[..., :16] if other == "part" else other
        amax = source.abs().amax(dim=dim, keepdim=True).clamp(min=1e-4)
        u = amax / c
        scale = torch.pow(2.0, torch.ceil(torch.log2(u))) if pow_form else torch.exp2(torch.ceil(torch.log2(u)))
        return (blocks / scale).to(torch.float8_e4m3fn).float()

    g = gen(0)
    x = (torch.randn(3, 64, generator=g) * 100).to(torch.bfloat16).float()
    clamps = lambda gm: op_counts(gm)["aten.clamp_max"]  # noqa: E731
    for pow_form in (True, False):
        own = normalized(lambda a: quant(a, None, pow_form=pow_form), x)
        assert clamps(own) == 1, own.code
        assert torch.equal(own(x)[0] if isinstance(own(x), tuple) else own(x), quant(x, None, pow_form=pow_form))
    other = torch.randn(3, 2, 32, generator=g)
    assert clamps(normalized(lambda a, o: quant(a, o), x, other)) == 0
    assert clamps(normalized(lambda a: quant(a, None, c=500.0), x)) == 0
    assert clamps(normalized(lambda a: quant(a, "part"), x)) == 0
    assert clamps(normalized(lambda a: quant(a, None, dim=-2), x)) == 1


def test_times_the_reciprocal_of_a_power_of_two_scale_is_the_quotient():
    """x * (1 / s) is x / s for the FP8 scales s = exp2(ceil(log2(max(a, 1e-4) / 448))) and the bit-built
    (e << 23).view(float32) (normal powers of two, so the reciprocal is exact); a scale without the amax floor
    (a subnormal power of two has no finite reciprocal) keeps the product."""
    def exp2_scale(x, a, floor=True):
        s = torch.exp2(torch.ceil(torch.log2((a.clamp_min(1e-4) if floor else a) / 448.0)))
        return x * (1.0 / s), x / s

    def bit_scale(x, e):
        s = (e << 23).view(torch.float32)
        return x * s.reciprocal(), x / s

    g = gen(0)
    x, a = torch.randn(4, 32, generator=g) * 100, torch.rand(4, 1, generator=g) * 1e-3
    e = torch.randint(0, 255, (4, 1), generator=g, dtype=torch.int32)
    for f, args in ((exp2_scale, (x, a)), (bit_scale, (x, e))):
        gm = normalized(f, *args)
        assert op_counts(gm)["aten.reciprocal"] == 0 and op_counts(gm)["aten.div.Tensor"] >= 2
        got, want = gm(*args)[0], f(*args)[0]
        assert torch.equal(got, want) and torch.equal(got, f(*args)[1])
    gm = normalized(lambda x, a: exp2_scale(x, a, floor=False), x, a)
    assert op_counts(gm)["aten.reciprocal"] == 1


def test_times_one_is_the_value():
    """x * 1.0 (as `1.0 / s` traces: reciprocal(s) * 1.0) is x; an integer x promoted by the 1.0 stays."""
    gm = normalized(lambda x, i: (x * 1.0, 1.0 * x, i * 1.0), torch.randn(3), torch.arange(3))
    assert op_counts(gm)["aten.mul.Tensor"] == 1


def test_cast_of_blocked_rows_moves_below_a_merge_view_with_unit_dims():
    """The reference's `act_quant` rows cast back, reshaped and read as `y[:, None]` (one view [T, 1, n k] after the
    chain collapses) are the merged value cast, then viewed: the cast sits at [T, n k] as in the unflatten form."""
    def rows(x):
        xf = x.float().reshape(-1, 32)
        s = xf.abs().amax(1, keepdim=True).clamp_min(1e-4)
        return (xf / s * s).to(x.dtype).reshape(x.shape)[:, None]

    x = torch.randn(3, 64).to(torch.bfloat16)
    gm = normalized(rows, x)
    cast = next(n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default
                and n.args[1] == torch.bfloat16)
    assert list(cast.meta["val"].shape) == [3, 64] and [u.target for u in cast.users] == [aten.view.default]
    assert torch.equal(gm(x), rows(x))


def test_cast_after_a_merge_view_with_unit_dims_moves_above_the_unit_dims():
    """Rows of a [B, 1, d] value merged back by `reshape(x.shape)` before the cast (`(q * s).reshape(x.shape)
    .to(bf16)`: one view [B, 2, 32] -> [B, 1, 64], then the cast) are the merged value cast at [B, 64], then viewed
    [B, 1, 64], as in the unflatten form; a cast of rows viewed to another non-unit shape stays above its view."""
    def merged_then_cast(x):
        xf = x.float().reshape(-1, 32)
        s = xf.abs().amax(1, keepdim=True).clamp_min(1e-4)
        return (xf / s * s).reshape(x.shape).to(x.dtype)

    def unflatten_form(x):
        xf = x.float().unflatten(-1, (-1, 32))
        s = xf.abs().amax(-1, keepdim=True).clamp_min(1e-4)
        return (xf / s * s).flatten(-2).to(x.dtype)

    def rows_cast(x):
        xf = x.float().reshape(-1, 32)
        s = xf.abs().amax(1, keepdim=True).clamp_min(1e-4)
        return (xf / s * s).reshape(3, 2, 1, 32).to(x.dtype)

    def last_casts(gm):
        return [(tuple(n.meta["val"].shape), [u.target for u in n.users]) for n in gm.graph.nodes
                if n.target is torch.ops.prims.convert_element_type.default and n.args[1] == torch.bfloat16]

    x = torch.randn(3, 1, 64, generator=gen(0)).to(torch.bfloat16)
    gm, want = normalized(merged_then_cast, x), normalized(unflatten_form, x)
    assert last_casts(gm) == last_casts(want) == [((3, 64), [aten.view.default])], gm.code
    assert torch.equal(gm(x), merged_then_cast(x))
    other = normalized(rows_cast, x)
    assert [shape for shape, _ in last_casts(other)] == [(3, 2, 1, 32)], other.code
    assert torch.equal(other(x), rows_cast(x))


def test_fp32_addcmul_and_addcdiv_are_the_add_of_a_product_and_a_quotient():
    """fp32 addcmul(a, b, c) is a + b * c (within one fp32 ulp: eager's CPU kernel contracts it into an FMA) and
    addcdiv(a, b, c) is a + b / c (bit for bit); a bf16 addcmul (computed in fp32, rounded once) and a value other
    than 1 stay."""
    def f(a, b, c):
        return (torch.addcmul(a, b, c), torch.addcdiv(a, b, c), torch.addcmul(a, b, c, value=0.5),
                torch.addcmul(a.bfloat16(), b.bfloat16(), c.bfloat16()))

    g = gen(0)
    x = [torch.randn(4, 8, generator=g) for _ in range(3)]
    gm = normalized(f, *x)
    ops = op_counts(gm)
    assert ops["aten.addcmul"] == 2 and ops["aten.addcdiv"] == 0 and ops["aten.div.Tensor"] == 1, ops
    got, want = gm(*x), f(*x)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    a, b, c = x
    assert ((got[0] - want[0]).abs() <= 2.0**-23 * (a.abs() + (b * c).abs())).all()  # one rounding of the sum


def test_fp32_addcmul_and_addcdiv_with_value_minus_one_are_the_difference():
    """addcmul(a, b, c, value=-1) is a - b * c (within one fp32 ulp: eager's FMA) and addcdiv(a, b, c, value=-1) is
    a - b / c (bit for bit: the negation is exact); value -2 and 2 (just past +-1, a rounding factor) and a bf16
    addcmul with value -1 stay."""
    def f(a, b, c):
        return (torch.addcmul(a, b, c, value=-1), torch.addcdiv(a, b, c, value=-1), torch.addcmul(a, b, c, value=-2),
                torch.addcdiv(a, b, c, value=2), torch.addcmul(a.bfloat16(), b.bfloat16(), c.bfloat16(), value=-1))

    g = gen(0)
    x = [torch.randn(4, 8, generator=g) for _ in range(3)]
    gm = normalized(f, *x)
    ops = op_counts(gm)
    assert ops["aten.addcmul"] == 2 and ops["aten.addcdiv"] == 1 and ops["aten.sub.Tensor"] == 2, ops
    for seed in (1, 2):
        x = [torch.randn(4, 8, generator=gen(seed)) for _ in range(3)]
        got, want = gm(*x), f(*x)
        assert all(torch.equal(got[i], want[i]) for i in (1, 2, 3, 4))
        a, b, c = x
        assert ((got[0] - want[0]).abs() <= 2.0**-23 * (a.abs() + (b * c).abs())).all()  # one rounding of the sum
        assert torch.equal(got[0], a - b * c)  # the rewritten form computes the difference itself


def test_clamps_by_tensor_literals_are_clamps_by_numbers():
    """`torch.clamp(u, -limit, limit)` with `limit = torch.tensor(10.0)` (a 0-d literal and its negation; the clamp
    traces as clamp_min and clamp_max) is the clamp by -10.0 and 10.0, and so is a 0-d float64 literal 10.0 on an
    fp32 x (exact in fp32), bit for bit; a float64 literal 10.1 (which the fp32 comparison would round), a
    1-element literal that is not 0-d, and a bound read from a graph input stay."""
    def f(x, bound):
        limit = torch.tensor(10.0)
        return (torch.clamp(x, -limit, limit), torch.clamp(x, max=torch.tensor(10.0, dtype=torch.float64)),
                torch.clamp(x, max=torch.tensor(10.1, dtype=torch.float64)), torch.clamp(x, max=torch.tensor([10.0])),
                torch.clamp(x, max=bound))

    x = (torch.randn(4, 8, generator=gen(0)) * 20, torch.tensor(3.0))
    gm = normalized(f, *x)
    ops = op_counts(gm)
    assert ops["aten.clamp_min"] == 1 and ops["aten.clamp_max"] == 2 and ops["aten.clamp_max.Tensor"] == 3, ops
    assert ops["aten.lift_fresh_copy"] == 1 and ops["aten.neg"] == 0, ops  # the 1-element literal's
    assert ops["aten.scalar_tensor"] == 1 and ops["prims.convert_element_type"] == 1, ops  # 10.1's, cast to fp32
    bounds = [n.args[1] for n in gm.graph.nodes if n.target in (aten.clamp_min.default, aten.clamp_max.default)]
    assert bounds == [-10.0, 10.0, 10.0], gm.code
    for seed in (1, 2):
        x = (torch.randn(4, 8, generator=gen(seed)) * 20, torch.tensor(3.0))
        for got, want in zip(gm(*x), f(*x), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_gemm_adding_its_input_is_the_gemm_plus_the_input():
    """baddbmm(a, b, c) is bmm(b, c) + a and addmm(a, b, c) is mm(b, c) + a (beta = alpha = 1); another beta stays.
    Values within one fp32 rounding of the sum (the library may add a before its last K block)."""
    def f(a3, b3, c3, a2, b2, c2):
        return torch.baddbmm(a3, b3, c3), torch.addmm(a2, b2, c2), torch.addmm(a2, b2, c2, beta=0.5)

    g = gen(0)
    x = [torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 5, generator=g), torch.randn(2, 5, 4, generator=g),
         torch.randn(3, 4, generator=g), torch.randn(3, 5, generator=g), torch.randn(5, 4, generator=g)]
    gm = normalized(f, *x)
    ops = op_counts(gm)
    assert ops["aten.baddbmm"] == 0 and ops["aten.addmm"] == 1 and ops["aten.bmm"] == 1 and ops["aten.mm"] == 1, ops
    for got, want in zip(gm(*x), f(*x), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_scatter_reduce_sum_is_scatter_add():
    """scatter_reduce(..., "sum") (include_self) is scatter_add, bit for bit; "amax" and include_self=False stay."""
    def f(z, idx, src):
        return (z.scatter_reduce(0, idx, src, "sum"), z.scatter_reduce(0, idx, src, "amax"),
                z.scatter_reduce(0, idx, src, "sum", include_self=False))

    g = gen(0)
    x = (torch.randn(4, 8, generator=g), torch.randint(0, 4, (6, 8), generator=g), torch.randn(6, 8, generator=g))
    gm = normalized(f, *x)
    ops = op_counts(gm)
    assert ops["aten.scatter_add"] == 1 and ops["aten.scatter_reduce.two"] == 2, ops
    for got, want in zip(gm(*x), f(*x), strict=True):
        assert torch.equal(got, want)


def test_select_of_a_split_dims_outer_factor_is_a_run():
    """x.view(T, 2, I).unbind(1) halves are x[:, :I] and x[:, I:] (the inner factor stays a stride-k slice, on any
    dim); bit for bit."""
    def f(x):
        g, u = x.view(3, 2, 4).unbind(1)
        even = x.view(3, 4, 2)[:, :, 0]
        mid = x.view(3, 2, 2, 2)[:, :, 1]  # the inner factor of the middle dim
        return g, u, even, mid

    x = torch.randn(3, 8, generator=gen(0))
    gm = normalized(f, x)
    slices = [n for n in gm.graph.nodes if n.target is aten.slice.Tensor]
    assert op_counts(gm)["aten.select.int"] == 1 and len(slices) == 3, op_counts(gm)
    assert sorted(tuple(n.args[1:]) for n in slices) == [(1, 0, 4), (1, 0, 2**63 - 1, 2), (1, 4, 2**63 - 1)]
    for got, want in zip(gm(x), f(x), strict=True):
        assert torch.equal(got, want)


def test_select_of_a_split_dim_beyond_unit_dims_is_a_run():
    """A bmm's column-vector output [S, 2I, 1] (squeezed: one view [S, 1, 2I] -> [S, 2, I] of the normalised bmm,
    unit dim and split in one view) split in halves by `view(S, 2, I).unbind(1)` is gu[:, :I], gu[:, I:] of
    gu = view(S, 2I): one graph with the slicing form (the flat pairs' gathered experts under the rewrite test's
    "slice as split-dim select"), bit for bit."""
    def sliced(w, v):
        gu = torch.bmm(w, v.unsqueeze(-1)).squeeze(-1)
        return gu[:, :4] * gu[:, 4:]

    def unbound(w, v):
        g, u = torch.bmm(w, v.unsqueeze(-1)).squeeze(-1).view(6, 2, 4).unbind(1)
        return g * u

    g = gen(0)
    x = (torch.randn(6, 8, 5, generator=g), torch.randn(6, 5, generator=g))
    a, b = normalized(sliced, *x), normalized(unbound, *x)
    assert _ops(a) == _ops(b) and op_counts(b)["aten.select.int"] == 0, (a.code, b.code)
    assert torch.equal(b(*x), unbound(*x)) and torch.equal(a(*x), sliced(*x))


def test_a_split_past_unit_dims_not_where_the_view_adds_them():
    """The split-dim pair past unit dims is found where the view drops a size-1 dim ([S, 1, 2I] -> [S, 2, I], either
    half), not where it adds one (RoPE pairs at one request, [1, H, rd] -> [1, 1, H, rd/2, 2]: the unit-dim sinking's
    form, whose qkv_norm fuses with its RoPE), nor where no pair merges to x's shape."""
    from dsv41.passes.normalize import _split_pair_of_an_input_dim as pair
    assert pair([6, 1, 8], [6, 2, 4], 1) == 1 and pair([6, 1, 8], [6, 2, 4], 2) == 1
    assert pair([1, 4, 16], [1, 1, 4, 8, 2], 4) is None
    assert pair([6, 1, 8], [6, 4, 4], 1) is None  # no pair merges to x's shape: not a split of x


@pytest.mark.parametrize("x_shape, view, dim, want", [
    ((18, 1, 64), (3, 6, 2, 32), 2, (3, 6, 64)),  # the dims before the split one reshaped ([T k, 1, 2I]: a bmm's rows)
    ((4, 6, 2, 3), (4, 2, 3, 6), 1, (4, 6, 6)),   # the dims after it reshaped
    ((18, 64), (3, 6, 2, 32), 3, (3, 6, 64)),     # the inner factor: a stride-2 slice of the same view
])
def test_select_of_a_split_dim_beside_reshaped_dims_is_a_slice_of_the_merged_view(x_shape, view, dim, want):
    """select(x.view(vs), dim, i) where vs splits one dim of x into (n, k) and reshapes the dims on one side of it
    (the others as in x) is the slice of x.view(m), m the split dim merged (the view the unsplit form reads): no
    select is left, the slice's input has shape m, bit for bit (x.view(vs) = x.view(m).view(vs), a row-major
    reshape)."""
    def f(x):
        pieces = x.view(*view).unbind(dim)
        return pieces[0] * 2.0, pieces[-1] * 3.0

    x = torch.randn(*x_shape, generator=gen(0))
    gm = normalized(f, x)
    slices = [n for n in gm.graph.nodes if n.target is aten.slice.Tensor]
    assert op_counts(gm)["aten.select.int"] == 0 and len(slices) == 2, gm.code
    assert all(tuple(n.args[0].meta["val"].shape) == want for n in slices), gm.code
    for got, want_value in zip(gm(x), f(x), strict=True):
        assert torch.equal(got, want_value)


def test_select_of_a_split_that_is_no_dim_of_the_input_stays():
    """x [6, 64] viewed [3, 4, 32]: the dims (3, 4) merge to 12, no dim of x and not x's shape up to unit dims
    (with either neighbour), so no merged view is the one a program reads: the select stays (still exact)."""
    def f(x):
        return x.view(3, 4, 32).select(1, 2) * 2.0

    x = torch.randn(6, 64, generator=gen(0))
    gm = normalized(f, x)
    assert op_counts(gm)["aten.select.int"] == 1, gm.code
    assert torch.equal(gm(x), f(x))


def test_a_matrix_times_a_vector_is_the_vector_times_the_matrix():
    """einsum('tjd,tj->td', x, pre) (a bmm of [T, D, hc] by [T, hc, 1]) becomes the [T, 1, hc] by [T, hc, D] bmm
    that einsum('tj,tjd->td', pre, x) traces to: one graph, equal values."""
    def matrix_vector(x, pre):
        return torch.einsum("tjd,tj->td", x, pre)

    def vector_matrix(x, pre):
        return torch.einsum("tj,tjd->td", pre, x)

    g = gen(0)
    x = (torch.randn(3, 4, 16, generator=g), torch.randn(3, 4, generator=g))
    a, b = normalized(matrix_vector, *x), normalized(vector_matrix, *x)
    def ops(gm):
        return [(n.target, tuple(n.meta["val"].shape)) for n in gm.graph.nodes if n.op == "call_function"]
    assert ops(a) == ops(b) and ops(a)[1][0] is aten.bmm.default, (a.code, b.code)
    torch.testing.assert_close(a(*x), matrix_vector(*x), atol=1e-6, rtol=1e-6)




E4M3 = torch.float8_e4m3fn


def _casts(gm):
    """(shape, dtype) of each cast, in graph order."""
    return [(tuple(n.meta["val"].shape), n.args[1]) for n in gm.graph.nodes
            if n.target is torch.ops.prims.convert_element_type.default]


def test_pointwise_ops_between_a_view_and_its_view_back_run_at_the_values_layout():
    """view(f(view(x, S1)), S0) with x [S0] is f(x): the reference's dequantisation `y.view(T, n k).float()
    .view(T, n, k)` of e4m3 blocks y [T, n, k] is y.float(); a flat value viewed into blocks and back likewise; a
    chain with a number, a 0-d scale and a per-row scale (varying along the dim both shapes keep only, taken as
    [T, 1, 1]). No view of the round trips is left (one view lifts the row scale); bit for bit."""
    def f(x, y, row, s):
        e = (x * 2.0).to(E4M3)                                               # computed e4m3 blocks [3, 2, 32]
        blocks_flat_blocks = e.view(3, 64).float().view(3, 2, 32)
        z = y * 2.0                                                          # a computed flat value [3, 64]
        flat_blocks_flat = z.view(3, 2, 32).to(torch.bfloat16).view(3, 64)
        chain = (-(e.view(3, 64).float() * 0.5 * row[:, None] * s)).view(3, 2, 32)
        return blocks_flat_blocks, flat_blocks_flat, chain

    g = gen(0)
    x = (torch.randn(3, 2, 32, generator=g).bfloat16(), torch.randn(3, 64, generator=g), torch.randn(3, generator=g),
         torch.tensor(0.25))
    gm = normalized(f, *x)
    assert op_counts(gm)["aten.view"] == 1, gm.code
    (view,) = [n for n in gm.graph.nodes if n.target is aten.view.default]
    assert view.args[0].name == "arg2_1" and list(view.args[1]) == [3, 1, 1]
    assert _casts(gm) == [((3, 2, 32), E4M3), ((3, 2, 32), torch.float32), ((3, 64), torch.bfloat16),
                          ((3, 2, 32), torch.float32)]
    for got, want in zip(gm(*x), f(*x), strict=True):
        assert torch.equal(got, want)


def _e4m3_blocks(x):
    return (x * 2.0).to(E4M3)  # computed e4m3 blocks [3, 2, 32] (a graph input's view is a boundary, left alone)


def _other_shape(x, w):
    return _e4m3_blocks(x).view(3, 64).float().view(3, 4, 16)


def _scan_inside(x, w):
    return _e4m3_blocks(x).view(3, 64).float().cumsum(-1).view(3, 2, 32)


def _viewed_value_read_again(x, w):
    flat = _e4m3_blocks(x).view(3, 64)
    return flat.float().view(3, 2, 32), flat


def _chain_value_read_again(x, w):
    cast = _e4m3_blocks(x).view(3, 64).float()
    return cast.view(3, 2, 32), cast


def _per_block_scale(x, w):
    z = x.view(3, 64) * 2.0  # a computed flat value [3, 64]
    return (z.view(3, 2, 32).float() * x[:, :, :1].float()).view(3, 64)


def _grouped_gemm_output(x, w):
    """The model's grouped wo_a einsum output flattened, then read as FP8 blocks of 32 (TINY: o_lora_rank = 32)."""
    return torch.einsum("tgd,grd->tgr", x, w).flatten(1).float().view(3, 2, 32)


def _expanded_value_flattened(x, w):
    """A reshape that copies an expanded value (as the indexer's candidate rows), read back in its layout."""
    return (x[:, :, :16] * 2.0).unsqueeze(-1).expand(3, 2, 16, 2).reshape(3, 64).float().view(3, 2, 16, 2)


def _graph_input(x, w):
    return x.view(3, 64).float().view(3, 2, 32)


# name -> (function of x [3, 2, 32] and w [2, 32, 32] bf16, its views as (input shape, output shape), its casts as (shape, dtype))
STAYS = {
    "the view back has another shape": (_other_shape, [((3, 2, 32), (3, 64)), ((3, 64), (3, 4, 16))],
                                        [((3, 2, 32), E4M3), ((3, 64), torch.float32)]),
    "a scan inside": (_scan_inside, [((3, 2, 32), (3, 64)), ((3, 64), (3, 2, 32))],
                      [((3, 2, 32), E4M3), ((3, 64), torch.float32)]),
    "the viewed value read again": (_viewed_value_read_again, [((3, 2, 32), (3, 64)), ((3, 64), (3, 2, 32))],
                                    [((3, 2, 32), E4M3), ((3, 64), torch.float32)]),
    "a chain value read again": (_chain_value_read_again, [((3, 2, 32), (3, 64)), ((3, 64), (3, 2, 32))],
                                 [((3, 2, 32), E4M3), ((3, 64), torch.float32)]),
    "a per-block scale": (_per_block_scale, [((3, 2, 32), (3, 64)), ((3, 64), (3, 2, 32)), ((3, 2, 32), (3, 64))],
                          [((3, 2, 32), torch.float32), ((3, 2, 1), torch.float32)]),
    "a reshape's copy of a GEMM output": (_grouped_gemm_output, None, [((3, 64), torch.float32)]),
    "a reshape's copy of an expanded value": (_expanded_value_flattened, [((3, 2, 16), (3, 2, 16, 1)),
                                                                        ((3, 2, 16, 2), (3, 64)),
                                                                        ((3, 64), (3, 2, 16, 2))],
                                              [((3, 64), torch.float32)]),
    "a view of a graph input": (_graph_input, [((3, 2, 32), (3, 64)), ((3, 64), (3, 2, 32))], [((3, 64), torch.float32)]),
}


@pytest.mark.parametrize("name", sorted(STAYS))
def test_a_view_round_trip_stays_where_rewriting_it_would_change_values_or_shapes(name):
    """No rewrite where the view back has another shape, a scan sits inside the round trip, the viewed value or a
    value of the chain has another user, an operand varies along a reshaped dim (a per-block scale against the flat
    value), or a pattern may start or end at the first view: a view of a graph input, the view of a reshape that
    copies (the grouped wo_a's einsum `.flatten(1)`, a permute, a clone and a view, which the model's FP8 step reads
    as blocks of 32 where o_lora_rank is 32; an expanded value flattened); the graph computes as traced, bit for
    bit."""
    f, views, casts = STAYS[name]
    g = gen(1)
    x = (torch.randn(3, 2, 32, generator=g).bfloat16(), torch.randn(2, 32, 32, generator=g).bfloat16())
    gm = normalized(f, *x)
    found = [(tuple(n.args[0].meta["val"].shape), tuple(n.meta["val"].shape)) for n in gm.graph.nodes
             if n.target is aten.view.default]
    if views is None:  # the GEMM's own layout chain: the cast stays on the flattened [3, 64] value
        assert found[-2:] == [((3, 2, 32), (3, 64)), ((3, 64), (3, 2, 32))], gm.code
    else:
        assert found == views, gm.code
    assert _casts(gm) == casts, gm.code
    for got, want in zip(as_tuple(gm(*x)), as_tuple(f(*x)), strict=True):
        assert torch.equal(got.float(), want.float())


BF16 = torch.bfloat16


def _exp2_scale(xf):
    """The FP8 step's per-block scale of fp32 blocks xf [..., n, 32]: a normal power of two from 2^-22 up."""
    return torch.exp2(torch.ceil(torch.log2(xf.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0)))


def _blocks_cast_then_merged(x):
    xf = x.float().unflatten(-1, (-1, 32))
    s = _exp2_scale(xf)
    q = (xf / s).clamp(-448.0, 448.0)
    return (q.to(E4M3).float() * s).to(BF16).reshape(x.shape), q.to(E4M3).reshape(x.shape)


def _blocks_merged_then_cast(x):
    xf = x.float().unflatten(-1, (-1, 32))
    s = _exp2_scale(xf)
    q = (xf / s).clamp(-448.0, 448.0)
    return (q.to(E4M3).float() * s).flatten(-2).to(BF16), q.flatten(-2).to(E4M3)


def test_cast_of_unflattened_blocks_moves_below_the_merge_view():
    """A cast of blocks computed from `x.unflatten(-1, (-1, k))` by pointwise ops, then reshaped back, is the cast
    of the merged blocks: `(q * s).to(bf16).reshape(x.shape)` is `(q * s).flatten(-2).to(bf16)`, and the e4m3 cast
    (a narrowing one) likewise; one form, both casts at [3, 64] after a view, bit for bit."""
    x = (torch.randn(3, 64, generator=gen(2)) * torch.logspace(-6, 30, 3)[:, None]).bfloat16()
    forms = [normalized(f, x) for f in (_blocks_cast_then_merged, _blocks_merged_then_cast)]
    assert _ops(forms[0]) == _ops(forms[1])
    assert _casts(forms[0])[-2:] == [((3, 64), BF16), ((3, 64), E4M3)], forms[0].code
    for gm, f in zip(forms, (_blocks_cast_then_merged, _blocks_merged_then_cast)):
        for got, want in zip(gm(x), f(x), strict=True):
            assert torch.equal(got.float(), want.float())
    for got, want in zip(forms[0](x), forms[1](x), strict=True):
        assert torch.equal(got.float(), want.float())


def _gemm_output_cast(x, w):
    """A bmm output [2, 3, 32] cast, then flattened: a pattern's input may be the cast (no split view upstream)."""
    return torch.bmm(x.view(2, 3, 32), w).to(BF16).reshape(2, 96)


def _scan_between(x, w):
    return x.float().view(3, 2, 32).cumsum(-1).to(BF16).reshape(3, 64)


def _other_merge(x, w):
    return (x.float().view(3, 2, 32) * 2.0).to(BF16).reshape(6, 32)


def _two_full_operands(x, w):
    """A product of two blocked values: no one chain back to the split view."""
    xf = x.float().view(3, 2, 32)
    return (xf * xf.exp()).to(BF16).reshape(3, 64)


CAST_STAYS = {"a GEMM output": _gemm_output_cast, "a scan between": _scan_between, "another merge": _other_merge,
              "two full operands": _two_full_operands}


@pytest.mark.parametrize("name", sorted(CAST_STAYS))
def test_cast_before_a_view_stays_without_a_split_it_undoes(name):
    """The cast stays above the view where its value is not computed pointwise from blocks the view merges back:
    a GEMM output's layout (a pattern may take the cast as its input), a scan between the split and the cast, a view
    to another shape than the split's input, a chain of two blocked operands; the graph computes as traced."""
    f = CAST_STAYS[name]
    g = gen(3)
    x = (torch.randn(3, 64, generator=g), torch.randn(2, 32, 32, generator=g))
    gm = normalized(f, *x)
    (cast,) = [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default
               and n.args[1] == BF16]
    assert len(cast.meta["val"].shape) == 3 and [u.target for u in cast.users] == [aten.view.default], gm.code
    assert torch.equal(gm(*x), f(*x))


def test_narrow_product_of_exact_casts_is_the_cast_of_the_fp32_product():
    """`y.to(bf16) * s.to(bf16)` for e4m3 y and the FP8 step's exp2 scale s (a normal power of two: bf16 holds it)
    is `(y.float() * s).to(bf16)`, so is it with the scale as `torch.pow(2, ...)` viewed after its cast, and an fp16
    product of two e4m3 values is that of their fp32 product: the products in fp32, one cast to the narrow type
    each; bit for bit, on blocks whose amax spans 1e-6 to 1e30."""
    def pow_scale(xf):
        return torch.pow(2.0, torch.ceil(torch.log2(xf.abs().amax(-1).clamp_min(1e-4) / 448.0)))

    def bf16_dequant(x):
        xf = x.float().unflatten(-1, (-1, 32))
        s = _exp2_scale(xf)
        y = (xf / s).clamp(-448.0, 448.0).to(E4M3)
        return (y.to(BF16) * s.to(BF16), y[:, :1].to(torch.float16) * y[:, 1:].to(torch.float16),
                y.to(BF16) * pow_scale(xf).to(BF16).unsqueeze(-1))

    def fp32_dequant(x):
        xf = x.float().unflatten(-1, (-1, 32))
        s = _exp2_scale(xf)
        y = (xf / s).clamp(-448.0, 448.0).to(E4M3)
        return ((y.float() * s).to(BF16), (y[:, :1].float() * y[:, 1:].float()).to(torch.float16),
                (y.float() * pow_scale(xf).unsqueeze(-1)).to(BF16))

    x = (torch.randn(4, 64, generator=gen(6)) * torch.logspace(-6, 30, 4)[:, None]).bfloat16()
    forms = [normalized(f, x) for f in (bf16_dequant, fp32_dequant)]
    assert Counter(_ops(forms[0])) == Counter(_ops(forms[1]))  # (the casts made at the product: the order differs)
    muls = [n for n in forms[0].graph.nodes if n.target is aten.mul.Tensor]
    assert [n.meta["val"].dtype for n in muls] == [torch.float32] * 3, forms[0].code
    assert Counter(c[1] for c in _casts(forms[0])) == {torch.float32: 5, E4M3: 1, BF16: 2, torch.float16: 1}, \
        forms[0].code  # x's, y's (or a slice's) made at each product; two bf16 outputs, one fp16
    for got, want, ref in zip(forms[0](x), bf16_dequant(x), fp32_dequant(x), strict=True):
        assert torch.equal(got, want) and torch.equal(got, ref)


def _rounding_cast(x, a):
    return x.to(BF16) * a.to(BF16)  # x.to(bf16) rounds an arbitrary fp32 value


def _unfloored_scale(x, a):
    return x.to(E4M3).to(BF16) * torch.exp2(torch.ceil(torch.log2(a / 448.0))).to(BF16)  # no amax floor


def _scale_to_fp16(x, a):
    s = torch.exp2(torch.ceil(torch.log2(a.clamp_min(1e-4) / 448.0)))
    return x.to(E4M3).to(torch.float16) * s.to(torch.float16)  # fp16 does not hold every such scale (2^16 and up)


NARROW_STAYS = {"a rounding cast": _rounding_cast, "an unfloored scale": _unfloored_scale,
                "a scale cast to fp16": _scale_to_fp16}


@pytest.mark.parametrize("name", sorted(NARROW_STAYS))
def test_narrow_product_stays_where_a_cast_rounds(name):
    """The product stays in the narrow type where an operand's cast may round (an arbitrary fp32 value to bf16, a
    power of two scale to fp16) or is not shown to hold every value (a scale without the amax floor may be
    subnormal): removing that rounding would change values. The graph computes as traced."""
    f = NARROW_STAYS[name]
    g = gen(7)
    x = (torch.randn(4, 32, generator=g) * 100, torch.rand(4, 1, generator=g) * 1e6)
    gm = normalized(f, *x)
    (mul,) = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    assert mul.meta["val"].dtype in (BF16, torch.float16) and op_counts(gm)["aten.mul.Tensor"] == 1, gm.code
    assert torch.equal(gm(*x), f(*x))


def test_e4m3_times_a_normal_power_of_two_is_exact_in_bf16():
    """The arithmetic behind the narrow product rule at the FP8 step: every e4m3 value times every normal power of
    two scale 2^-126..2^127, as bf16 operands, equals the fp32 product cast to bf16 (inf where it overflows)."""
    y = torch.arange(256, dtype=torch.uint8).view(E4M3)
    y = y[~y.float().isnan()]
    s = torch.exp2(torch.arange(-126, 128, dtype=torch.float32))
    narrow = y.to(BF16)[:, None] * s.to(BF16)[None, :]
    assert torch.equal(narrow, (y.float()[:, None] * s[None, :]).to(BF16))
    assert torch.equal(s.to(BF16).float(), s)
    n = torch.arange(-126, 128, dtype=torch.float32)  # the exp2 and pow spellings of the scale: exact powers of two
    assert torch.equal(torch.pow(2.0, n), s) and torch.equal(torch.exp2(n), s)
    assert torch.equal(s, torch.ldexp(torch.ones(254), n))


def _rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def test_gptj_rope_is_the_pairwise_rope():
    """GPT-J's `x * cos2 + rotate_every_two(x) * sin2` with cos2/sin2 = cos/sin.repeat_interleave(2, -1) is the
    spec's pairwise form (`dsv41.models.functional.rope`): the same ops, once per rotation (operands in either
    order, with heads broadcast), bit for bit; the half-split (`rotate_half`) layout and a cos tiled by `repeat`
    are other rotations and stay."""
    from dsv41.models.functional import rope

    def pairwise(x, cos, sin):
        return rope(x, cos[:, None], sin[:, None])

    def gptj(x, cos, sin):
        c2, s2 = (t.repeat_interleave(2, dim=-1)[:, None] for t in (cos, sin))
        xf = x.float()
        return (xf * c2 + s2 * _rotate_every_two(xf)).to(x.dtype)

    def half_split(x, cos, sin):
        c2, s2 = (torch.cat((t, t), dim=-1)[:, None] for t in (cos, sin))
        xf = x.float()
        x1, x2 = xf[..., :8], xf[..., 8:]
        return (xf * c2 + torch.cat((-x2, x1), dim=-1) * s2).to(x.dtype)

    def tiled(x, cos, sin):
        c2, s2 = (t.repeat(1, 2)[:, None] for t in (cos, sin))
        xf = x.float()
        return (xf * c2 + _rotate_every_two(xf) * s2).to(x.dtype)

    g = gen(0)
    x = (torch.randn(3, 4, 16, generator=g).bfloat16(), torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g))
    want, got = normalized(pairwise, *x), normalized(gptj, *x)
    counts = op_counts(got)
    assert counts == op_counts(want) and counts["aten.sub.Tensor"] == 1 and counts["aten.mul.Tensor"] == 4, got.code
    assert counts["aten.expand"] == counts["aten.clone"] == counts["aten.neg"] == 0 and counts["aten.cat"] == 1
    assert torch.equal(got(*x), gptj(*x)) and torch.equal(got(*x), pairwise(*x))
    for other in (half_split, tiled):
        gm = normalized(other, *x)
        assert op_counts(gm)["aten.sub.Tensor"] == 0 and op_counts(gm)["aten.neg"] == 1, gm.code
        assert torch.equal(gm(*x), other(*x))


def test_ldexp_is_the_product_with_a_power_of_two():
    """ldexp(x, e) is x * pow(2.0, e) (torch's definition), and ldexp(ones, e) (`jnp.ldexp(1.0, e)`, a power-of-two
    scale) is pow(2.0, e) alone, the form of `torch.pow(2, ...)`; bit for bit."""
    def f(amax, x, e):
        return torch.ldexp(torch.ones_like(amax), torch.ceil(torch.log2(amax / 448.0))), torch.ldexp(x, e)

    def pow_form(amax):
        return torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))

    g = gen(0)
    x = (torch.rand(4, 8, generator=g) * 1e3 + 1e-4, torch.randn(4, 8, generator=g),
         torch.randint(-20, 20, (4, 8), generator=g).float())
    gm = normalized(f, *x)
    ops = op_counts(gm)
    assert ops["aten.ldexp.Tensor"] == 0 and ops["aten.pow.Scalar"] == 2 and ops["aten.mul.Tensor"] == 1, gm.code
    assert ops["aten.full"] == 0, gm.code
    scale = [n for n in gm.graph.nodes if n.target is aten.pow.Scalar][0]
    assert op_counts(normalized(pow_form, x[0]))["aten.pow.Scalar"] == 1 and scale in gm.graph.output_node().args[0]
    for got, want in zip(gm(*x), f(*x), strict=True):
        assert torch.equal(got, want)


def test_cast_moves_below_a_run_slice():
    """The halves of a cast value, `torch.chunk(y.float(), 2, -1)`, are the casts of y's halves (a slice of a cast is
    the cast of the slice, run or strided); bit for bit."""
    def f(y):
        a, b = torch.chunk(y.float(), 2, dim=-1)
        return a * 2.0, b + 1.0, y.float()[1:, 2:6]

    y = torch.randn(3, 8, generator=gen(0)).to(torch.bfloat16)
    gm = normalized(f, y)
    for n in gm.graph.nodes:
        if n.target is aten.slice.Tensor:
            assert n.args[0].op == "placeholder" or n.args[0].target is aten.slice.Tensor, n.format_node()
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default]
    assert len(casts) == 3 and all(c.args[0].target is aten.slice.Tensor for c in casts)
    for got, want in zip(gm(y), f(y), strict=True):
        assert torch.equal(got, want)


def test_gather_of_a_1d_value_is_the_lookup():
    """gather(x, 0, i) of a 1-D x is x[i]; a 2-D gather stays; bit for bit."""
    def f(x, i, m, j):
        return torch.gather(x, 0, i), torch.gather(m, 1, j)

    g = gen(0)
    x = (torch.randn(6, generator=g), torch.randint(0, 6, (9,), generator=g), torch.randn(3, 5, generator=g),
         torch.randint(0, 5, (3, 2), generator=g))
    gm = normalized(f, *x)
    ops = op_counts(gm)
    assert ops["aten.index.Tensor"] == 1 and ops["aten.gather"] == 1, ops
    for got, want in zip(gm(*x), f(*x), strict=True):
        assert torch.equal(got, want)


def test_maximum_and_minimum_with_a_nonzero_constant_are_clamps():
    """torch.maximum(x, full_like(x, c)) / minimum (either operand order) are clamp_min / clamp_max(x, c), NaN
    propagated alike; with c = 0 (the sign of a zero result may differ) or a varying operand they stay."""
    def f(x, y):
        return (torch.maximum(x, torch.full_like(x, 1e-4)), torch.minimum(torch.full_like(x, 10.0), x),
                torch.maximum(x, torch.zeros_like(x)), torch.minimum(x, y))

    g = gen(0)
    x = torch.randn(4, 8, generator=g) * 20
    x[0, :3] = torch.tensor([float("nan"), 0.0, -0.0])
    args = (x, torch.randn(4, 8, generator=g))
    gm = normalized(f, *args)
    ops = op_counts(gm)
    assert ops["aten.clamp_min"] == 1 and ops["aten.clamp_max"] == 1, gm.code
    assert ops["aten.maximum"] == 1 and ops["aten.minimum"] == 1, gm.code
    for got, want in zip(gm(*args), f(*args), strict=True):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)) and torch.equal(got.isnan(), want.isnan())


def test_a_clamp_with_one_bound_is_clamp_min_or_clamp_max():
    """aten.clamp(x, lo), clamp(x, None, hi) and clamp(x, min=lo) (the traced decompositions give clamp_min /
    clamp_max; a graph rewritten elsewhere may not) are clamp_min / clamp_max, NaN propagated alike; a clamp with both
    bounds stays."""
    def f(x):
        return x.clamp_min(-10.0), x.clamp_max(10.0), x.clamp_min(1e-4), x.clamp_max(3.0)

    g = gen(0)
    x = torch.randn(4, 8, generator=g) * 20
    x[0, :2] = torch.tensor([float("nan"), -0.0])
    gm = aten_graph(f, x)
    lo, hi, lo_kw, both = [n for n in gm.graph.nodes if n.op == "call_function"]
    lo.target, lo.args = torch.ops.aten.clamp.default, (lo.args[0], -10.0)
    hi.target, hi.args = torch.ops.aten.clamp.default, (hi.args[0], None, 10.0)
    lo_kw.target, lo_kw.args, lo_kw.kwargs = torch.ops.aten.clamp.default, (lo_kw.args[0],), {"min": 1e-4}
    both.target, both.args = torch.ops.aten.clamp.default, (both.args[0], -3.0, 3.0)
    gm.recompile()
    want = gm(x)
    normalize_graph(gm.graph)
    gm.recompile()
    assert [(n.target, n.args[1:], n.kwargs) for n in gm.graph.nodes if n.op == "call_function"] == [
        (torch.ops.aten.clamp_min.default, (-10.0,), {}), (torch.ops.aten.clamp_max.default, (10.0,), {}),
        (torch.ops.aten.clamp_min.default, (1e-4,), {}), (torch.ops.aten.clamp.default, (-3.0, 3.0), {})], gm.code
    for got, w in zip(gm(x), want, strict=True):
        assert torch.equal(got.nan_to_num(7.0), w.nan_to_num(7.0)) and torch.equal(got.isnan(), w.isnan())


def test_int64_sum_of_a_lossless_narrow_integer_cast_is_the_sum_of_the_int64_cast():
    """A one-hot count cast to int32 before its (int64) sum, `(ids[:, None] == arange(E)).to(int32).sum(0)`, is the
    sum of the comparison cast to int64, the form of `F.one_hot(ids, E).sum(0)`; a cast that can lose values
    (int64 -> int32) stays."""
    def f(ids, big):
        onehot = ids[:, None] == torch.arange(8)[None, :]
        return onehot.to(torch.int32).sum(0), big.to(torch.int32).sum(0)

    def one_hot(ids):
        return F.one_hot(ids, 8).sum(0)

    g = gen(0)
    args = (torch.randint(0, 8, (12,), generator=g), torch.randint(2**31, 2**33, (5, 3), generator=g))
    gm = normalized(f, *args)
    casts = [n.args[1] for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default]
    assert sorted(map(str, casts)) == ["torch.int32", "torch.int64"], gm.code
    assert op_counts(normalized(one_hot, args[0])) == op_counts(normalized(lambda i: f(i, args[1])[0], args[0]))
    for got, want in zip(gm(*args), f(*args), strict=True):
        assert torch.equal(got, want)


def test_a_slice_updated_from_itself_is_a_cat():
    """`torch.slice_scatter(x, rope(x[..., -r:]), -1, d - r)` and the functionalised `y[..., -r:] = ...` (a slice
    written from that slice, `x.at[..., -r:].set(...)`) are cat(x[..., :d - r], the new slice); a slice_scatter of
    values not computed from the slice it replaces (a cache row) stays; bit for bit."""
    def f(x, row):
        tail = x[..., 12:] * 2.0
        a = torch.slice_scatter(x, tail, dim=-1, start=12)
        b = x.clone()
        b[..., 4:8] = b[..., 4:8].neg()
        cache = torch.slice_scatter(x, row, dim=1, start=2, end=3)
        return a, b, cache

    g = gen(0)
    args = (torch.randn(3, 4, 16, generator=g), torch.randn(3, 1, 16, generator=g))
    gm = normalized(f, *args)
    ops = op_counts(gm)
    assert ops["aten.cat"] == 2 and ops["aten.slice_scatter"] == 1, gm.code
    for got, want in zip(gm(*args), f(*args), strict=True):
        assert torch.equal(got, want)


def test_a_batch_one_bmm_against_a_2d_weight_is_a_gemm():
    """`einsum('bld,dq->blq', h, w)` with a 2-D [in, out] kernel traces as a bmm of batch 1 against w viewed
    [1, in, out]: it is mm(h rows, w), the form of `h @ w`. A batch of 1 that is a dim of the operands (an einsum
    over one token, `'tj,tjd->td'` at T = 1) stays a bmm."""
    def flax(h, w):
        return torch.einsum("bld,dq->blq", h, w)

    def matmul(h, w):
        return (h.view(-1, h.shape[-1]) @ w).view(*h.shape[:-1], -1)

    def one_token(pre, x):
        return torch.einsum("tj,tjd->td", pre, x)

    g = gen(0)
    args = (torch.randn(3, 1, 16, generator=g), torch.randn(16, 8, generator=g))
    gm = normalized(flax, *args)
    assert op_counts(gm)["aten.bmm"] == 0 and op_counts(gm) == op_counts(normalized(matmul, *args)), gm.code
    # the same products summed in the CPU GEMM's order for mm and for bmm: equal up to fp32 reordering (an AVX-512
    # CPU's bmm and mm differed by 4.8e-7 here), torch's fp32 defaults rtol 1.3e-6, atol 1e-5
    torch.testing.assert_close(gm(*args), flax(*args))
    tok = (torch.randn(1, 4, generator=g), torch.randn(1, 4, 16, generator=g))
    gm = normalized(one_token, *tok)
    assert op_counts(gm)["aten.bmm"] == 1 and op_counts(gm)["aten.mm"] == 0, gm.code
    assert torch.equal(gm(*tok), one_token(*tok))


def test_a_unit_dim_put_back_by_a_view_of_a_pointwise_result_at_the_lower_rank_sinks_again():
    """MaxText's `m[..., 8:].reshape(B, L, 4, 4) * s + b.reshape(4, 4)` at L = 1: the product, moved above the
    view, is computed from values whose unit dim sank, so the view that splits its last dim and puts L back adds
    that dim, and the softmax below runs at [B, 4, 4] as in the [T, ...] form; bit for bit."""
    def f(x, s, b):
        m = x.float() * 2.0
        return torch.softmax(m[..., 8:].reshape(3, 1, 4, 4) * s + b.reshape(4, 4), dim=-1)

    def flat(x, s, b):
        m = x.view(3, 24).float() * 2.0
        return torch.softmax(m[:, 8:].view(3, 4, 4) * s + b.view(4, 4), dim=-1).view(3, 1, 4, 4)

    g = gen(0)
    args = (torch.randn(3, 1, 24, generator=g).bfloat16(), torch.randn((), generator=g), torch.randn(16, generator=g))
    gm = normalized(f, *args)
    (amax,) = [n for n in gm.graph.nodes if n.target is aten.amax.default]
    assert list(amax.meta["val"].shape) == [3, 4, 1], gm.code
    assert op_counts(gm) == op_counts(normalized(flat, *args)), gm.code
    assert torch.equal(gm(*args), aten_graph(f, *args)(*args))  # the traced ops (eager's softmax kernel rounds otherwise)


def test_take_along_dim_of_indices_in_range_is_a_gather_or_an_index():
    """take_along_dim wraps its indices (`remainder(i, n)`), the identity on indices known to lie in [0, n): a
    top-k's or sort's indices along a dim of size n, their sorted values, a floor division of them by k (the
    token of an expert-sorted row, `order // k` < T). Its gather of a vector broadcast along the other dims,
    `take_along_dim(x, token[:, None], dim=0)` (`jnp.take(x, token, axis=0)`), is `x[token]`. Indices of unknown
    range keep the remainder; bit for bit."""
    def f(x, ids, s, free):
        order = torch.argsort(ids.flatten(), stable=True)
        rows = torch.take_along_dim(x, (order // 2)[:, None], dim=0)
        picks = torch.sort(torch.topk(s, 3, dim=-1).indices, dim=-1).values
        return rows, torch.take_along_dim(s, picks, dim=-1), torch.take_along_dim(s, free, dim=-1)

    def plain(x, ids, s, free):
        order = torch.argsort(ids.flatten(), stable=True)
        picks = torch.sort(torch.topk(s, 3, dim=-1).indices, dim=-1).values
        return x[order // 2], s.gather(-1, picks)

    g = gen(0)
    args = (torch.randn(4, 8, generator=g), torch.randint(0, 5, (4, 2), generator=g), torch.randn(4, 6, generator=g),
            torch.randint(-6, 6, (4, 2), generator=g))
    gm = normalized(f, *args)
    ops = op_counts(gm)
    assert ops["aten.remainder.Scalar"] == 1 and ops["aten.gather"] == 2 and ops["aten.index.Tensor"] == 1, gm.code
    want = op_counts(normalized(plain, *args))
    assert ops["aten.index.Tensor"] == want["aten.index.Tensor"] and ops["aten.gather"] == want["aten.gather"] + 1
    for got, ref in zip(gm(*args), f(*args), strict=True):
        assert torch.equal(got, ref)


def _map_counts(scores, cast):
    """Megatron's tokens_per_expert: the column sums of a routing map scattered from the top-2 experts per row."""
    top = torch.topk(scores, 2, dim=-1).indices
    return cast(torch.zeros_like(scores).int().scatter(1, top, 1)).sum(dim=0), top.view(-1)


@pytest.mark.parametrize("cast", [lambda m: m.bool(), lambda m: m, lambda m: m.long()], ids=["bool", "int32", "int64"])
def test_routing_map_column_sums_are_the_expert_counts(cast):
    """zeros(T, E).scatter(1, topk ids, 1).sum(0) is zeros(E).scatter_add(0, ids.view(-1), ones) (k distinct
    experts per row), the map's scatter gone; reading the ids' flat view, the one a sort of the ids reads; equal to
    eager on fresh scores."""
    scores = torch.randn(5, 8, generator=gen(0))
    gm = normalized(lambda s: _map_counts(s, cast), scores)
    ops = op_counts(gm)
    assert ops["aten.scatter_add"] == 1 and ops["aten.scatter.value"] == 0 and ops["aten.sum.dim_IntList"] == 0, ops
    (add,) = [n for n in gm.graph.nodes if n.target is aten.scatter_add.default]
    assert add.args[2].target is aten.view.default and len(add.args[2].users) == 2  # the one flat view of the ids
    for seed in (1, 2):
        s = torch.randn(5, 8, generator=gen(seed))
        for got, want in zip(gm(s), _map_counts(s, cast), strict=True):
            assert torch.equal(got, want)


def _search_offsets(scores, search, k=3, right=True, n=None):
    """Expert offsets of top-k ids as a library user writes them: the flat ids sorted, then searched for each expert
    0..n-1 (`torch.searchsorted(sorted_ids, arange(n), right=right)` or `torch.bucketize` with the operands swapped),
    as int32."""
    ids = torch.topk(scores, k, dim=-1).indices.flatten()
    sorted_ids = torch.sort(ids, stable=True).values
    experts = torch.arange(scores.shape[1] if n is None else n)
    found = torch.searchsorted(sorted_ids, experts, right=right) if search == "searchsorted" else \
        torch.bucketize(experts, sorted_ids, right=right)
    return found.to(torch.int32)


@pytest.mark.parametrize("search", ["searchsorted", "bucketize"])
def test_searched_offsets_of_sorted_ids_are_the_cumsum_of_their_counts(search):
    """searchsorted(sort(ids).values, arange(n), right=True) (or bucketize(arange(n), ..., right=True)) of top-k ids
    in [0, n) is cumsum(zeros(n).scatter_add(0, ids, ones)): int32 counts and cumsum where the one user casts to
    int32 (the cast gone), bit for bit on fresh scores, including ties and unused experts; also at n one past the
    ids' range (the last expert's offset is all the ids)."""
    for n in (None, 9):
        scores = torch.randn(5, 8, generator=gen(0))
        gm = normalized(lambda s: _search_offsets(s, search, n=n), scores)
        ops = op_counts(gm)
        assert ops[f"aten.{search}.Tensor"] == 0 and ops["aten.scatter_add"] == 1 and ops["aten.cumsum"] == 1, ops
        assert ops["prims.convert_element_type"] == 0, gm.code
        (cumsum,) = [u for u in gm.graph.nodes if u.target is aten.cumsum.default]
        assert cumsum.kwargs["dtype"] is torch.int32 and cumsum.meta["val"].dtype is torch.int32
        for seed in (1, 2, 3):
            s = torch.randn(5, 8, generator=gen(seed)).round()  # ties among the scores
            assert torch.equal(gm(s), _search_offsets(s, search, n=n))


def test_searches_that_are_not_counts_stay():
    """The counts rule needs the right side, a sort's ascending values, needles arange(n) with n at least the ids'
    range: side left (the first position, the cumsum of counts below), a descending sort, and n one below the ids'
    range (an id n would be searched and uncounted) stay; where a user reads the int64 result the cumsum is int64."""
    def f(scores):
        ids = torch.topk(scores, 3, dim=-1).indices.flatten()
        up, down = torch.sort(ids).values, torch.sort(ids, descending=True).values
        return (torch.searchsorted(up, torch.arange(8)), torch.searchsorted(down, torch.arange(8), right=True),
                torch.searchsorted(up, torch.arange(7), right=True), torch.searchsorted(up, torch.arange(8), right=True))

    scores = torch.randn(5, 8, generator=gen(0))
    gm = normalized(f, scores)
    ops = op_counts(gm)
    assert ops["aten.searchsorted.Tensor"] == 3 and ops["aten.cumsum"] == 1, ops
    (cumsum,) = [u for u in gm.graph.nodes if u.target is aten.cumsum.default]
    assert cumsum.kwargs["dtype"] is torch.int64
    s = torch.randn(5, 8, generator=gen(1))
    for got, want in zip(gm(s), f(s), strict=True):
        assert torch.equal(got, want)


def test_counts_are_accumulated_in_the_dtype_their_cumsum_sums_in():
    """Counts by an int64 `index_add_` under `cumsum(dtype=int32)` are int32 counts, and int32 `scatter_add_`
    counts under a plain cumsum (which sums integers in int64) are int64 counts: the cumsum then reads counts of
    its own dtype, bit for bit. The edge of the rule: 127 ids under `cumsum(dtype=int8)` (every count fits int8)
    are counted in int8; 128 (just past it) and counts that another op also reads stay."""
    def f(ids, many):
        by_index = torch.zeros(8, dtype=torch.int64).index_add_(0, ids, torch.ones_like(ids))
        by_scatter = torch.zeros(8, dtype=torch.int32).scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        shared = torch.zeros(8, dtype=torch.int64).index_add_(0, ids, torch.ones_like(ids))
        small = torch.zeros(8, dtype=torch.int64).index_add_(0, many[:127], torch.ones_like(many[:127]))
        large = torch.zeros(8, dtype=torch.int64).index_add_(0, many, torch.ones_like(many))
        return (torch.cumsum(by_index, 0, dtype=torch.int32), by_scatter.cumsum(0),
                torch.cumsum(shared, 0, dtype=torch.int32), shared, torch.cumsum(small, 0, dtype=torch.int8),
                torch.cumsum(large, 0, dtype=torch.int8))

    x = (torch.randint(0, 8, (12,), generator=gen(0)), torch.randint(0, 8, (128,), generator=gen(1)))
    gm = normalized(f, *x)
    cumsums = [n for n in gm.graph.nodes if n.target is aten.cumsum.default]
    counted_in = [n.args[0].meta["val"].dtype for n in cumsums]
    assert counted_in == [torch.int32, torch.int64, torch.int64, torch.int8, torch.int64], gm.code
    for seed in (2, 3):
        x = (torch.randint(0, 8, (12,), generator=gen(seed)), torch.randint(0, 2, (128,), generator=gen(seed)))
        for got, want in zip(gm(*x), f(*x), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_column_sums_of_a_map_without_distinct_rows_stay():
    """The counts rule needs k distinct ids per row (a top-k's indices): a map scattered from any ids (duplicates
    set one entry once), a float map, or a row sum stay as written."""
    def f(scores, ids):
        top = torch.topk(scores, 2, dim=-1).indices
        return (torch.zeros_like(scores).int().scatter(1, ids, 1).sum(0),
                torch.zeros_like(scores).scatter(1, top, 1.0).sum(0),
                torch.zeros_like(scores).int().scatter(1, top, 1).sum(1))

    x = (torch.randn(5, 8, generator=gen(0)), torch.randint(0, 8, (5, 2), generator=gen(1)))
    ops = op_counts(normalized(f, *x))
    assert ops["aten.scatter.value"] == 3 and ops["aten.scatter_add"] == 0, ops


def test_megatron_interleaved_rope_is_the_pairwise_rope():
    """Megatron's interleaved rotary: each angle repeated by `stack((f.view(-1, 1), f.view(-1, 1)), -1)` (a cat of
    copies, the pair repeat), cos and sin taken of the repeated angles (the pair repeats of cos and sin), the rotate
    by stride-2 slices and `stack((-x2, x1), -1).view(...)`: the spec's pairwise form on cos(f), sin(f), the same ops
    as the model's `rope`, bit for bit; a cat of two different values stays."""
    from dsv41.models.functional import rope

    def pairwise(x, f):
        return rope(x, f.cos()[:, None], f.sin()[:, None])

    def megatron(x, f):
        emb = torch.stack((f.view(-1, 1), f.view(-1, 1)), dim=-1).view(f.shape[0], -1)[:, None]
        xf = x.float()
        x_new = torch.stack((-xf[..., 1::2], xf[..., ::2]), dim=-1)
        rotated = x_new.view(*x_new.shape[:-2], -1)
        return (xf * torch.cos(emb) + rotated * torch.sin(emb)).to(x.dtype)

    def two_values(f, g):
        return torch.stack((f.view(-1, 1), g.view(-1, 1)), dim=-1).view(f.shape[0], -1).cos()

    gen0 = gen(0)
    x = (torch.randn(3, 4, 16, generator=gen0).bfloat16(), torch.rand(3, 8, generator=gen0) * 6.3)
    want, got = normalized(pairwise, *x), normalized(megatron, *x)
    counts, views = op_counts(got), "aten.view"
    assert counts - Counter({views: counts[views]}) == op_counts(want) - Counter({views: op_counts(want)[views]})
    assert counts["aten.sub.Tensor"] == 1 and counts["aten.mul.Tensor"] == 4, got.code  # (cos of f's flat view)
    assert counts["aten.expand"] == counts["aten.clone"] == counts["aten.neg"] == 0 and counts["aten.cat"] == 1
    assert torch.equal(got(*x), megatron(*x)) and torch.equal(got(*x), pairwise(*x))
    fg = (torch.randn(3, 8, generator=gen0), torch.randn(3, 8, generator=gen0))
    gm = normalized(two_values, *fg)
    assert op_counts(gm)["aten.cat"] == 1 and op_counts(gm)["aten.expand"] == 0, gm.code
    assert torch.equal(gm(*fg), two_values(*fg))


def _seq_first(x, w, pre):
    """A linear layer on sequence-first activations x [1, B, K], then fp32 pointwise ops and a reduction there."""
    y = F.linear(x, w).float()
    s = torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (y * s * pre.unsqueeze(-1)).sum(-1)


def test_sequence_first_unit_dim_sinks_where_a_linear_runs_at_it():
    """In a graph that runs a linear layer on [1, B, K] activations (view to [B, K], mm, view to [1, B, N]), the
    leading S = 1 of its [1, B, ...] inputs and GEMM outputs sinks below the ops, which run at [B, ...] (one view
    restores the output's shape); without that evidence a leading unit dim is the token dim and stays (one token's
    [1, hc, D]); bit for bit."""
    g = gen(0)
    x = (torch.randn(1, 3, 16, generator=g).bfloat16(), torch.randn(8, 16, generator=g).bfloat16(),
         torch.randn(1, 3, generator=g))
    gm = normalized(_seq_first, *x)
    computed = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not aten.view.default]
    assert all(n.meta["val"].shape[0] != 1 for n in computed), gm.code  # mm, pow, mean, rsqrt, mul, sum at [3, ...]
    assert torch.equal(gm(*x), _seq_first(*x))

    def one_token(x, pre):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * pre.unsqueeze(-1)).sum(1)

    t1 = (torch.randn(1, 4, 16, generator=g).bfloat16(), torch.randn(1, 4, generator=g))
    gm = normalized(one_token, *t1)
    assert all(n.meta["val"].shape[0] == 1 for n in gm.graph.nodes if n.op == "call_function"), gm.code
    assert torch.equal(gm(*t1), one_token(*t1))


def _sorted_prefixes(s):
    """The first k of descending sorts: a stable sort's indices and values, and a plain sort's values."""
    vals, idx = torch.sort(s, dim=-1, descending=True, stable=True)
    return idx[:, :3], vals[:, :3], torch.sort(s, dim=1, descending=True).values[:, :2]


def test_first_k_of_a_descending_sort_is_a_topk():
    """sort(x, descending=True)[i][:, :k] is topk(x, k)[i]: the sorts are gone, one topk per k serving both of the
    stable sort's pieces; equal to eager on fresh rows, a NaN among them (the largest in both)."""
    s = torch.randn(4, 8, generator=gen(0))
    gm = normalized(_sorted_prefixes, s)
    ops = op_counts(gm)
    assert ops["aten.sort.stable"] == ops["aten.sort"] == ops["aten.slice.Tensor"] == 0, ops
    topks = sorted(n.args[1:] for n in gm.graph.nodes if n.target is aten.topk.default)
    assert topks == [(2, 1, True, True), (3, 1, True, True)], topks
    for seed in (1, 2):
        s = torch.randn(4, 8, generator=gen(seed))
        s[1, 5] = float("nan")
        for got, want in zip(gm(s), _sorted_prefixes(s), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_a_stable_sort_no_fusion_took_is_restored():
    """After the fusions, `restore_stable_sorts` computes the topk made from the stable sort's first k as that sort
    again (contiguous outputs, a view may follow) and leaves the plain sort's topk (ties unspecified in both):
    equal to eager bit for bit on rows of many ties, where the stable sort's order among them is defined."""
    def f(s):
        idx, vals, plain = _sorted_prefixes(s)
        return idx.reshape(-1), vals, plain

    gm = normalized(f, torch.randn(4, 8, generator=gen(0)))
    assert restore_stable_sorts(gm.graph) == 1
    gm.recompile()
    ops = op_counts(gm)
    assert ops["aten.sort.stable"] == 1 and ops["aten.topk"] == 1, ops
    assert [n.args[1] for n in gm.graph.nodes if n.target is aten.topk.default] == [2]
    for seed in (1, 2):
        s = torch.randint(0, 3, (4, 8), generator=gen(seed)).float()  # three values: ties across the k-th place
        for got, want in zip(gm(s)[:2], f(s)[:2], strict=True):
            assert torch.equal(got, want)


def test_other_pieces_of_a_sort_stay():
    """An ascending sort's first k (the k smallest), a descending sort's slice not starting at 0 or along another
    dim than the sort's stay as written."""
    def f(s):
        return (torch.sort(s, dim=-1).values[:, :3], torch.sort(s, dim=-1, descending=True).indices[:, 1:3],
                torch.sort(s, dim=-1, descending=True).values[:2])

    gm = normalized(f, torch.randn(4, 8, generator=gen(0)))
    ops = op_counts(gm)
    assert ops["aten.topk"] == 0 and ops["aten.sort"] == 3 and ops["aten.slice.Tensor"] == 3, ops


def _scatter_by_sort(rows, ids):
    """rows put back by the stable sort of ids, `new_x[order] = rows` into empty_like (SGLang's unpermute)."""
    order = ids.argsort(stable=True)
    new_x = torch.empty_like(rows)
    new_x[order] = rows
    return new_x


def test_scatter_by_a_permutation_is_the_gather_by_its_inverse():
    """index_put(base, [order], rows) with order a sort's indices over all rows is rows[argsort(order)]: the
    index_put and its base gone, one sort of order, one index; equal to eager on fresh rows and ids with repeats."""
    x = (torch.randn(6, 4, generator=gen(0)), torch.randint(0, 3, (6,), generator=gen(1)))
    gm = normalized(_scatter_by_sort, *x)
    ops = op_counts(gm)
    assert ops["aten.index_put"] == ops["aten.empty.memory_format"] == 0 and ops["aten.index.Tensor"] == 1, ops
    (inverse,) = [n for n in gm.graph.nodes if n.target is aten.sort.default]
    assert inverse.args[0].args[0].target is aten.sort.stable  # the sort of the permutation
    for seed in (2, 3):
        x = (torch.randn(6, 4, generator=gen(seed)), torch.randint(0, 3, (6,), generator=gen(seed + 10)))
        assert torch.equal(gm(*x), _scatter_by_sort(*x))


def test_scatter_by_other_indices_stays():
    """Indices that need not be a permutation (graph input ids, a sort's indices over fewer rows than the base's),
    and an accumulating index_put keep their index_put."""
    def f(rows, ids, short):
        a = torch.zeros_like(rows).index_put((ids,), rows)
        b = torch.zeros_like(rows).index_put((short.argsort(),), rows[:3])
        c = torch.zeros_like(rows).index_put((ids.argsort(),), rows, accumulate=True)
        return a, b, c

    x = (torch.randn(6, 4, generator=gen(0)), torch.randperm(6, generator=gen(1)), torch.randn(3, generator=gen(2)))
    assert op_counts(normalized(f, *x))["aten.index_put"] == 3


def test_clone_of_a_contiguous_computed_value_is_the_value():
    """x.reshape(-1) of a strided slice traces as clone + view; once the slice is a topk's contiguous indices (a
    descending sort's first k) the clone is the value itself: both flat views read the topk's indices. A clone of a
    graph input, or one the output reads, stays."""
    def f(s, y):
        ids = torch.sort(s, dim=-1, descending=True).indices[:, :2]
        return ids.reshape(-1).argsort(stable=True), ids.reshape(-1) * 3, y.clone() * 2, y.clone()

    x = (torch.randn(4, 8, generator=gen(0)), torch.randn(3, generator=gen(1)))
    gm = normalized(f, *x)
    assert op_counts(gm)["aten.clone"] == 2, gm.code
    (topk,) = [n for n in gm.graph.nodes if n.target is aten.topk.default]
    (indices,) = topk.users
    assert {u.target for u in indices.users} == {aten.view.default}, gm.code
    for got, want in zip(gm(*x), f(*x), strict=True):
        assert torch.equal(got, want)


def _rope_written_back(x, cos, sin):
    """x's last 8 elements rotated pairwise in fp32 and written back in place by `copy_` (SGLang's q_pe write-back)."""
    x = x * 1.5
    pe = x[:, -8:]
    x1, x2 = pe[:, ::2].float(), pe[:, 1::2].float()
    pe.copy_(torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2))
    return x


def test_a_copy_written_back_is_its_source():
    """copy(dst, src) of a same-shape src is src in dst's dtype: the fp32 rotation written into a bf16 slice is its
    bf16 cast, and the write-back a cat of the rest and that cast; no copy left; equal to eager bit for bit."""
    g = gen(0)
    x = (torch.randn(3, 16, generator=g).bfloat16(), torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g))
    gm = normalized(_rope_written_back, *x)
    ops = op_counts(gm)
    assert ops["aten.copy"] == ops["aten.slice_scatter"] == 0 and ops["aten.cat"] == 2, gm.code
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert out.target is aten.cat.default and out.args[0][1].target is torch.ops.prims.convert_element_type.default
    assert torch.equal(gm(*x), _rope_written_back(*x))


def test_a_broadcast_copy_stays():
    """copy(dst, src) of a src broadcast to dst's shape (`dst.copy_(row)`) stays a copy."""
    def f(x, row):
        y = x * 2
        y[:, :4].copy_(row)
        return y

    x = (torch.randn(3, 8, generator=gen(0)), torch.randn(4, generator=gen(1)))
    gm = normalized(f, *x)
    assert op_counts(gm)["aten.copy"] == 1, gm.code
    assert torch.equal(gm(*x), f(*x))


def _token_major_scores(q, keys, w):
    """Index scores token-major: bmm(keys, q^T) [T, N, H], relu, times the head weights, summed over the heads."""
    return (torch.bmm(keys, q.mT).relu() * w.unsqueeze(1)).sum(dim=-1)


def _head_major_scores(q, keys, w):
    return (torch.einsum("thd,tnd->thn", q, keys).relu() * w.unsqueeze(-1)).sum(dim=1)


def test_a_sum_over_a_products_columns_is_the_sum_over_the_transposed_products_rows():
    """sum(f(bmm(a, b)), dim=2) is sum(f^T(bmm(b^T, a^T)), dim=1): the token-major scores normalise to the graph of
    the head-major einsum form (the same ops at the same shapes); equal to eager within fp32 reordering."""
    g = gen(0)
    x = (torch.randn(3, 4, 8, generator=g), torch.randn(3, 10, 8, generator=g), torch.randn(3, 4, generator=g))
    forms = [normalized(f, *x) for f in (_token_major_scores, _head_major_scores)]
    texts = [[(n.target, tuple(n.meta["val"].shape)) for n in gm.graph.nodes if n.op == "call_function"] for gm in forms]
    assert texts[0] == texts[1], forms[0].code
    (total,) = [n for n in forms[0].graph.nodes if n.target is aten.sum.dim_IntList]
    assert total.args[1] == [1]
    for seed in (1, 2):
        g = gen(seed)
        x = (torch.randn(3, 4, 8, generator=g), torch.randn(3, 10, 8, generator=g), torch.randn(3, 4, generator=g))
        torch.testing.assert_close(forms[0](*x), _token_major_scores(*x), rtol=1e-6, atol=1e-6)


def test_a_sum_over_columns_of_other_values_stays():
    """The rule needs elementwise ops, each read once, between the bmm and the sum: a softmax between them, a
    product read twice, or a sum keeping its dim stay as written."""
    def f(a, b):
        p = torch.bmm(a, b)
        r = p.relu()
        return p.softmax(-1).sum(-1), (r * 2).sum(-1) + r.sum(1).sum(-1, keepdim=True), torch.bmm(a, b).sum(2, keepdim=True)

    g = gen(0)
    gm = normalized(f, torch.randn(2, 3, 4, generator=g), torch.randn(2, 4, 5, generator=g))
    ops = op_counts(gm)
    assert ops["aten.bmm"] == 2 and ops["aten.permute"] == 0, gm.code  # no product transposed


def test_lookup_of_a_lookup_is_one_lookup():
    """x[i][j] is x[i[j]]: one lookup of x (by the composed index), equal to eager exactly."""
    def f(x, i, j):
        return x[i][j]

    g = gen(0)
    args = (torch.randn(5, 4, generator=g), torch.randint(0, 5, (7,), generator=g), torch.randint(0, 7, (3,), generator=g))
    gm = normalized(f, *args)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    (of_x,) = x.users
    assert of_x.target is aten.index.Tensor and of_x.args[1][0].target is aten.index.Tensor, gm.code
    assert op_counts(gm)["aten.index.Tensor"] == 2, gm.code
    assert torch.equal(gm(*args), f(*args))


@pytest.mark.parametrize("in_range", [True, False])
def test_pair_tokens_looked_up_by_a_sort_are_its_indices_floor_k(in_range):
    """arange(T).unsqueeze(1).expand(-1, k).reshape(-1)[perm] with perm a sort's indices of T * k values is perm // k;
    by a sort of more values (indices up to 2 T k) it stays a lookup."""
    t, k = 3, 2

    def f(ids):
        token_idx = torch.arange(t).unsqueeze(1).expand(-1, k).reshape(-1)
        return token_idx[torch.argsort(ids, stable=True)[:t * k]]

    ids = torch.randint(0, 4, (t * k if in_range else 2 * t * k,), generator=gen(1))
    gm = normalized(f, ids)
    ops = op_counts(gm)
    assert (ops["aten.index.Tensor"], ops["aten.div.Tensor_mode"]) == ((0, 1) if in_range else (1, 0)), gm.code
    if in_range:
        assert torch.equal(gm(ids), f(ids))


def test_an_expand_operand_of_a_broadcasting_op_is_the_operand():
    """`s * w.unsqueeze(0).expand(T, N)` and `where(iota.expand(T, N) < n[:, None].expand(T, N), s, -inf)` are the
    ops on the unexpanded operands (the broadcast expands them alike); an expand that widens the output (b [T, 1]
    against a [T, 1] expanded to [T, N]) or changes the result's dtype (a 0-d int64 value expanded beside an int32
    tensor counts as dimensioned in type promotion: int64 with it, int32 without) stays; bit for bit."""
    def f(s, w, n, b, c, x):
        visible = torch.arange(s.shape[1]).unsqueeze(0).expand(s.shape) < n.unsqueeze(1).expand(s.shape)
        return (s * w.unsqueeze(0).expand(s.shape), torch.where(visible, s, torch.full_like(s, -torch.inf)),
                n.unsqueeze(1).to(torch.float32).expand(s.shape) + b, x * c.expand(x.shape))

    g = gen(0)
    args = (torch.randn(3, 8, generator=g), torch.randn(8, generator=g), torch.randint(0, 9, (3,), generator=g),
            torch.randn(3, 1, generator=g), torch.tensor(3), torch.randint(-9, 9, (4,), generator=g, dtype=torch.int32))
    gm = normalized(f, *args)
    expands = [n for n in gm.graph.nodes if n.target is aten.expand.default]
    assert len(expands) == 2, gm.code
    assert sorted(tuple(n.meta["val"].shape) for n in expands) == [(3, 8), (4,)], gm.code
    got, want = gm(*args), f(*args)
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.float32] * 3 + [torch.int64]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_cast_of_an_expand_is_the_expand_of_the_cast():
    """`pre.unsqueeze(-1).expand(x.shape).to(f32) * x.to(f32)` casts pre [T, hc] before the expand, which the
    multiply then drops (a cast is elementwise, expand repeats elements); bit for bit."""
    def f(pre, x):
        return (pre.unsqueeze(-1).expand(x.shape).to(torch.float32) * x.to(torch.float32)).sum(1)

    g = gen(0)
    args = (torch.rand(3, 4, generator=g).to(torch.bfloat16), torch.randn(3, 4, 8, generator=g).to(torch.bfloat16))
    gm = normalized(f, *args)
    assert op_counts(gm)["aten.expand"] == 0, gm.code
    (cast,) = [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default
               and tuple(n.meta["val"].shape) == (3, 4)]
    assert cast.args[0].op == "placeholder"
    assert torch.equal(gm(*args), f(*args))


def test_a_cast_of_an_expand_without_a_broadcasting_user_stays():
    """A model's first layer: its residual streams are the embedding expanded over them, `e[:, None].expand(T, hc,
    D)`, and `.float()` of them feeds a bmm (no broadcasting op could drop the expand), so the cast keeps reading the
    expanded value, as a fusion pattern's cast of its streams input reads it; bit for bit."""
    def f(e, comb):
        return torch.bmm(comb, e.unsqueeze(1).expand(-1, 4, -1).to(torch.float32))

    g = gen(0)
    args = (torch.randn(3, 8, generator=g).to(torch.bfloat16), torch.rand(3, 4, 4, generator=g))
    gm = normalized(f, *args)
    (cast,) = [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default]
    assert cast.args[0].target is aten.expand.default and tuple(cast.meta["val"].shape) == (3, 4, 8), gm.code
    assert torch.equal(gm(*args), f(*args))


def test_a_lookup_by_a_strided_arange_is_a_slice():
    """index_select(x, d, arange(start, stop, step)) in range is the strided slice of the same elements: to the
    end where that slice holds them all (x[..., 0::2], x[..., 1::2]), else ending one past the last (1, 3, 5 of 8);
    a lookup by another index tensor, or whose last index lies past the end, stays; bit for bit."""
    def f(x, i):
        return (torch.index_select(x, -1, torch.arange(0, 8, 2)), torch.index_select(x, 1, torch.arange(1, 8, 2)),
                torch.index_select(x, 1, torch.arange(1, 6, 2)), torch.index_select(x, 1, i))

    g = gen(0)
    args = (torch.randn(3, 8, generator=g), torch.randint(0, 8, (4,), generator=g))
    gm = normalized(f, *args)
    slices = [n.args[1:] for n in gm.graph.nodes if n.target is aten.slice.Tensor]
    assert slices == [(1, 0, 2**63 - 1, 2), (1, 1, 2**63 - 1, 2), (1, 1, 6, 2)], gm.code
    assert op_counts(gm)["aten.index.Tensor"] == 1
    for a, b in zip(gm(*args), f(*args), strict=True):
        assert torch.equal(a, b)
    past_end = normalized(lambda x: torch.index_select(x, 1, torch.arange(2, 10, 2)), torch.randn(3, 8))
    assert op_counts(past_end)["aten.index.Tensor"] == 1 and op_counts(past_end)["aten.slice.Tensor"] == 0


def test_lossless_integer_round_trip_is_the_value():
    """Top-k indices (in [0, 16)) put in an int32 buffer and read back as int64 for an index, through a view
    (`ids.to(int32).view(-1).long()`), are the flat int64 indices: no cast is left and the values are equal. The edge
    of the rule: a graph input's int64 values (of unknown range) through int32 and back, and top-k indices of a dim
    of 300 through int8 (which holds 127 at most) keep their casts."""
    def f(scores, ids, wide):
        top = torch.topk(scores, 4, dim=-1).indices
        return (top.to(torch.int32).view(-1).long(), ids.to(torch.int32).long(),
                torch.topk(wide, 4, dim=-1).indices.to(torch.int8).long())

    def x(seed):
        g = gen(seed)
        return (torch.randn(5, 16, generator=g), torch.randint(-2**40, 2**40, (6,), generator=g),
                torch.randn(2, 300, generator=g))

    gm = normalized(f, *x(0))
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default]
    assert [n.args[1] for n in casts] == [torch.int32, torch.int64, torch.int8, torch.int64], gm.code  # 2nd, 3rd
    first = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert first.target is aten.view.default and first.args[0].meta["val"].dtype == torch.int64  # the indices
    for seed in (1, 2):
        for got, want in zip(gm(*x(seed)), f(*x(seed)), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("stable", [True, False])
def test_sort_of_a_lossless_narrowing_is_the_sort_of_the_wide_values(stable):
    """A sort of top-k indices cast to int32 (an engine's int32 expert ids, flattened) sorts the int64 indices, its
    sorted values cast to int32: the same permutation (equal ids tie the same way), the same values, and the sort
    reads the value the ids' other readers (the counts of `ids.long()`) read. A sort of a graph input's int32 cast
    (values of unknown range) stays as written."""
    def f(scores, ids):
        flat = torch.topk(scores, 3, dim=-1).indices.to(torch.int32).view(-1)
        values, order = torch.sort(flat, stable=stable)
        counts = torch.zeros(16, dtype=torch.int32).scatter_add_(0, flat.long(), torch.ones_like(flat))
        return values, order, counts, torch.sort(ids.to(torch.int32), stable=stable).values

    def x(seed):
        g = gen(seed)
        return torch.randn(6, 16, generator=g), torch.randint(-2**40, 2**40, (7,), generator=g)

    gm = normalized(f, *x(0))
    sorts = [n for n in gm.graph.nodes if n.target in (aten.sort.default, aten.sort.stable)]
    flat = sorts[0].args[0]
    assert flat.meta["val"].dtype == torch.int64 and flat.target is aten.view.default, gm.code
    (scatter,) = [n for n in gm.graph.nodes if n.target is aten.scatter_add.default]
    assert scatter.args[2] is flat  # one value for the sort and the counts
    assert sorts[1].args[0].target is torch.ops.prims.convert_element_type.default
    for seed in (1, 2):
        got, want = gm(*x(seed)), f(*x(seed))
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.dtype == w.dtype
            if i == 1 and not stable:  # an unstable sort's order among equal ids is unspecified: it sorts the ids
                flat = torch.topk(x(seed)[0], 3, dim=-1).indices.view(-1)
                assert torch.equal(flat[g], want[0].long()) and torch.equal(g.sort().values, torch.arange(len(g)))
            else:
                assert torch.equal(g, w)



def _every_bf16() -> torch.Tensor:
    """All 65536 bf16 bit patterns (NaNs, infinities, signed zeros, subnormals included) as [2048, 32] blocks."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(2048, 32)


def _same_bits_or_nan(got, want) -> bool:
    return bool(((got == want) & (torch.signbit(got) == torch.signbit(want)) | got.isnan() & want.isnan()).all())


def test_a_widening_cast_of_a_block_view_and_of_abs_moves_above_them():
    """DeepGEMM's per-token-group amax `x.view(T, -1, 32).abs().float()` of a computed bf16 x (here `x * 2`) is the reference's
    `x.float().view(T, -1, 32).abs()`: the widening cast moves above abs, then above the block view (one form, no
    abs or view below a cast). Exact on every bf16 value (each held exactly in fp32, abs only clears the sign bit,
    a view renames elements): checked on all 65536 bit patterns, fp16 too."""
    def deepgemm(x):
        return (x * 2).view(x.shape[0], -1, 32).abs().float().amax(-1, keepdim=True)

    def reference(x):
        return (x * 2).float().view(x.shape[0], -1, 32).abs().amax(-1, keepdim=True)

    x = _every_bf16().view(512, 128)
    forms = [normalized(f, x) for f in (deepgemm, reference)]
    assert _ops(forms[0]) == _ops(forms[1]), forms[0].code
    for gm, f in zip(forms, (deepgemm, reference)):
        assert _same_bits_or_nan(as_tuple(gm(x))[0], f(x))
    pointwise = normalized(lambda x: (x * 2).view(512, -1, 32).abs().float(), x)  # the values themselves
    assert _same_bits_or_nan(as_tuple(pointwise(x))[0], (x * 2).view(512, -1, 32).abs().float())
    half = _every_bf16().view(torch.int16).view(torch.float16).view(512, 128)
    assert _same_bits_or_nan(as_tuple(normalized(deepgemm, half)(half))[0], deepgemm(half))


def test_casts_that_stay_above_a_view_or_below_abs():
    """A cast of a view of a graph input or a GEMM output (a pattern's input may be that view), of a view that is
    no block split of the last dim, of a split no per-block reduction reads (heads, which a RoPE reads as values;
    hoisted, the JAX block's norm output met its cast back and qkv_norm fused bare), and a narrowing cast stay where
    they are: the rule moves only a widening cast of a computed value's quantisation blocks."""
    x = torch.randn(4, 64).bfloat16()
    for f in (lambda x: x.view(4, 2, 32).float(),  # a graph input's blocks
              lambda x: (x @ x.t()).view(4, 2, 2).float(),  # a GEMM output's
              lambda x: (x * 2).view(2, 128).float(),  # not a block split
              lambda x: (x * 2).view(4, 2, 32).float(),  # heads: no reduction over the blocks reads them
              lambda x: (x.float() * 2).view(4, 2, 32).to(torch.bfloat16)):  # narrowing
        gm = normalized(f, x)
        casts = [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default]
        assert casts and all(n.args[0].target is aten.view.default for n in casts[-1:]), gm.code
        assert torch.equal(as_tuple(gm(x))[0], f(x))


def test_abs_of_a_value_bounded_below_by_a_positive_number_is_the_value():
    """ceil_to_ue8m0's `2 ** ceil(log2(u.abs()))` of u = max(amax, 1e-4) / 448 (positive, or NaN) is the power of
    u: abs is dropped, so the scale is seen as a normal power of two and `x * (1 / s)` as `x / s`. Checked on random
    and extreme amaxes (0, subnormal, huge, inf, NaN); an abs of a value that may be negative or zero stays."""
    def ue8m0(x, a):
        s = torch.pow(2.0, torch.ceil(torch.log2((a.clamp_min(1e-4) / 448.0).abs())))
        return x * (1.0 / s)

    g = gen(3)
    a = torch.cat([torch.rand(60, 1, generator=g) * 10.0 ** torch.randint(-40, 38, (60, 1), generator=g),
                   torch.tensor([[0.0], [-0.0], [1e-45], [3e38], [float("inf")], [float("nan")], [-5.0], [-1e-30]])])
    x = torch.randn(68, 32, generator=g)
    gm = normalized(ue8m0, x, a)
    assert op_counts(gm)["aten.abs"] == 0 and op_counts(gm)["aten.reciprocal"] == 0, gm.code
    assert torch.equal(as_tuple(gm(x, a))[0].nan_to_num(7.0), ue8m0(x, a).nan_to_num(7.0))
    for f in (lambda a: (a / 448.0).abs(), lambda a: a.clamp_min(0.0).abs(), lambda a: (a.clamp_min(1e-4) * -2.0).abs()):
        assert op_counts(normalized(f, a))["aten.abs"] == 1
