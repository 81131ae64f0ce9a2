"""The agreement check of `dsv41.models.agreement` passes a correct compile, survives rounding noise, and catches
planted bugs.

Set-up: the 8-layer TINY model (batch 3) compiled once through the backend in `fx` mode, where every fused op is
called at run time, so a bug planted in an op's reference or in the kernel selection (monkeypatched for one test)
takes effect without recompiling. Each planted bug is a mistake a kernel or a pass could make: a wrong eps (1e-6,
V4's, for V4.1's 1e-20), q_norm and kv_norm weights swapped (equal shapes in TINY), one Sinkhorn iteration too few,
an off-by-one offset of the selected compressed rows past the window, a wrong eps in the mHC post+pre norm. Each must
fail the check, with the tier that catches it recorded; the correct compile must pass on fresh weights and inputs.
"""

from __future__ import annotations

import statistics

import pytest
import torch

import dsv41.models.model as model_module
from dsv41.backend import make_backend
from dsv41.lowerings import _kernels, indexer_topk, mhc_coeffs, mhc_post_pre, qkv_norm
from dsv41.models import TINY, DSV41Model, agreement
from dsv41.models.config import FLASH

BATCH = 3


@pytest.fixture(scope="module")
def compiled():
    seed = int(torch.randint(0, 2**31, ()))  # fresh weights every run; the seed is in the failure message
    model = DSV41Model(TINY, max_batch=BATCH, max_context=256, seed=seed)
    torch._dynamo.reset()
    backend = make_backend(mode="fx")
    step = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    tokens = torch.randint(0, TINY.vocab_size, (BATCH,))
    with torch.no_grad():
        step(tokens, agreement.check_positions(TINY, BATCH, model.max_context, tokens.device))
    assert backend.reports[-1].fallback is None
    yield model, step, seed
    torch._dynamo.reset()


def _check(compiled):
    model, step, seed = compiled
    tokens = torch.randint(0, TINY.vocab_size, (BATCH,))
    return agreement.check(model, step, tokens, seed=seed), seed


def test_check_positions_leave_no_selection_boundary():
    pos = agreement.check_positions(TINY, 5, 256, "cpu")
    assert pos.tolist() == [7] * 5  # window 8 full; ratio-1 N_c = 8 = index_topk
    pos = agreement.check_positions(FLASH, 8, 1 << 20, "cpu")
    assert pos.max().item() == 511 and pos.min().item() == 127 and len(set(pos.tolist())) == 8


def test_correct_compile_agrees_and_state_is_restored(compiled):
    model = compiled[0]
    before = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}
    caches = {k: v.clone() for k, v in agreement.caches(model).items()}
    result, seed = _check(compiled)
    assert result.ok, f"seed {seed}: {result.reason}"
    assert result.rel_l2 <= agreement.AGREE_REL_L2 and result.kernel_calls == 0  # no kernels on a CPU
    assert set(result.layer_rel_l2) == {str(i) for i in range(TINY.n_layers)}
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"parameter {k} not restored"
    for k, v in agreement.caches(model).items():
        assert torch.equal(v, caches[k]), f"cache {k} not restored"


def test_conditioned_state_is_robust_to_rounding_noise(monkeypatch):
    """1e-6 relative noise on every RMSNorm output before its bf16 rounding (a compile's other summation order),
    five fresh models at the tiny model's depth and at 40 layers of the Flash schedule: the median distance stays
    under half the bound. (Single draws are not bounded: a rare 1-ulp flip of an FP8 scale moves a whole block;
    measured over 24 draws: median 0.002, largest 0.038.)"""
    deep = TINY.with_(n_layers=40, compress_ratios=FLASH.compress_ratios, kv_source_layers=FLASH.kv_source_layers,
                      index_source_layers=FLASH.index_source_layers, candidate_source_layer=FLASH.candidate_source_layer)
    for cfg in (TINY, deep):
        distances = [_noisy_check(cfg, monkeypatch) for _ in range(5)]
        assert statistics.median(distances) <= agreement.AGREE_REL_L2 / 2, f"{cfg.n_layers} layers: {distances}"


def _noisy_check(cfg, monkeypatch) -> float:
    def noisy_rms_norm(x, weight, eps):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return (y * (1 + 1e-6 * torch.randn_like(y))).to(x.dtype)

    model = DSV41Model(cfg, max_batch=8, max_context=256, seed=int(torch.randint(0, 2**31, ())))
    tokens = torch.randint(0, cfg.vocab_size, (8,))

    def noisy(tokens, positions):
        with monkeypatch.context() as m:
            m.setattr(model_module.fn, "rms_norm", noisy_rms_norm)
            return model(tokens, positions)

    return agreement.check(model, noisy, tokens).rel_l2


def _wrong_norm_eps(monkeypatch):
    real = qkv_norm.reference
    monkeypatch.setattr(qkv_norm, "reference", lambda *args, **kw: real(*args, **{**kw, "eps": 1e-6}))


def _swapped_norm_weights(monkeypatch):
    real = qkv_norm.reference
    monkeypatch.setattr(qkv_norm, "reference", lambda qkv, q_w, kv_w, *args, **kw: real(qkv, kv_w, q_w, *args, **kw))


def _window_offset_off_by_one(monkeypatch):
    real = indexer_topk.reference
    monkeypatch.setattr(indexer_topk, "reference", lambda *args, **kw: real(*args, **{**kw, "offset": kw["offset"] + 1}))


def _kernel(monkeypatch, op, buggy):
    """Kernel selection that picks `buggy` for `op` (as if its CuTe kernel were wrong); the others unchanged."""
    choose = _kernels.choose
    monkeypatch.setattr(_kernels, "choose", lambda o, k, *a: buggy if k == op else choose(o, k, *a))


def _sinkhorn_iteration_dropped(monkeypatch):
    def kernel(*args, **kw):
        return mhc_coeffs.reference(*args, **{**kw, "iters": kw["iters"] - 1})
    _kernel(monkeypatch, "mhc_coeffs", kernel)


def _post_pre_norm_eps(monkeypatch):
    def kernel(*args, **kw):
        return mhc_post_pre.reference(*args, **{**kw, "eps": 1e-6})
    _kernel(monkeypatch, "mhc_post_pre", kernel)


BUGS = {
    "qkv_norm eps 1e-6 (reference)": (_wrong_norm_eps, "logits"),
    "q_norm/kv_norm weights swapped (reference)": (_swapped_norm_weights, "logits"),
    "indexer offset off by one (reference)": (_window_offset_off_by_one, "logits"),
    "one Sinkhorn iteration dropped (kernel)": (_sinkhorn_iteration_dropped, "kernel"),
    "mhc_post_pre eps 1e-6 (kernel)": (_post_pre_norm_eps, "kernel"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_planted_bug_is_caught(compiled, monkeypatch, bug):
    plant, tier = BUGS[bug]
    plant(monkeypatch)
    result, seed = _check(compiled)
    assert not result.ok, f"seed {seed}: {bug} passed the check (rel L2 {result.rel_l2:.3g})"
    if tier == "logits":
        assert result.rel_l2 > agreement.AGREE_REL_L2, result.reason
    else:
        assert result.kernel_mismatches and result.kernel_calls > 0, result.reason
    print(f"{bug}: caught ({result.reason})")


def test_nan_never_agrees(compiled, monkeypatch):
    real = mhc_post_pre.reference
    monkeypatch.setattr(mhc_post_pre, "reference", lambda *a, **kw: tuple(o * float("nan") for o in real(*a, **kw)))
    result, _ = _check(compiled)
    assert not result.ok and "nan" in result.reason.lower()
