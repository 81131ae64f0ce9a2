"""The qkv_norm kernel: q and kv RMSNorms, the KV RoPE tail and FP8 fake-quant in one launch.

CPU: it compiles for sm_90a at Flash sizes (q 1280, kv 512, rd 64, quant_block 32) in every variant (RoPE on/off,
quantisation on/off, both norm roundings, with and without programmatic dependent launch) and at the tiny model's
sizes; `layout`, `supports` and the entry explain what they reject; the op selects the kernel module.
GPU (Hopper), on fresh random inputs, outputs NaN-poisoned before each call and all of them written, for T in
DSV41_TEST_TOKENS (default 1, 2, 3, 8, 16, 31, 64), both norm roundings, with and without cos/sin, quant_block 0 and
32 (and 64):
- the norms alone (no RoPE, no quantisation) match the reference to one bf16 ulp, |got - want| <= 2^-7 |want| +
  1e-5 (KERNEL_RTOL[bf16]: the sum of squares is taken in another order and rsqrt is approximate, so a value near a
  rounding midpoint may round to its neighbour), 2^-6 under "bf16_then_weight" (its two roundings may each take the
  neighbour); at most 1% (or 4) of the elements differ at all (a wrong rounding mode moves about half);
- the RoPE and the FP8 step are exact: with them on, qr is bit-identical to the norms-alone call and kv is
  bit-identical to `fp8_fake_quant(apply_rope_tail(kv_norms_alone, cos, sin))` computed by torch on the GPU (the
  kernel rounds each RoPE product on its own, as torch does, and quantises with the same scale bit pattern). This
  pins the rounding points without a tolerance on the FP8 round trip;
- the whole op against the reference within `lowerings.qkv_norm.compare_kernel` (where a norm output one ulp off
  may move an FP8 element by one e4m3 step: 2^-3 relative);
- a CUDA graph captured once replays it on new inputs bit-identically to direct calls.
"""

import pytest
import torch

from tests.kernels.support import (assert_compiles_fresh, assert_replays_bit_identical, require_cute_dsl,
                                   tokens_from_env)

require_cute_dsl()

from dsv41.kernels import qkv_norm as K  # noqa: E402
from dsv41.lowerings import _kernels  # noqa: E402
from dsv41.lowerings import qkv_norm as L  # noqa: E402
from dsv41.models import FLASH, TINY, functional  # noqa: E402

TOKENS = tokens_from_env("1,2,3,8,16,31,64")
Q_DIM, KV_DIM, RD, QB = FLASH.q_lora_rank, FLASH.head_dim, FLASH.rope_head_dim, FLASH.fp8_block
EPS = FLASH.norm_eps
ROUNDINGS = ("fp32_weight", "bf16_then_weight")
BF16_RTOL, BF16_ATOL = _kernels.KERNEL_RTOL[torch.bfloat16]


