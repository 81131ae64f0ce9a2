"""Complex RoPE as DeepSeek's reference writes it, inside a `qkv_norm` region (the KV RoPE) and a `wo_a` region (the
inverse RoPE): the tail's pairs viewed as complex numbers (`view_as_complex(x.float().view(..., -1, 2))`), multiplied
by a complex64 table built with `torch.polar` (a graph input indexed by the positions, or given per token;
`conj()` or a table built with the negated angle for the inverse), `view_as_real(...).flatten(-2)`, written back by
a cat or by `copy_` into the slice. `dsv41.passes.complex_arith` spells it in real pairs, so the fusions' RoPE
patterns see it. Each formulation differs from the model in the named way and is found exactly once with its whole
RoPE (the pattern that fused includes it, and no complex value is left but the table input).

Tolerance against eager: one bf16 ulp (atol=1e-6, rtol=2^-7, the qkv_norm pass's; 1.6e-2 absolute for the bmm
contraction), and one e4m3 step on at most 1% of an FP8-quantised output. The reason: eager's CPU complex product
rounds its two products and then adds them, as the real form does, where its kernel takes the vector path (blocks of
2 vectors); its scalar remainder contracts one product into an FMA, up to one fp32 rounding of difference
(`test_complex_product_rounds_as_the_real_form`), which the bf16 rounding hides except near a rounding boundary. On
this machine (AVX2) every case is bit-exact. A complex table the rewrite cannot spell (built by `polar` inside the
graph) is declined with the reason named, and the graph stays equal to eager."""

from __future__ import annotations

import math

import pytest
import torch

from dsv41.models import functional as fn

from ..harness import NORM_EPS, as_tuple, assert_close, compiled_matches, declined, gen, op_counts, rand, run_passes
from ..test_qkv_norm import KVD, QD, RD
from ..test_wo_a import G, H, HD, R

POSITIONS = 16  # rows of an indexed table


def norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w.float()).to(x.dtype)


