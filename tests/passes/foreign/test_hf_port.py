"""The Hugging Face port of DeepSeek-V4.1 (transformers' models/deepseek_v41) through the backend: a tiny 7-layer
config with every layer kind, batch 2, one decode step after a prefill, compiled with dynamic=False. Skipped until
an installed transformers release ships deepseek_v41 (5.24.0 does not).

Asserted: no graph falls back, the exact matches per fusion summed over the compiled graphs, and the logits agree
with eager (bf16 model: atol=rtol=2e-2; the argmax exactly).

Measured on 2026-12-01 with the port's source from the transformers repository dropped into transformers 5.24.0
(plus its cache-type registration in cache_utils), not committed; logits bit-equal to eager (last measured on
2026-12-02 with the modeling file at transformers commit 0a2080b: the same counts). Dynamo compiles one
graph per attention layer (7) and one MoE-gate graph that all 7 layers reuse. Per attention graph, qkv_norm,
mhc_post_pre and wo_a fuse once each and mhc_coeffs twice (both sites; the attention site's since its [B, 1, hc, D]
hidden state, a graph input read only through views, binds without its unit dim) (the port computes at [B, S=1, ...], which the normalisation's
unit-dim sinking brings to the patterns' [T, ...]; its RMSNorm rounds to bf16 before the weight multiply,
norm_rounding="bf16_then_weight"; its comb logits are scaled before their [hc, hc] view, a view the normalisation
moves below pointwise ops by scalars and like-viewed operands; its inverse RoPE takes the pairs by stride-2 slices
cast after slicing, cos/sin as bf16 [B, 1, rd/2], and the wo_a result is [B, 1, G*R]); moe_route fuses once in the MoE graph (7 of 7 sites
at run time), whose routing outputs leave it at the bincount break, which its note names. indexer_topk fuses at
all 3 index-source layers (visibility as iota >= n_c, the spare column's index as full_like, the softmax scale on
relu(q.k) before the head weights, score_scale); at the candidate source its scores also feed HF's block selection
(F.pad + amax + a scatter of the valid picks + repeat_interleave, which no pattern matches), so the op fuses the
top-k and returns the scores to that selection (return_scores), which stays in the graph. Not fused yet:
moe_finalize and the ffn-side mHC post (eager frames behind a bincount graph break and a data-dependent expert
loop). Any change here is a change of what the backend finds in the port:
update the counts with the reason."""

from __future__ import annotations

import pytest
import torch

modeling = pytest.importorskip("transformers.models.deepseek_v41.modeling_deepseek_v41")
configuration = pytest.importorskip("transformers.models.deepseek_v41.configuration_deepseek_v41")

from dsv41.backend import make_backend  # noqa: E402
from dsv41.passes.registry import FUSION_NAMES  # noqa: E402


def tiny_config():
    return configuration.DeepseekV41TextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=7, num_attention_heads=4, head_dim=32, q_lora_rank=32,
        qk_rope_head_dim=16, sliding_window=8, compress_ratios=[0, 0, 2, 2, 1, 1, 1],
        kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 6], candidate_source_layer_id=4,
        candidate_topk_blocks=2, candidate_block_size=4, index_n_heads=2, index_head_dim=32, index_topk=4, o_groups=2,
        o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, engram_layer_ids=[],
        num_nextn_predict_layers=0, torch_dtype=torch.bfloat16)


@torch.no_grad()
def test_hf_port_decode_step_is_fused():
    torch.manual_seed(0)
    # the port's own class: AutoModelForCausalLM does not map DeepseekV41TextConfig (measured on its source)
    model = modeling.DeepseekV41ForCausalLM._from_config(tiny_config(), dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, 256, (2, 12))
    out = model(prompt, use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    want = model(nxt, past_key_values=past, use_cache=True).logits

    out = model(prompt, use_cache=True)
    backend = make_backend(mode="fx", streams=False)
    step = torch.compile(model, backend=backend, dynamic=False)
    got = step(nxt, past_key_values=out.past_key_values, use_cache=True).logits
    assert all(r.fallback is None for r in backend.reports)
    fired = {name: sum(r.matches[name] for r in backend.reports) for name in FUSION_NAMES}
    assert fired == {**dict.fromkeys(FUSION_NAMES, 0), "qkv_norm": 7, "mhc_post_pre": 7, "mhc_coeffs": 14, "wo_a": 7,
                     "indexer_topk": 3, "moe_route": 1}, [r.near_misses for r in backend.reports]
    split = [(name, note) for r in backend.reports for name, note in r.notes.items() if "split by a graph break" in note]
    assert [name for name, _ in split] == ["moe_route"], split  # only the route, whose outputs leave at the break
    route_notes = [note for _, note in split]
    assert route_notes[0].startswith("split by a graph break?"), route_notes
    assert "Dynamic shape operator (aten.bincount.default)" in route_notes[0].split("Dynamo's latest graph breaks: ")[1]
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
