"""`allreduce_mhc`: a TP all-reduce of a sublayer output + mHC post + collapse + RMSNorm -> dsv41::allreduce_mhc.

A 1-process gloo group is the default group for this module, so `funcol.all_reduce` traces to
`_c10d_functional.all_reduce` + `wait_tensor` (as under TP) and the fused op's all-reduce runs (a sum over one
rank). Every formulation the pass lists (attention and MoE sites, each with the three stream formulations of
mhc_post_pre) has a user-written function here. Tolerances: the model's stream formulation is bit-exact
(atol=rtol=0); einsum / F.rms_norm ones within bf16 tolerance (atol=rtol=1.6e-2), as in test_mhc_post_pre.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from dsv41.models import functional as fn

from .harness import BF16, F16, NORM_EPS, assert_close, assert_scalar_decline, compiled_matches, gen, graph_text, op_counts, \
    pattern_names, rand, run_declined, run_fused_once, run_passes
from .test_mhc_post_pre import STREAM_COMBINATIONS

FUSION, OP = "allreduce_mhc", "dsv41.allreduce_mhc"
T, HC, D = 3, 4, 32
BF16_TOL = dict(atol=1.6e-2, rtol=1.6e-2)


@pytest.fixture(scope="module", autouse=True)
def gloo_world(gloo_group):
    """The 1-process gloo group (tests/conftest.py) as the default group while this module runs; compiled graphs
    hold it, so Dynamo's caches are reset before it is destroyed."""
    yield
    torch._dynamo.reset()


def inputs(seed, kind, t=T, d=D, dtype=BF16):
    """attention: y_partial bf16; ffn: routed fp32 + shared bf16; then x, post, comb, pre, norm weight."""
    g = gen(seed)
    head = [rand(g, t, d, dtype=dtype)] if kind == "attention" else [rand(g, t, d, dtype=torch.float32), rand(g, t, d, dtype=dtype)]
    return head + [rand(g, t, HC, d, dtype=dtype), 2 * torch.rand(t, HC, generator=g),
                   torch.softmax(torch.randn(t, HC, HC, generator=g), -1), torch.rand(t, HC, generator=g) + 0.1,
                   rand(g, d, scale=0.1, mean=1.0)]


def reduce(t):
    return funcol.all_reduce(t, "sum", dist.group.WORLD)


