"""Decomposition of what the passes wrote: the graph handed to code generation holds only ops Inductor lowers.

AOTAutograd decomposed the user's graph with Inductor's table (`select_decomp_table()`) before any dsv41 pass ran;
a node that a pass writes afterwards (a replacement's derived offsets, `ones_like(ids).cumsum(0)`; a normalised
spelling) has not been through that table. Inductor then meets an op it has a decomposition for but no lowering,
makes an implicit fallback of it and stops: "both a fallback and a decomp for same op" (and under CI=1 any op with a
registered decomposition). `DecomposePass` traces every node whose op is in the table, and has no Inductor
lowering, through the table, as AOT would have, and splices the result in place (`inline_traced`, which
`lower_references` uses for the fused ops' references too). It runs in both modes, so `fx` mode runs the graph
Inductor would compile.

Inductor rounds a bf16 / fp16 value where eager would only at the nodes AOT's trace marked as low-precision
barriers (under `emulate_precision_casts`, which the backend sets): the pass manager marks the nodes the passes
created alike (`mark_precision_barriers`), so a rewritten graph rounds where the user's code does.

`unlowerable(nodes)` is the check the pass manager runs in debug mode over every node the passes created: each is
`getitem`, a higher-order op, an op with an Inductor lowering, or an op with no decomposition anywhere (an implicit
fallback Inductor accepts: the `dsv41::` ops).
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from dsv41.passes.fusion import GraphPass, PassResult
from dsv41.passes.streams import STREAM

# what the nodes that replace a node inherit from it
_INHERITED = (STREAM, "stack_trace", "nn_module_stack")
# the node annotation by which Inductor rounds a low-precision value where eager would (`mark_precision_barriers`)
PRECISION_BARRIER = "low_precision_pointwise_barrier"
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class DecomposePass(GraphPass):
    name = "decompose"

    def __call__(self, graph: fx.Graph) -> PassResult:
        result = PassResult(self.name)
        for node in list(graph.nodes):
            if node.op != "call_function" or not _decomposed_not_lowered(node.target):
                continue
            created = inline_traced(graph, node, node.target, node.args, node.kwargs, decompose_once=True)
            if created is None:  # its decomposition declines these arguments: the op stays, as AOT left it
                continue
            result.matches += 1
            result.replaced.append({"pattern": _op_name(node.target), "erased": [node.name], "created": created,
                                    "stack_trace": node.meta.get("stack_trace"), "module": None})
        return result


def inline_traced(graph: fx.Graph, node: fx.Node, fn, args, kwargs=None, *, decompose_once: bool = False):
    """Replace `node` by `fn(*args, **kwargs)` traced to ATen through Inductor's decompositions (functionalised, on
    the fake values of the graph nodes among the arguments), its outputs taking the place of node's (a tuple output
    through node's `getitem` users). Copied nodes inherit node's stream, stack trace and module (`_INHERITED`).
    The names of the created nodes; None, with the graph unchanged, when `decompose_once` and the trace is node's
    own op again (a decomposition that declines these arguments)."""
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    positions = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
    fake = [flat[i].meta["val"] for i in positions]

    def call(*tensors):
        full = list(flat)
        for i, t in zip(positions, tensors):
            full[i] = t
        a, k = pytree.tree_unflatten(full, spec)
        return fn(*a, **k)

    # the arguments' fake mode; for an op of no tensor argument (a `full`), the graph's
    mode = detect_fake_mode(fake) or detect_fake_mode([p.meta.get("val") for p in graph.find_nodes(op="placeholder")])
    with mode if mode is not None else contextlib.nullcontext():
        sub = make_fx(torch.func.functionalize(call, remove="mutations"), decomposition_table=select_decomp_table(),
                      tracing_mode="real")(*fake)
    sub.graph.eliminate_dead_code()
    calls = [n for n in sub.graph.nodes if n.op == "call_function"]
    if decompose_once and [n.target for n in calls] == [node.target]:
        return None
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env = {p: flat[i] for p, i in zip(placeholders, positions)}
    for const in sub.graph.find_nodes(op="get_attr"):  # a tensor the trace holds (a decomposition's table)
        env[const] = _hold(graph, const.target, getattr(sub, const.target), before=node)
        env[const].meta.update(const.meta)
    with graph.inserting_before(node):
        out = graph.graph_copy(sub.graph, env)
    copied = [env[n] for n in calls]
    for new in copied:
        for key in _INHERITED:
            if key in node.meta:
                new.meta.setdefault(key, node.meta[key])
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if len(outs) == 1 and not any(u.target is operator.getitem for u in node.users):
        node.replace_all_uses_with(outs[0])
    else:
        for user in list(node.users):
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(node)
    return [n.name for n in copied]


def _hold(graph: fx.Graph, name: str, value: torch.Tensor, before: fx.Node) -> fx.Node:
    """A get_attr node of `graph`'s module for `value`, held under a fresh attribute name derived from `name`."""
    module = graph.owning_module
    if module is None:
        raise RuntimeError(f"the trace holds a constant ({name}) but the graph has no module to hold it")
    held, i = f"_dsv41_{name}", 0
    while hasattr(module, f"{held}_{i}"):
        i += 1
    setattr(module, f"{held}_{i}", value)
    with graph.inserting_before(before):
        return graph.get_attr(f"{held}_{i}")


def mark_precision_barriers(nodes) -> None:
    """Mark each op node among `nodes` that reads or returns a bf16 / fp16 tensor as a low-precision barrier, as
    AOT's trace marks the user's ops under Inductor's `emulate_precision_casts` (the backend's setting): Inductor
    then rounds its value to that dtype where eager would, instead of carrying fp32 through a fused chain of
    pointwise ops. The passes' own nodes (a normalised spelling, a replacement's derived values, an inlined
    reference) are ops that eager would run one by one too."""
    for n in nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        values = [n.meta.get("val"), *(a.meta.get("val") for a in n.all_input_nodes)]
        if any(isinstance(v, torch.Tensor) and v.dtype in _LOW_PRECISION for v in values):
            n.meta[PRECISION_BARRIER] = True


def unlowerable(nodes) -> list[str]:
    """The nodes among `nodes` that Inductor would not lower, each with why (empty: all lower)."""
    from torch._decomp import get_decompositions
    from torch._inductor.lowering import lowerings

    bad = []
    for n in nodes:
        t = n.target
        if n.op != "call_function" or t is operator.getitem or isinstance(t, torch._ops.HigherOrderOperator) \
                or t in lowerings:
            continue
        if not isinstance(t, torch._ops.OpOverload):
            bad.append(f"%{n.name}: {t} is not an ATen op overload")
        elif t in select_decomp_table() or get_decompositions([t]):  # (t has no lowering: checked above)
            bad.append(f"%{n.name} = {_op_name(t)}: Inductor has a decomposition for it and no lowering")
    return bad


def _decomposed_not_lowered(target) -> bool:
    """Inductor's table decomposes `target` and Inductor has no lowering of its own for it (an op in both, such as
    `add.Tensor`, whose decomposition applies to complex values only, is lowered as it stands)."""
    from torch._inductor.lowering import lowerings

    return target in select_decomp_table() and target not in lowerings


def _op_name(target) -> str:
    return target.name() if hasattr(target, "name") else str(target)
