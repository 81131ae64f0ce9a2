"""The routing-metadata kernel (dsv41.kernels.moe_metadata).

CPU: it compiles for sm_90a (Flash's E=384 k=6 with and without programmatic dependent launch, the tiny model's
E=16 k=6, the limits E=1023 and k=1 or 8); `supports` and the entry explain what they reject.
GPU (H200), against the op's reference (`dsv41.lowerings.moe_metadata.reference`: the model's stable argsort,
scatter_add counts, cumsum and gather) on the same inputs, every output poisoned before each call (token -1,
offsets -7, row_weights NaN) and compared exactly (integers and gathered values: any difference is a bug):
- T in DSV41_TEST_TOKENS (default 1,2,3,5,8,16,31,64) at E=384 k=6 and E=64 k=4, routings as moe_route makes them
  (each token's k experts distinct, drawn among the first E/2, so at least half the experts get 0 rows);
- every token on the same k experts (all other experts empty; at k=1 every pair on one expert) and many equal ids
  in a row (the stable order must keep them in pair order), at T=64;
- the limits: M = 2048 pairs (T = 256, k = 8) and E = 1023;
- ids outside [0, E) (not checked on the device): sorted after every expert, never counted in the offsets;
- 500 CUDA-graph replays alternating two input sets (different routings) bit-identical to direct calls;
- the op with impl="cute" and "auto" is the entry; above the limits "auto" runs the reference and "cute" says why.
When CUDA is present these tests fail (never skip) if the kernel cannot run.
"""

import pytest
import torch

from tests.kernels.support import assert_compiles_fresh, require_cute_dsl, tokens_from_env

require_cute_dsl()

from dsv41.kernels import moe_metadata as K  # noqa: E402
from dsv41.lowerings.moe_metadata import reference  # noqa: E402

TOKENS = tokens_from_env("1,2,3,5,8,16,31,64")
SHAPES = [(384, 6), (64, 4)]  # (E, k)


def _routing(t, e, k, seed, device="cuda"):
    """flat ids [T * k] (each token's k experts distinct, among the first e // 2) and weights [T * k]."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(e // 2, generator=g)[:k] for _ in range(t)]).flatten()
    return experts.to(device), torch.rand(t * k, generator=g).to(device)


def _poisoned(m, e, device="cuda"):
    return (torch.full((m,), -1, dtype=torch.int64, device=device),
            torch.full((e,), -7, dtype=torch.int32, device=device),
            torch.full((m,), float("nan"), device=device))


def _run(flat_e, flat_w, k, e, **kw):
    return K.moe_metadata(flat_e, flat_w, topk=k, num_experts=e, out=_poisoned(flat_e.shape[0], e), **kw)


def _assert_equal(got, want):
    for name, g, w in zip(("token", "offsets", "row_weights"), got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{name}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}"
        assert torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"


def _check(flat_e, flat_w, k, e, **kw):
    _assert_equal(_run(flat_e, flat_w, k, e, **kw), reference(flat_e, flat_w, k, e))


@pytest.mark.parametrize("config", [(384, 6, True), (384, 6, False), (16, 6, True), (1023, 8, True), (8, 1, True)],
                         ids=lambda c: "E{}-k{}-pdl{}".format(*c))
def test_compiles_for_sm90a(config, monkeypatch, tmp_path):
    assert_compiles_fresh(monkeypatch, tmp_path, K._compile_moe_metadata, config, K.compile_for)


def test_supports_explains():
    flat_e, flat_w = _routing(4, 64, 6, 0, device="cpu")
    kw = dict(topk=6, num_experts=64)
    assert K.supports(flat_e, flat_w, **kw) == "flat_experts is not a CUDA tensor"
    assert "flat_experts must be 1-D [M], got shape [4, 6]" in K.supports(flat_e.view(4, 6), flat_w, **kw)
    assert "flat_experts must be torch.int64" in K.supports(flat_e.int(), flat_w, **kw)
    assert "flat_weights must be torch.float32" in K.supports(flat_e, flat_w.double(), **kw)
    assert "flat_weights must have shape [24], got [23]" in K.supports(flat_e, flat_w[1:], **kw)
    big = torch.zeros(2049, dtype=torch.int64)
    assert "M = T * k must be at most 2048" in K.supports(big, torch.zeros(2049), **kw)
    assert "num_experts must be in [1, 1023]" in K.supports(flat_e, flat_w, topk=6, num_experts=1024)
    assert "num_experts must be in [1, 1023]" in K.supports(flat_e, flat_w, topk=6, num_experts=0)
    assert "topk must be >= 1, got 0" in K.supports(flat_e, flat_w, topk=0, num_experts=64)
    with pytest.raises(ValueError, match="moe_metadata: num_experts must be in"):
        K.moe_metadata(flat_e, flat_w, topk=6, num_experts=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-k{}".format(*s))
@pytest.mark.parametrize("t", TOKENS, ids=lambda t: f"T{t}")
def test_matches_reference(t, shape):
    e, k = shape
    for seed in range(2):
        _check(*_routing(t, e, k, seed), k, e)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [*SHAPES, (384, 1)], ids=lambda s: "E{}-k{}".format(*s))
def test_one_expert_set_for_all(shape):
    """Every token on the same k experts (at k = 1: every pair on one expert); all other experts get 0 rows."""
    e, k = shape
    favoured = torch.randperm(e, generator=torch.Generator().manual_seed(3))[:k]
    flat_e = favoured.repeat(64).cuda()
    _check(flat_e, torch.rand(64 * k, device="cuda"), k, e)
    _check(torch.full((64 * k,), e - 1, device="cuda"), torch.rand(64 * k, device="cuda"), k, e)  # the last expert


@pytest.mark.gpu
def test_equal_ids_keep_pair_order():
    """Long runs of equal ids (two experts only): the stable order keeps each expert's pairs in pair order."""
    g = torch.Generator().manual_seed(4)
    flat_e = (torch.randint(0, 2, (64 * 6,), generator=g) * 100).cuda()
    _check(flat_e, torch.rand(64 * 6, generator=g).cuda(), 6, 384)


