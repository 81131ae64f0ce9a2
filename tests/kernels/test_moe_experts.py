"""The routed-experts kernel (dsv41.kernels.moe_experts).

CPU: both launches compile for sm_90a (Flash sizes with and without the FP8 fake quantisation and programmatic
dependent launch, the tiny model's sizes, a GEMM2 of 16 chunks a warp, GEMM1 with w1 and w3 held apart); `supports`
and the entry explain what they reject.
GPU (H200), against the op's reference (`dsv41.lowerings.moe_experts.reference`: the model's torch._grouped_mm path)
on the same inputs, outputs poisoned with NaN before each call, compared by the op's `compare_kernel` (|diff| <= 2^-6
|want| + 2^-5 rms(want row), but for at most one row in 16 within 2^-4 relative L2: the GEMMs sum in another order,
so a bf16 rounding of g, u or a and then an FP8 step of a may differ). T in DSV41_TEST_TOKENS (default
1,2,3,5,8,16,31,64) at three small shapes: D=128 I=64 (the tiny model), D=512 I=1536 (GEMM2: 6 chunks a warp in two
load groups of 3), D=256 I=4096 (GEMM2: 16 chunks a warp in four groups of 4), with the model's SwiGLU limit
and a limit of 0.75 that clamps often; the Flash sizes D=5120 I=2304 (E=16) at T = 1, 8, 64 (one pass of 6 experts,
48 rows over 8 experts, 384 rows: about 48 an expert, 6 passes); routings with experts that get no rows and with
every token on one expert; without the quantisation and PDL (bit-identical to the PDL launches); 500 CUDA-graph
replays alternating two input sets (different x and routings) bit-identical to direct calls, PDL edges included; the
op with impl="cute" is the entry; experts whose weights lie past 2^31 elements at Flash sizes (E = 384). With w1
and w3 held apart (contiguous copies of w13's halves; the small shapes at every T, Flash sizes at T = 1 and 8, past
2^31 elements, the graph replays, the op): the output is the stacked launch's bit for bit, since only the addresses
of the gate and up rows differ. Weights are
drawn on the device: the file's former > 300 s went to CPU draws of Flash-size weights at E = 64 (2.3e9 elements,
about 9 ns each on one core here: ~20 s a draw, 64+ draws). When CUDA is present these tests fail (never skip) if the
kernel cannot run.
"""


import pytest
import torch

from tests.kernels.support import assert_replays_bit_identical, require_cute_dsl, tokens_from_env

require_cute_dsl()

from dsv41.kernels import moe_experts as K  # noqa: E402
from dsv41.lowerings import moe_experts as op_module  # noqa: E402

TOKENS = tokens_from_env("1,2,3,5,8,16,31,64")
SMALL = [(128, 64, 16), (512, 1536, 16), (256, 4096, 16)]  # (D, I, E)
FLASH = (5120, 2304, 16)
TOPK, LIMIT, BLOCK = 6, 10.0, 32


