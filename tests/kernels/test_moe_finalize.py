"""The combine kernel (dsv41.kernels.moe_finalize).

CPU: it compiles for sm_90a (Flash's D=5120 with and without weights and shared, with and without programmatic
dependent launch; D=32); `supports` and the entry explain what they reject; the reference's CPU index_add_ adds each
token's rows in row order from +0.0 (the kernel's order, checked against an explicit loop), which is why the GPU
tests can ask for equal bits.
GPU (H200), against the op's reference (`dsv41.lowerings.moe_finalize.reference`) run on the CPU on the same inputs,
outputs poisoned with NaN before each call, compared bit for bit:
- T in DSV41_TEST_TOKENS (default 1,2,3,5,8,16,31,64) at D=5120 k=6 (rows in a routing's expert-sorted order) and
  D=1032 k=2 (a partial last column block), with and without weights and shared (bf16 or fp32 out);
- tokens with no rows (y = shared, or 0) and every row on one token (M = 384), rows holding inf and NaN;
- 500 CUDA-graph replays alternating two input sets (different rows, routings, weights) bit-identical to direct calls;
- the op with impl="cute" and "auto" is the entry, weights included; "auto" falls back where `supports` declines.
When CUDA is present these tests fail (never skip) if the kernel cannot run.
"""

import pytest
import torch

from tests.kernels.support import (assert_compiles_fresh, assert_replays_bit_identical, require_cute_dsl,
                                   tokens_from_env)

require_cute_dsl()

from dsv41.kernels import moe_finalize as K  # noqa: E402
from dsv41.lowerings.moe_finalize import reference  # noqa: E402

TOKENS = tokens_from_env("1,2,3,5,8,16,31,64")
SHAPES = [(5120, 6), (1032, 2)]  # (D, k)
FORMS = [(True, False), (False, True), (True, True), (False, False)]  # (weighted, with shared)


def _inputs(t, d, k, seed, weighted=True, with_shared=True, one_token=False, device="cuda"):
    """expert_out [T * k, D], token [T * k] (a routing's expert-sorted order over 64 experts, or every row on the last
    token), shared [T, D] or None, weights [T * k] or None."""
    g = torch.Generator().manual_seed(seed)
    m = t * k
    if one_token:
        token = torch.full((m,), t - 1)
    else:
        experts = torch.stack([torch.randperm(64, generator=g)[:k] for _ in range(t)]).flatten()
        token = torch.argsort(experts, stable=True) // k
    rows = torch.randn(m, d, generator=g).bfloat16()
    shared = torch.randn(t, d, generator=g).bfloat16() if with_shared else None
    weights = torch.rand(m, generator=g) if weighted else None
    return [None if a is None else a.to(device) for a in (rows, token, shared, weights)]


def _run(rows, token, shared, weights, num_tokens, **kw):
    dtype = torch.float32 if shared is None else torch.bfloat16
    out = torch.full((num_tokens, rows.shape[1]), float("nan"), dtype=dtype, device=rows.device)
    return K.moe_finalize(rows, token, shared, num_tokens=num_tokens, weights=weights, out=out, **kw)


def _assert_bits(rows, token, shared, weights, num_tokens, **kw):
    got = _run(rows, token, shared, weights, num_tokens, **kw)
    cpu = [None if a is None else a.cpu() for a in (rows, token, shared, weights)]
    want = reference(*cpu[:3], num_tokens, weights=cpu[3])
    assert got.dtype == want.dtype and got.shape == want.shape
    same = (got.cpu() == want) | (got.cpu().isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {want.numel()} entries differ from the CPU reference"
    return got


@pytest.mark.parametrize("config", [(5120, True, True, True), (5120, False, True, True), (5120, True, False, True),
                                    (5120, False, False, False), (32, True, True, True)],
                         ids=lambda c: "D{}-w{}-shared{}-pdl{}".format(*c))
def test_compiles_for_sm90a(config, monkeypatch, tmp_path):
    assert_compiles_fresh(monkeypatch, tmp_path, K._compile_moe_finalize, config, K.compile_for)


@pytest.mark.parametrize("weighted", [True, False])
def test_cpu_reference_adds_in_row_order(weighted):
    """index_add_ on the CPU: y[t] = ((0 + r(m_1)) + r(m_2)) + ... over t's rows in ascending m, the kernel's order."""
    rows, token, shared, weights = _inputs(16, 64, 6, 1, weighted=weighted, device="cpu")
    rows = rows * torch.logspace(-6, 6, rows.shape[0]).bfloat16()[:, None]  # row magnitudes that make the order matter
    want = torch.zeros(16, 64)
    for m in range(token.shape[0]):
        r = rows[m].float() if weights is None else rows[m].float() * weights[m]
        want[token[m]] = want[token[m]] + r
    assert torch.equal(reference(rows, token, None, 16, weights=weights), want)
    assert torch.equal(reference(rows, token, shared, 16, weights=weights), (want + shared.float()).bfloat16())


def test_supports_explains():
    rows, token, shared, weights = _inputs(2, 64, 6, 0, device="cpu")
    kw = dict(num_tokens=2, weights=weights)
    assert K.supports(rows, token, shared, **kw) == "expert_out is not a CUDA tensor"
    assert "expert_out must be torch.bfloat16" in K.supports(rows.float(), token, shared, **kw)
    assert "token must be torch.int64" in K.supports(rows, token.int(), shared, **kw)
    assert "shared must have shape [2, 64], got [1, 64]" in K.supports(rows, token, shared[:1], **kw)
    assert "weights must be torch.float32" in K.supports(rows, token, shared, num_tokens=2, weights=weights.double())
    assert "expert_out and token must be 2-D and 1-D" in K.supports(rows[0], token, shared, **kw)
    assert "D must be a positive multiple of 8 (16-byte rows), got 60" in K.supports(
        rows[:, :60], token, shared[:, :60], **kw)
    assert "M = 0 rows, the kernel takes 1 to 4096" in K.supports(rows[:0], token[:0], shared, num_tokens=2)
    assert "num_tokens must be >= 1, got 0" in K.supports(rows, token, None, num_tokens=0, weights=weights)
    with pytest.raises(ValueError, match="moe_finalize: token must be torch.int64"):
        K.moe_finalize(rows, token.int(), shared, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS, ids=lambda f: "w{}-shared{}".format(*f))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "D{}-k{}".format(*s))
