"""The Megatron-Core-style block (megatron_style.py) through the real backend in both modes (inductor and fx): outputs equal to eager (h
and x_new bf16 within one bf16 ulp of an fp32 reordering: atol=rtol=1.6e-2 on at least 99% of elements, since the
FP8 round trip may move a bucket; the indexer's indices exactly, ascending, so the index sets agree), every one of
its sites fused, exactly once each, in its sequence-first [1, B, ...] layout; qkv_norm and moe_experts with their FP8
steps inside."""

from __future__ import annotations

import pytest
import torch

from dsv41.backend import make_backend

from ..harness import config, gen, rand
from .blocks import assert_one_request_fuses, assert_outputs_agree, compile_and_run, fused_sites
from .megatron_style import T_SITES, MaskedSelectDispatchBlock, MegatronStyleBlock

B, N = 3, 24


def inputs(seed, block, b=B):
    """x [1, B, hc, D], pre_mix [1, B, hc] (sequence first), positions [B], index keys [B, N, ihd], n_c (0..N)."""
    g = gen(seed)
    return [rand(g, 1, b, block.hc, 64), torch.softmax(torch.randn(1, b, block.hc, generator=g), -1),
            torch.randint(0, 4096, (b,), generator=g), rand(g, b, N, block.index_dim),
            torch.randint(0, N + 1, (b,), generator=g)]


@pytest.fixture(scope="module")
def compiled(mode):
    """The block compiled once; (backend, [(compiled outputs, eager outputs)] on three fresh inputs)."""
    return compile_and_run(MegatronStyleBlock(), inputs, (1, 2, 3), mode)


def test_sites_fused_exactly_once(compiled):
    sites, report = fused_sites(compiled[0])
    assert sites == T_SITES, report.declined


def test_fp8_steps_are_inside_the_ops(compiled):
    """GroupedMLP's flat weights viewed [E, D, 2I] / [E, I, D] bind in place with the w2 input's FP8 step inside;
    qkv_norm holds the window KV's RoPE (Megatron's interleaved rotary) and FP8 step; the counts are the routing
    map's column sums."""
    _, report = fused_sites(compiled[0])
    fused = {p.name: [r["pattern"] for r in p.replaced] for p in report.passes}
    assert fused["moe_experts"] == ["experts_fp8"] and fused["qkv_norm"] == ["q_kv_norm_rope_fp8"], fused
    assert fused["moe_metadata"] == ["scatter_add_int64"], fused


def test_agrees_with_eager(compiled):
    assert_outputs_agree(compiled[1])


def test_one_request(mode):
    """B = 1: every site in T_SITES fuses as at B = 3 (the last mhc_post_pre site's sublayer output, a `[1, 1, D]` value cast beside `[1, hc, 1]` weights, and wo_a's `[1, 1, rd/2]` cos/sin beside `[1, H, rd/2]` heads bind without the leading unit dim that broadcasting adds anyway; with B = 1 the block's layout reads as batch-first, there being no `[1, B > 1, ...]` linear layer to show it sequence-first)."""
    assert_one_request_fuses(MegatronStyleBlock(), inputs, T_SITES, mode)


def test_masked_select_dispatch_breaks_the_graph_and_says_so():
    """Megatron-Core's own `permute` by `masked_select` has data-dependent sizes: Dynamo breaks the graph there, the
    router (fused) ends at the break and its note names it, no graph has the routing metadata's sort (moe_metadata
    has no candidate), the experts and the combine fuse in the graph after the break; outputs equal to eager."""
    torch._dynamo.reset()
    block, backend = MaskedSelectDispatchBlock(), make_backend(config())
    fn = torch.compile(block, backend=backend)
    with torch.no_grad():
        assert_outputs_agree([(fn(*x), block(*x)) for x in (inputs(seed, block) for seed in (1, 2))])
    torch._dynamo.reset()
    assert all(r.fallback is None and r.matches["moe_metadata"] == 0 for r in backend.reports)
    (route,) = [r for r in backend.reports if r.matches["moe_route"]]
    assert "Dynamic shape operator (aten.masked_select.default)" in route.notes["moe_route"], route.notes
    assert sum(r.matches["moe_experts"] for r in backend.reports) == sum(
        r.matches["moe_finalize"] for r in backend.reports) == 1
    # the last graph (the FFN post, collapse and final norm) runs no linear layer, so nothing there shows its
    # [1, B, ...] values to be sequence-first: the leading unit dim stays and the site is a near miss at F.linear's
    # absence, the view where the pattern casts
    last = {p.name: p for p in backend.reports[-1].passes}["mhc_post_pre"]
    assert last.matches == 0 and [(f.expected, f.found) for f in last.attempts] == [
        ("prims::convert_element_type", "aten::view")], last.attempts
