"""Shared fixtures of the op-library tests: small random CPU samples per op and an invalid-input checker (the
1-process gloo group is in tests/conftest.py). Helpers are fixtures (not an imported module) so the suite works in
any pytest import mode.
"""

from __future__ import annotations

import pytest
import torch

BF16, F32 = torch.bfloat16, torch.float32


def _rand(g, *shape, dtype=BF16, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _mhc_streams(g, t, hc, d):
    """x, post, comb, pre, norm_weight of an mHC site, with realistic ranges."""
    return dict(x=_rand(g, t, hc, d), post=2 * torch.rand(t, hc, generator=g),
                comb=torch.softmax(torch.randn(t, hc, hc, generator=g), -1), pre=torch.rand(t, hc, generator=g) + 0.1,
                norm_weight=(1 + 0.1 * torch.randn(d, generator=g)).to(BF16))


def mhc_coeffs(g, t=3, hc=4, d=16):
    n = (2 + hc) * hc
    return dict(x=_rand(g, t, hc, d), fn=_rand(g, n, hc * d, dtype=F32, scale=(hc * d) ** -0.5),
                base=_rand(g, n, dtype=F32, scale=0.5), scale=1 + _rand(g, 3, dtype=F32, scale=0.1),
                norm_eps=1e-20, hc_eps=1e-6, iters=20)


def mhc_post_pre(g, t=3, hc=4, d=16):
    s = _mhc_streams(g, t, hc, d)
    return dict(y=_rand(g, t, d), x=s["x"], post=s["post"], comb=s["comb"], pre=s["pre"],
                norm_weight=s["norm_weight"], eps=1e-20)


def allreduce_mhc(g, group_name, t=3, hc=4, d=16, moe=False):
    """moe: y fp32 (the routed sum) plus y_add bf16 (the shared expert); else y bf16 (attention), no y_add."""
    s = _mhc_streams(g, t, hc, d)
    y, y_add = (_rand(g, t, d, dtype=F32), _rand(g, t, d)) if moe else (_rand(g, t, d), None)
    return dict(y=y, y_add=y_add, x=s["x"], post=s["post"], comb=s["comb"], pre=s["pre"],
                norm_weight=s["norm_weight"], eps=1e-20, group_name=group_name)


def qkv_norm(g, t=3, q_dim=32, kv_dim=64, rd=16, quant_block=32, rope=True):
    cos_sin = dict(cos=None, sin=None)
    if rope:
        angle = torch.rand(t, rd // 2, generator=g) * 6.3
        cos_sin = dict(cos=angle.cos(), sin=angle.sin())
    return dict(qkv=_rand(g, t, q_dim + kv_dim, scale=3.0), q_weight=(1 + 0.1 * torch.randn(q_dim, generator=g)).to(BF16),
                kv_weight=(1 + 0.1 * torch.randn(kv_dim, generator=g)).to(BF16), **cos_sin, eps=1e-20,
                quant_block=quant_block)


def wo_a(g, t=3, heads=4, hd=32, rd=16, groups=2, rank=8):
    angle = torch.rand(t, rd // 2, generator=g) * 6.3
    return dict(o=_rand(g, t, heads, hd), cos=angle.cos(), sin=angle.sin(),
                weight=_rand(g, groups * rank, heads // groups * hd, scale=0.1), groups=groups)


def indexer_topk(g, t=3, ih=4, ihd=32, n_cap=16, topk=6, offset=8, cand_block=4, cand_topk_blocks=0,
                 candidates=False):
    n_c = torch.randint(0, n_cap + 1, (t,), generator=g)
    n_c[0] = n_cap
    return dict(q=_rand(g, t, ih, ihd), w=torch.rand(t, ih, generator=g), keys=_rand(g, t, n_cap, ihd), n_c=n_c,
                candidates=torch.rand(t, n_cap, generator=g) < 0.6 if candidates else None, topk=topk, offset=offset,
                cand_block=cand_block, cand_topk_blocks=cand_topk_blocks)


def moe_route(g, t=3, d=32, experts=16, topk=6):
    return dict(h=_rand(g, t, d), gate_weight=_rand(g, experts, d, scale=d**-0.5),
                bias=_rand(g, experts, dtype=F32, scale=0.1), topk=topk, route_scale=1.5, gate_temp=1.0)


def moe_finalize(g, t=3, d=32, topk=6, shared=True):
    m = t * topk
    return dict(expert_out=_rand(g, m, d), token=torch.randperm(m, generator=g) // topk,
                shared=_rand(g, t, d) if shared else None, num_tokens=t)


def moe_experts(g, t=3, d=64, inter=64, experts=8, topk=6, quant_block=32, apart=False):
    """Rows sorted by expert (tokens permuted); every other expert gets no rows. apart: w1 and w3 held apart (w13 is
    w1 [E, I, D], w3 [E, I, D]: w13's halves of the stacked draw)."""
    m = t * topk
    counts = torch.bincount(torch.randint(0, experts // 2, (m,), generator=g) * 2, minlength=experts)
    kwargs = dict(x=_rand(g, t, d), token=torch.randperm(m, generator=g) // topk,
                  row_weights=torch.rand(m, generator=g), offsets=torch.cumsum(counts, 0).to(torch.int32),
                  w13=_rand(g, experts, 2 * inter, d, scale=d**-0.5), w2=_rand(g, experts, d, inter, scale=inter**-0.5),
                  swiglu_limit=10.0, quant_block=quant_block)
    if apart:
        w13 = kwargs["w13"]
        kwargs.update(w13=w13[:, :inter].contiguous(), w3=w13[:, inter:].contiguous())
    return kwargs


def moe_metadata(g, t=3, topk=6, experts=8):
    """A routing's flat expert ids (every other expert gets no pair) and weights."""
    m = t * topk
    return dict(flat_experts=torch.randint(0, experts // 2, (m,), generator=g) * 2,
                flat_weights=torch.rand(m, generator=g), topk=topk, num_experts=experts)


BUILDERS = {f.__name__: f for f in (mhc_coeffs, mhc_post_pre, allreduce_mhc, qkv_norm, wo_a, indexer_topk, moe_route,
                                    moe_finalize, moe_experts, moe_metadata)}


@pytest.fixture
def samples():
    """samples(name, seed=0, **options): the op's keyword arguments in schema order (without `impl`), from a
    fresh seeded generator; `options` select the op's variants (see each builder)."""

    def make(name, seed=0, **options):
        return BUILDERS[name](torch.Generator().manual_seed(seed), **options)

    return make


@pytest.fixture
def rejects():
    """rejects(op, kwargs, exc, match, fake=True, **changes): op(**{**kwargs, **changes}) raises `exc` whose message
    matches `match`, through the real implementation on CPU and (if `fake`) through the fake, on meta tensors."""

    def check(op, kwargs, exc, match, fake=True, **changes):
        bad = {**kwargs, **changes}
        with pytest.raises(exc, match=match):
            op(**bad)
        if fake:
            with pytest.raises(exc, match=match):
                op(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in bad.items()})

    return check
