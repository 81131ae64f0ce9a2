"""Match counts are invariant under exact rewrites of the graph.

The foreign-formulation suites are hand-written: each differs from the model in one named way. This test writes
the formulations instead. For every fusion and every formulation it accepts, the formulation is traced at its
example shapes (the graph the backend sees, ATen after decompositions) and must fuse exactly once; then it is
rewritten by a random mix of exact identities, the spellings another author could have chosen:

- the operands of add / mul commuted;
- `a - b` as `a + (-b)`;
- a comparison flipped (`a < b` as `b > a`, and so on);
- `where(c, a, b)` as `where(~c, b, a)`;
- `x ** 2` as `x * x`, `-x` as `x * -1`, `clamp_min(x, a)` as `clamp(x, a)`, `amax` as `max(...).values`, a
  keepdim sum as a sum and an unsqueeze;
- a slice as a piece of `torch.split`, a select as an `unbind` item, `x.float() * y` as `x * y` for an fp32 y of
  rank >= 1 (implicit promotion);
- a value reshaped in two steps (through its flat shape), or given a leading unit dim that is squeezed away again;
- `x + 2.0` by the Scalar overload (`add.Scalar`, as `F.rms_norm`'s decomposition writes its eps);
- `scale[i]` as the one-element slice `scale[i:i+1]` where only same-dtype arithmetic reads it (`tensor_split`);
- `scatter_add` as `scatter_reduce(..., "sum")`, an fp32 `a + b / c` as `addcdiv(a, b, c)`;
- a slice of whole runs `x[..., i*k:(i+1)*k]` as a select of the split dim (`x.view(..., n, k).unbind(d)[i]`);
- a view read by several ops written once per reader.

Each rewritten graph must still fuse exactly once, with the formulation the traced one fused (RoPE + FP8, not RoPE
alone with the step left as glue; the scaled or sorted indexer formulation, not another whose semantic check its
draws pass). The rewrites are checked to be exact: on graphs without integer inputs and collectives the rewritten graph runs on fresh random inputs and
must equal the original bit for bit (NaN nowhere).
A rewrite kind that a fusion cannot see through is a generality gap in the matcher, not a test to loosen.
DSV41_REWRITE_SEEDS (default 3) sets how many rewritten graphs per formulation; the seeds are fixed per count, so a
failure reproduces.

Apart from the random mix (so that its seeds keep their rewrites), every cast of a computed value is also written
as a view round trip around it, `x.view(-1).to(d).view(x.shape)`, as DeepSeek's reference dequantises its flat e4m3
values: each formulation must still fuse once, as traced.
"""

from __future__ import annotations

import functools
import operator
import os
import random

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dsv41.passes import fusion_pass_class
from dsv41.passes.manager import CompileReport, PassManager
from dsv41.passes.normalize import _LAYOUT_OPS, keeps_first_view
from dsv41.passes.registry import FUSION_NAMES

from .harness import aten_graph, config

aten = torch.ops.aten
SEEDS = range(int(os.environ.get("DSV41_REWRITE_SEEDS", "3")))
_FLIPPED = {aten.lt.Tensor: aten.gt.Tensor, aten.gt.Tensor: aten.lt.Tensor, aten.le.Tensor: aten.ge.Tensor,
            aten.ge.Tensor: aten.le.Tensor}


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _is_tensor_node(arg) -> bool:
    return isinstance(_val(arg), torch.Tensor)


KINDS = ("commute", "sub as add of neg", "flip", "where swapped", "square as product", "neg as product",
         "clamp_min as clamp", "amax as max", "keepdim as unsqueeze", "slice as split piece", "select as unbind",
         "implicit promotion", "two-step view", "unit dim round trip", "Scalar overload", "select as unit slice",
         "scatter_add as scatter_reduce", "addcdiv", "slice as split-dim select", "repeated view")
_SCALAR_OVERLOADS = {aten.add.Tensor: aten.add.Scalar, aten.sub.Tensor: aten.sub.Scalar, aten.mul.Tensor: aten.mul.Scalar,
                     aten.div.Tensor: aten.div.Scalar}
