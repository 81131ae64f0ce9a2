"""The fused mHC post + collapse + RMSNorm kernel.

CPU: it compiles for sm_90a (with and without programmatic dependent launch) at the Flash and tiny hidden sizes
and at D = 4096 (a 4-CTA cluster); `supports` and the entry explain what they reject.
GPU (H200), on fresh random inputs, NaN-poisoned outputs fully written, also under CUDA-graph replay:
- X' matches `functional.hc_post` to one bf16 ulp: |got - want| <= 2^-7 |want| + 1e-5 (the 1e-5 covers fp32
  noise where the post sum cancels; the kernel contracts products into FMAs where torch rounds each);
- h matches `rms_norm(hc_collapse(X'_kernel, pre), w)` to the same level at 2^-6 |want| + 1e-5 (u may itself be
  one ulp off): this pins the rounding points, i.e. the collapse reads the stored bf16 X';
- h matches the full reference chain within 2^-6 |want| + 2e-2: an X' element one ulp off moves u, and after
  cancellation in u the normalised h, by more than an ulp of h;
- at most 1% (or 4) of the elements of X' and h differ at all (2% for h against the full chain, which inherits
  the X' differences); a wrong rounding mode would flip about half.
DSV41_TEST_TOKENS narrows the token counts (sanitizers).
"""


import pytest
import torch

from tests.kernels.support import assert_compiles_fresh, require_cute_dsl, tokens_from_env

require_cute_dsl()

from dsv41.kernels import mhc_post_pre as K  # noqa: E402
from dsv41.models import functional  # noqa: E402

TOKENS = tokens_from_env("1,2,3,8,16,31,64")
DIMS = [5120, 128]
EPS = 1e-20


def _inputs(t, dim, seed, device="cuda"):
    """Stream coefficients shaped like mhc_coeffs outputs: post in (0, 2), comb positive with rows summing to 1,
    pre in (0, 1); a norm weight near 1."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    y = torch.randn(t, dim, generator=g).bfloat16()
    x = (2 * torch.randn(t, 4, dim, generator=g)).bfloat16()
    post = 2 * torch.sigmoid(torch.randn(t, 4, generator=g))
    comb = torch.softmax(torch.randn(t, 4, 4, generator=g), dim=-1)
    pre = torch.sigmoid(torch.randn(t, 4, generator=g)) + 1e-6
    w = (1 + 0.1 * torch.randn(dim, generator=g)).bfloat16()
    return [a.to(device) for a in (y, x, post, comb, pre, w)]


def _reference(y, x, post, comb, pre, w, eps=EPS):
    x_new = functional.hc_post(y, x, post, comb)
    return x_new, functional.rms_norm(functional.hc_collapse(x_new, pre), w, eps)


def _assert_close(name, got, want, rtol, atol, max_differing=0.01):
    assert got.dtype == torch.bfloat16 and not got.isnan().any(), f"{name}: elements left unwritten"
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    differing = (got != want).sum().item()
    assert differing <= max(4, max_differing * got.numel()), f"{name}: {differing} of {got.numel()} elements differ"


def _assert_matches(got, args, eps=EPS):
    x_new, h = got
    y, x, post, comb, pre, w = args
    want_x, want_h = _reference(*args, eps=eps)
    _assert_close("x_new", x_new, want_x, 2.0**-7, 1e-5)
    _assert_close("h from the kernel's x_new", h, functional.rms_norm(functional.hc_collapse(x_new, pre), w, eps),
                  2.0**-6, 1e-5)
    _assert_close("h", h, want_h, 2.0**-6, 2e-2, max_differing=0.02)


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize(("dim", "cluster_n"), [(5120, 5), (5120, 1), (128, 1), (4096, 4)])
def test_compiles_for_sm90a(dim, cluster_n, pdl, monkeypatch, tmp_path):
    assert_compiles_fresh(monkeypatch, tmp_path, K._compile_mhc_post_pre, (dim, pdl, cluster_n), K.compile_for)


def test_config():
    assert K._config(5120) == (8, 4, 5)
    assert K._config(5120, 1) == (8, 20, 1)
    assert K._config(5120, 2) == (8, 10, 2)
    assert K._config(5120, 3) is None  # 20 warps do not split into 3 CTAs
    assert K._config(4096) == (8, 4, 4)
    assert K._config(128) == (4, 1, 1)
    assert K._config(100) is None
    assert K._config(8192, 1) == (8, 32, 1)
    assert K._config(16384, 1) is None  # 64 warps: more than one CTA holds
    assert [K.cluster_for(5120, t) for t in (1, K.LARGE_TOKENS - 1, K.LARGE_TOKENS)] == [5, 5, 2]
    assert K.cluster_for(128, 64) == 1  # one warp: no 2-CTA split
    with pytest.raises(ValueError, match="no launch layout for D = 5120 with cluster_n = 3"):
        K.compile_for(5120, cluster_n=3)


def test_supports_explains():
    args = _inputs(2, 128, 0, device="cpu")
    assert K.supports(*args, eps=EPS) == "y is not a CUDA tensor"
    y, x, post, comb, pre, w = args
    assert "comb must have shape [2, 4, 4]" in K.supports(y, x, post, comb[:, :3], pre, w, eps=EPS)
    assert "norm_weight must be torch.bfloat16" in K.supports(y, x, post, comb, pre, w.float(), eps=EPS)
    assert "not a multiple of 128" in K.supports(y[:, :96], x[..., :96], post, comb, pre, w[:96], eps=EPS)
    with pytest.raises(ValueError, match="mhc_post_pre: pre must be torch.float32"):
        K.mhc_post_pre(y, x, post, comb, pre.double(), w, eps=EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("t", TOKENS, ids=lambda t: f"T{t}")
def test_matches_reference(t, dim):
    for seed in range(2):
        args = _inputs(t, dim, seed)
        out = (torch.full_like(args[1], float("nan")), torch.full_like(args[0], float("nan")))
        _assert_matches(K.mhc_post_pre(*args, eps=EPS, out=out), args)


@pytest.mark.gpu
@pytest.mark.parametrize("cluster_n", [1, 2, 5])
@pytest.mark.parametrize("t", TOKENS, ids=lambda t: f"T{t}")
def test_every_layout_matches_reference(t, cluster_n):
    """The layouts the entry point picks from (5 and 2 CTAs per token) and one CTA per token, at every token count,
    not only where ``cluster_for`` uses them."""
    args = _inputs(t, 5120, 7)
    out = (torch.full_like(args[1], float("nan")), torch.full_like(args[0], float("nan")))
    _assert_matches(K.mhc_post_pre(*args, eps=EPS, out=out, cluster_n=cluster_n), args)


@pytest.mark.gpu
def test_other_eps_and_dim():
    args = _inputs(5, 4096, 3)
    _assert_matches(K.mhc_post_pre(*args, eps=1e-6), args, eps=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", DIMS)
def test_without_pdl(dim):
    args = _inputs(8, dim, 4)
    _assert_matches(K.mhc_post_pre(*args, eps=EPS, pdl=False), args)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", DIMS)
def test_cuda_graph_replay(dim):
    t = 16
    static = _inputs(t, dim, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        K.mhc_post_pre(*static, eps=EPS)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = K.mhc_post_pre(*static, eps=EPS)
    for seed in range(1, 4):
        for dst, src in zip(static, _inputs(t, dim, seed), strict=True):
            dst.copy_(src)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches(outs, static)
