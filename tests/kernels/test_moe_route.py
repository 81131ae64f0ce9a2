"""The MoE router kernel (dsv41.kernels.moe_route).

CPU: it compiles for sm_90a (Flash dimensions with and without programmatic dependent launch, a small shape at the
smallest and largest k); `supports` and the entry explain what they reject; the op's reference honours the tie rule.
GPU (H200), against the op's reference (`dsv41.lowerings.moe_route.reference`, fp32), outputs poisoned with NaN
before each call: T in DSV41_TEST_TOKENS (default 1,2,3,4,5,8,16,31,64) at D=5120 E=384 k=6 and D=2048 E=64 k=4; the
default covers both of the kernel's tails and the step between them (one ticket up to K.ONE_HOP_TOKENS = 4 tokens,
two above).

How results are compared. The kernel sums the logits in another order than cuBLAS (bf16 tensor-core products with
fp32 accumulation over 128 columns, then fp32 sums over warps and CTAs), so its logits differ from the reference's by
~1e-6 at these magnitudes (|logit| ~ 1). Hence:
- experts, as per-token sets: the kernel's set must be a top-k of the reference's biased scores up to BIASED_TOL
  = 1e-4 (every chosen expert's biased score >= every unchosen one's - 1e-4), and its order descending up to the
  same tolerance; this is exact set equality wherever the reference's k-th and (k+1)-th scores are more than 1e-4
  apart, and fails on a wrong score function, bias handling or selection by a wide margin (typical gaps ~ 1e-2).
- weights, following their expert: against the reference scores of the kernel's own experts, normalised and scaled,
  with rtol 1e-5: a logit error dx moves sqrt(softplus(x)) by at most dx / 2 relatively (and the weight by about
  dx), so 1e-5 is 10x the expected error while a wrong temperature, eps or scale is off by far more.
- ties (equal biased scores, made exact for both implementations: zero hidden states, quantised bias): the experts
  must equal the reference's exactly, order included (the lower expert index first), on both tails (each breaks them
  in two levels: within a block of 32 or 16 experts, then across the blocks).
- NaN biased scores rank above every number, in index order, as the reference's sort ranks them.
- the two tails (one ticket, two tickets) give the same tokens bit-identical routes.
CUDA graphs: 500 replays alternating two input sets with different routings are bit-identical to direct calls, on
each tail.
When CUDA is present these tests fail (never skip) if the kernel cannot run.
"""

import math

import pytest
import torch

from tests.kernels.support import assert_compiles_fresh, require_cute_dsl, tokens_from_env

require_cute_dsl()

from dsv41.kernels import moe_route as K  # noqa: E402
from dsv41.lowerings.moe_route import reference  # noqa: E402

TOKENS = tokens_from_env("1,2,3,4,5,8,16,31,64")
SHAPES = [(5120, 384, 6), (2048, 64, 4)]  # (D, E, k)
ROUTE_SCALE = 1.5
BIASED_TOL = 1e-4
WEIGHT_RTOL = 1e-5


