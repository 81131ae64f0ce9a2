"""Normalised graph code: one line per node, stable across identical runs and free of noise.

    %name: bf16[3, 4, 128] = aten.mul.Tensor(%a, 2.0)
    %name: f32[3, 4] = dsv41.mhc_coeffs(...)  @stream2      (a node on a side stream)

Node names are FX's own (deterministic for a given trace, and untouched by passes that do not touch the node,
so diffs stay small); devices, file paths and object addresses are left out; shapes and dtypes come from
`meta["val"]`. Tests compare this text with expecttest goldens; the graph-diff tool diffs it.
"""

from __future__ import annotations

import functools
import re

import torch
import torch.fx as fx

_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16", torch.int64: "i64", torch.int32: "i32",
           torch.bool: "b8", torch.float8_e4m3fn: "f8e4m3", torch.uint8: "u8", torch.int8: "i8"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def describe_value(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{dtype_name(val.dtype)}{list(val.shape)}"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(describe_value(v) for v in val) + ")"
    return "" if val is None else type(val).__name__


def op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target.namespace, target._schema.name.split("::")[-1]
        overload = target._overloadname
        return f"{ns}.{name}" + ("" if overload == "default" else f".{overload}")
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return getattr(target, "__name__", str(target))


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.device):
        return "<device>"
    if isinstance(a, torch.dtype):
        return dtype_name(a)
    if isinstance(a, torch._ops.OpOverload):
        return op_name(a)
    if isinstance(a, float):
        return repr(a)
    return repr(a)


def node_line(node: fx.Node) -> str:
    typ = describe_value(node.meta.get("val"))
    lhs = f"%{node.name}" + (f": {typ}" if typ else "")
    if node.op == "placeholder":
        return f"{lhs} = input"
    if node.op == "get_attr":
        return f"{lhs} = get_attr {node.target}"
    if node.op == "output":
        return f"return {_arg(node.args[0])}"
    args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items() if k not in ("device", "pin_memory", "layout")]
    stream = node.meta.get("dsv41_stream", 0)
    return f"{lhs} = {op_name(node.target)}({', '.join(args)})" + (f"  @stream{stream}" if stream else "")


def graph_code(graph: fx.Graph) -> str:
    return "\n".join(node_line(n) for n in graph.nodes) + "\n"


def module_path(nn_module_stack) -> str | None:
    """The innermost module of node.meta['nn_module_stack'] as a dotted path (`layers.3.attn`)."""
    if not nn_module_stack:
        return None
    try:
        path = list(nn_module_stack.values())[-1][0]
    except (AttributeError, IndexError, TypeError):
        return None
    return _clean_module_path(str(path))


@functools.lru_cache(maxsize=4096)
def _clean_module_path(path: str) -> str | None:
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)  # layers['3'] / layers[3] -> layers.3
    return path.strip(".") or None
