"""The eager TINY decode step and its `torch.compile(backend="inductor", fullgraph=True)` form agree.

Layers [0, 2, 3, 4, 6] cover every schedule kind that changes the graph: window-only (0), ratio-2 kv/index
source (2) and its consumer (3), ratio-1 source with the candidate indexer (4), and the re-index layer (6).
Compiling them takes ~70 s on a 2-core CPU (cold Inductor cache); the three compiled steps then take ms.

Why `emulate_precision_casts`: the model is discontinuous by design. FP8/FP4 fake-quant rounds to a coarse
grid and the indexer / router / candidate blocks take top-k, so a 1-ulp bf16 difference upstream (Inductor
otherwise keeps fused intermediates in fp32 where eager rounds to bf16) can flip a quantisation bucket or a
selection, and the logits then differ by far more than any rounding tolerance. With the emulation, Inductor
rounds every intermediate where eager does, and on this CPU the result is bit-exact.
"""

from __future__ import annotations

import torch

from dsv41.models import TINY, DSV41Model

LAYERS = [0, 2, 3, 4, 6]


def _cache_buffers(model: DSV41Model) -> dict[str, torch.Tensor]:
    return {name: buf for name, buf in model.named_buffers() if not name.startswith("inv_freq")}


@torch.no_grad()
def test_compiled_decode_matches_eager_logits_and_caches():
    torch._dynamo.reset()
    eager = DSV41Model(TINY, LAYERS, max_batch=2, max_context=32)
    target = DSV41Model(TINY, LAYERS, max_batch=2, max_context=32)  # same seed: identical weights
    names = set(_cache_buffers(eager))
    assert {n.rsplit(".", 1)[-1] for n in names} == {"window_kv", "compress_kv", "index_k", "kv_state", "score_state"}

    # Warm both caches eagerly so that the compiled steps see a wrapped window ring, N_c above index_topk and
    # more candidate blocks than are kept: request 0 decodes positions 0..9, request 1 positions 3..12.
    g = torch.Generator().manual_seed(0)
    for p in range(10):
        tok = torch.randint(0, TINY.vocab_size, (2,), generator=g)
        pos = torch.tensor([p, p + 3])
        eager(tok, pos)
        target(tok, pos)

    compiled = torch.compile(target, backend="inductor", fullgraph=True)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        for p in range(10, 13):  # positions 10, 11, 12 / 13, 14, 15: both ratio-2 branches on both requests
            tok = torch.randint(0, TINY.vocab_size, (2,), generator=g)
            pos = torch.tensor([p, p + 3])
            ref = eager(tok, pos)
            out = compiled(tok, pos)
            assert out.dtype == torch.float32 and out.shape == ref.shape
            # bf16-level tolerance on fp32 logits (the run is bit-exact here; see the module docstring)
            torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
            got = _cache_buffers(target)
            for name, buf in _cache_buffers(eager).items():
                assert torch.equal(got[name], buf), f"cache {name} diverged at step {p}"
    torch._dynamo.reset()
