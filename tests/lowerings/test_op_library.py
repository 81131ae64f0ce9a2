"""The dsv41 op library as a whole: every op in the `torch.ops.dsv41` namespace has a fake, passes opcheck, gives
backed output sizes, rejects bad tensors naming the argument, honours `impl`, and stays one extern call in Inductor.

The ops are enumerated from the dispatcher's `dsv41::` namespace, not from a hand list, so an op added without a
fake or without a sample builder in conftest.py fails here.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch._inductor.utils import fresh_cache, run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_symbols, free_unbacked_symbols

import dsv41.lowerings
from dsv41.lowerings import _kernels

OPS = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("dsv41::"))

# Sample options per op for opcheck; the first entry also holds every optional tensor (for the per-argument tests).
VARIANTS = {
    "allreduce_mhc": [dict(moe=True), dict()],
    "indexer_topk": [dict(candidates=True, cand_topk_blocks=2), dict(), dict(n_cap=4, topk=6)],
    "moe_experts": [dict(apart=True), dict()],
    "moe_finalize": [dict(), dict(shared=False)],
    "qkv_norm": [dict(), dict(rope=False), dict(quant_block=0), dict(rope=False, quant_block=0)],
}


@pytest.fixture
def sample(samples, request):
    """sample(name, i=0): the op's i-th variant's keyword arguments (with a live group_name where needed)."""

    def make(name, i=0):
        options = VARIANTS.get(name, [{}])[i]
        if name == "allreduce_mhc":
            options = dict(options, group_name=request.getfixturevalue("gloo_group"))
        return samples(name, **options)

    return make


def _cases():
    return [(name, i) for name in OPS for i in range(len(VARIANTS.get(name, [{}])))]


def test_namespace_is_the_library():
    assert OPS == sorted(dsv41.lowerings.ALL_OPS)
    assert all(packet is getattr(torch.ops.dsv41, name) for name, packet in dsv41.lowerings.ALL_OPS.items())


@pytest.mark.parametrize("name", OPS)
def test_every_op_has_a_fake(name):
    qualname = f"dsv41::{name}"
    entry = torch._library.simple_registry.singleton.find(qualname)
    assert entry.fake_impl.kernel is not None or torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta"), (
        f"{qualname} has no fake (register_fake) implementation")


# All four default opcheck utils run (test_schema, test_autograd_registration, test_faketensor,
# test_aot_dispatch_dynamic); none needs restricting: the ops are functional, have no autograd formula (inputs
# need no grad), their fakes give backed sizes, and allreduce_mhc's collective runs in a real 1-process gloo group.
@pytest.mark.parametrize("name,i", _cases())
def test_opcheck(name, i, sample):
    kwargs = sample(name, i)
    torch.library.opcheck(getattr(torch.ops.dsv41, name).default, (), kwargs)


@pytest.mark.parametrize("name", OPS)
def test_fake_sizes_are_backed(name, sample):
    """Traced with symbolic input sizes, every output size is an expression of the inputs' (backed) sizes."""
    kwargs = sample(name)
    keys = list(kwargs)
    op = getattr(torch.ops.dsv41, name)
    gm = make_fx(lambda *args: op(**dict(zip(keys, args))), tracing_mode="symbolic")(*kwargs.values())
    (node,) = [n for n in gm.graph.nodes if n.target == op.default]
    vals = node.meta["val"] if isinstance(node.meta["val"], tuple) else (node.meta["val"],)
    assert any(free_symbols(v) for v in vals) and not any(free_unbacked_symbols(v) for v in vals)


def _tensor_args(kwargs):
    return [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("name", OPS)
def test_wrong_dtype_names_the_argument(name, sample, rejects):
    """Each tensor argument in float64, a dtype no op takes (fp16 is one: moe_route's router weight)."""
    kwargs = sample(name)
    for arg in _tensor_args(kwargs):
        rejects(getattr(torch.ops.dsv41, name), kwargs, TypeError, f"'{arg}' must be", **{arg: kwargs[arg].double()})


@pytest.mark.parametrize("name", OPS)
def test_wrong_rank_names_the_argument(name, sample, rejects):
    kwargs = sample(name)
    for arg in _tensor_args(kwargs):
        rejects(getattr(torch.ops.dsv41, name), kwargs, ValueError, f"'{arg}' must be .-D",
                **{arg: kwargs[arg].unsqueeze(0)})


@pytest.mark.parametrize("name", OPS)
def test_wrong_device_names_the_argument(name, sample, rejects):
    """One argument on meta, the others on CPU."""
    kwargs = sample(name)
    for arg in _tensor_args(kwargs):
        rejects(getattr(torch.ops.dsv41, name), kwargs, ValueError, f"'{arg}'.* is on|is on .*'{arg}'", fake=False,
                **{arg: kwargs[arg].to("meta")})


@pytest.mark.parametrize("name", OPS)
def test_impl_values(name, sample, rejects):
    """'auto' on CPU is the reference; 'cute' on CPU and an unknown impl raise clear errors."""
    kwargs = sample(name)
    op = getattr(torch.ops.dsv41, name)
    auto, ref = op(**kwargs), op(**kwargs, impl="reference")
    for a, r in zip(auto if isinstance(auto, tuple) else (auto,), ref if isinstance(ref, tuple) else (ref,)):
        assert torch.equal(a, r)
    with pytest.raises(RuntimeError, match=rf"dsv41::{name}: impl='cute' needs CUDA tensors, got tensors on cpu"):
        op(**kwargs, impl="cute")
    rejects(op, kwargs, ValueError, "'impl' must be one of", impl="fast")


def test_inductor_keeps_each_op_as_one_extern_call(sample):
    """Compiled by Inductor on CPU, the code calls every op exactly once and matches eager."""
    calls = {name: sample(name) for name in OPS}

    def f(calls):
        return {name: getattr(torch.ops.dsv41, name)(**kw) for name, kw in calls.items()}

    with fresh_cache():
        out, codes = run_and_get_code(torch.compile(f, backend="inductor", fullgraph=True), calls)
    code = "\n".join(codes)
    for name in OPS:
        assert code.count(f"torch.ops.dsv41.{name}.default(") == 1, name
    torch.testing.assert_close(out, f(calls), rtol=0, atol=0)


@pytest.fixture
def fake_kernels(monkeypatch):
    """Registers kernel modules dsv41.kernels._t_ok (supports everything) and _t_no (supports nothing)."""
    for name, reason in (("_t_ok", None), ("_t_no", "too many tokens")):
        module = types.ModuleType(f"dsv41.kernels.{name}")
        module.supports = lambda *args, reason=reason, **kwargs: reason
        setattr(module, name, lambda *args, **kwargs: "kernel")
        monkeypatch.setitem(sys.modules, module.__name__, module)
    _kernels.load.cache_clear()
    yield
    _kernels.load.cache_clear()


def test_kernel_selection(fake_kernels):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def select(kernel, impl, device=cuda):
        entry = _kernels.select("op", kernel, impl, device, (), {})
        return None if entry is None else entry()

    assert select("_t_ok", "auto") == "kernel"
    assert select("_t_ok", "cute") == "kernel"
    assert select("_t_ok", "reference") is None
    assert select("_t_ok", "auto", cpu) is None
    assert select("_t_no", "auto") is None
    assert select("_t_missing", "auto") is None
    with pytest.raises(RuntimeError, match="does not support these inputs: too many tokens"):
        select("_t_no", "cute")
    with pytest.raises(RuntimeError, match=r"dsv41.kernels._t_missing is unavailable \(No module named"):
        select("_t_missing", "cute")
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        select("_t_ok", "cute", cpu)
