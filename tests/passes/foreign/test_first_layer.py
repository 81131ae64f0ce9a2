"""A model's first layer: its residual streams are the token embedding expanded over the hc streams,
`e[:, None, :].expand(T, hc, D)`, a broadcast view rather than a tensor of its own. Each block below, wrapped so
that its streams input is that expand of a [T, D] embedding, fuses exactly the sites its own test declares for a
later layer, in the mode given; each fused op runs in the compiled step; the outputs agree with eager (selection
equal; h and x_new within one bf16 ulp of an fp32 reordering on 99% of elements; no NaN).

The TensorRT-LLM-style block reads the streams as `hidden_states.float()` under `bmm`s (no broadcasting op that
could drop the expand), so its first mhc_post_pre site fused only once the normaliser kept such a cast reading the
expanded value (before, `cast_above_expand` made it `expand(cast(e))`, a near miss at the expand)."""

from __future__ import annotations

import pytest
import torch

from . import export_style, test_export_style, test_trtllm_style, trtllm_style
from .blocks import assert_outputs_agree, compile_and_run, fused_sites


class FirstLayer(torch.nn.Module):
    """block(e[:, None, :].expand(T, hc, D), *rest): the block at layer 0, its streams the expanded embedding e."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, embedding, *rest):
        return self.block(embedding[:, None, :].expand(-1, self.block.hc, -1), *rest)


def first_layer_inputs(inputs):
    """The block's inputs with its streams [T, hc, D] replaced by an embedding [T, D] (the first stream)."""
    def make(seed, wrapped):
        streams, *rest = inputs(seed, wrapped.block)
        return (streams[:, 0].contiguous(), *rest)
    return make


BLOCKS = {"trtllm": (trtllm_style.TrtllmStyleBlock, trtllm_style.inputs, test_trtllm_style.SITES),
          "export": (export_style.ExportStyleBlock, export_style.inputs, test_export_style.SITES)}


@pytest.mark.parametrize("name, mode", [("trtllm", "fx"), ("trtllm", "inductor"), ("export", "fx")])
def test_first_layer_fuses_as_a_later_one(name, mode):
    block_class, inputs, sites = BLOCKS[name]
    backend, runs = compile_and_run(FirstLayer(block_class()), first_layer_inputs(inputs), (1, 2), mode)
    fused, report = fused_sites(backend)
    assert fused == sites, (fused, report.near_misses)
    assert_outputs_agree(runs)
