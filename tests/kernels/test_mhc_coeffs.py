"""The mHC coefficient kernel.

CPU: it compiles for sm_90a (with and without programmatic dependent launch) at the Flash and tiny hidden sizes;
`supports` and the entry explain what they reject; a plain-torch model of the last CTA's lane layout, summation
order and approximate reciprocals (biased by 1 ulp throughout) stays within a quarter of the tolerances below.
GPU (H200): on fresh random inputs it matches `functional.hc_mixes` (fp32) within atol 1e-5 on pre and post and
1e-4 on comb, writes every element of NaN-poisoned outputs, leaves its workspace zeroed (so the next launch is
right too), and replays correctly inside a CUDA graph. DSV41_TEST_TOKENS=1,31 narrows the token counts (sanitizers).
"""

import math

import pytest
import torch

from tests.kernels.support import assert_compiles_fresh, require_cute_dsl, tokens_from_env

require_cute_dsl()

from dsv41.kernels import mhc_coeffs as K  # noqa: E402
from dsv41.lowerings.mhc_coeffs import KERNEL_ATOL  # noqa: E402
from dsv41.models import functional  # noqa: E402

TOKENS = tokens_from_env("1,2,3,8,16,31,64")
DIMS = [5120, 128]
ITERS, NORM_EPS, HC_EPS = 20, 1e-20, 1e-6


