"""Normalisation run before the fusions, on the graph and on every traced pattern alike.

- reshape forms: `aten._unsafe_view` becomes `aten.view` (the same op on a functional graph);
- no-op views: `view`/`expand` to the input's own shape, a full-range `slice`, a `convert_element_type` to the
  input's own dtype, and `alias` are replaced by their input;
- static sizes: `view`/`reshape`/`expand` take the output's static shape (so `reshape(t, -1)` and
  `reshape(t, 64)` are one form);
- dims: negative dimension arguments become non-negative (`unsqueeze(-2)` on a 2-d input is `unsqueeze(1)`);
- defaults: trailing positional defaults of reductions, top-k and sort are written out (`topk(x, k)` is
  `topk(x, k, -1, True, True)`);
- layout chains: a chain of views, unsqueezes, squeezes and permutes is at most one permute and one view of its
  root (one-step and two-step reshapes, `x[:, None]` and `x.unsqueeze(1)` are one form);
- broadcasting: an operand viewed only to add leading size-1 dims is the operand itself;
- `where(~m, a, b)` is `where(m, b, a)`; a negation of a view is the view of the negation.

Shapes come from `meta["val"]`; a node without it is left alone.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

aten, prims = torch.ops.aten, torch.ops.prims


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _is_noop(node: fx.Node) -> bool:
    out, inp = _val(node), _val(node.args[0]) if node.args else None
    if not isinstance(out, torch.Tensor) or not isinstance(inp, torch.Tensor):
        return False
    t = node.target
    if t in (aten.view.default, aten.expand.default, aten.reshape.default):
        return out.shape == inp.shape
    if t is aten.alias.default:
        return True
    if t is prims.convert_element_type.default:
        return out.dtype == inp.dtype
    if t is aten.slice.Tensor:
        dim = node.args[1] if len(node.args) > 1 else 0
        step = node.args[4] if len(node.args) > 4 else 1
        return out.shape == inp.shape and step == 1 and (node.args[2] if len(node.args) > 2 else 0) in (0, None) and dim is not None
    return False


# op -> (argument index of the dim or dim list, whose rank it counts against: the input's or the output's)
_DIM_ARGS = {
    aten.unsqueeze.default: (1, "out"), aten.cat.default: (1, "out"),
    aten.sum.dim_IntList: (1, "in"), aten.mean.dim: (1, "in"), aten.amax.default: (1, "in"), aten.amin.default: (1, "in"),
    aten._softmax.default: (1, "in"), aten._log_softmax.default: (1, "in"), aten.slice.Tensor: (1, "in"),
    aten.select.int: (1, "in"), aten.topk.default: (2, "in"), aten.sort.default: (1, "in"), aten.sort.stable: (1, "in"),
    aten.gather.default: (1, "in"), aten.scatter.src: (1, "in"), aten.scatter.value: (1, "in"),
    aten.scatter_add.default: (1, "in"), aten.index_add.default: (1, "in"), aten.squeeze.dim: (1, "in"),
    aten.squeeze.dims: (1, "in"), aten.cumsum.default: (1, "in"), aten.split.Tensor: (2, "in"),
    aten.split_with_sizes.default: (2, "in"), aten.index_select.default: (1, "in"), aten.argmax.default: (1, "in"),
}
_SIZE_OPS = (aten.view.default, aten.reshape.default, aten.expand.default)


def _canonical_args(node: fx.Node) -> bool:
    """Static sizes and non-negative dims in place; True when an argument changed."""
    out = _val(node)
    args = list(node.args)
    if node.target in _SIZE_OPS and isinstance(out, torch.Tensor) and all(isinstance(d, int) for d in out.shape):
        if list(args[1]) != list(out.shape):
            args[1] = list(out.shape)
            node.args = tuple(args)
            return True
        return False
    spec = _DIM_ARGS.get(node.target)
    if spec is None or len(args) <= spec[0]:
        return False
    pos, which = spec
    ref = out if which == "out" else _val(args[0][0] if node.target is aten.cat.default else args[0])
    if isinstance(ref, (tuple, list)):
        ref = ref[0]
    if not isinstance(ref, torch.Tensor):
        return False
    rank = max(ref.dim(), 1)
    dim = args[pos]
    fixed = [d + rank if isinstance(d, int) and d < 0 else d for d in dim] if isinstance(dim, (list, tuple)) else (
        dim + rank if isinstance(dim, int) and not isinstance(dim, bool) and dim < 0 else dim)
    if fixed == dim or (isinstance(dim, (list, tuple)) and list(fixed) == list(dim)):
        return False
    args[pos] = fixed
    node.args = tuple(args)
    return True


# ops whose trailing defaults callers often spell out (topk(x, k) vs topk(x, k, -1)): written out here
_DEFAULTS_FILLED = (aten.topk.default, aten.sort.default, aten.sort.stable, aten.sum.dim_IntList, aten.mean.dim,
                    aten.amax.default, aten.amin.default, aten.argmax.default, aten.cumsum.default)


def _fill_defaults(node: fx.Node) -> bool:
    """The positional arguments a caller left at their schema defaults, written out."""
    if node.target not in _DEFAULTS_FILLED:
        return False
    params = [a for a in node.target._schema.arguments if not a.kwarg_only]
    args = list(node.args)
    for a in params[len(args):]:
        if a.name in node.kwargs or not a.has_default_value():
            break
        args.append(a.default_value)
    if len(args) == len(node.args):
        return False
    node.args = tuple(args)
    return True


def _local_forms(graph: fx.Graph) -> int:
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        changed += _fill_defaults(node)
        if node.target is aten._unsafe_view.default:
            node.target = aten.view.default
            changed += 1
        changed += _canonical_args(node)
        if _is_noop(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            changed += 1
    return changed


def normalize_graph(graph: fx.Graph) -> int:
    """Rewrite `graph` in place (to a fixed point); returns the number of nodes changed."""
    total = 0
    for _ in range(4):
        changed = _local_forms(graph) + _canonical_forms(graph)
        total += changed
        if not changed:
            break
    return total


# ---- exact canonical rewrites: layout chains, broadcast-only unsqueezes, negated where ---------------
_LAYOUT_OPS = (aten.view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
               aten.permute.default)
_BROADCASTING = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default,
                 aten.minimum.default, aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor,
                 aten.ge.Tensor, aten.where.self)


def _static(t) -> bool:
    return isinstance(t, torch.Tensor) and all(isinstance(d, int) for d in t.shape)


def _contiguous_strides(shape) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return strides[::-1]


def _layout_root(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The first non-layout producer above `node` and the chain of layout ops from it down to `node`."""
    chain = [node]
    while isinstance(chain[-1].args[0], fx.Node) and chain[-1].args[0].op == "call_function" and chain[-1].args[0].target in _LAYOUT_OPS:
        chain.append(chain[-1].args[0])
    return chain[-1].args[0], chain[::-1]