def polar_table(g, rows, sign=1.0, half=RD // 2):
    angle = torch.rand(rows, half, generator=g) * 2 * math.pi
    return torch.polar(torch.ones_like(angle), sign * angle)


def project(o, w):
    t, g = o.shape[0], w.shape[0] // R
    return torch.einsum("tgd,grd->tgr", o.view(t, g, -1), w.view(g, R, -1)).flatten(1)


def as_complex(tail):
    """The reference's spelling: view(*shape[:-1], -1, 2), then view_as_complex."""
    return torch.view_as_complex(tail.view(*tail.shape[:-1], -1, 2))


def rotate_back(x, y):
    """The rotated tail y (fp32 pairs) in x's dtype, after x's other dims."""
    rd = y.shape[-1]
    return torch.cat((x[..., :-rd], y.to(x.dtype)), dim=-1)


# ---- qkv_norm: the KV RoPE --------------------------------------------------------------------------------------
def kv_table_indexed(qkv, q_w, kv_w, freqs_cis, positions):
    """the table a complex64 input indexed by the positions in the graph (the reference's `freqs_cis[pos]`)."""
    qr, kv = norm(qkv[:, :QD], q_w), norm(qkv[:, QD:], kv_w)
    z = as_complex(kv[..., -2 * freqs_cis.shape[-1]:].float())
    y = torch.view_as_real(z * freqs_cis[positions]).flatten(-2)
    return qr, fn.fp8_fake_quant(rotate_back(kv, y), 32)


def kv_table_given_float_first(qkv, q_w, kv_w, freqs):
    """the table given per token [T, rd/2]; x.float() before the slice, pairs by unflatten, the table on the left."""
    qr, kv = norm(qkv[:, :QD], q_w), norm(qkv[:, QD:], kv_w)
    z = torch.view_as_complex(kv.float()[..., -2 * freqs.shape[-1]:].unflatten(-1, (-1, 2)))
    y = torch.view_as_real(freqs * z).flatten(-2)
    return qr, fn.fp8_fake_quant(rotate_back(kv, y), 32)


def kv_copy_back(qkv, q_w, kv_w, freqs_cis, positions):
    """written back in place: `kv[..., -rd:].copy_(rotated)` (no FP8 tail)."""
    qr, kv = norm(qkv[:, :QD], q_w), norm(qkv[:, QD:], kv_w)
    tail = kv[..., -2 * freqs_cis.shape[-1]:]
    tail.copy_(torch.view_as_real(as_complex(tail.float()) * freqs_cis[positions]).flatten(-2))
    return qr, kv


def kv_shared_row(qkv, q_w, kv_w, freqs_cis, positions):
    """one table row for every token (the reference's `freqs_cis[start_pos:end_pos]` when the batch shares its
    position), broadcast over the tokens; the op takes it expanded to [T, rd/2]."""
    qr, kv = norm(qkv[:, :QD], q_w), norm(qkv[:, QD:], kv_w)
    z = as_complex(kv[..., -2 * freqs_cis.shape[-1]:].float())
    y = torch.view_as_real(z * freqs_cis[5:6]).flatten(-2)
    return qr, fn.fp8_fake_quant(rotate_back(kv, y), 32)


def kv_indexed_inputs(seed, t=3):
    g = gen(seed)
    return [rand(g, t, QD + KVD, scale=3.0), rand(g, QD, scale=0.1, mean=1.0), rand(g, KVD, scale=0.1, mean=1.0),
            polar_table(g, POSITIONS), torch.randint(0, POSITIONS, (t,), generator=g)]


def kv_given_inputs(seed, t=3):
    qkv, q_w, kv_w, _, _ = kv_indexed_inputs(seed, t)
    return [qkv, q_w, kv_w, polar_table(gen(seed + 100), t)]


# ---- wo_a: the inverse RoPE -------------------------------------------------------------------------------------
def o_conj_indexed(o, freqs_cis, positions, w):
    """the inverse by `freqs_cis[pos].conj()`, viewed [T, 1, rd/2] over the heads (the reference's)."""
    z = as_complex(o[..., -2 * freqs_cis.shape[-1]:].float())
    y = torch.view_as_real(z * freqs_cis[positions].conj().view(o.shape[0], 1, -1)).flatten(-2)
    return project(rotate_back(o, y), w)


def o_negated_angle_given(o, freqs_inverse, w):
    """the inverse by a table built with the negated angle (no conj in the graph), given [T, rd/2], unsqueezed."""
    z = torch.view_as_complex(o[..., -2 * freqs_inverse.shape[-1]:].float().unflatten(-1, (-1, 2)))
    y = torch.view_as_real(z * freqs_inverse.unsqueeze(1)).flatten(-2)
    return project(rotate_back(o, y), w)


def o_copy_back_float_first(o, freqs_cis, positions, w):
    """written back in place into a copy of o; o.float() before the slice; conj after the view; bmm contraction."""
    o = o.clone()
    rd = 2 * freqs_cis.shape[-1]
    table = freqs_cis[positions].view(o.shape[0], 1, -1).conj_physical()
    o[..., -rd:].copy_(torch.view_as_real(as_complex(o.float()[..., -rd:]) * table).flatten(-2))
    t, g = o.shape[0], w.shape[0] // R
    z = torch.bmm(o.view(t, g, -1).transpose(0, 1), w.view(g, R, -1).transpose(1, 2))
    return z.transpose(0, 1).flatten(1)


def o_indexed_inputs(seed, t=3):
    g = gen(seed)
    return [rand(g, t, H, HD), polar_table(g, POSITIONS), torch.randint(0, POSITIONS, (t,), generator=g),
            rand(g, G * R, H // G * HD, scale=0.1)]


def o_negated_inputs(seed, t=3):
    o, _, _, w = o_indexed_inputs(seed, t)
    return [o, polar_table(gen(seed + 100), t, sign=-1.0), w]


BF16_ULP, BMM = dict(atol=1e-6, rtol=2.0**-7), dict(atol=1.6e-2, rtol=2.0**-7)
CASES = {  # name -> (function, inputs, fusion, the pattern that must fuse it, tolerance, FP8-quantised outputs)
    "kv_table_indexed": (kv_table_indexed, kv_indexed_inputs, "qkv_norm", "q_kv_norm_rope_fp8", BF16_ULP, (1,)),
    "kv_table_given_float_first": (kv_table_given_float_first, kv_given_inputs, "qkv_norm", "q_kv_norm_rope_fp8",
                                   BF16_ULP, (1,)),
    "kv_copy_back": (kv_copy_back, kv_indexed_inputs, "qkv_norm", "q_kv_norm_rope", BF16_ULP, ()),
    "kv_shared_row": (kv_shared_row, kv_indexed_inputs, "qkv_norm", "q_kv_norm_rope_fp8", BF16_ULP, (1,)),
    "o_conj_indexed": (o_conj_indexed, o_indexed_inputs, "wo_a", "wo_a_einsum", BF16_ULP, ()),
    "o_negated_angle_given": (o_negated_angle_given, o_negated_inputs, "wo_a", "wo_a_einsum_negated_angle", BF16_ULP,
                              ()),
    "o_copy_back_float_first": (o_copy_back_float_first, o_indexed_inputs, "wo_a", "wo_a_bmm", BMM, ()),
}


def check_equal(got, want, tol, fp8=()):
    """got equals eager's want within tol, an FP8-quantised output (index in fp8) within one e4m3 step on 99%."""
    got, want = as_tuple(got), as_tuple(want)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if i not in fp8:
            assert_close(g, w, **tol)
            continue
        assert g.dtype == w.dtype and g.shape == w.shape and not g.isnan().any()
        close = torch.isclose(g.float(), w.float(), rtol=0.125, atol=1e-2)
        assert close.float().mean() >= 0.99, f"{(~close).sum()} of {close.numel()} fp8 elements differ by over a step"


def complex_nodes(gm) -> list[str]:
    """The ops with a complex value (the table's graph input is not one)."""
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].is_complex()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_found_once_with_its_rope_and_equal_to_eager(name):
    f, inputs_of, fusion, pattern, tol, fp8 = CASES[name]
    gm, report = run_passes(f, inputs_of(0), fusion)
    assert report.matches == {fusion: 1}, report.declined
    assert op_counts(gm)[f"dsv41.{fusion}"] == 1
    fused = next(p for p in report.passes if p.name == fusion).replaced
    assert [r["pattern"] for r in fused] == [pattern]
    assert not complex_nodes(gm) and not op_counts(gm)["aten.view_as_complex"]
    x = inputs_of(1)
    check_equal(gm(*x), f(*x), tol, fp8)


def test_complex_product_rounds_as_the_real_form():
    """The numerics the rewrite relies on: eager's complex product of fp32 pairs against (a*c - b*d, a*d + b*c)
    computed as separate rounded ops. Bit for bit where the CPU kernel's vector path covers the whole tensor (16
    complex values per row: two vectors with AVX512, four with AVX2); at any width within eps * (|first product| +
    |second|) per part (the scalar remainder may fuse a product into an FMA)."""
    g = gen(5)
    eps = torch.finfo(torch.float32).eps
    for n in (1, 3, 4, 7, 8, 9, 16, 31, 32, 33, 48):
        x, f = torch.randn(5, n, 2, generator=g) * 10, polar_table(g, 5, half=n)
        got = torch.view_as_real(torch.view_as_complex(x) * f)
        a, b, c, d = x[..., 0], x[..., 1], f.real, f.imag
        want = torch.stack((a * c - b * d, a * d + b * c), dim=-1)
        bound = eps * torch.stack(((a * c).abs() + (b * d).abs(), (a * d).abs() + (b * c).abs()), dim=-1)
        assert ((got - want).abs() <= bound).all(), n
        if n % 16 == 0:
            assert torch.equal(got, want), n


# ---- what the rewrite leaves complex ----------------------------------------------------------------------------
def o_polar_in_graph(o, angle, w):
    """the table built inside the graph by polar: its cos/sin would round as polar's, not as cos/sin ops."""
    z = torch.view_as_complex(o[..., -2 * angle.shape[-1]:].float().unflatten(-1, (-1, 2)))
    table = torch.polar(torch.ones_like(angle), angle).conj().unsqueeze(1)
    return project(rotate_back(o, torch.view_as_real(z * table).flatten(-2)), w)


def kv_polar_in_graph(qkv, q_w, kv_w, angle):
    qr, kv = norm(qkv[:, :QD], q_w), norm(qkv[:, QD:], kv_w)
    z = torch.view_as_complex(kv[..., -2 * angle.shape[-1]:].float().unflatten(-1, (-1, 2)))
    y = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
    return qr, fn.fp8_fake_quant(rotate_back(kv, y), 32)


def angles(seed, t=3):
    return torch.rand(t, RD // 2, generator=gen(seed + 200)) * 2 * math.pi


def test_table_built_in_the_graph_is_declined_with_its_reason():
    """wo_a: not fused, declined naming the polar; qkv_norm: the norms fuse, and the site is recorded as narrowed
    (fused without the RoPE after them) with the same reason; the normalisation's own record says which view_as_real
    it left; both graphs equal eager."""
    o_inputs = lambda seed: [o_indexed_inputs(seed)[0], angles(seed), o_indexed_inputs(seed)[3]]  # noqa: E731
    kv_inputs = lambda seed: kv_indexed_inputs(seed)[:3] + [angles(seed)]  # noqa: E731
    for f, inputs_of, fusion, matches in ((o_polar_in_graph, o_inputs, "wo_a", 0),
                                          (kv_polar_in_graph, kv_inputs, "qkv_norm", 1)):
        gm, report = run_passes(f, inputs_of(0), fusion)
        assert report.matches == {fusion: matches} and report.fallback is None
        reasons = declined(report, fusion) if matches == 0 else "\n".join(report.narrowed[fusion])
        assert "check" in reasons and "aten::polar" in reasons, reasons
        assert matches == 0 or not report.declined[fusion] and reasons.startswith("fused as q_kv_norm"), report
        assert "left complex" in report.passes[0].note and "aten::polar" in report.passes[0].note
        x = inputs_of(1)
        assert_close(gm(*x), f(*x), atol=0, rtol=0)


# ---- through the backend: the reference's buffer -----------------------------------------------------------------
class ReferenceStyleAttention(torch.nn.Module):
    """The KV RoPE and the inverse RoPE before wo_a with a complex64 `freqs_cis` buffer (Dynamo lifts it to a graph
    input), as DeepSeek's reference keeps its table: qkv [T, QD+KVD], o [T, H, HD], positions [T]."""

    def __init__(self, seed=0):
        super().__init__()
        g = gen(seed)
        self.register_buffer("freqs_cis", polar_table(g, POSITIONS))
        self.q_w, self.kv_w = rand(g, QD, scale=0.1, mean=1.0), rand(g, KVD, scale=0.1, mean=1.0)
        self.wo_a = rand(g, G * R, H // G * HD, scale=0.1)

    def forward(self, qkv, o, positions):
        qr, kv = kv_table_indexed(qkv, self.q_w, self.kv_w, self.freqs_cis, positions)
        return qr, kv, o_conj_indexed(o, self.freqs_cis, positions, self.wo_a)


@torch.no_grad()
def test_reference_style_module_through_the_backend():
    def inputs_of(seed):
        g = gen(seed)
        return [rand(g, 3, QD + KVD, scale=3.0), rand(g, 3, H, HD), torch.randint(0, POSITIONS, (3,), generator=g)]

    assert compiled_matches(ReferenceStyleAttention(), inputs_of) == {"qkv_norm": 1, "wo_a": 1}