def _inputs(t, d, e, seed, device="cuda"):
    """h ~ N(0, 1) and W ~ N(0, 1/D) (bf16), so logits ~ N(0, 1); bias ~ N(0, 0.1^2)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(t, d, generator=g).bfloat16()
    w = (torch.randn(e, d, generator=g) / math.sqrt(d)).bfloat16()
    bias = 0.1 * torch.randn(e, generator=g)
    return [a.to(device) for a in (h, w, bias)]


def _poisoned(t, k, device="cuda"):
    return (torch.full((t, k), float("nan"), device=device),
            torch.full((t, k), -1, dtype=torch.int64, device=device))


def _route(h, w, bias, k, gate_temp=1.0, **kw):
    return K.moe_route(h, w, bias, topk=k, route_scale=ROUTE_SCALE, gate_temp=gate_temp,
                       out=_poisoned(h.shape[0], k), **kw)


def _assert_routes(got, h, w, bias, k, gate_temp=1.0):
    """The comparison described in the module docstring."""
    weights, experts = got
    t, e = h.shape[0], w.shape[0]
    assert not weights.isnan().any(), "weights left unwritten"
    assert ((experts >= 0) & (experts < e)).all(), f"expert ids out of [0, {e}): {experts}"
    assert (experts.sort(dim=1).values.diff(dim=1) > 0).all(), f"a token got an expert twice: {experts}"
    scores = torch.sqrt(torch.nn.functional.softplus(torch.mm(h.float(), w.float().t()) / gate_temp))
    biased = scores + bias
    chosen = torch.zeros(t, e, dtype=torch.bool, device=h.device).scatter_(1, experts, True)
    lowest_chosen = biased.masked_fill(~chosen, math.inf).min(dim=1).values
    highest_other = biased.masked_fill(chosen, -math.inf).max(dim=1).values
    bad = (lowest_chosen < highest_other - BIASED_TOL).nonzero().flatten().tolist()
    assert not bad, f"tokens {bad}: experts {experts[bad].tolist()} are not a top-{k} of the biased scores"
    order = biased.gather(1, experts)
    assert (order[:, :-1] >= order[:, 1:] - BIASED_TOL).all(), f"experts not in descending biased score: {experts}"
    s = scores.gather(1, experts)
    want = s / (s.sum(dim=1, keepdim=True) + 1e-20) * ROUTE_SCALE
    torch.testing.assert_close(weights, want, rtol=WEIGHT_RTOL, atol=0)
    return experts


@pytest.mark.parametrize("shape_pdl", [(5120, 384, 6, True), (5120, 384, 6, False), (2048, 64, 1, True),
                                       (2048, 64, 8, True)], ids=lambda c: "D{}-E{}-k{}-pdl{}".format(*c))
def test_compiles_for_sm90a(shape_pdl, monkeypatch, tmp_path):
    assert_compiles_fresh(monkeypatch, tmp_path, K._compile_moe_route, shape_pdl, K.compile_for)


def test_supports_explains():
    h, w, bias = _inputs(2, 2048, 64, 0, device="cpu")
    kw = dict(topk=4, route_scale=ROUTE_SCALE, gate_temp=1.0)
    assert K.supports(h, w, bias, **kw) == "h is not a CUDA tensor"
    assert "h must be torch.bfloat16" in K.supports(h.float(), w, bias, **kw)
    assert "gate_weight must have shape [64, 2048], got [64, 2047]" in K.supports(h, w[:, 1:], bias, **kw)
    assert "bias must be torch.float32" in K.supports(h, w, bias.double(), **kw)
    assert "bias must have shape [64]" in K.supports(h, w, bias[:-1], **kw)
    assert "D must be a multiple of 1024" in K.supports(h[:, :1536], w[:, :1536], bias, **kw)
    assert "E must be a multiple of 32" in K.supports(h, w[:48], bias[:48], **kw)
    big = torch.zeros(544, 2048, dtype=torch.bfloat16)
    assert "E must be a multiple of 32 in [32, 512], got 544" in K.supports(h, big, torch.zeros(544), **kw)
    assert "topk must be in [1, 8], got 0" in K.supports(h, w, bias, **{**kw, "topk": 0})
    assert "topk must be in [1, 8], got 9" in K.supports(h, w, bias, **{**kw, "topk": 9})
    assert "must be 2-D" in K.supports(h[0], w, bias, **kw)
    with pytest.raises(ValueError, match="moe_route: bias must have shape"):
        K.moe_route(h, w, bias[:-1], **kw)
    with pytest.raises(ValueError, match="moe_route: topk must be in"):
        K.moe_route(h, w, bias, **{**kw, "topk": 9})


def test_reference_tie_rule():
    """The reference orders equal biased scores by expert index (and matches torch.topk where they differ)."""
    h, w, _ = _inputs(3, 64, 32, 1, device="cpu")
    bias = torch.tensor([0.0, 0.5, 0.0, 0.5] * 8)
    _, experts = reference(torch.zeros_like(h), w, bias, 6, ROUTE_SCALE, 1.0)
    assert experts.tolist() == [[1, 3, 5, 7, 9, 11]] * 3 and experts.is_contiguous()  # as the op's fake
    bias = _inputs(3, 64, 32, 2, device="cpu")[2]
    scores = torch.sqrt(torch.nn.functional.softplus(h.float() @ w.float().t()))
    assert torch.equal(reference(h, w, bias, 6, ROUTE_SCALE, 1.0)[1], torch.topk(scores + bias, 6).indices)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "D{}-E{}-k{}".format(*s))
@pytest.mark.parametrize("t", TOKENS, ids=lambda t: f"T{t}")
def test_matches_reference(t, shape):
    d, e, k = shape
    for seed in range(2):  # twice: the second launch relies on the first having reset the ticket counters
        h, w, bias = _inputs(t, d, e, seed)
        _assert_routes(_route(h, w, bias, k), h, w, bias, k)
    torch.cuda.synchronize()
    assert not K._COUNTERS[h.device.index].any(), "ticket counters not reset"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "D{}-E{}-k{}".format(*s))
def test_matches_reference_gate_temp(shape):
    d, e, k = shape
    h, w, bias = _inputs(16, d, e, 3)
    _assert_routes(_route(h, w, bias, k, gate_temp=0.7), h, w, bias, k, gate_temp=0.7)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "D{}-E{}-k{}".format(*s))
@pytest.mark.parametrize("t", [1, 5, 31], ids=lambda t: f"T{t}")
def test_matches_reference_ties(t, shape):
    """Zero hidden states give every expert the score sqrt(log 2); with 3 random experts biased by 0.5 and 20 others
    by 0.25, the k-th place falls among the 20 tied ones, which the tie rule breaks by the lower expert index,
    exactly as the reference does."""
    d, e, k = shape
    h, w, _ = _inputs(t, d, e, 4)
    h.zero_()
    levels = torch.randperm(e, generator=torch.Generator().manual_seed(5))
    bias = torch.zeros(e).index_fill_(0, levels[:3], 0.5).index_fill_(0, levels[3:23], 0.25).cuda()
    got = _route(h, w, bias, k)
    want_w, want_e = reference(h, w, bias, k, ROUTE_SCALE, 1.0)
    assert torch.equal(got[1], want_e), f"{got[1].tolist()} != {want_e.tolist()}"
    torch.testing.assert_close(got[0], want_w, rtol=WEIGHT_RTOL, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "D{}-E{}-k{}".format(*s))
@pytest.mark.parametrize("t", [3, 64], ids=lambda t: f"T{t}")
def test_matches_reference_one_expert_set(t, shape):
    """A bias that dominates the scores routes every token to the same k experts (the others get no rows); their
    weights still come from each token's own unbiased scores. The k experts lie in one block of 32 (one segment
    of the one-ticket selection, whose list then supplies every place; one or two of the two-ticket one's)."""
    d, e, k = shape
    h, w, _ = _inputs(t, d, e, 6)
    g = torch.Generator().manual_seed(7)
    favoured = (32 * torch.randint(e // 32, (1,), generator=g) + torch.randperm(32, generator=g)[:k]).cuda()
    bias = torch.zeros(e, device="cuda").index_fill_(0, favoured, 10.0)
    experts = _assert_routes(_route(h, w, bias, k), h, w, bias, k)
    assert (experts.sort(dim=1).values == favoured.sort().values).all()


@pytest.mark.gpu
def test_without_pdl():
    h, w, bias = _inputs(8, 5120, 384, 8)
    _assert_routes(_route(h, w, bias, 6, pdl=False), h, w, bias, 6)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "D{}-E{}-k{}".format(*s))
def test_tails_agree(shape):
    """A token's route does not depend on the others' nor on the tail: the first K.ONE_HOP_TOKENS tokens routed alone
    (one ticket) are bit-identical to the same tokens routed with more (two tickets)."""
    d, e, k = shape
    n = K.ONE_HOP_TOKENS
    h, w, bias = _inputs(n + 3, d, e, 15)
    alone, together = _route(h[:n].contiguous(), w, bias, k), _route(h, w, bias, k)
    assert torch.equal(alone[0], together[0][:n]) and torch.equal(alone[1], together[1][:n])


@pytest.mark.gpu
@pytest.mark.parametrize("t", [3, K.ONE_HOP_TOKENS + 1], ids=lambda t: f"T{t}")
def test_matches_reference_nan_bias(t):
    """Experts whose bias is NaN come first, the lower index first, then the ties of the test above as the reference
    breaks them; the weights (from the unbiased scores) stay finite. On both tails."""
    d, e, k = 5120, 384, 6
    h, w, _ = _inputs(t, d, e, 13)
    h.zero_()
    levels = torch.randperm(e, generator=torch.Generator().manual_seed(14))
    bias = torch.zeros(e).index_fill_(0, levels[:2], math.nan).index_fill_(0, levels[2:12], 0.25).cuda()
    got = _route(h, w, bias, k)
    want_w, want_e = reference(h, w, bias, k, ROUTE_SCALE, 1.0)
    assert want_e[0, :2].tolist() == levels[:2].sort().values.tolist()
    assert torch.equal(got[1], want_e), f"{got[1].tolist()} != {want_e.tolist()}"
    torch.testing.assert_close(got[0], want_w, rtol=WEIGHT_RTOL, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [K.ONE_HOP_TOKENS, 16], ids=lambda t: f"T{t}")
def test_cuda_graph_replay(t):
    """500 replays alternating two input sets (different routings) are bit-identical to direct calls."""
    d, e, k = 5120, 384, 6
    sets = [_inputs(t, d, e, seed) for seed in (10, 11)]
    direct = [K.moe_route(*s, topk=k, route_scale=ROUTE_SCALE, gate_temp=1.0) for s in sets]
    again = [K.moe_route(*s, topk=k, route_scale=ROUTE_SCALE, gate_temp=1.0) for s in sets]
    for (w0, e0), (w1, e1), s in zip(direct, again, sets, strict=True):
        assert torch.equal(w0, w1) and torch.equal(e0, e1), "direct calls are not deterministic"
        _assert_routes((w0, e0), *s, k)
    assert not torch.equal(direct[0][1], direct[1][1]), "the two input sets should route differently"
    static = [x.clone() for x in sets[0]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        K.moe_route(*static, topk=k, route_scale=ROUTE_SCALE, gate_temp=1.0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = K.moe_route(*static, topk=k, route_scale=ROUTE_SCALE, gate_temp=1.0)
    for i in range(500):
        for dst, src in zip(static, sets[i % 2], strict=True):
            dst.copy_(src)
        outs[0].fill_(float("nan"))
        outs[1].fill_(-1)
        graph.replay()
        assert torch.equal(outs[0], direct[i % 2][0]) and torch.equal(outs[1], direct[i % 2][1]), f"replay {i}"


@pytest.mark.gpu
def test_op_runs_the_kernel():
    """dsv41::moe_route with impl="cute" (and "auto" on Hopper) calls this kernel: bit-identical to the entry."""
    import dsv41.lowerings  # noqa: F401  (registers the ops)

    h, w, bias = _inputs(4, 5120, 384, 12)
    want = K.moe_route(h, w, bias, topk=6, route_scale=ROUTE_SCALE, gate_temp=1.0)
    for impl in ("cute", "auto"):
        got = torch.ops.dsv41.moe_route(h, w, bias, 6, ROUTE_SCALE, 1.0, impl)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), impl