@pytest.mark.gpu
def test_at_the_limits():
    """M = 2048 pairs (T = 256 at k = 8) over E = 384, and E = 1023 (at T = 64, most experts empty)."""
    _check(*_routing(256, 384, 8, 5), 8, 384)
    _check(*_routing(64, 1023, 6, 6), 6, 1023)


@pytest.mark.gpu
def test_without_pdl():
    _check(*_routing(16, 384, 6, 7), 6, 384, pdl=False)


@pytest.mark.gpu
def test_ids_outside_the_experts():
    """Ids outside [0, E) (an unmasked TP routing; never checked on the device) are sorted after every expert, in pair
    order, and not counted in the offsets: the valid experts' rows are the reference's on the valid pairs."""
    e, k = 64, 2
    flat_e = torch.tensor([3, -1, 64, 3, 2**40, 0, 7, 64], device="cuda")
    flat_w = torch.rand(8, device="cuda")
    token, offsets, row_weights = _run(flat_e, flat_w, k, e)
    valid = ((flat_e >= 0) & (flat_e < e)).nonzero().flatten()
    order = torch.cat([valid[torch.argsort(flat_e[valid], stable=True)], (~((flat_e >= 0) & (flat_e < e))).nonzero().flatten()])
    assert torch.equal(token, order // k) and torch.equal(row_weights, flat_w[order])
    want_offsets = torch.cumsum(torch.bincount(flat_e[valid], minlength=e), 0).to(torch.int32)
    assert torch.equal(offsets, want_offsets)


@pytest.mark.gpu
def test_cuda_graph_replay():
    """500 replays alternating two input sets (different routings) are bit-identical to direct calls."""
    e, k = 384, 6
    sets = [_routing(16, e, k, seed) for seed in (10, 11)]
    direct = [K.moe_metadata(*s, topk=k, num_experts=e) for s in sets]
    for got, s in zip(direct, sets, strict=True):
        _assert_equal(got, reference(*s, k, e))
    assert not torch.equal(direct[0][1], direct[1][1]), "the two input sets should route differently"
    static = [x.clone() for x in sets[0]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        K.moe_metadata(*static, topk=k, num_experts=e)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = K.moe_metadata(*static, topk=k, num_experts=e)
    for i in range(500):
        for dst, src in zip(static, sets[i % 2], strict=True):
            dst.copy_(src)
        for o, poison in zip(outs, (-1, -7, float("nan")), strict=True):
            o.fill_(poison)
        graph.replay()
        for o, want in zip(outs, direct[i % 2], strict=True):
            assert torch.equal(o, want), f"replay {i}"


@pytest.mark.gpu
def test_op_runs_the_kernel():
    """dsv41::moe_metadata with impl="cute" (and "auto" on Hopper) calls this kernel: bit-identical to the entry;
    above the kernel's limits "auto" runs the reference and "cute" names the limit."""
    import dsv41.lowerings  # noqa: F401  (registers the ops)

    flat_e, flat_w = _routing(4, 384, 6, 12)
    want = K.moe_metadata(flat_e, flat_w, topk=6, num_experts=384)
    for impl in ("cute", "auto"):
        got = torch.ops.dsv41.moe_metadata(flat_e, flat_w, 6, 384, impl)
        _assert_equal(got, want)
    big = _routing(342, 384, 6, 13)  # M = 2052 > 2048
    _assert_equal(torch.ops.dsv41.moe_metadata(*big, 6, 384, "auto"), reference(*big, 6, 384))
    with pytest.raises(RuntimeError, match="M = T \\* k must be at most 2048"):
        torch.ops.dsv41.moe_metadata(*big, 6, 384, "cute")


def test_bench_entry():
    """`dsv41 bench kernels --op moe_metadata`: Flash routings (k distinct experts per token), the floor's bytes, and
    the eager variant is the op's reference."""
    from dsv41.models import FLASH
    from dsv41.tools.bench_kernels import OPS

    op = OPS["moe_metadata"](FLASH)
    flat_e, flat_w = op.make_inputs(8, torch.Generator().manual_seed(0))
    assert flat_e.shape == flat_w.shape == (48,) and flat_e.dtype == torch.int64 and flat_w.dtype == torch.float32
    assert all(len(set(row)) == 6 for row in flat_e.view(8, 6).tolist())
    assert op.nbytes(8) == 48 * 24 + 384 * 4
    _assert_equal(op.reference(flat_e, flat_w), reference(flat_e, flat_w, 6, 384))