def _canonical_layout(root_shape, chain) -> tuple | None:
    """The chain's effect on a contiguous [root_shape] tensor as () (nothing), ("view", shape),
    ("permute", perm) or ("permute", perm, "view", shape); None when it is none of these."""
    t = torch.empty(root_shape, device="meta")
    try:
        for n in chain:
            t = n.target(t, *n.args[1:])
    except Exception:
        return None
    sizes, strides = list(t.shape), list(t.stride())
    if all(s == c for d, s, c in zip(sizes, strides, _contiguous_strides(sizes)) if d != 1):
        return () if sizes == list(root_shape) else ("view", sizes)
    root_strides = _contiguous_strides(root_shape)
    free = {i for i, d in enumerate(root_shape) if d != 1}
    perm = []
    for d, s in zip(sizes, strides):
        if d == 1:
            continue
        match = next((i for i in sorted(free) if root_shape[i] == d and root_strides[i] == s), None)
        if match is None:
            return None
        perm.append(match)
        free.discard(match)
    if free:
        return None
    perm += [i for i in range(len(root_shape)) if i not in perm]
    permuted = [root_shape[i] for i in perm]
    return ("permute", perm) if permuted == sizes else ("permute", perm, "view", sizes)


def _describe(root, chain) -> tuple:
    out = []
    for n in chain:
        if n.target not in (aten.view.default, aten.permute.default):
            return (n.target,)
        out += ["view" if n.target is aten.view.default else "permute", list(n.args[1])]
    return tuple(out)