def _inputs(t, dim, seed, device="cuda"):
    """Magnitudes of the model's initialisation (models/model.py): fn ~ N(0, 1/(4D)), base ~ N(0, 0.5^2),
    scale ~ 1 + N(0, 0.1^2); X ~ 3 N(0, 1) so that the rsqrt normalisation matters."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (3 * torch.randn(t, 4, dim, generator=g)).bfloat16()
    fn = torch.randn(24, 4 * dim, generator=g) / math.sqrt(4 * dim)
    base = 0.5 * torch.randn(24, generator=g)
    scale = 1 + 0.1 * torch.randn(3, generator=g)
    return [a.to(device) for a in (x, fn, base, scale)]


def _poisoned(t, device="cuda"):
    return tuple(torch.full(s, float("nan"), device=device) for s in ((t, 4), (t, 4), (t, 4, 4)))


def _assert_matches(got, x, fn, base, scale):
    want = functional.hc_mixes(x, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    for name, g, w in zip(("pre", "post", "comb"), got, want, strict=True):
        assert not g.isnan().any(), f"{name}: elements left unwritten"
        torch.testing.assert_close(g, w, rtol=0, atol=KERNEL_ATOL[name], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("dim", DIMS)
def test_compiles_for_sm90a(dim, pdl, monkeypatch, tmp_path):
    assert_compiles_fresh(monkeypatch, tmp_path, K._compile_mhc_coeffs, (dim, ITERS, pdl), K.compile_for)


def test_supports_explains():
    x, fn, base, scale = _inputs(2, 128, 0, device="cpu")
    kw = dict(norm_eps=NORM_EPS, hc_eps=HC_EPS, iters=ITERS)
    assert K.supports(x, fn, base, scale, **kw) == "x is not a CUDA tensor"
    assert "fn must be torch.float32" in K.supports(x, fn.double(), base, scale, **kw)
    assert "fn must have shape [24, 512]" in K.supports(x, fn[:, :-4], base, scale, **kw)
    assert "multiple of 128" in K.supports(x[..., :100], fn[:, :400], base, scale, **kw)
    assert "x must be [T, 4, D]" in K.supports(x[:, :3], fn, base, scale, **kw)
    for hc_eps in (0.0, 1e-40, float("nan"), float("inf")):  # outside finish_comb's rcp.approx.ftz argument
        assert "hc_eps must be a normal fp32" in K.supports(x, fn, base, scale, **{**kw, "hc_eps": hc_eps})
    with pytest.raises(ValueError, match="mhc_coeffs: scale must have shape"):
        K.mhc_coeffs(x, fn, base, scale[:2], **kw)


def _rcp(x, ulps):
    """1 / x moved by `ulps` units in the last place towards +inf (ulps > 0) or 0: rcp.approx is within 1 ulp."""
    r = 1.0 / x
    for _ in range(abs(ulps)):
        r = torch.nextafter(r, torch.full_like(r, math.inf if ulps > 0 else 0.0))
    return r


def _tail_model(sums, base, scale, k, ulps):
    """The last CTA in plain torch: sums [T, 32] fp32 are the replica sums, workspace column l on lane l (24 dots,
    then the sum of squares); pre / post on lanes 0..7, comb element l - 8 on lanes 8..23 (a source row per aligned
    group of 4 lanes), then one thread's Sinkhorn, every reciprocal through `_rcp(., ulps)`."""
    hc, lane = K.HC, torch.arange(32)
    z = (sums * torch.rsqrt(sums[:, K.N_MIX:K.N_MIX + 1] * (1.0 / k) + NORM_EPS)
         * scale[(lane // hc).clamp(max=2)] + base[lane.clamp(max=K.N_MIX - 1)])
    is_comb = lane >= 2 * hc
    e = torch.exp(torch.where(is_comb, z - z.view(-1, 8, hc).amax(-1).repeat_interleave(hc, 1), -z))
    g = e.view(-1, 8, hc)
    q = _rcp(torch.where(is_comb, ((g[..., 0] + g[..., 1]) + (g[..., 2] + g[..., 3])).repeat_interleave(hc, 1), 1 + e),
             ulps)
    c = (e * q + HC_EPS)[:, 2 * hc:K.N_MIX].view(-1, hc, hc)

    def normalize(c, dim):
        s = c.select(dim, 0) + c.select(dim, 1) + (c.select(dim, 2) + c.select(dim, 3))
        return c * _rcp(s + HC_EPS, ulps).unsqueeze(dim)

    c = normalize(c, 1)
    for _ in range(ITERS - 1):
        c = normalize(normalize(c, 2), 1)
    return q[:, :hc] + HC_EPS, 2 * q[:, hc:2 * hc], c


@pytest.mark.parametrize("ulps", [1, -1])
def test_tail_model_within_tolerance(ulps):
    """The lane layout, the butterfly order and 1-ulp reciprocals biased one way through all 39 normalisations
    leave pre, post and comb within a quarter of KERNEL_ATOL of the fp32 reference (the rest is the split-K
    order's), from dots accumulated in fp64 and rounded once."""
    seed = int(torch.randint(2**31, ()))
    t, dim = 512, 512
    x, fn, base, scale = _inputs(t, dim, seed, device="cpu")
    xf = x.flatten(1).double()
    sums = torch.zeros(t, 32, dtype=torch.float64)
    sums[:, :K.N_MIX], sums[:, K.N_MIX] = xf @ fn.double().t(), xf.pow(2).sum(-1)
    got = _tail_model(sums.float(), base, scale, 4 * dim, ulps)
    want = functional.hc_mixes(x, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    for name, g, w in zip(("pre", "post", "comb"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=KERNEL_ATOL[name] / 4, msg=lambda m: f"{name}, seed {seed}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("t", TOKENS, ids=lambda t: f"T{t}")
def test_matches_reference(t, dim):
    for seed in range(2):  # twice: the second launch relies on the first having re-zeroed the workspace
        x, fn, base, scale = _inputs(t, dim, seed)
        got = K.mhc_coeffs(x, fn, base, scale, norm_eps=NORM_EPS, hc_eps=HC_EPS, iters=ITERS, out=_poisoned(t))
        _assert_matches(got, x, fn, base, scale)
    ws, count = K._WORKSPACE.get(x.device, t)
    torch.cuda.synchronize()
    assert count.item() == 0 and not ws.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("t", [65, 131, 300], ids=lambda t: f"T{t}")
def test_many_tokens(t, dim):
    """More tokens than one shared-memory block (64), so several blocks run the last CTA's finish, the last one
    with 1, 3 or 44 tokens (at 1 and 3, rows of a warp's four past the block); more tokens than its threads (128)."""
    x, fn, base, scale = _inputs(t, dim, 7)
    got = K.mhc_coeffs(x, fn, base, scale, norm_eps=NORM_EPS, hc_eps=HC_EPS, iters=ITERS, out=_poisoned(t))
    _assert_matches(got, x, fn, base, scale)
    ws, count = K._WORKSPACE.get(x.device, t)
    torch.cuda.synchronize()
    assert count.item() == 0 and not ws.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dim", DIMS)
def test_without_pdl(dim):
    x, fn, base, scale = _inputs(8, dim, 5)
    got = K.mhc_coeffs(x, fn, base, scale, norm_eps=NORM_EPS, hc_eps=HC_EPS, iters=ITERS, pdl=False)
    _assert_matches(got, x, fn, base, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", DIMS)
def test_cuda_graph_replay(dim):
    t = 16
    static = _inputs(t, dim, 0)
    kw = dict(norm_eps=NORM_EPS, hc_eps=HC_EPS, iters=ITERS)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        K.mhc_coeffs(*static, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = K.mhc_coeffs(*static, **kw)
    for seed in range(1, 4):
        for dst, src in zip(static, _inputs(t, dim, seed), strict=True):
            dst.copy_(src)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches(outs, *static)