_PROMOTING = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor)


def _slice_as_piece(graph: fx.Graph, node: fx.Node) -> bool:
    """x[start:end] along d (step 1) as torch.split(x, [start, end - start, rest], d)[i]."""
    a = node.args
    x = _val(a[0])
    if len(a) < 4 or (len(a) > 4 and a[4] != 1) or not all(isinstance(b, int) for b in a[1:4]) or x is None:
        return False
    size = x.shape[a[1]]
    start, end = min(a[2], size), min(a[3], size)
    sizes = [n for n in (start, end - start, size - end) if n > 0]
    if end <= start or len(sizes) < 2:
        return False
    with graph.inserting_before(node):
        pieces = graph.call_function(aten.split_with_sizes.default, (a[0], sizes, a[1]))
    node.target, node.args = operator.getitem, (pieces, 1 if start else 0)
    return True


def _implicit_promotion(node: fx.Node) -> bool:
    """An fp32 add/sub/mul/div of x.float() (x bf16) and an fp32 tensor of rank >= 1 reads x itself: type
    promotion casts it so."""
    if node.target not in _PROMOTING or len(node.args) != 2 or node.kwargs:
        return False
    for i, arg in enumerate(node.args):
        other = _val(node.args[1 - i])
        if isinstance(arg, fx.Node) and arg.target is torch.ops.prims.convert_element_type.default \
                and arg.args[1] is torch.float32 and _val(arg.args[0]) is not None \
                and _val(arg.args[0]).dtype is torch.bfloat16 and isinstance(other, torch.Tensor) \
                and other.dtype is torch.float32 and other.dim() >= 1:
            node.args = tuple(arg.args[0] if j == i else b for j, b in enumerate(node.args))
            return True
    return False


def _select_as_unit_slice(node: fx.Node) -> bool:
    """x[i] of a 1-D x as x[i:i+1] where every user is an add/sub/mul/div whose tensor operands share x's dtype and
    whose other operand has rank >= 1 (broadcasting gives the same values, shape and dtype)."""
    x, dim, i = node.args
    xv = _val(x)
    if xv is None or xv.dim() != 1 or dim != 0 or not isinstance(i, int) or i < 0 or not node.users:
        return False
    for user in node.users:
        others = [b for b in user.args if b is not node and _is_tensor_node(b)]
        if user.target not in _PROMOTING or user.kwargs or not others or any(
                _val(b).dtype != xv.dtype or _val(b).dim() < 1 for b in others):
            return False
    node.target, node.args = aten.slice.Tensor, (x, 0, i, i + 1)
    return True


