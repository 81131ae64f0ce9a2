"""dsv41::moe_experts: its reference is bit-exact with the tiny model's MoE on CPU (routing, sort and finalize around
it as the model does them) and agrees, within the op's kernel tolerance, with spec 2.6 written as a loop over rows
(fp32 matmuls per row: another summation order); argument errors name the argument.

Tolerance of the row loop (`compare_kernel`): |diff| <= 2^-6 |want| + 2^-5 rms(want row), except in at most one
row in 16 whose relative L2 distance is within 2^-4 (a flipped FP8 step). A per-row GEMM sums in another order than
_grouped_mm, so g, u and a may round to the neighbouring bf16 and an FP8 step (1/8 relative) of a may flip; a wrong
limit, a missing clamp or a dropped routing weight moves outputs by far more (checked below).
"""

import pytest
import torch

from dsv41.lowerings import ALL_OPS
from dsv41.lowerings.moe_experts import compare_kernel
from dsv41.models import TINY, DSV41Model
from dsv41.models import functional as fn

op = ALL_OPS["moe_experts"]


def spec_rows(x, token, row_weights, offsets, w13, w2, swiglu_limit, quant_block):
    """Spec 2.6 per row m of expert e: fp32 matmuls of the row, bf16 where the model stores."""
    inter = w2.shape[2]
    out = torch.empty(token.shape[0], w2.shape[1], dtype=torch.bfloat16)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        for m in range(start, end):
            gu = (x[token[m]].float() @ w13[e].float().t()).bfloat16().float()
            g, u = gu[:inter].clamp(max=swiglu_limit), gu[inter:].clamp(-swiglu_limit, swiglu_limit)
            a = (torch.nn.functional.silu(g) * u * row_weights[m]).bfloat16()
            if quant_block:
                a = fn.fp8_fake_quant(a, quant_block)
            out[m] = (a.float() @ w2[e].float().t()).bfloat16()
        start = end
    return out


@pytest.mark.parametrize("quant_block", [32, 0])
@pytest.mark.parametrize("seed", range(2))
def test_reference_matches_the_spec_rows(samples, seed, quant_block):
    kw = samples("moe_experts", seed=seed, quant_block=quant_block)
    got = op(**kw, impl="reference")
    assert got.dtype == torch.bfloat16 and got.shape == (kw["token"].shape[0], kw["x"].shape[1])
    assert compare_kernel(got, spec_rows(**kw)) is None
    for wrong in (dict(swiglu_limit=0.5), dict(row_weights=torch.ones_like(kw["row_weights"]))):
        assert compare_kernel(got, spec_rows(**{**kw, **wrong})) is not None, f"the tolerance misses {list(wrong)}"


@pytest.mark.parametrize("quant_block", [32, 0])
def test_w1_w3_apart_are_the_stacked_halves(samples, quant_block):
    """With w3 given (w13 = w1), the reference is the stacked form's on w13 = cat(w1, w3) bit for bit (the same
    products per output column, on the CPU), and within the tolerance of the spec rows; w1 and w3 swapped is not."""
    kw = samples("moe_experts", seed=3, quant_block=quant_block, apart=True)
    w1, w3 = kw["w13"], kw.pop("w3")
    got = op(**kw, w3=w3, impl="reference")
    stacked = {**kw, "w13": torch.cat([w1, w3], 1)}
    assert torch.equal(got, op(**stacked, impl="reference"))
    assert compare_kernel(got, spec_rows(**stacked)) is None
    swapped = {**kw, "w13": torch.cat([w3, w1], 1)}
    assert compare_kernel(got, spec_rows(**swapped)) is not None, "the tolerance misses w1 / w3 swapped"


def test_one_expert_for_all_rows(samples):
    kw = samples("moe_experts", seed=5)
    offsets = torch.full_like(kw["offsets"], kw["token"].shape[0])
    offsets[:3] = 0  # experts 0-2 empty, expert 3 takes every row
    kw["offsets"] = offsets
    assert compare_kernel(op(**kw, impl="reference"), spec_rows(**kw)) is None


