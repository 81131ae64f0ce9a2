"""Normalisation run before the fusions, on the graph and on every traced pattern alike.

- reshape forms: `aten._unsafe_view` becomes `aten.view` (the same op on a functional graph);
- no-op views: `view`/`expand` to the input's own shape, a full-range `slice`, a `convert_element_type` to the
  input's own dtype, and `alias` are replaced by their input;
- static sizes: `view`/`reshape`/`expand` take the output's static shape (so `reshape(t, -1)` and
  `reshape(t, 64)` are one form);
- dims: negative dimension arguments become non-negative (`unsqueeze(-2)` on a 2-d input is `unsqueeze(1)`).

Shapes come from `meta["val"]`; a node without it is left alone.
"""

from __future__ import annotations

import torch
import torch.fx as fx

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


def normalize_graph(graph: fx.Graph) -> int:
    """Rewrite `graph` in place; returns the number of nodes changed."""
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._unsafe_view.default:
            node.target = aten.view.default
            changed += 1
        changed += _canonical_args(node)
        if _is_noop(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            changed += 1
    return changed
