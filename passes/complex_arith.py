"""Complex arithmetic on real pairs rewritten as real arithmetic: the RoPE of DeepSeek's reference code.

The reference rotates the interleaved pairs (x[2i], x[2i+1]) of a RoPE tail as complex numbers,

    z = view_as_complex(x[..., -rd:].float().view(..., -1, 2))
    y = view_as_real(z * freqs_cis[positions]).flatten(-2)       (freqs_cis.conj() for the inverse rotation)

with freqs_cis a complex64 table (`torch.polar`), and writes y back with `copy_` into the slice or with a cat.
The fusions' patterns spell RoPE in real arithmetic on cos/sin tables. `real_pairs(graph)` rewrites every
`view_as_real(z)` whose complex value z is computed by the ops below into real ops on z's parts, each part a
real tensor of z's shape (so a layout op applies to a part with z's own arguments):

    view_as_complex(y)            re = y[..., 0], im = y[..., 1]   (a float conversion on y's chain moves after
                                  its slices and before its views: `x.float()[..., -rd:]` is `x[..., -rd:].float()`)
    a complex graph input F       re = view_as_real(F)[..., 0], im = view_as_real(F)[..., 1]
    a * b, both complex           re = ar*br - ai*bi, im = ar*bi + ai*br
    conj(a)                       re = ar, im = -ai               (_conj, conj_physical)
    view, unsqueeze, squeeze, expand, permute, slice, select, index   the same op on each part
    clone, alias, resolve_conj    the parts of a                  (the same values)
    view_as_real(z)               stack((re, im), -1)

A table `F[positions]` becomes `view_as_real(F)[..., 0][positions]` and `view_as_real(F)[..., 1][positions]`:
real views and gathers of the table, which a fused op takes as its cos and sin. Where the rotated slice is written
back (`aten.copy` into `slice(base)`, then `slice_scatter(base, ...)`: a functionalised `copy_`), the write-back
becomes the cat of base's other slices and the value, as the patterns spell it.

Every rewrite is an identity of real arithmetic, and of the floating-point values where eager computes a complex
product as two rounded products and one add or subtract per part: PyTorch's CPU kernel does on its vector path,
while its scalar remainder (and CUDA's complex mul, not measured) may contract a product into an FMA, which differs
from the real form by at most eps * (|first product| + |second|) per part (test_complex_rope checks both).

Complex values computed by any other op (`polar` or `exp` building the table inside the graph, a complex matmul,
division, a product with a real value, a complex constant) are left as they are, with the graph unchanged there:
`real_pairs` returns the reason per `view_as_real` it left and records it on that node, and a fusion whose site
holds such a node declines naming it (`restate_failure` for a site that stopped there; `left_after` names it for a
site fused without its RoPE, which the fusion records as narrowed).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from dsv41.passes.matcher import Derived, MatchFailure
from dsv41.passes.normalize import _insert, _val

aten = torch.ops.aten
_LEFT = "dsv41_complex_left"  # meta key: why this view_as_real was left complex
_PER_PART = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
                       aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
                       aten.permute.default, aten.slice.Tensor, aten.select.int, aten.index.Tensor})
_SAME_VALUES = frozenset({aten.clone.default, aten.alias.default, aten.resolve_conj.default})
_CONJ = frozenset({aten._conj.default, aten.conj_physical.default, aten._conj_physical.default})
_CHAIN_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_CONVERT = torch.ops.prims.convert_element_type.default


class _Left(Exception):
    """A complex value that is not computed by the ops above (the reason names its op)."""


_NEAR = 32  # graph nodes searched above a node for a view_as_real left complex


def _near_ancestors(node: fx.Node):
    """node and its ancestors, breadth first, at most _NEAR of them."""
    seen, queue = {node}, [node]
    while queue:
        n = queue.pop(0)
        yield n
        for a in n.all_input_nodes:
            if a not in seen and len(seen) < _NEAR:
                seen.add(a)
                queue.append(a)


def restate_failure(failure: MatchFailure, graph: fx.Graph) -> MatchFailure:
    """A fusion's failure whose first differing op is (or is just below) a view_as_real that real_pairs left
    complex: a decline ("check") that names why the RoPE there is not in real pairs; else the failure as it is."""
    if not any(_LEFT in n.meta for n in graph.find_nodes(op="call_function", target=aten.view_as_real.default)):
        return failure
    blocking = next((n for n in graph.nodes if n.name == failure.blocking), None)
    left = next((n for n in _near_ancestors(blocking) if _LEFT in n.meta), None) if blocking is not None else None
    if left is None:
        return failure
    return dataclasses.replace(failure, kind="check", reason=f"{left.meta[_LEFT]}, so the RoPE there is not in real "
                               f"pairs for the pattern ({failure.reason})")


def left_after(graph: fx.Graph, fusion: str, created: set[str]) -> list[MatchFailure]:
    """Declines of the wider formulations of a fused site: each view_as_real that real_pairs left complex within
    _NEAR nodes below a node the fusion created (a norm fused, its RoPE left out)."""
    out = []
    for vr in graph.find_nodes(op="call_function", target=aten.view_as_real.default):
        near = next((n for n in _near_ancestors(vr) if n.name in created), None) if _LEFT in vr.meta else None
        if near is not None:
            out.append(MatchFailure(fusion, vr.name, 0, 1, "check", f"%{near.name} is fused without the RoPE at "
                                    f"%{vr.name}: {vr.meta[_LEFT]}"))
    return out


def per_token(table, tokens: int):
    """A RoPE table (cos or sin) bound with one row that the graph broadcasts over the tokens (the reference's
    `freqs_cis[start_pos:end_pos]` in a decode step whose rows share the position) expanded to the op's
    [T, rd/2]; any other table as it is."""
    v = table.meta["val"]
    if v.dim() == 2 and v.shape[0] == 1 and tokens != 1:
        return Derived(aten.expand.default, (table, [tokens, v.shape[1]]))
    return table


def _is_complex(n) -> bool:
    v = _val(n)
    return isinstance(v, torch.Tensor) and v.is_complex()


def _name(target) -> str:
    return target.name() if hasattr(target, "name") else str(target)


class _Rewriter:
    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.parts: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}  # complex node -> (re, im)
        self.before: fx.Node | None = None  # new nodes go before this node
        self.touched: set[fx.Node] = set()  # nodes made or replaced here: erased below when left unused

    def emit(self, target, *args) -> fx.Node:
        node = _insert(self.graph, self.before, target, args)
        self.touched.add(node)
        return node

    def split(self, z: fx.Node) -> tuple[fx.Node, fx.Node]:
        """(re, im) of the complex value z, real tensors of z's shape; _Left when z is computed another way."""
        if z in self.parts:
            return self.parts[z]
        if not isinstance(_val(z), torch.Tensor):
            raise _Left(f"%{z.name} carries no value metadata")
        if z.op in ("placeholder", "get_attr"):
            pairs = self.emit(aten.view_as_real.default, z)
            out = self.halves(pairs)
        elif z.op != "call_function":
            raise _Left(f"%{z.name} is a {z.op}")
        elif z.target is aten.view_as_complex.default:
            out = self.halves(self.real_chain(z.args[0]))
        elif z.target in _SAME_VALUES:
            out = self.split(z.args[0])
        elif z.target in _CONJ:
            re, im = self.split(z.args[0])
            out = (re, self.emit(aten.neg.default, im))
        elif z.target in _PER_PART and not z.kwargs:
            re, im = self.split(z.args[0])
            out = (self.emit(z.target, re, *z.args[1:]), self.emit(z.target, im, *z.args[1:]))
        elif z.target is aten.mul.Tensor and len(z.args) == 2 and all(_is_complex(a) for a in z.args):
            (ar, ai), (br, bi) = self.split(z.args[0]), self.split(z.args[1])
            mul, sub, add = aten.mul.Tensor, aten.sub.Tensor, aten.add.Tensor
            out = (self.emit(sub, self.emit(mul, ar, br), self.emit(mul, ai, bi)),
                   self.emit(add, self.emit(mul, ar, bi), self.emit(mul, ai, br)))
        else:
            operands = ", ".join("complex" if _is_complex(a) else "real" if isinstance(a, fx.Node) else repr(a)
                                 for a in z.args)
            raise _Left(f"%{z.name} = {_name(z.target)}({operands}) is complex arithmetic this rewrite does not "
                        "spell in real pairs")
        self.parts[z] = out
        return out

    def halves(self, pairs: fx.Node) -> tuple[fx.Node, fx.Node]:
        last = _val(pairs).dim() - 1
        return self.emit(aten.select.int, pairs, last, 0), self.emit(aten.select.int, pairs, last, 1)

    def real_chain(self, y: fx.Node) -> fx.Node:
        """y, the real [..., 2] input of a view_as_complex, with one float conversion on its chain of slices and
        views moved after the slices and before the views (the patterns' order; a conversion commutes with both)."""
        chain, root = [], y
        while isinstance(root, fx.Node) and root.op == "call_function" and (
                root.target in (*_CHAIN_VIEWS, aten.slice.Tensor, _CONVERT)):
            chain.append(root)
            root = root.args[0]
            if chain[-1].target is _CONVERT:
                break
        converts = [n for n in chain if n.target is _CONVERT]
        if not converts or converts[0].kwargs:
            return y
        layout = [n for n in reversed(chain) if n is not converts[0]]  # root first
        slices = 0
        while slices < len(layout) and layout[slices].target is aten.slice.Tensor:
            slices += 1
        if any(n.target is aten.slice.Tensor for n in layout[slices:]) or chain[::-1].index(converts[0]) == slices:
            return y  # a slice after a view (left as written), or the order already canonical
        self.touched.update(chain)
        value = root
        for i, n in enumerate(layout + [None]):
            if i == slices:
                value = self.emit(_CONVERT, value, *converts[0].args[1:])
            if n is not None:
                value = self.emit(n.target, value, *n.args[1:])
        return value

    def write_back_as_cat(self, node: fx.Node, rewritten: set) -> None:
        """slice_scatter(base, copy(dst, v), dim, start, end) of a rewritten rotation v is cat(base[.., :start], v
        in dst's dtype, base[.., end:]) (the functionalised `base[..., start:end].copy_(v)`, dst that slice of base,
        of v's shape); a slice_scatter of anything else is left as it is."""
        base, src, dim, start, end, step = list(node.args) + [0, None, None, 1][len(node.args) - 2:]
        bv, sv = _val(base), _val(src)
        if step != 1 or node.kwargs or not isinstance(bv, torch.Tensor) or not isinstance(sv, torch.Tensor):
            return
        if not (isinstance(src, fx.Node) and src.target is aten.copy.default and _written_from(src.args[1], rewritten)):
            return
        value = src.args[1]
        if (list(_val(value).shape) != list(sv.shape) or sv.dtype != bv.dtype
                or not all(isinstance(d, int) for d in bv.shape)):
            return
        dim = dim % bv.dim()
        size = bv.shape[dim]
        start = 0 if start is None else (start + size if start < 0 else min(start, size))
        end = size if end is None else (end + size if end < 0 else min(end, size))
        if end - start != sv.shape[dim]:
            return
        self.before = node
        pieces = [self.emit(aten.slice.Tensor, base, dim, 0, start)] if start > 0 else []
        pieces.append(value if _val(value).dtype == bv.dtype else self.emit(_CONVERT, value, bv.dtype))
        if end < size:
            pieces.append(self.emit(aten.slice.Tensor, base, dim, end, size))
        node.replace_all_uses_with(self.emit(aten.cat.default, pieces, dim))
        self.graph.erase_node(node)
        self.touched |= {src, *src.all_input_nodes}