def _fake_call(target, *args):
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    mode = next((v.fake_mode for v in vals if isinstance(v, FakeTensor)), None)
    if mode is None:
        return target(*vals)
    with mode:
        return target(*vals)


def _emit(graph: fx.Graph, before: fx.Node, root: fx.Node, steps: tuple) -> fx.Node:
    value = root
    for op, arg in zip(steps[::2], steps[1::2]):
        target = aten.view.default if op == "view" else aten.permute.default
        with graph.inserting_before(before):
            new = graph.call_function(target, (value, arg))
        new.meta["val"] = _fake_call(target, value, arg)
        for key in ("stack_trace", "nn_module_stack"):
            if key in before.meta:
                new.meta[key] = before.meta[key]
        value = new
    return value


def _canonicalise_layout(graph: fx.Graph, node: fx.Node) -> bool:
    """Rewrite a chain of views/unsqueezes/squeezes/permutes ending at `node` as at most one permute and one view of
    its root (the same elements in the same order: an exact identity)."""
    root, chain = _layout_root(node)
    rv = _val(root)
    if not isinstance(root, fx.Node) or not _static(rv) or not _static(_val(node)):
        return False
    steps = _canonical_layout(list(rv.shape), chain)
    if steps is None or tuple(steps) == _describe(root, chain):
        return False
    node.replace_all_uses_with(_emit(graph, node, root, steps) if steps else root)
    graph.erase_node(node)
    return True


def _drop_broadcast_views(node: fx.Node) -> bool:
    """An operand of a broadcasting op viewed only to add leading size-1 dims is the operand itself."""
    out = _val(node)
    if not _static(out):
        return False
    args, changed = list(node.args), False
    for i, a in enumerate(args):
        if not (isinstance(a, fx.Node) and a.op == "call_function" and a.target is aten.view.default):
            continue
        src, av = a.args[0], _val(a)
        sv = _val(src)
        if not (_static(sv) and _static(av)) or av.dim() <= sv.dim():
            continue
        lead = av.dim() - sv.dim()
        if list(av.shape) != [1] * lead + list(sv.shape):
            continue
        others = [_val(b).shape for j, b in enumerate(args) if j != i and isinstance(b, fx.Node) and _static(_val(b))]
        if list(torch.broadcast_shapes(*others, sv.shape)) != list(out.shape):
            continue
        args[i], changed = src, True
    if changed:
        node.args = tuple(args)
    return changed


def _neg_before_view(graph: fx.Graph, node: fx.Node) -> bool:
    """neg(view(x)) = view(neg(x)): the negation moves above a view chain (`-sin.view(...)` and `(-sin).view(...)`
    are one form)."""
    src = node.args[0]
    if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.view.default
            and len(src.users) == 1 and _static(_val(src.args[0]))):
        return False
    with graph.inserting_before(src):
        neg = graph.call_function(aten.neg.default, (src.args[0],))
    neg.meta["val"] = _fake_call(aten.neg.default, src.args[0])
    src.args = (neg, *src.args[1:])
    src.meta["val"] = _fake_call(aten.view.default, neg, *src.args[1:])
    node.replace_all_uses_with(src)
    graph.erase_node(node)
    return True


def _where_not(node: fx.Node) -> bool:
    """where(~m, a, b) = where(m, b, a)."""
    cond = node.args[0]
    if isinstance(cond, fx.Node) and cond.op == "call_function" and cond.target is aten.bitwise_not.default:
        node.args = (cond.args[0], node.args[2], node.args[1])
        return True
    return False


def _canonical_forms(graph: fx.Graph) -> int:
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.graph is not graph or not node.users and node.target in _LAYOUT_OPS:
            continue
        if node.target in _LAYOUT_OPS:
            changed += _canonicalise_layout(graph, node)
        elif node.target is aten.neg.default:
            changed += _neg_before_view(graph, node)
        elif node.target in _BROADCASTING:
            changed += _drop_broadcast_views(node)
            if node.target is aten.where.self:
                changed += _where_not(node)
    for node in reversed(list(graph.nodes)):  # layout ops and negations left without users
        if node.op == "call_function" and not node.users and node.target in (*_LAYOUT_OPS, aten.bitwise_not.default):
            graph.erase_node(node)
    return changed
