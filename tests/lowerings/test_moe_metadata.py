"""dsv41::moe_metadata: its reference is bit-exact with the tiny model's MoE on CPU (the op's outputs in place of the
model's row order, offsets and row weights give the layer's output bit for bit, with and without TP masking) and
equals the op's definition written as loops over experts and pairs; argument errors name the argument.
"""

import pytest
import torch

from dsv41.lowerings import ALL_OPS
from dsv41.models import TINY, DSV41Model
from dsv41.models import functional as fn

op = ALL_OPS["moe_metadata"]


def by_definition(flat_experts, flat_weights, topk, num_experts):
    """The docstring's math by loops: each expert's pairs in pair order, offsets as the running row count."""
    ids = flat_experts.tolist()
    rows = [p for e in range(num_experts) for p in range(len(ids)) if ids[p] == e]
    offsets = [sum(1 for i in ids if i <= e) for e in range(num_experts)]
    return (torch.tensor([p // topk for p in rows]), torch.tensor(offsets, dtype=torch.int32),
            flat_weights[torch.tensor(rows)])


def assert_equal(got, want):
    for name, g, w in zip(("token", "offsets", "row_weights"), got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"


@pytest.mark.parametrize("seed", range(3))
def test_reference_is_the_definition(samples, seed):
    kw = samples("moe_metadata", seed=seed)
    assert_equal(op(**kw, impl="reference"), by_definition(**kw))


@pytest.mark.parametrize("case", ["one expert for all", "last expert", "one pair", "one expert in all", "ties"])
def test_edge_routings(case):
    """Every pair on one expert (the others get 0 rows), a routing with only the last expert, M = 1, E = 1, and
    many equal ids (the stable order keeps them in pair order)."""
    g = torch.Generator().manual_seed(3)
    m, topk, e = {"one pair": (1, 1, 8), "one expert in all": (12, 4, 1)}.get(case, (24, 6, 8))
    flat_experts = {"one expert for all": torch.full((m,), 5), "last expert": torch.full((m,), e - 1),
                    "ties": torch.randint(0, 2, (m,), generator=g) * 3}.get(case, torch.zeros(m, dtype=torch.int64))
    kw = dict(flat_experts=flat_experts, flat_weights=torch.rand(m, generator=g), topk=topk, num_experts=e)
    assert_equal(op(**kw, impl="reference"), by_definition(**kw))


@pytest.fixture(scope="module")
def moe_layer():
    torch.manual_seed(0)
    return DSV41Model(TINY, [0], max_batch=8, max_context=128).layers["0"].ffn


def layer_with_op(layer, h, world=1, expert_start=0, n_local=None):
    """MoE.forward with dsv41::moe_metadata in place of its argsort, counts, cumsum and gather (the TP masking, when
    world > 1, as the model does it, before the op)."""
    cfg = layer.cfg
    k, inter = cfg.n_activated_experts, cfg.moe_inter_dim
    n_local = n_local or cfg.n_routed_experts
    weights, experts = fn.route(h, layer.gate, layer.gate_bias, k, cfg.route_scale, cfg.gate_temp)
    x = fn.fp8_fake_quant(h)
    flat_e, flat_w = experts.flatten(), weights.flatten()
    if world > 1:
        local = (flat_e >= expert_start) & (flat_e < expert_start + n_local)
        flat_e = torch.where(local, flat_e - expert_start, 0)
        flat_w = torch.where(local, flat_w, 0.0)
    token, offs, row_weights = op(flat_e, flat_w, k, n_local, impl="reference")
    gu = torch._grouped_mm(x[token], layer.w13[:n_local].transpose(1, 2), offs=offs)
    a = (fn.swiglu_clamped(gu[:, :inter], gu[:, inter:], cfg.swiglu_limit) * row_weights.unsqueeze(-1)).to(h.dtype)
    out = torch._grouped_mm(fn.fp8_fake_quant(a), layer.w2[:n_local].transpose(1, 2), offs=offs)
    y = torch.zeros(h.shape[0], cfg.dim).index_add_(0, token, out.float())
    return y, (y + layer.shared_expert(h, x).float()).to(h.dtype)


@pytest.mark.parametrize("t", [1, 5, 8])
@torch.no_grad()
def test_reference_is_the_models_math(moe_layer, t):
    h = torch.randn(t, TINY.dim, generator=torch.Generator().manual_seed(100 + t)).bfloat16()
    assert torch.equal(layer_with_op(moe_layer, h)[1], moe_layer(h))


@torch.no_grad()
def test_reference_under_tp_masking(moe_layer, monkeypatch):
    """Rank 1 of 2: pairs of other ranks' experts sent to local expert 0 at weight 0, as MoE.forward does; the routed
    sum before the all-reduce equals the model's (its all-reduce replaced by the identity)."""
    e = TINY.n_routed_experts
    h = torch.randn(5, TINY.dim, generator=torch.Generator().manual_seed(9)).bfloat16()
    layer = moe_layer
    monkeypatch.setattr(layer, "world", 2)
    monkeypatch.setattr(layer, "n_local", e // 2)
    monkeypatch.setattr(layer, "expert_start", e // 2)
    monkeypatch.setattr(layer, "w13", torch.nn.Parameter(layer.w13[e // 2:], requires_grad=False))
    monkeypatch.setattr(layer, "w2", torch.nn.Parameter(layer.w2[e // 2:], requires_grad=False))
    import dsv41.models.model as model_module
    monkeypatch.setattr(model_module, "_all_reduce", lambda y: y)
    y, _ = layer_with_op(layer, h, world=2, expert_start=e // 2, n_local=e // 2)
    shared = layer.shared_expert(h, fn.fp8_fake_quant(h)).float()
    assert torch.equal((y + shared).to(h.dtype), layer(h))


BAD = {
    "experts dtype": (lambda kw: dict(flat_experts=kw["flat_experts"].int()), TypeError,
                      r"'flat_experts' must be torch.int64, got torch.int32"),
    "experts rank": (lambda kw: dict(flat_experts=kw["flat_experts"].view(3, 6)), ValueError,
                     r"'flat_experts' must be 1-D \[M\]"),
    "no pairs": (lambda kw: dict(flat_experts=kw["flat_experts"][:0], flat_weights=kw["flat_weights"][:0]),
                 ValueError, r"'flat_experts' must hold at least one \(token, slot\) pair"),
    "weights dtype": (lambda kw: dict(flat_weights=kw["flat_weights"].bfloat16()), TypeError,
                      r"'flat_weights' must be torch.float32, got torch.bfloat16"),
    "weights M": (lambda kw: dict(flat_weights=kw["flat_weights"][:-1]), ValueError,
                  r"'flat_weights' must have shape \[M\] = \[18\], got \[17\]"),
    "topk": (lambda kw: dict(topk=0), ValueError, r"'topk' must be >= 1 and divide M = 18 \(from 'flat_experts'\) \(M = T \* topk\), got 0"),
    "num_experts": (lambda kw: dict(num_experts=0), ValueError, r"'num_experts' must be in \[1, 2\*\*31 - 1\] \(offsets are int32\), got 0"),
    "impl": (lambda kw: dict(impl="fast"), ValueError, r"'impl' must be one of"),
    "device": (lambda kw: dict(flat_weights=kw["flat_weights"].to("meta")), ValueError,
               r"'flat_weights' is on meta, expected cpu like 'flat_experts'"),
}


@pytest.mark.parametrize("change", BAD.values(), ids=BAD.keys())
def test_bad_inputs(samples, rejects, change):
    kw = samples("moe_metadata")
    changes, exc, match = change
    rejects(op, kw, exc, match, fake=not match.startswith(r"'flat_weights' is on meta"), **changes(kw))


@pytest.mark.parametrize("value", [-1, 8])
def test_bad_ids(samples, rejects, value):
    """An id outside [0, num_experts) is rejected where the values are on the host (never on the fake: no sync)."""
    kw = samples("moe_metadata")
    ids = kw["flat_experts"].clone()
    ids[4] = value
    rejects(op, kw, ValueError, rf"'flat_experts' must be in \[0, num_experts - 1 = 7\], got flat_experts\[4\] = {value}",
            fake=False, flat_experts=ids)


def test_cute_needs_cuda(samples):
    with pytest.raises(RuntimeError, match=r"dsv41::moe_metadata: impl='cute' needs CUDA tensors"):
        op(**samples("moe_metadata"), impl="cute")