def _inputs(t, seed, q_dim=Q_DIM, kv_dim=KV_DIM, rd=RD, rope=True, device="cuda"):
    """qkv ~ 3 N(0, 1) (a wq_a|wkv output: the norm matters), weights near 1, cos/sin of angles in [0, 2 pi)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    qkv = (3 * torch.randn(t, q_dim + kv_dim, generator=g)).bfloat16()
    qw = (1 + 0.1 * torch.randn(q_dim, generator=g)).bfloat16()
    kvw = (1 + 0.1 * torch.randn(kv_dim, generator=g)).bfloat16()
    angle = torch.rand(t, rd // 2, generator=g) * 6.283
    cos, sin = (angle.cos(), angle.sin()) if rope else (None, None)
    return [None if a is None else a.to(device) for a in (qkv, qw, kvw, cos, sin)]


def _poisoned(qkv, q_dim):
    t, width = qkv.shape
    return (torch.full((t, q_dim), float("nan"), dtype=torch.bfloat16, device=qkv.device),
            torch.full((t, width - q_dim), float("nan"), dtype=torch.bfloat16, device=qkv.device))


def _call(args, quant_block, rounding, **kw):
    got = K.qkv_norm(*args, eps=EPS, quant_block=quant_block, norm_rounding=rounding,
                     out=_poisoned(args[0], args[1].shape[0]), **kw)
    for name, o in zip(("qr", "kv"), got):
        assert not o.isnan().any(), f"{name}: elements left unwritten"
    return got


def _assert_close(name, got, want, rtol):
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=BF16_ATOL, msg=lambda m: f"{name}: {m}")
    differing = (got != want).sum().item()
    assert differing <= max(4, 0.01 * got.numel()), f"{name}: {differing} of {got.numel()} elements differ"


def _check(args, quant_block, rounding, **kw):
    """The three checks of the module docstring for one input set, with RoPE when args has cos/sin."""
    qkv, qw, kvw, cos, sin = args
    rtol = BF16_RTOL if rounding == "fp32_weight" else 2 * BF16_RTOL
    # the norms alone against the reference
    qr0, kv0 = _call([qkv, qw, kvw, None, None], 0, rounding, **kw)
    want_q, want_kv0 = L.reference(qkv, qw, kvw, None, None, EPS, 0, rounding)
    _assert_close("qr", qr0, want_q, rtol)
    _assert_close("kv (norm)", kv0, want_kv0, rtol)
    # RoPE and FP8 on top: exact on the kernel's own norm output
    qr, kv = _call(args, quant_block, rounding, **kw)
    assert torch.equal(qr, qr0), "qr depends on the kv options"
    chain = kv0 if cos is None else functional.apply_rope_tail(kv0, cos, sin)
    if quant_block:
        chain = functional.fp8_fake_quant(chain, quant_block)
    if not torch.equal(kv, chain):
        bad = (kv != chain).nonzero()
        raise AssertionError(f"kv: {len(bad)} elements differ from the RoPE/FP8 chain on the kernel's norm output, "
                             f"first at {bad[0].tolist()}: {kv[tuple(bad[0])].item()} vs {chain[tuple(bad[0])].item()}")
    # the whole op against the reference
    mismatch = L.compare_kernel((qr, kv), L.reference(qkv, qw, kvw, cos, sin, EPS, quant_block, rounding))
    assert mismatch is None, mismatch


FLASH_VARIANTS = [(rd, qb, rounding, pdl) for rd in (RD, 0) for qb in (QB, 0) for rounding in ROUNDINGS
                  for pdl in (True, False) if pdl or (rd, qb, rounding) == (RD, QB, "fp32_weight")]


@pytest.mark.parametrize(("rd", "quant_block", "rounding", "pdl"), FLASH_VARIANTS,
                         ids=lambda v: str(v))
def test_compiles_for_sm90a(rd, quant_block, rounding, pdl, monkeypatch, tmp_path):
    assert_compiles_fresh(monkeypatch, tmp_path, K._compile_qkv_norm, (Q_DIM, KV_DIM, rd, quant_block, rounding, pdl),
                          K.compile_for)


@pytest.mark.parametrize(("q_dim", "kv_dim", "rd", "quant_block"),
                         [(TINY.q_lora_rank, TINY.head_dim, TINY.rope_head_dim, TINY.fp8_block), (32, 64, 16, 32),
                          (Q_DIM, KV_DIM, RD, 64)])
def test_other_sizes_compile(q_dim, kv_dim, rd, quant_block, monkeypatch, tmp_path):
    assert_compiles_fresh(monkeypatch, tmp_path, K._compile_qkv_norm,
                          (q_dim, kv_dim, rd, quant_block, "fp32_weight", True), K.compile_for)


def test_layout():
    assert K.layout(1280, 512, 64, 32) == (8, 224)  # 7 warps of 16-byte vectors
    assert K.layout(1280, 512, 0, 0) == (8, 224)
    assert K.layout(64, 64, 16, 32) == (8, 16)  # the tiny model: half a warp
    assert K.layout(32, 64, 16, 32) == (8, 12)
    assert K.layout(36, 60, 4, 0) == (4, 24)
    assert K.layout(34, 62, 2, 0) == (2, 48)
    assert "have no common vector width" in K.layout(33, 63, 0, 0)
    assert "must divide q_dim = 1000" in K.layout(1000, 512, 64, 32)
    assert "must divide kv_dim = 512" in K.layout(1280, 512, 64, 48)
    assert "spans 64 threads of 8 columns" in K.layout(1024, 512, 64, 512)
    assert "spans 3 threads" in K.layout(1536, 384, 0, 24)
    assert "more than one CTA holds" in K.layout(8192, 512, 64, 32)
    assert "rd must be even" in K.layout(1280, 512, 1024, 32)
    with pytest.raises(ValueError, match="qkv_norm: quant_block = 48 must divide kv_dim = 512"):
        K.compile_for(1280, 512, 64, 48)
    with pytest.raises(ValueError, match="norm_rounding must be one of"):
        K.compile_for(1280, 512, 64, 32, "bf16")


def test_supports_explains():
    args = _inputs(2, 0, device="cpu")
    kw = dict(eps=EPS, quant_block=QB)
    assert K.supports(*args, **kw) == "qkv is not a CUDA tensor"
    qkv, qw, kvw, cos, sin = args
    assert K.supports(qkv, qw, kvw, None, None, **kw) == "qkv is not a CUDA tensor"
    assert "norm_rounding must be one of" in K.supports(*args, **kw, norm_rounding="bf16")
    assert "qkv must have shape [2, 1792], got [2, 1791]" in K.supports(qkv[:, :-1], qw, kvw, cos, sin, **kw)
    assert "q_weight must be torch.bfloat16" in K.supports(qkv, qw.float(), kvw, cos, sin, **kw)
    assert "sin must have shape [2, 32], got [2, 31]" in K.supports(qkv, qw, kvw, cos, sin[:, :31], **kw)
    assert "cos must be torch.float32" in K.supports(qkv, qw, kvw, cos.double(), sin, **kw)
    assert "both be tensors or both be None" in K.supports(qkv, qw, kvw, cos, None, **kw)
    assert "must divide kv_dim = 512" in K.supports(*args, eps=EPS, quant_block=48)
    assert "must be >= 0" in K.supports(*args, eps=EPS, quant_block=-1)
    with pytest.raises(ValueError, match="qkv_norm: kv_weight must be torch.bfloat16"):
        K.qkv_norm(qkv, qw, kvw.float(), cos, sin, **kw)


def test_the_op_selects_the_kernel_module():
    module, error = _kernels.load("qkv_norm")
    assert module is K and error is None
    args = _inputs(2, 0, device="cpu")
    kw = dict(eps=EPS, quant_block=QB, norm_rounding="fp32_weight")
    assert _kernels.choose("qkv_norm", "qkv_norm", "auto", torch.device("cpu"), tuple(args), kw) is None
    with pytest.raises(RuntimeError, match=r"dsv41::qkv_norm: impl='cute' needs CUDA tensors"):
        torch.ops.dsv41.qkv_norm(*args, EPS, QB, impl="cute")
    from dsv41.passes.lower_references import KERNEL_OF
    assert KERNEL_OF["qkv_norm"] == "qkv_norm"  # inductor mode keeps the op a call on CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "no_rope"])
@pytest.mark.parametrize("quant_block", [QB, 0], ids=lambda q: f"qb{q}")
@pytest.mark.parametrize("t", TOKENS, ids=lambda t: f"T{t}")
def test_matches_reference(t, quant_block, rope, rounding):
    for seed in range(2):
        _check(_inputs(t, seed, rope=rope), quant_block, rounding)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 31])
def test_other_block_sizes_and_without_pdl(t):
    args = _inputs(t, 5)
    _check(args, 64, "fp32_weight")
    _check(args, QB, "fp32_weight", pdl=False)


@pytest.mark.gpu
@pytest.mark.parametrize(("q_dim", "kv_dim", "rd"), [(TINY.q_lora_rank, TINY.head_dim, TINY.rope_head_dim),
                                                     (32, 64, 16)])
def test_small_sizes(q_dim, kv_dim, rd):
    """Part warps: the tiny model's 16 threads, and a warp holding both the q and the kv threads."""
    for t in (1, 5):
        _check(_inputs(t, 3, q_dim, kv_dim, rd), 32, "fp32_weight")