@pytest.fixture(scope="module")
def moe_layer():
    torch.manual_seed(0)
    return DSV41Model(TINY, [0], max_batch=8, max_context=128).layers["0"].ffn


@pytest.mark.parametrize("t", [1, 5, 8])
@torch.no_grad()
def test_reference_is_the_models_math(moe_layer, t):
    """MoE.forward with the op in place of its expert GEMMs: bit-exact with the model on fresh inputs."""
    layer, cfg = moe_layer, TINY
    h = (torch.randn(t, cfg.dim, generator=torch.Generator().manual_seed(100 + t))).bfloat16()
    weights, experts = fn.route(h, layer.gate, layer.gate_bias, cfg.n_activated_experts, cfg.route_scale,
                                cfg.gate_temp)
    x = fn.fp8_fake_quant(h)
    flat_e, flat_w = experts.flatten(), weights.flatten()
    order = torch.argsort(flat_e, stable=True)
    token = order // cfg.n_activated_experts
    offsets = torch.cumsum(torch.bincount(flat_e, minlength=cfg.n_routed_experts), 0).to(torch.int32)
    out = op(x, token, flat_w[order], offsets, layer.w13, layer.w2, cfg.swiglu_limit, cfg.fp8_block, impl="reference")
    y = torch.zeros(t, cfg.dim).index_add_(0, token, out.float())
    got = (y + layer.shared_expert(h, x).float()).bfloat16()
    assert torch.equal(got, layer(h))


def _bad_offsets(values):
    return torch.tensor(values, dtype=torch.int32)


