"""Fuzz of every `torch.ops.dsv41` op: from a valid call, one mutation at a time, each call must either succeed
as the contract says or raise a ValueError / TypeError that names the mutated argument.

The ops come from the dispatcher's `dsv41::` namespace and their arguments from each op's schema, so a new op or
argument is fuzzed without editing this file; its valid call comes from the op library's sample builders
(tests/lowerings/conftest.py; an op without one fails here). Mutations (fixed seeds):

- per tensor argument: every other dtype; one dim more, one less; each dim one larger and empty (0); a strided
  (non-contiguous) and a transposed copy; a stride-0 expansion of its first row; on `meta` (the others on CPU);
  a Python scalar, a list, None (when not optional); a NaN and an inf element (float tensors);
- per scalar argument: 0, -1, int32 and int64 extremes, one past int64 (ints); 0, -1, NaN, +-inf (floats); a value
  of another type; None;
- the whole call on `meta` (the fake): outputs must match the real ones in shape and dtype.

A call "succeeds as the contract says" when it returns outputs whose shapes and dtypes are the fake's, with no NaN
unless an input is NaN or infinite; a strided or expanded tensor gives the result of its contiguous copy (within
the dtype's default tolerance of `torch.testing.assert_close`: another layout may sum in another order; integer
outputs exactly). A Python
value of the wrong type for a schema argument is rejected by the dispatcher before any dsv41 code runs, as a
RuntimeError "Expected a value of type ... for argument '<name>'"; that message names the argument and is accepted
as such (it is torch's, not the op's). Sizes past int64 and int32/int64 extremes of scalar sizes run in one child
process, so an abort there is a failing case, not a lost test run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsv41.lowerings  # noqa: F401  (registers the dsv41:: ops)

OPS = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("dsv41::"))
DTYPES = (torch.float16, torch.float32, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.bool,
          torch.uint8, torch.complex64)
INT64_MAX = 2**63 - 1


def _builders():
    """The op library's valid sample calls (tests/lowerings/conftest.py), loaded by path: name -> builder(g)."""
    path = Path(__file__).resolve().parents[1] / "lowerings" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_dsv41_op_samples", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BUILDERS


BUILDERS = _builders()


def valid_calls(name: str, group_name: str | None) -> list[dict]:
    """The op's sample keyword arguments (seed 0) with every optional tensor given, and with every optional tensor
    None (the schema says which are optional)."""
    options = {"allreduce_mhc": dict(moe=True, group_name=group_name),
               "indexer_topk": dict(candidates=True, cand_topk_blocks=2)}.get(name, {})
    full = BUILDERS[name](torch.Generator().manual_seed(0), **options)
    bare = {**full, **{a.name: None for a in schema_args(name) if _kind(a) == "tensor" and _optional(a) and a.name in full}}
    return [full, bare] if bare != full else [full]


def schema_args(name: str) -> list:
    return [a for a in getattr(torch.ops.dsv41, name).default._schema.arguments]


def _kind(arg) -> str:
    """'tensor', 'int', 'float', 'bool' or 'str': what the schema argument holds."""
    text = str(arg.type).replace("Optional[", "").rstrip("]")
    return {"Tensor": "tensor", "SymInt": "int", "int": "int", "float": "float", "bool": "bool", "str": "str"}[text]


def _optional(arg) -> bool:
    return str(arg.type).startswith("Optional[")


# ---- mutations: (label, the argument's new value, its contiguous twin or None)

def tensor_mutations(value: torch.Tensor, optional: bool):
    g = torch.Generator().manual_seed(1)
    for dtype in DTYPES:
        if dtype != value.dtype:
            yield f"dtype {dtype}", value.to(dtype), None
    yield "rank +1", value.unsqueeze(0), None
    if value.dim() >= 1:
        yield "rank -1", value.select(0, 0), None
    for d in range(value.dim()):
        bigger = torch.cat([value, value.narrow(d, value.shape[d] - 1, 1) if value.shape[d] else value], dim=d)
        yield f"dim {d} + 1", bigger, None
        yield f"dim {d} = 0", value.narrow(d, 0, 0), None
    if value.dim() >= 1 and value.numel() > 1:
        wide = torch.zeros(*value.shape[:-1], 2 * value.shape[-1], dtype=value.dtype)
        wide[..., ::2] = value
        yield "strided", wide[..., ::2], value
    if value.dim() >= 2:
        yield "transposed", value.mT.contiguous().mT, value
    if value.dim() >= 1 and value.shape[0] > 1:
        expanded = value[:1].expand_as(value)
        yield "expanded (stride 0)", expanded, expanded.contiguous()
    yield "on meta", value.to("meta"), None
    yield "python float", 1.5, None
    yield "python list", [1, 2], None
    if not optional:
        yield "None", None, None
    if value.is_floating_point() and value.numel():
        for bad in (math.nan, math.inf):
            special = value.clone()
            special.view(-1)[int(torch.randint(value.numel(), (1,), generator=g))] = bad
            yield f"one {bad} element", special, None


SCALARS = {
    "int": [0, -1, -(2**31), 1.5, "1", None],
    "float": [0.0, -1.0, math.nan, math.inf, -math.inf, "1", None],
    "bool": [1, "yes", None],
    "str": ["", "nope", 3, None],
}
CHILD_SCALARS = {"int": [2**31, 2**62, INT64_MAX, -(2**62), INT64_MAX + 1]}  # sizes that might abort a process: run in a child