@pytest.mark.gpu
def test_strided_cos_sin_and_the_op():
    """cos and sin as the halves of a complex table (strided views): the entry copies them; the op under
    impl='auto' and 'cute' runs the kernel and agrees with impl='reference' by compare_kernel."""
    qkv, qw, kvw, cos, sin = _inputs(8, 4)
    halves = torch.view_as_real(torch.polar(torch.ones_like(cos), torch.atan2(sin, cos)))
    got = K.qkv_norm(qkv, qw, kvw, halves[..., 0], halves[..., 1], eps=EPS, quant_block=QB)
    want = K.qkv_norm(qkv, qw, kvw, halves[..., 0].contiguous(), halves[..., 1].contiguous(), eps=EPS, quant_block=QB)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    ref = torch.ops.dsv41.qkv_norm(qkv, qw, kvw, cos, sin, EPS, QB, impl="reference")
    for impl in ("auto", "cute"):
        with _kernels.checking() as calls:
            out = torch.ops.dsv41.qkv_norm(qkv, qw, kvw, cos, sin, EPS, QB, impl=impl)
        assert [(c.kernel, c.mismatch) for c in calls] == [("qkv_norm", None)], calls
        assert L.compare_kernel(out, ref) is None


@pytest.mark.gpu
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "no_rope"])
def test_cuda_graph_replay(rope):
    """Captured once, replayed 500 times round robin over 4 input sets: the two outputs, views of one flat buffer
    (poisoned before each replay), equal the direct calls' bit for bit."""
    t = 16
    static = _inputs(t, 0, rope=rope)
    flat = torch.empty(t * (Q_DIM + KV_DIM), dtype=torch.bfloat16, device="cuda")
    outs = (flat[:t * Q_DIM].view(t, Q_DIM), flat[t * Q_DIM:].view(t, KV_DIM))
    sets = [_inputs(t, seed, rope=rope) for seed in range(1, 5)]
    direct = [torch.cat([o.flatten() for o in K.qkv_norm(*s, eps=EPS, quant_block=QB)]) for s in sets]
    assert_replays_bit_identical(lambda: K.qkv_norm(*static, eps=EPS, quant_block=QB, out=outs), static, sets, flat,
                                 direct)
