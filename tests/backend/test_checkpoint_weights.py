"""What the backend fuses on a weights="checkpoint" model today (docs/checkpoint_weights.md): layer 0 of TINY in `fx`
mode fuses every site it fuses on the bf16-held model, and the compiled step equals eager bit for bit; but no fused
op reads a stored format: `moe_experts` and `wo_a` take the bf16 weights that the dequantisation ops in front of
them materialise from the e4m3 / packed-FP4 / E8M0 inputs. (Issue #31's kernels and patterns change the second
half; the 8-layer counts, the same in both models, are in the doc.) One compile, about 2 minutes on a 2-core CPU.
"""

from __future__ import annotations

import torch

from dsv41.backend import make_backend
from dsv41.models import TINY, DSV41Model

from .test_tiny_model import expected_matches

STORED = (torch.float8_e4m3fn, torch.uint8, torch.float8_e8m0fnu)


def _ancestors(node):
    seen, stack = set(), [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


@torch.no_grad()
def test_checkpoint_model_fuses_like_bf16_on_dequantised_weights():
    torch._dynamo.reset()
    model = DSV41Model(TINY, [0], max_batch=3, max_context=64, weights="checkpoint")
    eager = DSV41Model(TINY, [0], max_batch=3, max_context=64, weights="bf16")
    backend = make_backend(mode="fx")
    graphs = []
    compile_graph = backend._compile_graph

    def capture(gm, inputs):
        graphs.append(gm)
        return compile_graph(gm, inputs)

    backend._compile_graph = capture
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    tokens, positions = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2])
    assert torch.equal(compiled(tokens, positions), eager(tokens, positions))
    (report,) = backend.reports
    assert report.fallback is None and report.matches == expected_matches(TINY, [0])
    assert all(not reasons for reasons in report.declined.values()), report.declined
    (gm,) = graphs
    fused = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("dsv41.")]
    assert fused and not any(getattr(a.meta.get("val"), "dtype", None) in STORED for n in fused for a in n.all_input_nodes)
    for name in ("dsv41.moe_experts.default", "dsv41.wo_a.default"):
        (node,) = [n for n in fused if str(n.target) == name]
        weights = [a for a in node.all_input_nodes if a.meta["val"].dim() == (3 if "moe" in name else 2)
                   and a.meta["val"].dtype == torch.bfloat16]
        assert weights, name
        for w in weights:  # each is dequantised from stored placeholders by ops outside the fused op
            stored = {a.meta["val"].dtype for a in _ancestors(w) if a.op == "placeholder"}
            assert stored & set(STORED) and torch.float8_e8m0fnu in stored, (name, w.name, stored)
    torch._dynamo.reset()
