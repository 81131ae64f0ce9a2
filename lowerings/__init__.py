"""The dsv41 op library: one functional `dsv41::` custom op per fusion of the backend.

Importing this package registers every op; `ALL_OPS` maps each fusion name (`dsv41.passes.registry`) to its
`torch.ops.dsv41` packet.
Each op module (`lowerings/<name>.py`) holds the op's schema and math (its docstring), a plain-torch reference
(CPU and CUDA; the model's own functions in the model's op order, so it is bit-identical to the eager model on
CPU), a fake that is a pure shape function of the inputs' sizes, and validation shared by both through
`_checks`. The trailing `impl` argument ("auto" | "cute" | "reference") picks the CuTe DSL kernel of
`dsv41.kernels` or the reference (`_kernels`). The ops mutate nothing and return fresh tensors; Inductor keeps
each as one extern fallback call.
"""

import importlib

import torch

from dsv41.passes.registry import FUSIONS

for _fusion in FUSIONS:  # importing an op module registers its op
    importlib.import_module(f"dsv41.lowerings.{_fusion.name}")

ALL_OPS = {f.name: getattr(torch.ops.dsv41, f.name) for f in FUSIONS}
