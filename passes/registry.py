"""The fusions of the backend, each declared once: every list of fusion names derives from `FUSIONS`.

A fusion `name` is the key of `report.matches`, its pass is `dsv41.passes.<name>` (the formulations it accepts,
its patterns), its op is `dsv41::<name>` in `dsv41.lowerings.<name>`, and `kernel` is the CuTe DSL kernel module
`dsv41.kernels.<kernel>` the op runs on Hopper (None: the reference only). `FUSIONS` is in run order, most specific
first: moe_finalize takes the TP combine before allreduce_mhc claims the post + pre sites behind an all-reduce, and
those before mhc_post_pre; moe_experts may come after moe_finalize, which binds the expert rows as its input (the
rows moe_experts' op then produces); moe_metadata's outputs (token, offsets, row weights) are graph values that
moe_experts and moe_finalize bind as inputs, so it may run before or after them. This module imports nothing heavy, so `dsv41.config` can read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fusion:
    name: str
    kernel: str | None = None

    @property
    def op(self) -> str:
        return f"dsv41::{self.name}"


FUSIONS = (
    Fusion("mhc_coeffs", kernel="mhc_coeffs"),
    Fusion("moe_finalize", kernel="moe_finalize"),
    Fusion("allreduce_mhc", kernel="mhc_post_pre"),
    Fusion("mhc_post_pre", kernel="mhc_post_pre"),
    Fusion("qkv_norm", kernel="qkv_norm"),
    Fusion("wo_a"),
    Fusion("indexer_topk", kernel="indexer_topk"),
    Fusion("moe_route", kernel="moe_route"),
    Fusion("moe_metadata", kernel="moe_metadata"),
    Fusion("moe_experts", kernel="moe_experts"),
)
FUSION_NAMES = tuple(f.name for f in FUSIONS)