# ---- stream formulations (as in test_mhc_post_pre) --------------------------------------------------------------
def streams_model(y, x, post, comb, pre, w, eps):
    """The model's: broadcast-multiply-sum mixing, RMSNorm written out."""
    x_new = (post.unsqueeze(-1) * y.float().unsqueeze(-2) + (comb.unsqueeze(-1) * x.float().unsqueeze(-2)).sum(dim=1)).to(x.dtype)
    u = (pre.unsqueeze(-1) * x_new.float()).sum(dim=1).to(x.dtype)
    uf = u.float()
    return x_new, (uf * torch.rsqrt(uf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(u.dtype)


def streams_einsum(y, x, post, comb, pre, w, eps):
    x_new = (post.unsqueeze(-1) * y.float().unsqueeze(1) + torch.einsum("tjk,tjd->tkd", comb, x.float())).to(x.dtype)
    return x_new, fn.rms_norm(torch.einsum("tj,tjd->td", pre, x_new.float()).to(x.dtype), w, eps)


def streams_f_rms_norm(y, x, post, comb, pre, w, eps):
    x_new = fn.hc_post(y, x, post, comb)
    u = fn.hc_collapse(x_new, pre)
    return x_new, F.rms_norm(u.float(), (u.shape[-1],), w.float(), eps).to(u.dtype)


STREAMS = {"": streams_model, "_einsum": streams_einsum, "_F_rms_norm": streams_f_rms_norm}
STREAMS |= {suffix: f for suffix, f in STREAM_COMBINATIONS.items()
            if suffix not in STREAMS and not suffix.endswith("_bf16_then_weight")}  # the other combinations


def attention_site(streams):
    def f(y_partial, x, post, comb, pre, w, eps=NORM_EPS):
        y = reduce(y_partial.float()).to(y_partial.dtype)
        return streams(y, x, post, comb, pre, w, eps)
    return f


def ffn_site(streams):
    def f(routed, shared, x, post, comb, pre, w, eps=NORM_EPS):
        y = (reduce(routed) + shared.float()).to(shared.dtype)
        return streams(y, x, post, comb, pre, w, eps)
    return f


FORMULATIONS = {f"{kind}{suffix}": (kind, site(streams)) for suffix, streams in STREAMS.items()
                for kind, site in (("attention", attention_site), ("ffn", ffn_site))}


def tolerance(name):
    return dict(atol=0, rtol=0) if name in ("attention", "ffn") else BF16_TOL


def test_every_formulation_has_a_test():
    assert pattern_names(FUSION) == set(FORMULATIONS)


@pytest.mark.parametrize("name", sorted(FORMULATIONS))
def test_formulation_is_fused(name):
    kind, f = FORMULATIONS[name]
    gone = ("_c10d_functional.all_reduce", "_c10d_functional.wait_tensor", "aten.sum.dim_IntList", "aten.rsqrt",
            "aten.bmm")
    gm, _, node = run_fused_once(f, inputs(0, kind), FUSION, gone)
    assert node.args[8] == dist.group.WORLD.group_name  # the group is read from the matched collective
    assert (node.args[1] is None) == (kind == "attention")  # y_add: the shared expert of the MoE site
    x = inputs(1, kind)
    assert_close(gm(*x), f(*x), **tolerance(name))


def tp_block_tail(y_partial, routed, shared, x, post, comb, pre, w, w2):
    """An attention site, a stand-in FFN, then the MoE site: two all-reduces each followed by an mHC post."""
    x1, h1 = attention_site(streams_model)(y_partial, x, post, comb, pre, w)
    x2, h2 = ffn_site(streams_einsum)(routed + h1.float(), shared, x1, post, comb, pre, w2)
    return x2, h2


def tail_inputs(seed):
    a, f = inputs(seed, "attention"), inputs(seed + 100, "ffn")
    return [a[0], f[0], f[1]] + a[1:] + [f[-1]]


def test_two_sites_replace_mhc_post_pre():
    """allreduce_mhc runs before mhc_post_pre and claims both sites; mhc_post_pre finds none left."""
    gm, report = run_passes(tp_block_tail, tail_inputs(0), FUSION, "mhc_post_pre")
    assert report.matches == {FUSION: 2, "mhc_post_pre": 0}
    assert op_counts(gm)[OP] == 2 and op_counts(gm)["_c10d_functional.all_reduce"] == 0
    x = tail_inputs(1)
    assert_close(gm(*x), tp_block_tail(*x), **BF16_TOL)


def test_without_allreduce_mhc_only_the_post_pre_is_fused():
    gm, report = run_passes(tp_block_tail, tail_inputs(0), "mhc_post_pre")
    assert report.matches == {"mhc_post_pre": 2}
    assert op_counts(gm)["_c10d_functional.all_reduce"] == 2 and op_counts(gm)[OP] == 0


@torch.no_grad()
def test_model_moe_tail_through_the_backend():
    """The model's MoE tail under TP: moe_finalize takes the combine (fp32 out), allreduce_mhc the rest."""
    def moe_tail(expert_out, token, shared, x, post, comb, pre, w):
        y = torch.zeros(x.shape[0], x.shape[2], dtype=torch.float32).index_add_(0, token, expert_out.float())
        y = (reduce(y) + shared.float()).to(shared.dtype)
        x_new = fn.hc_post(y, x, post, comb)
        return x_new, fn.rms_norm(fn.hc_collapse(x_new, pre), w, NORM_EPS)

    def moe_inputs(seed):
        g = gen(seed)
        rest = inputs(seed, "ffn")
        return [rand(g, T * 6, D), torch.randperm(T * 6, generator=g) // 6] + rest[1:]

    assert compiled_matches(moe_tail, moe_inputs) == {FUSION: 1, "moe_finalize": 1}


def test_golden():
    gm, _ = run_passes(FORMULATIONS["attention"][1], inputs(0, "attention", t=2, d=8), FUSION)
    code = graph_text(gm).replace(repr(dist.group.WORLD.group_name), "'<group>'")
    expecttest.assert_expected_inline(code, """\
%arg0_1: bf16[2, 8] = input
%arg1_1: bf16[2, 4, 8] = input
%arg2_1: f32[2, 4] = input
%arg3_1: f32[2, 4, 4] = input
%arg4_1: f32[2, 4] = input
%arg5_1: bf16[8] = input
%allreduce_mhc_default: (bf16[2, 4, 8], bf16[2, 8]) = dsv41.allreduce_mhc(%arg0_1, None, %arg1_1, %arg2_1, %arg3_1, %arg4_1, %arg5_1, 1e-20, '<group>', 'auto')
%getitem_1: bf16[2, 8] = getitem(%allreduce_mhc_default, 1)
%getitem: bf16[2, 4, 8] = getitem(%allreduce_mhc_default, 0)
return [%getitem, %getitem_1]
""")


# ---- declines ---------------------------------------------------------------------------------------------------
def test_decline_token_limit():
    reasons = run_declined(FORMULATIONS["attention"][1], inputs(0, "attention", t=3), FUSION, max_tokens=2)
    assert "token limit: T=3 > max_tokens=2" in reasons


def test_decline_fp16_activations():
    reasons = run_declined(FORMULATIONS["ffn"][1], inputs(0, "ffn", dtype=F16), FUSION)
    assert "dtype" in reasons and "float16" in reasons


@pytest.mark.parametrize("name", ["attention", "ffn_F_rms_norm"])
def test_decline_other_eps(name):
    kind, f = FORMULATIONS[name]
    reasons = run_declined(lambda *a: f(*a, eps=1e-6), inputs(0, kind), FUSION)
    assert_scalar_decline(reasons, 1e-20, 1e-6)