def _static_contiguous(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.is_contiguous() and all(isinstance(d, int) for d in v.shape)


def _as_addcdiv(graph: fx.Graph, node: fx.Node) -> bool:
    """An fp32 a + b / c (the quotient read only there) as addcdiv(a, b, c): the same two roundings."""
    if node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return False
    for a, d in (node.args, node.args[::-1]):
        if isinstance(d, fx.Node) and d.target is aten.div.Tensor and len(d.users) == 1 and not d.kwargs \
                and all(_is_tensor_node(x) and _val(x).dtype is torch.float32 for x in (a, *d.args, node)):
            node.target, node.args = aten.addcdiv.default, (a, *d.args)
            graph.erase_node(d)
            return True
    return False


def _slice_as_split_select(graph: fx.Graph, node: fx.Node) -> bool:
    """x[..., s:s+k] (step 1) with k dividing s and the dim's size (n >= 2 runs) as x.view(..., n, k)[..., s//k, :]."""
    a = node.args
    x = _val(a[0])
    if len(a) < 4 or (len(a) > 4 and a[4] != 1) or not all(isinstance(b, int) for b in a[1:4]) or not _static_contiguous(x):
        return False
    d, size = a[1], x.shape[a[1]]
    start, end = min(a[2], size), min(a[3], size)
    k = end - start
    if k <= 0 or size % k or start % k or size // k < 2:
        return False
    shape = list(x.shape[:d]) + [size // k, k] + list(x.shape[d + 1:])
    with graph.inserting_before(node):
        view = graph.call_function(aten.view.default, (a[0], shape))
    node.target, node.args = aten.select.int, (view, d, start // k)
    return True


def _cast_between_views(graph: fx.Graph, node: fx.Node) -> bool:
    """cast(x) as view(cast(view(x, [numel])), x's shape), as the reference's dequantisation views flat e4m3 values
    into blocks around the cast, for an x with two dims or more above 1 that an op other than a layout op computes
    (a view of a view is one view of the root, then no round trip of x); not where the normalisation leaves that
    first view (`keeps_first_view`: a pattern may start or end at it)."""
    x = node.args[0]
    v = _val(x)
    if node.target is not torch.ops.prims.convert_element_type.default or not isinstance(x, fx.Node) \
            or x.op != "call_function" or x.target in _LAYOUT_OPS or not _static_contiguous(v) \
            or len([d for d in v.shape if d != 1]) < 2:
        return False
    with graph.inserting_before(node):
        flat = graph.call_function(aten.view.default, (x, [_numel(v.shape)]))
    if keeps_first_view(flat):
        graph.erase_node(flat)
        return False
    users = list(node.users)
    with graph.inserting_after(node):
        back = graph.call_function(aten.view.default, (node, list(v.shape)))
    for user in users:
        user.replace_input_with(node, back)
    node.args = (flat, *node.args[1:])
    return True


def _repeated_view(graph: fx.Graph, node: fx.Node) -> bool:
    """A view read by several ops as one view per reader."""
    users = list(node.users)
    if len(users) < 2:
        return False
    for user in users[1:]:
        with graph.inserting_after(node):
            again = graph.call_function(node.target, node.args, dict(node.kwargs))
        user.replace_input_with(node, again)
    return True


def rewrite(graph: fx.Graph, rng: random.Random, p: float = 0.5, kinds=KINDS) -> list[str]:
    """Apply exact identities of `kinds` to about a fraction `p` of the eligible nodes of `graph` (in place); the
    rewrites made, by kind and node."""
    made = []
    for node in list(graph.nodes):
        if node.op != "call_function" or rng.random() >= p:
            continue
        a = node.args
        if "addcdiv" in kinds and node.target is aten.add.Tensor and rng.random() < 0.5 and _as_addcdiv(graph, node):
            made.append(f"addcdiv {node.name}")  # (before the commute, which takes every add of two tensors)
        elif "slice as split-dim select" in kinds and node.target is aten.slice.Tensor and rng.random() < 0.5 \
                and _slice_as_split_select(graph, node):
            made.append(f"slice as split-dim select {node.name}")
        elif "commute" in kinds and node.target in (aten.add.Tensor, aten.mul.Tensor) and not node.kwargs \
                and len(a) == 2 and _is_tensor_node(a[0]) and _is_tensor_node(a[1]):
            node.args = (a[1], a[0])
            made.append(f"commute {node.name}")
        elif "sub as add of neg" in kinds and node.target is aten.sub.Tensor and not node.kwargs and len(a) == 2 and _is_tensor_node(a[1]):
            with graph.inserting_before(node):
                neg = graph.call_function(aten.neg.default, (a[1],))
            node.target, node.args = aten.add.Tensor, (a[0], neg)
            made.append(f"sub as add of neg {node.name}")
        elif "flip" in kinds and node.target in _FLIPPED and _is_tensor_node(a[0]) and _is_tensor_node(a[1]):
            node.target, node.args = _FLIPPED[node.target], (a[1], a[0])
            made.append(f"flip {node.name}")
        elif "where swapped" in kinds and node.target is aten.where.self and _is_tensor_node(a[0]):
            with graph.inserting_before(node):
                inverted = graph.call_function(aten.logical_not.default, (a[0],))
            node.args = (inverted, a[2], a[1])
            made.append(f"where swapped {node.name}")
        elif "square as product" in kinds and node.target is aten.pow.Tensor_Scalar and a[1] == 2:
            node.target, node.args = aten.mul.Tensor, (a[0], a[0])
            made.append(f"square as product {node.name}")
        elif "neg as product" in kinds and node.target is aten.neg.default:
            node.target, node.args = aten.mul.Tensor, (a[0], -1)
            made.append(f"neg as product {node.name}")
        elif "clamp_min as clamp" in kinds and node.target is aten.clamp_min.default:
            node.target, node.args = aten.clamp.default, (a[0], a[1])
            made.append(f"clamp_min as clamp {node.name}")
        elif "amax as max" in kinds and node.target is aten.amax.default and len(a[1]) == 1:
            with graph.inserting_before(node):
                pair = graph.call_function(aten.max.dim, (a[0], a[1][0], *a[2:]))
            node.target, node.args = operator.getitem, (pair, 0)
            made.append(f"amax as max {node.name}")
        elif "keepdim as unsqueeze" in kinds and node.target is aten.sum.dim_IntList and len(a) >= 3 and a[2] \
                and len(a[1]) == 1 and not node.kwargs:
            with graph.inserting_before(node):
                reduced = graph.call_function(aten.sum.dim_IntList, (a[0], a[1], False))
            node.target, node.args = aten.unsqueeze.default, (reduced, a[1][0])
            made.append(f"keepdim as unsqueeze {node.name}")
        elif "slice as split piece" in kinds and node.target is aten.slice.Tensor and _slice_as_piece(graph, node):
            made.append(f"slice as split piece {node.name}")
        elif "select as unbind" in kinds and node.target is aten.select.int and len(a) == 3:
            with graph.inserting_before(node):
                pieces = graph.call_function(aten.unbind.int, (a[0], a[1]))
            node.target, node.args = operator.getitem, (pieces, a[2])
            made.append(f"select as unbind {node.name}")
        elif "Scalar overload" in kinds and node.target in _SCALAR_OVERLOADS and len(a) == 2 and not node.kwargs \
                and isinstance(a[1], (int, float)) and not isinstance(a[1], bool):
            node.target = _SCALAR_OVERLOADS[node.target]
            made.append(f"Scalar overload {node.name}")
        elif "select as unit slice" in kinds and node.target is aten.select.int and _select_as_unit_slice(node):
            made.append(f"select as unit slice {node.name}")
        elif "implicit promotion" in kinds and _implicit_promotion(node):
            made.append(f"implicit promotion {node.name}")
        elif "scatter_add as scatter_reduce" in kinds and node.target is aten.scatter_add.default and not node.kwargs:
            node.target, node.args = aten.scatter_reduce.two, (*a, "sum")
            made.append(f"scatter_add as scatter_reduce {node.name}")
        elif "repeated view" in kinds and node.target is aten.view.default and _repeated_view(graph, node):
            made.append(f"repeated view {node.name}")
        elif "cast between views" in kinds and _cast_between_views(graph, node):
            made.append(f"cast between views {node.name}")
        elif {"two-step view", "unit dim round trip"} & set(kinds) and _is_tensor_node(node) and _val(node).dim() >= 1 and _val(node).is_contiguous() \
                and all(isinstance(d, int) for d in _val(node).shape) and node.users:
            shape = list(_val(node).shape)
            users = list(node.users)
            with graph.inserting_after(node):
                if "two-step view" in kinds and ("unit dim round trip" not in kinds or rng.random() < 0.5):
                    first = graph.call_function(aten.view.default, (node, [_numel(shape)]))
                    kind = "two-step view"
                else:
                    first = graph.call_function(aten.unsqueeze.default, (node, 0))
                    kind = "unit dim round trip"
            with graph.inserting_after(first):
                back = graph.call_function(aten.view.default, (first, shape)) if kind == "two-step view" \
                    else graph.call_function(aten.squeeze.dim, (first, 0))
            for user in users:
                user.replace_input_with(node, back)
            made.append(f"{kind} {node.name}")
    graph.lint()
    return made


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _formulations():
    cases = []
    for fusion in FUSION_NAMES:
        for pattern in fusion_pass_class(fusion)(config()).patterns():
            cases.append(pytest.param(fusion, pattern.name, id=f"{fusion}-{pattern.name}"))
    return cases


def _traced(fusion: str, name: str):
    pattern = next(p for p in fusion_pass_class(fusion)(config()).patterns() if p.name == name)
    inputs = list(pattern.inputs())
    fn = lambda *args: pattern.search(*args, **pattern.free_defaults)  # noqa: E731
    return fn, inputs, aten_graph(fn, *inputs)


@functools.cache
def _baseline(fusion: str, name: str) -> CompileReport:
    """The report of the formulation as traced, not rewritten."""
    fn, inputs, gm = _traced(fusion, name)
    return _fuse(gm, fusion)


def test_every_fusion_has_formulations_that_fuse_as_traced():
    """The rewrite test is not vacuous: every fusion has formulations that fuse at their example shapes (those
    that do not need their inputs made another way, as the split q/kv norms' guard wants them from GEMMs of one
    activation)."""
    for fusion in FUSION_NAMES:
        names = [p.name for p in fusion_pass_class(fusion)(config()).patterns()]
        assert any(_baseline(fusion, n).matches.get(fusion) == 1 for n in names), fusion


def _fuse(gm: fx.GraphModule, fusion: str) -> CompileReport:
    return PassManager(config(fusion)).run(gm.graph, CompileReport(graph_id=0))


def _fused_patterns(report: CompileReport, fusion: str) -> list[str]:
    """The formulations the fusion's replacements matched (the region it took: RoPE + FP8 or RoPE alone)."""
    return [r["pattern"] for p in report.passes if p.name == fusion for r in p.replaced]


def _random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(t.shape, generator=gen).to(t.dtype)


def _runnable(inputs, gm) -> bool:
    """Whether the graph runs on random inputs here: float inputs only (integer ones index), no collectives."""
    return all(not isinstance(a, torch.Tensor) or a.is_floating_point() for a in inputs) and not any(
        n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional" for n in gm.graph.nodes)


@pytest.mark.parametrize("fusion,name", _formulations())
def test_match_count_survives_exact_rewrites(fusion, name):
    fn, inputs, traced = _traced(fusion, name)
    baseline = _baseline(fusion, name)
    if baseline.matches.get(fusion) != 1:
        pytest.skip(f"the formulation does not fuse at its own example shapes ({baseline.matches}; "
                    f"declined: {baseline.declined.get(fusion)}): covered by its own tests at the op's shapes")
    runnable = _runnable(inputs, traced)
    traded = []  # seeds whose rewritten graph fused another formulation than the traced graph did
    for seed in SEEDS:
        gm = aten_graph(fn, *inputs)
        made = rewrite(gm.graph, random.Random(f"{fusion}/{name}/{seed}"))
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                 for a in inputs])
        gm.recompile()
        if runnable:  # the rewrites are exact: same values, bit for bit
            gen = torch.Generator().manual_seed(1000 + seed)
            real = [_random_like(a, gen) if isinstance(a, torch.Tensor) else a for a in inputs]
            original = aten_graph(fn, *inputs)
            want, got = original(*real), gm(*real)
            for w, g in zip(want if isinstance(want, (tuple, list)) else [want],
                            got if isinstance(got, (tuple, list)) else [got], strict=True):
                assert not torch.isnan(g).any() or torch.isnan(w).any(), "the rewritten graph made a NaN"
                torch.testing.assert_close(g, w, atol=0, rtol=0, equal_nan=True)
        report = _fuse(gm, fusion)
        if _fused_patterns(report, fusion) != _fused_patterns(baseline, fusion):
            traded.append(f"seed {seed}: {len(made)} rewrites ({'; '.join(made)}) fused "
                          f"{_fused_patterns(report, fusion)}; narrowed: {report.narrowed.get(fusion)}")
        assert report.matches.get(fusion) == 1, (
            f"seed {seed}: {len(made)} rewrites ({'; '.join(made)}) took {fusion} from 1 match to "
            f"{report.matches.get(fusion)}; near misses: {report.near_misses.get(fusion)}; declined: "
            f"{report.declined.get(fusion)}; notes: {report.notes.get(fusion)}")
    assert not traded, f"the traced graph fused {_fused_patterns(baseline, fusion)}; " + " | ".join(traded)


@pytest.mark.parametrize("fusion,name", _formulations())
def test_match_count_survives_casts_between_views(fusion, name):
    """Every cast of a computed value rewritten as a view of it, the cast and the view back (`_cast_between_views`:
    not in KINDS, so the random rewrites' seeds keep their meaning): the formulation still fuses once, as traced,
    and the graph computes as traced, bit for bit."""
    fn, inputs, _ = _traced(fusion, name)
    baseline = _baseline(fusion, name)
    if baseline.matches.get(fusion) != 1:
        pytest.skip(f"the formulation does not fuse at its own example shapes ({baseline.matches})")
    gm = aten_graph(fn, *inputs)
    made = rewrite(gm.graph, random.Random(0), p=1.0, kinds=("cast between views",))
    if not made:
        pytest.skip("no cast of a computed value with two dims above 1 to rewrite")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in inputs])
    gm.recompile()
    if _runnable(inputs, gm):
        gen = torch.Generator().manual_seed(1000)
        real = [_random_like(a, gen) if isinstance(a, torch.Tensor) else a for a in inputs]
        want, got = aten_graph(fn, *inputs)(*real), gm(*real)
        for w, g in zip(want if isinstance(want, (tuple, list)) else [want],
                        got if isinstance(got, (tuple, list)) else [got], strict=True):
            torch.testing.assert_close(g, w, atol=0, rtol=0, equal_nan=True)
    report = _fuse(gm, fusion)
    assert report.matches.get(fusion) == 1 and _fused_patterns(report, fusion) == _fused_patterns(baseline, fusion), (
        f"{len(made)} rewrites ({'; '.join(made)}): {report.matches}, fused {_fused_patterns(report, fusion)}; near "
        f"misses: {report.near_misses.get(fusion)}; declined: {report.declined.get(fusion)}")


