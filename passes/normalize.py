"""Normalisation run before the fusions, on the graph and on every traced pattern alike.

- reshape forms: `aten._unsafe_view` becomes `aten.view` (the same op on a functional graph);
- no-op views: `view`/`expand` to the input's own shape, a full-range `slice`, a `convert_element_type` to the
  input's own dtype, and `alias` are replaced by their input.

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


def normalize_graph(graph: fx.Graph) -> int:
    """Rewrite `graph` in place; returns the number of nodes changed."""
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._unsafe_view.default:
            node.target = aten.view.default
            changed += 1
        if _is_noop(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            changed += 1
    return changed