def real_pairs(graph: fx.Graph) -> tuple[int, list[str]]:
    """Rewrite `graph` in place (see the module docstring): the number of view_as_real nodes rewritten, and per
    view_as_real left complex the reason."""
    rewriter, rewritten, left = _Rewriter(graph), set(), []
    for vr in list(graph.find_nodes(op="call_function", target=aten.view_as_real.default)):
        z = vr.args[0]
        if not (isinstance(z, fx.Node) and z.op == "call_function"):
            continue  # a complex graph input viewed as real pairs: nothing to rewrite
        rewriter.before = vr
        try:
            re, im = rewriter.split(z)
        except _Left as e:
            vr.meta[_LEFT] = str(e)
            left.append(f"%{vr.name} left complex: {e}")
            continue
        last = _val(re).dim()
        stacked = rewriter.emit(aten.cat.default, [rewriter.emit(aten.unsqueeze.default, re, last),
                                                   rewriter.emit(aten.unsqueeze.default, im, last)], last)
        vr.replace_all_uses_with(stacked)
        graph.erase_node(vr)
        rewritten.add(stacked)
    for node in list(graph.find_nodes(op="call_function", target=aten.slice_scatter.default)):
        rewriter.write_back_as_cat(node, rewritten)
    for node in reversed(list(graph.nodes)):  # what the rewrite left unused (complex values among them)
        if node.op == "call_function" and not node.users and (node in rewriter.touched or node in rewriter.parts):
            graph.erase_node(node)
    return len(rewritten), left


def _written_from(v, rewritten: set) -> bool:
    """v is a rewritten view_as_real, through views and float conversions."""
    while (isinstance(v, fx.Node) and v.op == "call_function" and v not in rewritten
           and v.target in (*_CHAIN_VIEWS, _CONVERT)):
        v = v.args[0]
    return v in rewritten