# rewrites (formulation, seed of test_match_count_survives_exact_rewrites) after which no indexer formulation
# matches op for op, and the unscaled one took the scaled one's graph before formulations were compared
UNSCALED_TOOK = (("candidate_source_scaled", 2), ("candidate_source_mask_sorted_scaled", 0),
                 ("candidate_source_mask_spare_scaled", 2))


@pytest.mark.parametrize("name,seed", UNSCALED_TOOK)
def test_a_score_scale_that_rounds_stays_in_the_op_under_rewrites(name, seed):
    """The indexer's score scale 0.1 (not a power of two, so relu(q.k) * 0.1 rounds: the unscaled formulation's op,
    which would treat the multiply as a part computed another way, selects differently at near ties, which random
    draws seldom show). Under rewrites that leave no formulation op for op, the scaled formulation still fuses, and
    the op takes the graph's scale."""
    pattern = next(p for p in fusion_pass_class("indexer_topk")(config()).patterns() if p.name == name)
    free = {**pattern.free_defaults, "score_scale": 0.1}
    inputs = list(pattern.inputs())
    gm = aten_graph(lambda *args: pattern.search(*args, **free), *inputs)
    made = rewrite(gm.graph, random.Random(f"indexer_topk/{name}/{seed}"))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(a) for a in inputs])
    report = _fuse(gm, "indexer_topk")
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.dsv41.indexer_topk.default]
    assert _fused_patterns(report, "indexer_topk") == [name] and op.args[11] == pytest.approx(0.1), (
        f"{'; '.join(made)}: fused {_fused_patterns(report, 'indexer_topk')} with score_scale {op.args[11]}")