BAD = {
    "x dtype": (lambda kw: dict(x=kw["x"].float()), TypeError, r"'x' must be torch.bfloat16, got torch.float32"),
    "x rank": (lambda kw: dict(x=kw["x"][0]), ValueError, r"'x' must be 2-D \[T, D\]"),
    "no tokens": (lambda kw: dict(x=kw["x"][:0]), ValueError, r"'x' must hold at least one token"),
    "token dtype": (lambda kw: dict(token=kw["token"].int()), TypeError, r"'token' must be torch.int64"),
    "row_weights M": (lambda kw: dict(row_weights=kw["row_weights"][:-1]), ValueError,
                      r"'row_weights' must have shape \[M\] = \[18\], got \[17\]"),
    "offsets dtype": (lambda kw: dict(offsets=kw["offsets"].long()), TypeError, r"'offsets' must be torch.int32"),
    "no experts": (lambda kw: dict(offsets=kw["offsets"][:0]), ValueError, r"'offsets' must hold at least one expert"),
    "w2 E": (lambda kw: dict(w2=kw["w2"][:-1]), ValueError, r"'w2' must have shape \[E, D, I\] = \[8, 64, 64\], got \[7, 64, 64\]"),
    "w2 D": (lambda kw: dict(w2=kw["w2"][:, :-1]), ValueError, r"'w2' must have shape \[E, D, I\]"),
    "w13 not 2I": (lambda kw: dict(w13=kw["w13"][:, :-1]), ValueError,
                   r"'w13' must have shape \[E, 2\*I, D\] = \[8, 128, 64\], got \[8, 127, 64\]"),
    "w13 dtype": (lambda kw: dict(w13=kw["w13"].half()), TypeError, r"'w13' must be torch.bfloat16"),
    "w13 stacked beside w3": (lambda kw: dict(w3=kw["w13"][:, :64]), ValueError,
                              r"'w13' must have shape \[E, I, D\] = \[8, 64, 64\], got \[8, 128, 64\]"),
    "w3 I": (lambda kw: dict(w13=kw["w13"][:, :64], w3=kw["w13"][:, 64:-1]), ValueError,
             r"'w3' must have shape \[E, I, D\] = \[8, 64, 64\], got \[8, 63, 64\]"),
    "w3 dtype": (lambda kw: dict(w13=kw["w13"][:, :64], w3=kw["w13"][:, 64:].half()), TypeError,
                 r"'w3' must be torch.bfloat16, got torch.float16"),
    "w3 layout": (lambda kw: dict(w13=kw["w13"][:, :64], w3=torch.cat([kw["w13"][:, 64:]] * 2, 2)[:, :, ::2]),
                  ValueError, r"'w3' must have unit stride in one of its last two dims"),
    "limit": (lambda kw: dict(swiglu_limit=0.0), ValueError, r"'swiglu_limit' must be a finite number > 0, got 0.0"),
    "limit inf": (lambda kw: dict(swiglu_limit=float("inf")), ValueError, r"'swiglu_limit' must be a finite number > 0"),
    "quant_block": (lambda kw: dict(quant_block=-1), ValueError, r"'quant_block' must be >= 0, got -1"),
    "quant_block I": (lambda kw: dict(quant_block=24), ValueError, r"'quant_block' must divide I = 64 \(from 'w2'\), got 24"),
    "impl": (lambda kw: dict(impl="fast"), ValueError, r"'impl' must be one of"),
    "device": (lambda kw: dict(token=kw["token"].to("meta")), ValueError, r"'token' is on meta, expected cpu like 'x'"),
}
VALUE_BAD = {  # value checks: on host tensors only (not on the fake)
    "token range": (lambda kw: dict(token=kw["token"] + 1), r"'token' must be in \[0, T - 1 = 2\], got token\[\d+\] = 3"),
    "offsets range": (lambda kw: dict(offsets=kw["offsets"] + 1), r"'offsets' must be in \[0, M = 18\]"),
    "offsets order": (lambda kw: dict(offsets=_bad_offsets([10, 5, 18, 18, 18, 18, 18, 18])),
                      r"'offsets' must be non-decreasing"),
    "offsets end": (lambda kw: dict(offsets=_bad_offsets([0, 5, 9, 9, 9, 9, 9, 17])),
                    r"'offsets' must end at M = 18 \(every row belongs to an expert\), got offsets\[-1\] = 17"),
}


@pytest.mark.parametrize("change", BAD.values(), ids=BAD.keys())
def test_bad_inputs(samples, rejects, change):
    kw = samples("moe_experts")
    changes, exc, match = change
    # not through the fake where `.to("meta")` undoes the change: the device, a strided view (copied dense)
    fake = not match.startswith(r"'token' is on meta") and "unit stride" not in match
    rejects(op, kw, exc, match, fake=fake, **changes(kw))


@pytest.mark.parametrize("change", VALUE_BAD.values(), ids=VALUE_BAD.keys())
def test_bad_values(samples, rejects, change):
    kw = samples("moe_experts")
    changes, match = change
    rejects(op, kw, ValueError, match, fake=False, **changes(kw))


def test_compare_kernel_bounds_the_flipped_rows():
    """One row moved as a flipped FP8 step moves it (one a element's step times a w2 column) passes; the same in
    too many rows, a larger move or a NaN does not."""
    g = torch.Generator().manual_seed(7)
    want = torch.randn(32, 512, generator=g).bfloat16()
    column = torch.randn(512, generator=g)
    def moved(rows, size):
        got = want.float().clone()
        got[rows] += size * column
        return got.bfloat16()
    assert compare_kernel(want.clone(), want) is None
    assert compare_kernel(moved([3], 0.03), want) is None
    assert compare_kernel(moved([3, 9], 0.03), want) is None  # 32 rows: two may flip
    assert compare_kernel(moved([3, 9, 20], 0.03), want) is not None
    assert compare_kernel(moved([3], 0.2), want) is not None
    nan = want.clone()
    nan[5, 7] = float("nan")
    assert compare_kernel(nan, want) is not None
