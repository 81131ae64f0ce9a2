"""`qkv_norm`: the q_norm and kv_norm RMSNorms of the merged wq_a|wkv output, with the KV RoPE and the FP8
fake quantisation of the window KV when they follow in the same chain.

    qr = rms_norm(qkv[:, :q_dim], q_w, eps);  kv = rms_norm(qkv[:, q_dim:], kv_w, eps)
    kv = fp8_fake_quant(rope_tail(kv, cos, sin), 32)           (when present)
  -> dsv41::qkv_norm(qkv, q_w, kv_w, cos, sin, eps, quant_block)

Formulations: RMSNorm written out or as F.rms_norm; with RoPE + FP8 quantisation (the model with fake
quantisation on), with RoPE only, or the bare pair of norms.
"""

from __future__ import annotations

import torch

from dsv41.models import functional as fn
from dsv41.passes.fusion import FusionPass, Replacement
from dsv41.passes.matcher import Pattern
from dsv41.passes.mhc_post_pre import rms_norm_functional

T, QD, KVD, RD = 3, 32, 64, 16


def _inputs():
    bf = torch.bfloat16
    return [torch.empty(T, QD + KVD, dtype=bf), torch.empty(QD, dtype=bf), torch.empty(KVD, dtype=bf),
            torch.empty(T, RD // 2), torch.empty(T, RD // 2)]


class QkvNormPass(FusionPass):
    name = "qkv_norm"

    def patterns(self):
        eps, block = self.config.norm_eps, self.config.fp8_block
        out = []
        for norm_name, norm in (("", fn.rms_norm), ("_F_rms_norm", rms_norm_functional)):
            def bare(qkv, q_w, kv_w, norm=norm):
                q_dim = q_w.shape[0]
                return norm(qkv[:, :q_dim], q_w, eps), norm(qkv[:, q_dim:], kv_w, eps)

            def rope(qkv, q_w, kv_w, cos, sin, bare=bare):
                qr, kv = bare(qkv, q_w, kv_w)
                return qr, fn.apply_rope_tail(kv, cos, sin)

            def rope_fp8(qkv, q_w, kv_w, cos, sin, rope=rope):
                qr, kv = rope(qkv, q_w, kv_w, cos, sin)
                return qr, fn.fp8_fake_quant(kv, block)

            out += [Pattern(f"q_kv_norm_rope_fp8{norm_name}", rope_fp8, _inputs),
                    Pattern(f"q_kv_norm_rope{norm_name}", rope, _inputs),
                    Pattern(f"q_kv_norm_none{norm_name}", bare, lambda: _inputs()[:3])]
        return out

    def replacement(self, m):
        tail = m.pattern.name.split("q_kv_norm_")[1].removesuffix("_F_rms_norm")
        qkv, q_w, kv_w = m.inputs[:3]
        cos, sin = m.inputs[3:5] if tail != "none" else (None, None)
        block = self.config.fp8_block if tail == "rope_fp8" else 0
        op = torch.ops.dsv41.qkv_norm.default
        return Replacement(op, (qkv, q_w, kv_w, cos, sin, self.config.norm_eps, block, self.config.kernel), (0, 1))