@pytest.mark.parametrize("t", TOKENS, ids=lambda t: f"T{t}")
def test_matches_reference(t, shape, form):
    for seed in range(2):
        inputs = _inputs(t, *shape, seed, *form)
        _assert_bits(*inputs, t)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS, ids=lambda f: "w{}-shared{}".format(*f))
def test_tokens_without_rows_and_one_token_with_all(form):
    """T = 64 with every one of the 384 rows on token 63: tokens 0..62 get shared (or 0), token 63 the sum of 384."""
    rows, token, shared, weights = _inputs(64, 5120, 6, 2, *form, one_token=True)
    _assert_bits(rows, token, shared, weights, 64)
    # num_tokens above every token value: tokens 64..69 have no rows
    more = None if shared is None else torch.cat([shared, torch.randn(6, 5120, device="cuda").bfloat16()])
    _assert_bits(rows, token, more, weights, 70)


@pytest.mark.gpu
def test_inf_and_nan_rows():
    rows, token, shared, weights = _inputs(8, 1032, 6, 3)
    rows[3, 5], rows[10, 7], rows[11, 900] = float("inf"), float("-inf"), float("nan")
    _assert_bits(rows, token, shared, weights, 8)
    _assert_bits(rows, token, None, None, 8)


@pytest.mark.gpu
def test_without_pdl():
    inputs = _inputs(16, 5120, 6, 4)
    assert torch.equal(_assert_bits(*inputs, 16, pdl=False), _run(*inputs, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("form", [(True, True), (False, False)], ids=lambda f: "w{}-shared{}".format(*f))
def test_cuda_graph_replay(form):
    """500 replays alternating two input sets (different rows, routings and weights) are bit-identical to direct
    calls."""
    t = 16
    sets = [_inputs(t, 5120, 6, seed, *form) for seed in (10, 11)]
    direct = [_assert_bits(*s, t) for s in sets]
    assert not torch.equal(sets[0][1], sets[1][1]), "the two input sets should route differently"
    static = [None if a is None else a.clone() for a in sets[0]]
    out = torch.empty_like(direct[0])
    assert_replays_bit_identical(lambda: K.moe_finalize(*static[:3], num_tokens=t, weights=static[3], out=out),
                                 static, sets, out, direct)


@pytest.mark.gpu
def test_op_runs_the_kernel():
    """dsv41::moe_finalize with impl="cute" (and "auto" on Hopper) calls this kernel, weights included; where
    `supports` declines (D = 60), "auto" runs the reference and "cute" says why."""
    import dsv41.lowerings  # noqa: F401  (registers the ops)
    from dsv41.lowerings._kernels import compare

    rows, token, shared, weights = _inputs(4, 5120, 6, 12)
    want = K.moe_finalize(rows, token, shared, num_tokens=4, weights=weights)
    for impl in ("cute", "auto"):
        assert torch.equal(torch.ops.dsv41.moe_finalize(rows, token, shared, 4, weights, impl), want), impl
    odd = rows[:, :60].contiguous(), token, shared[:, :60].contiguous()
    # the reference on CUDA adds by atomics, in any order: compared as the kernel checks compare
    assert compare(torch.ops.dsv41.moe_finalize(*odd, 4, weights, "auto"), reference(*odd, 4, weights=weights)) is None
    with pytest.raises(RuntimeError, match="D must be a positive multiple of 8"):
        torch.ops.dsv41.moe_finalize(*odd, 4, weights, "cute")


def test_bench_entry():
    """`dsv41 bench kernels --op moe_finalize`: T * k rows in a routing's expert-sorted order (each token k rows), the
    floor's bytes, and the eager variant is the op's reference with shared."""
    from dsv41.models import FLASH
    from dsv41.tools.bench_kernels import OPS

    op = OPS["moe_finalize"](FLASH)
    rows, token, shared = op.make_inputs(8, torch.Generator().manual_seed(0))
    assert rows.shape == (48, 5120) and shared.shape == (8, 5120) and rows.dtype == shared.dtype == torch.bfloat16
    assert torch.equal(torch.bincount(token, minlength=8), torch.full((8,), 6))
    assert op.nbytes(8) == 48 * (5120 * 2 + 8) + 2 * 8 * 5120 * 2
    assert torch.equal(op.reference(rows, token, shared), reference(rows, token, shared, 8))