def _routing(t, e, g, one_expert=False):
    """token [M], offsets [E] of a routing as the model sorts it: each token picks TOPK distinct experts among the
    first e // 2 (so half the experts get no rows), or all pick the same expert (one_expert)."""
    if one_expert:
        experts = torch.full((t, TOPK), e - 1)
    else:
        experts = torch.stack([torch.randperm(e // 2, generator=g)[:TOPK] for _ in range(t)])
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    return order // TOPK, torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)


def _weights(d, inter, e, seed, device):
    """w13 [E, 2I, D], w2 [E, D, I] bf16, drawn on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.empty(e, 2 * inter, d, device=device).normal_(0, d**-0.5, generator=g).bfloat16()
    w2 = torch.empty(e, d, inter, device=device).normal_(0, inter**-0.5, generator=g).bfloat16()
    return w13, w2


def _inputs(t, d, inter, e, seed, one_expert=False, device="cuda", weights=None):
    """x, token, row_weights, offsets (from ``seed``) and the weights (``weights``, else drawn from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    token, offsets = _routing(t, e, g, one_expert)
    m = token.shape[0]
    x = torch.randn(t, d, generator=g).bfloat16()
    row_weights = 0.5 * torch.rand(m, generator=g)
    w13, w2 = weights if weights is not None else _weights(d, inter, e, seed, device)
    return [a.to(device) for a in (x, token, row_weights, offsets)] + [w13, w2]


def _apart(inputs):
    """The inputs with w1 and w3 held apart: (inputs with w13 replaced by w1 [E, I, D], w3 [E, I, D]), contiguous
    copies of w13's halves."""
    *rows, w13, w2 = inputs
    inter = w2.shape[2]
    return [*rows, w13[:, :inter].contiguous(), w2], w13[:, inter:].contiguous()


def _run(inputs, limit=LIMIT, quant_block=BLOCK, **kw):
    """The kernel's output into an out poisoned with NaN."""
    m, d = inputs[1].shape[0], inputs[0].shape[1]
    out = torch.full((m, d), float("nan"), dtype=torch.bfloat16, device=inputs[0].device)
    return K.moe_experts(*inputs, swiglu_limit=limit, quant_block=quant_block, out=out, **kw)


def _assert_matches(got, inputs, limit=LIMIT, quant_block=BLOCK, w3=None):
    """Every row written, and within the op's compare_kernel of its reference."""
    assert not got.isnan().any(), "rows left unwritten"
    want = op_module.reference(*inputs, limit, quant_block, w3=w3)
    mismatch = op_module.compare_kernel(got, want)
    assert mismatch is None, mismatch


@pytest.mark.parametrize("config", [(5120, 2304, 384, 32, True, False), (5120, 2304, 384, 0, False, False),
                                    (128, 64, 16, 32, True, False), (256, 4096, 16, 32, True, False),
                                    (5120, 2304, 384, 32, True, True), (128, 64, 16, 0, False, True)],
                         ids=lambda c: "D{}-I{}-E{}-q{}-pdl{}-split{}".format(*c))
def test_compiles_for_sm90a(config, monkeypatch, tmp_path):
    """Both launches compile (split: GEMM1 with w1 and w3 apart) and land in a fresh cache under their keys."""
    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path))  # a fresh cache: really run cute.compile
    K._compile_moe_experts.cache_clear()
    d, inter, e, quant_block, pdl, split = config
    assert all(callable(f) for f in K.compile_for(d, inter, e, quant_block, pdl, split=split))
    assert K._compile_moe_experts.object_path(d, inter, e, True, split, False, pdl).exists()
    assert K._compile_moe_experts.object_path(inter, d, e, False, False, quant_block == 32, pdl).exists()
    assert len(list(tmp_path.rglob("*.o"))) == 2
    K._compile_moe_experts.cache_clear()


def test_supports_explains():
    x, token, w, offsets, w13, w2 = _inputs(2, 128, 64, 16, 0, device="cpu")
    kw = dict(swiglu_limit=LIMIT, quant_block=BLOCK)
    assert K.supports(x, token, w, offsets, w13, w2, **kw) == "x is not a CUDA tensor"
    assert "x must be torch.bfloat16" in K.supports(x.float(), token, w, offsets, w13, w2, **kw)
    assert "token must be torch.int64" in K.supports(x, token.int(), w, offsets, w13, w2, **kw)
    assert "row_weights must have shape [12]" in K.supports(x, token, w[:-1], offsets, w13, w2, **kw)
    assert "offsets must be torch.int32" in K.supports(x, token, w, offsets.long(), w13, w2, **kw)
    assert "w13 must have shape [16, 128, 128]" in K.supports(x, token, w, offsets, w13[:, :-1], w2, **kw)
    assert "D and I must be multiples of 32, got D = 128, I = 48" in K.supports(
        x, token, w, offsets, w13[:, :96], w2[:, :, :48], **kw)
    assert "quant_block must be 0 or 32, got 16" in K.supports(x, token, w, offsets, w13, w2,
                                                               **{**kw, "quant_block": 16})
    big = torch.zeros(385, dtype=torch.int64)
    assert "M = 385 rows, the kernel takes 1 to 384" in K.supports(x, big, torch.zeros(385), offsets, w13, w2, **kw)
    assert "must be 2-D, 1-D and 3-D" in K.supports(x[0], token, w, offsets, w13, w2, **kw)
    w1, w3 = w13[:, :64], w13[:, 64:]
    assert K.supports(x, token, w, offsets, w1, w2, **kw, w3=w3) == "x is not a CUDA tensor"
    assert "w13 must have shape [16, 64, 128]" in K.supports(x, token, w, offsets, w13, w2, **kw, w3=w3)
    assert "w3 must have shape [16, 64, 128]" in K.supports(x, token, w, offsets, w1, w2, **kw, w3=w13)
    assert "w3 must be torch.bfloat16" in K.supports(x, token, w, offsets, w1, w2, **kw, w3=w3.half())
    with pytest.raises(ValueError, match="moe_experts: row_weights must have shape"):
        K.moe_experts(x, token, w[:-1], offsets, w13, w2, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("limit", [LIMIT, 0.75], ids=lambda v: f"limit{v}")
@pytest.mark.parametrize("shape", SMALL, ids=lambda s: "D{}-I{}-E{}".format(*s))
@pytest.mark.parametrize("t", TOKENS, ids=lambda t: f"T{t}")
def test_matches_reference(t, shape, limit):
    for seed in range(2):
        inputs = _inputs(t, *shape, seed)
        _assert_matches(_run(inputs, limit), inputs, limit)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64], ids=lambda t: f"T{t}")
def test_flash_sizes(t):
    inputs = _inputs(t, *FLASH, 5)
    _assert_matches(_run(inputs), inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, t", [(s, t) for s in SMALL for t in (1, 8, 64)] + [(FLASH, 64)],
                         ids=lambda v: f"T{v}" if isinstance(v, int) else "D{}-I{}-E{}".format(*v))
def test_every_token_on_one_expert(shape, t):
    """All rows on the last expert (at T = 64: 384 rows, 48 passes over the CTA's weight slice)."""
    inputs = _inputs(t, *shape, 3, one_expert=True)
    _assert_matches(_run(inputs), inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [SMALL[1], SMALL[2], FLASH], ids=lambda s: "D{}-I{}-E{}".format(*s))
@pytest.mark.parametrize("t", [1, 16], ids=lambda t: f"T{t}")
def test_without_quantisation_and_pdl(t, shape):
    """Plain stream-ordered launches give the PDL launches' results bit for bit (and match without the FP8 step)."""
    inputs = _inputs(t, *shape, 4)
    _assert_matches(_run(inputs, quant_block=0, pdl=False), inputs, quant_block=0)
    assert torch.equal(_run(inputs, pdl=False), _run(inputs, pdl=True)), "PDL changed the result"


@pytest.mark.gpu
@pytest.mark.parametrize("shape, t", [(s, t) for s in SMALL for t in TOKENS] + [(FLASH, 1), (FLASH, 8)],
                         ids=lambda v: f"T{v}" if isinstance(v, int) else "D{}-I{}-E{}".format(*v))
def test_w1_w3_apart(shape, t):
    """w1 and w3 held apart (GEMM1 reads its gate and up rows from two tensors): within the tolerance of the
    reference's form with w3, and bit-identical to the stacked w13 launch (the same math in the same order, only
    the addresses differ), every row written (out poisoned with NaN)."""
    for seed in range(2):
        stacked = _inputs(t, *shape, 20 + seed)
        apart, w3 = _apart(stacked)
        got = _run(apart, w3=w3)
        _assert_matches(got, apart, w3=w3)
        assert torch.equal(got, _run(stacked)), "w1 / w3 apart differ from the stacked w13"


@pytest.mark.gpu
@pytest.mark.parametrize("apart", [False, True], ids=["stacked", "apart"])
def test_experts_past_2_pow_31_elements(apart):
    """At Flash sizes (E = 384) w13 has 9.1e9 elements: the experts whose weights lie past 2^31 elements (e >= 92)
    are read from the right place (the kernel offsets each expert's slice in 64 bits). Apart, w1 and w3 have 4.5e9
    elements each (past 2^31 from e = 183): bit-identical to the stacked launch."""
    d, inter, e, t = 5120, 2304, 384, 4
    g = torch.Generator(device="cuda").manual_seed(13)
    experts = torch.tensor([[383, 183, 182, 92, 91, 0]] * t)  # both sides of 2^31 / (2I * D) = 91.02 and of 182.04
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    token = (order // TOPK).cuda()
    offsets = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32).cuda()
    x = torch.randn(t, d, generator=g, device="cuda").bfloat16()
    row_weights = 0.5 * torch.rand(token.shape[0], generator=g, device="cuda")
    w13 = torch.empty(e, 2 * inter, d, dtype=torch.bfloat16, device="cuda").normal_(0, d**-0.5, generator=g)
    w2 = torch.empty(e, d, inter, dtype=torch.bfloat16, device="cuda").normal_(0, inter**-0.5, generator=g)
    inputs = [x, token, row_weights, offsets, w13, w2]
    got = _run(inputs)
    _assert_matches(got, inputs)
    if apart:
        split, w3 = _apart(inputs)
        assert torch.equal(_run(split, w3=w3), got), "w1 / w3 apart differ from the stacked w13"
        del split, w3
    del w13, w2, inputs
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("apart", [False, True], ids=["stacked", "apart"])
@pytest.mark.parametrize("shape, t", [(SMALL[1], 16), (FLASH, 5)], ids=["D512-I1536-T16", "flash-T5"])
def test_cuda_graph_replay(shape, t, apart):
    """500 replays alternating two input sets (different x and routings; the weights shared, w13 or w1 and w3
    apart) are bit-identical to direct calls; both GEMMs are PDL launches, so the graph holds a programmatic edge."""
    weights, w3 = _weights(*shape, 9, "cuda"), None
    sets = [_inputs(t, *shape, seed, weights=weights) for seed in (10, 11)]
    if apart:
        split, w3 = _apart(sets[0])
        weights = split[4:]
        sets = [[*s[:4], *weights] for s in sets]
    direct = [_run(s, w3=w3) for s in sets]
    for out, s in zip(direct, sets, strict=True):
        assert torch.equal(out, _run(s, w3=w3)), "direct calls are not deterministic"
        _assert_matches(out, s, w3=w3)
    assert not torch.equal(sets[0][3], sets[1][3]), "the two input sets should route differently"
    static = [x.clone() for x in sets[0][:4]] + list(weights)
    out = torch.empty_like(direct[0])
    assert_replays_bit_identical(lambda: K.moe_experts(*static, swiglu_limit=LIMIT, quant_block=BLOCK, w3=w3, out=out),
                                 [*static[:4], None, None], sets, out, direct)  # the weights are shared, not copied


@pytest.mark.gpu
def test_op_runs_the_kernel():
    """dsv41::moe_experts with impl="cute" (and "auto" on Hopper) calls this kernel: bit-identical to the entry."""
    import dsv41.lowerings  # noqa: F401  (registers the ops)

    inputs = _inputs(4, *FLASH, 12)
    apart, w3 = _apart(inputs)
    want = K.moe_experts(*inputs, swiglu_limit=LIMIT, quant_block=BLOCK)
    for impl in ("cute", "auto"):
        assert torch.equal(torch.ops.dsv41.moe_experts(*inputs, LIMIT, BLOCK, impl=impl), want), impl
        assert torch.equal(torch.ops.dsv41.moe_experts(*apart, LIMIT, BLOCK, w3, impl=impl), want), f"{impl}, apart"