def scalar_mutations(kind: str, child: bool = False):
    for value in (CHILD_SCALARS if child else SCALARS).get(kind, []):
        yield f"= {value!r}", value, None


# ---- judging one call

def _outputs(out) -> tuple:
    return out if isinstance(out, (tuple, list)) else (out,)


def _has_nan(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type != "meta" and (value.is_floating_point() or value.is_complex()) and bool(value.isnan().any())
    return isinstance(value, float) and math.isnan(value)


def _non_finite(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type != "meta" and (value.is_floating_point() or value.is_complex()) and not bool(value.isfinite().all())
    return isinstance(value, float) and not math.isfinite(value)


def _names_argument(message: str, arg: str) -> bool:
    return bool(re.search(rf"'{arg}'|\b{arg}\b", message))


def _judge_error(name: str, arg: str, e: Exception) -> str | None:
    """None when the error of a call with `arg` mutated is a clear rejection of it, else what is wrong."""
    if isinstance(e, (TypeError, ValueError)):
        if not str(e).startswith(f"dsv41::{name}"):
            return f"{type(e).__name__} not from the op: {e}"
        return None if _names_argument(str(e), arg) else f"{type(e).__name__} does not name '{arg}': {e}"
    if isinstance(e, RuntimeError) and re.search(rf"Expected a value of type '[^']+' for argument '{arg}'", str(e)):
        return None  # the dispatcher's schema type check
    return f"{type(e).__name__}: {str(e)[:400]}"  # an internal error is the finding


def judge(name: str, kwargs: dict, arg: str | None, twin=None) -> str | None:
    """None when op(**kwargs) behaves (see the module docstring), else what went wrong; arg: the mutated argument
    (None: the call is valid and must succeed)."""
    op = getattr(torch.ops.dsv41, name)
    try:
        out = op(**kwargs)
    except Exception as e:  # noqa: BLE001
        if arg is None:
            return f"a valid call raised {type(e).__name__}: {e}"
        return _judge_error(name, arg, e)
    outs = _outputs(out)
    if any(not isinstance(o, torch.Tensor) for o in outs):
        return f"returned a non-tensor {outs!r:.200}"
    if any(o.device.type != "meta" for o in outs):
        try:
            fake = _outputs(op(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}))
        except Exception as e:  # noqa: BLE001
            return f"the real call succeeded but the fake raised {type(e).__name__}: {e}"
        for i, (o, f) in enumerate(zip(outs, fake, strict=True)):
            if o.shape != f.shape or o.dtype != f.dtype:
                return f"output {i}: real {o.dtype}{list(o.shape)} vs fake {f.dtype}{list(f.shape)}"
        if not any(_non_finite(v) for v in kwargs.values()):
            for i, o in enumerate(outs):
                if _has_nan(o):
                    return f"output {i} holds NaN though every input is finite"
    if twin is not None:
        want = _outputs(op(**{**kwargs, arg: twin}))
        for i, (o, w) in enumerate(zip(outs, want, strict=True)):
            try:  # another layout may take another summation order: the dtype's default tolerance, integers exact
                torch.testing.assert_close(o, w, equal_nan=True)
            except AssertionError as e:
                return f"output {i} differs from the call with a contiguous '{arg}': {e}"
    return None


def fuzz_op(name: str, group_name: str | None, child: bool = False) -> list[str]:
    """Every mutation of op `name`'s valid calls; the list of failures ('arg: mutation: why')."""
    failures = []
    for i, base in enumerate(valid_calls(name, group_name)):
        failures += [f"call {i}: {f}" for f in _fuzz_call(name, base, child)]
    return failures


def _fuzz_call(name: str, base: dict, child: bool) -> list[str]:
    failures = []
    for a in schema_args(name):
        kind = _kind(a)
        if kind == "tensor":
            if child or base.get(a.name) is None:
                continue
            cases = tensor_mutations(base[a.name], _optional(a))
        else:
            cases = scalar_mutations(kind, child)
        for label, value, twin in cases:
            if child:  # the last line on stderr names the case that aborted the child, if one does
                print(f"dsv41::{name} {a.name} {label}", file=sys.stderr, flush=True)
            why = judge(name, {**base, a.name: value}, a.name, twin)
            if why is not None:
                failures.append(f"{a.name}: {label}: {why}")
    if not child:
        why = judge(name, {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in base.items()}, None)
        if why is not None:
            failures.append(f"all on meta: {why}")
    return failures


def test_every_op_has_a_valid_call():
    assert set(OPS) <= set(BUILDERS), f"ops without a sample builder in tests/lowerings/conftest.py: {set(OPS) - set(BUILDERS)}"


@pytest.mark.parametrize("name", OPS)
def test_mutations(name, gloo_group):
    failures = fuzz_op(name, gloo_group)
    assert not failures, f"{len(failures)} mutations of dsv41::{name} misbehave:\n" + "\n".join(failures)


CHILD = """
import json, sys
sys.path.insert(0, {here!r})
import test_op_fuzz as fuzz
print(json.dumps({{name: fuzz.fuzz_op(name, None, child=True) for name in fuzz.OPS if name != "allreduce_mhc"}}))
"""


def test_extreme_sizes_in_a_child_process():
    """int sizes at the int64 extremes and one past (all ops but allreduce_mhc, which needs a process group):
    the child must exit cleanly, and every case behave."""
    proc = subprocess.run([sys.executable, "-c", CHILD.format(here=str(Path(__file__).parent))], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"the child died (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not any(failures.values()), "\n".join(f"{n}: {f}" for n, fs in failures.items() for f in fs)
