"""Lowering of fused ops without a kernel: in `inductor` mode on CUDA, a `dsv41::` op whose CuTe DSL kernel is not
available is replaced by its reference decomposition (the op's `reference`, traced to ATen in the graph's fake
mode), so Inductor compiles that math fused instead of calling the op as an extern of eager kernels. Ops with a
kernel stay single extern calls. The fusion passes have already counted the match; this pass chooses the
implementation (vLLM's IR lowering idea). It runs after stream scheduling: inlined nodes keep the op's stream.
"""

from __future__ import annotations

import importlib

import torch
import torch.fx as fx

from dsv41.passes.decompose import inline_traced
from dsv41.passes.fusion import GraphPass, PassResult
from dsv41.passes.registry import FUSIONS

# op -> the dsv41.kernels module that implements it on CUDA (declared in the registry)
KERNEL_OF = {f.name: f.kernel for f in FUSIONS if f.kernel is not None}


def kernel_available(op_name: str) -> bool:
    from dsv41.lowerings import _kernels

    kernel = KERNEL_OF.get(op_name)
    return kernel is not None and _kernels.load(kernel)[0] is not None


def _reference(op_name: str):
    module = importlib.import_module(f"dsv41.lowerings.{op_name}")
    return module.reference


class LowerReferencesPass(GraphPass):
    name = "lower_references"

    def __call__(self, graph: fx.Graph) -> PassResult:
        result = PassResult(self.name)
        if self.config.mode != "inductor":
            return result
        vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
        if not any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in vals):
            return result  # no kernels off CUDA: the ops stay single calls (CPU is not a performance target)
        keep = set() if self.config.kernel == "reference" else {k for k in KERNEL_OF if kernel_available(k)}
        return lower_references(graph, keep, result)


def lower_references(graph: fx.Graph, keep: set[str], result: PassResult | None = None) -> PassResult:
    """Inline the reference of every dsv41 op whose name is not in `keep`."""
    result = result or PassResult(LowerReferencesPass.name)
    for node in list(graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target.namespace != "dsv41":
            continue
        op_name = target._schema.name.split("::")[-1]
        if op_name in keep:
            continue
        arguments = {a.name: v for a, v in zip(target._schema.arguments, node.args)} | dict(node.kwargs)
        arguments.pop("impl", None)  # the reference takes the op's other arguments by their schema names
        created = inline_traced(graph, node, _reference(op_name), (), arguments)
        result.matches += 1
        result.replaced.append({"pattern": op_name, "erased": [node.name], "created": created,
                                "stack_trace": node.meta.get("stack_trace"), "module": None})
    return result
