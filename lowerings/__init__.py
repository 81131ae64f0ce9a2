"""The dsv41 op library: one functional `dsv41::` custom op per fusion of the backend.

Importing this package registers every op; `ALL_OPS` maps each fusion name to its `torch.ops.dsv41` packet.
Each op module (`lowerings/<name>.py`) holds the op's schema and math (its docstring), a plain-torch reference
(CPU and CUDA; the model's own functions in the model's op order, so it is bit-identical to the eager model on
CPU), a fake that is a pure shape function of the inputs' sizes, and validation shared by both through
`_checks`. The trailing `impl` argument ("auto" | "cute" | "reference") picks the CuTe DSL kernel of
`dsv41.kernels` or the reference (`_kernels`). The ops mutate nothing and return fresh tensors; Inductor keeps
each as one extern fallback call.
"""

import torch

from dsv41.lowerings import (  # noqa: F401  (importing registers the ops)
    allreduce_mhc,
    indexer_topk,
    mhc_coeffs,
    mhc_post_pre,
    moe_finalize,
    moe_route,
    qkv_norm,
    wo_a,
)

ALL_OPS = {
    name: getattr(torch.ops.dsv41, name)
    for name in ("indexer_topk", "moe_route", "moe_finalize", "qkv_norm", "wo_a", "mhc_coeffs", "mhc_post_pre",
                 "allreduce_mhc")
}
