"""`moe_metadata`: the grouped-GEMM metadata of a routing, from the flat expert ids and weights to the rows the
expert GEMMs and the combine take.

    order = argsort(flat_experts, stable=True);  token = order // k
    offsets = cumsum(bincount(flat_experts, minlength=E)) (int32);  row_weights = flat_weights[order]
  -> dsv41::moe_metadata(flat_experts, flat_weights, k, E)

The pattern starts at the flat ids after any TP masking (the `where` that sends other ranks' pairs to local expert
0 stays outside, a plain input); k and E are read from the graph. Formulations: the model's (counts by an int32
scatter_add_, cumsum in int32: the ops of the op's reference, `dsv41.lowerings.moe_metadata.reference`), the same by
index_add_, and counts in int64 by scatter_add_, index_add_ or one_hot(...).sum(0) with the cumsum in int64 cast to
int32; torch.sort(..., stable=True).indices is the same graph as the stable argsort.
`bincount(minlength=E)` has no formulation: its output shape depends on the values, so it does not trace (Dynamo
breaks the graph there). An unstable argsort orders equal expert ids arbitrarily, so its rows differ from the
stable order's: declined with that reason.

The sort's permutation `order` may also be read outside the region (HF's grouped_mm experts: `inv_perm =
argsort(perm, stable=True)` puts the expert outputs back in pair order). Each formulation returns it as an optional
output (`Pattern.optional_outputs`), so such a reader is no extra user: the replacement serves it by the same stable
argsort of the flat ids, left in the graph beside the op. Exact: a stable sort's permutation is a function of its
keys alone (equal keys in index order), so it is the permutation the op sorts by. It is recomputed rather than
returned because none of the op's outputs determines it (token = order // k drops the slot, and the slots of one
token's pairs need not have distinct experts: under TP other ranks' pairs all go to local expert 0); the op's kernel
holds each pair's row and could write it out instead, saving that sort.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsv41.passes.fusion import Derived, FusionPass, Replacement
from dsv41.passes.matcher import Pattern

M, E = 18, 8
aten, prims = torch.ops.aten, torch.ops.prims
UNSTABLE = "unstable_argsort"


@dataclass(frozen=True)
class MetadataForm:
    """A formulation of the routing metadata: `counts`, how the per-expert counts are written ("scatter_add",
    "index_add": ones accumulated into zeros; "one_hot": one_hot(...).sum(0)); `int32_counts`, int32 counts summed by
    cumsum(dtype=int32), the model's (else int64 counts whose cumsum is cast); `stable`, the argsort stable (else
    declined: equal ids in any order)."""

    counts: str
    int32_counts: bool
    stable: bool = True


def _inputs():
    return [torch.empty(M, dtype=torch.int64), torch.empty(M)]


def _formulation(count, int32_counts):
    """The metadata with the counts of `count(flat_experts, E, dtype)`: int32 counts summed by cumsum(dtype=int32),
    as the model does, or int64 counts whose int64 cumsum is cast to int32; then the sort's permutation (the
    optional output)."""
    def metadata(flat_experts, flat_weights, topk, num_experts):
        order = torch.sort(flat_experts, stable=True).indices
        if int32_counts:
            offsets = torch.cumsum(count(flat_experts, num_experts, torch.int32), 0, dtype=torch.int32)
        else:
            offsets = count(flat_experts, num_experts, torch.int64).cumsum(0).to(torch.int32)
        return order // topk, offsets, flat_weights[order], order
    return metadata


def _accumulated(method: str):
    """Counts by an in-place accumulation of ones into zeros (`scatter_add_` or `index_add_`)."""
    def count(flat_experts, num_experts, dtype):
        zeros = torch.zeros(num_experts, dtype=dtype, device=flat_experts.device)
        return getattr(zeros, method)(0, flat_experts, torch.ones_like(flat_experts, dtype=dtype))
    return count


_scatter_add, _index_add = _accumulated("scatter_add_"), _accumulated("index_add_")


def _one_hot(flat_experts, num_experts, dtype):
    return F.one_hot(flat_experts, num_experts).sum(0)


# the counts of each MetadataForm.counts
COUNTS = {"scatter_add": _scatter_add, "index_add": _index_add, "one_hot": _one_hot}


def unstable_argsort(flat_experts, flat_weights, topk, num_experts):
    """The model's metadata with an unstable argsort (declined: equal ids in any order)."""
    order = torch.argsort(flat_experts)
    counts = _scatter_add(flat_experts, num_experts, torch.int64)
    return order // topk, counts.cumsum(0).to(torch.int32), flat_weights[order], order


class MoeMetadataPass(FusionPass):
    name = "moe_metadata"
    form_type = MetadataForm
    int_ranges = {"flat_experts": lambda metas, free: (0, free["num_experts"])}

    def patterns(self):
        topk = (aten.div.Tensor_mode, 0, 1)
        by_full = {"topk": topk, "num_experts": (aten.full.default, 0, (0, 0))}
        by_iota = {"topk": topk, "num_experts": (prims.iota.default, 0, 0)}
        defaults = {"topk": 6, "num_experts": E}
        forms = [("model", MetadataForm("scatter_add", True), by_full),
                 ("index_add", MetadataForm("index_add", True), by_full),
                 ("scatter_add_int64", MetadataForm("scatter_add", False), by_full),
                 ("index_add_int64", MetadataForm("index_add", False), by_full),
                 ("one_hot", MetadataForm("one_hot", False), by_iota),
                 (UNSTABLE, MetadataForm("scatter_add", False, stable=False), by_full)]
        return [Pattern(name, _formulation(COUNTS[form.counts], form.int32_counts) if form.stable else unstable_argsort,
                        _inputs, free, defaults, anchor=aten.sort.stable if form.stable else aten.sort.default,
                        optional_outputs=1, form=form)
                for name, form, free in forms]

    def tokens(self, m):
        return m.inputs[0].meta["val"].shape[0] // m.free["topk"]

    def check(self, m):
        if not m.pattern.form.stable:
            return ("an unstable argsort orders the pairs of one expert in any order, so its rows (token, "
                    "row_weights) are not the stable order's: a different computation, not fused")
        return None

    def replacement(self, m):
        flat_experts, flat_weights = m.inputs
        args = (flat_experts, flat_weights, m.free["topk"], m.free["num_experts"], self.config.kernel)
        order = Derived(aten.argsort.stable, (flat_experts,), (("stable", True),))
        outputs = (0, 1, 2, lambda _: order) if any(m.exposed) else (0, 1, 2)  # the permutation read outside
        return Replacement(torch.ops.dsv41.moe_metadata.default, args, outputs)
