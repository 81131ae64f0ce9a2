"""`qkv_norm`: the q_norm and kv_norm RMSNorms of the merged wq_a|wkv output, with the KV RoPE and the FP8
fake quantisation of the window KV when they follow in the same chain.

    qr = rms_norm(qkv[:, :q_dim], q_w, eps);  kv = rms_norm(qkv[:, q_dim:], kv_w, eps)
    kv = fp8_fake_quant(rope_tail(kv, cos, sin), 32)           (when present)
  -> dsv41::qkv_norm(qkv, q_w, kv_w, cos, sin, eps, quant_block)

Formulations: RMSNorm written out or as F.rms_norm, or written out rounding twice (w * bf16(x * rsqrt(...)) in bf16,
HF's; the op's norm_rounding="bf16_then_weight"); with RoPE + FP8 quantisation (the model with fake
quantisation on), with RoPE only, or the bare pair of norms; each from the merged output (sliced) or from two
separate GEMM outputs q and kv (HF runs wq_a and wkv as two GEMMs), which the replacement joins with one cat into
the op's qkv input.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch
import torch.fx as fx

from dsv41.models import functional as fn
from dsv41.passes.complex_arith import left_after, per_token, restate_failure
from dsv41.passes.fusion import Derived, FusionPass, Replacement
from dsv41.passes.matcher import Pattern, same_value
from dsv41.passes.mhc_post_pre import NORMS, Norm

T, QD, KVD, RD = 3, 32, 64, 16


class KvTail(enum.Enum):
    """What follows kv's RMSNorm in the fused chain: nothing, the RoPE, or the RoPE and the FP8 fake quantisation."""

    NONE = "none"
    ROPE = "rope"
    ROPE_FP8 = "rope_fp8"


@dataclass(frozen=True)
class QkvNormForm:
    """A formulation of the q and kv norms: `tail`, what follows kv's norm; `split`, q and kv from two GEMM outputs
    (else slices of the merged one); `norm`, how both RMSNorms are written."""

    tail: KvTail
    split: bool
    norm: Norm


def _inputs():
    bf = torch.bfloat16
    return [torch.empty(T, QD + KVD, dtype=bf), torch.empty(QD, dtype=bf), torch.empty(KVD, dtype=bf),
            torch.empty(T, RD // 2), torch.empty(T, RD // 2)]


def _one_activation(inputs) -> str | None:
    """Two GEMM outputs qualify only as the q and kv projections of one activation (mm of one input value: one node,
    or two equal computations of it, `same_value`)."""
    q, kv = inputs[:2]
    gemm = torch.ops.aten.mm.default
    if isinstance(q, fx.Node) and isinstance(kv, fx.Node) and q.target == kv.target == gemm \
            and same_value(q.args[0], kv.args[0]):
        return None
    return "q and kv are not two GEMMs of one activation"


def _split_inputs():
    qkv, q_w, kv_w, cos, sin = _inputs()
    return [qkv[:, :QD].clone(), qkv[:, QD:].clone(), q_w, kv_w, cos, sin]


class QkvNormPass(FusionPass):
    name = "qkv_norm"
    form_type = QkvNormForm
    tolerance = {torch.bfloat16: (1e-6, 2.0**-7)}  # one bf16 ulp (a norm whose weight product rounds differently)

    def patterns(self):
        eps, block = self.config.norm_eps, self.config.fp8_block
        out = []
        for norm_form, (norm_name, norm) in NORMS.items():
            def bare(qkv, q_w, kv_w, norm=norm):
                q_dim = q_w.shape[0]
                return norm(qkv[:, :q_dim], q_w, eps), norm(qkv[:, q_dim:], kv_w, eps)

            def rope(qkv, q_w, kv_w, cos, sin, bare=bare):
                qr, kv = bare(qkv, q_w, kv_w)
                return qr, fn.apply_rope_tail(kv, cos, sin)

            def rope_fp8(qkv, q_w, kv_w, cos, sin, rope=rope):
                qr, kv = rope(qkv, q_w, kv_w, cos, sin)
                return qr, fn.fp8_fake_quant(kv, block)

            def split_bare(q, kv, q_w, kv_w, norm=norm):
                return norm(q, q_w, eps), norm(kv, kv_w, eps)

            def split_rope(q, kv, q_w, kv_w, cos, sin, split_bare=split_bare):
                qr, kv = split_bare(q, kv, q_w, kv_w)
                return qr, fn.apply_rope_tail(kv, cos, sin)

            def split_rope_fp8(q, kv, q_w, kv_w, cos, sin, split_rope=split_rope):
                qr, kv = split_rope(q, kv, q_w, kv_w, cos, sin)
                return qr, fn.fp8_fake_quant(kv, block)

            forms = ((KvTail.ROPE_FP8, False, rope_fp8, _inputs), (KvTail.ROPE, False, rope, _inputs),
                     (KvTail.NONE, False, bare, lambda: _inputs()[:3]),
                     (KvTail.ROPE_FP8, True, split_rope_fp8, _split_inputs),
                     (KvTail.ROPE, True, split_rope, _split_inputs),
                     (KvTail.NONE, True, split_bare, lambda: _split_inputs()[:4]))
            out += [Pattern(f"q_kv_norm_{tail.value}{'_split' if split else ''}{norm_name}", search, inputs,
                            anchor=torch.ops.aten.rsqrt.default, guard=_one_activation if split else None,
                            form=QkvNormForm(tail, split, norm_form))
                    for tail, split, search, inputs in forms]
        return out

    def sample_inputs(self, m, draws):
        """As the base class, with the first token's row of q and kv zero: an all-zero FP8 block, where the amax floor
        (1e-4) decides the scale (without it 0 / 0 is NaN)."""
        values = super().sample_inputs(m, draws)
        names = m.pattern.input_names()
        for name, v in zip(names, m.inputs):
            if name in ("qkv", "q", "kv") and v in values:
                values[v][0] = 0
        return values

    def wider(self, index):
        """A RoPE formulation is widened by its RoPE + FP8 one (same norm, same layout)."""
        forms = [p.form for p in self._patterns.patterns]
        if forms[index].tail is not KvTail.ROPE:
            return ()
        return (forms.index(dataclasses.replace(forms[index], tail=KvTail.ROPE_FP8)),)

    def replacement(self, m):
        form = m.pattern.form
        if form.split:
            q, kv, q_w, kv_w = m.inputs[:4]
            qkv, rest = Derived(torch.ops.aten.cat.default, ([q, kv], 1)), m.inputs[4:6]
        else:
            (qkv, q_w, kv_w), rest = m.inputs[:3], m.inputs[3:5]
        tokens = qkv.meta["val"].shape[0]
        cos, sin = (per_token(table, tokens) for table in rest) if form.tail is not KvTail.NONE else (None, None)
        block = self.config.fp8_block if form.tail is KvTail.ROPE_FP8 else 0
        op = torch.ops.dsv41.qkv_norm.default
        args = (qkv, q_w, kv_w, cos, sin, self.config.norm_eps, block, form.norm.rounding, self.config.kernel)
        return Replacement(op, args, (0, 1))

    def explain(self, failure, graph):
        return restate_failure(failure, graph)

    def __call__(self, graph):
        result = super().__call__(graph)
        for r in result.replaced:  # a norm pair fused, its complex RoPE left out: narrowed, not a decline
            result.narrowed += [(r["pattern"], f) for f in left_after(graph, self.name, set(r["created"]))]
        return result
