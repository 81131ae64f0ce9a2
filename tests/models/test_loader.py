"""Tests of dsv41.models.loader: the FP8 / FP4 (de)quantisers on hand-made inputs, and checkpoint round trips
through the tiny model (full, layer subset, strict errors, ignored keys, TP shards)."""

import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsv41.models.model as model_module
from dsv41.models import TINY, DSV41Model
from dsv41.models.loader import (
    dequantize_fp4,
    dequantize_fp8,
    load_checkpoint,
    quantize_fp4,
    quantize_fp8,
    save_synthetic_checkpoint,
)

MAX_CONTEXT = 16


def _e8m0(exponents) -> torch.Tensor:
    """E8M0 scales 2^e from integer exponents, built from the raw bytes e + 127."""
    return (torch.tensor(exponents, dtype=torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _e4m3_value(byte: int) -> float:
    """Independent E4M3 (fn) decoder: sign bit 7, exponent bits 3-6 (bias 7), mantissa bits 0-2, subnormals."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e2m1_value(nibble: int) -> float:
    return (-1.0 if nibble & 8 else 1.0) * _E2M1[nibble & 7]


# ---------------------------------------------------------------- dequantisers on hand-made inputs


def test_dequantize_fp8_block_of_known_values():
    codes = [b if b not in (0x7F, 0xFF) else 0 for b in (i % 256 for i in range(32 * 32))]
    q = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).view(32, 32)
    expected = torch.tensor([_e4m3_value(b) * 2.0**-3 for b in codes]).view(32, 32)
    out = dequantize_fp8(q, _e8m0([[-3]]), dtype=torch.float32)
    assert torch.equal(out, expected)
    assert torch.equal(dequantize_fp8(q, _e8m0([[-3]])), expected.bfloat16())


def test_dequantize_fp8_scale_per_32x32_block_with_ragged_edges():
    q = torch.full((40, 70), 1.0).to(torch.float8_e4m3fn)  # 2 x 3 blocks, the last row/column blocks partial
    exps = [[-7 + 3 * i + j for j in range(3)] for i in range(2)]
    out = dequantize_fp8(q, _e8m0(exps), dtype=torch.float32)
    for r in range(40):
        for c in range(70):
            assert out[r, c].item() == 2.0 ** exps[r // 32][c // 32]


def test_dequantize_fp4_known_bytes():
    # 0xB2: low nibble 0x2 = +1.0 (element 0), high nibble 0xB = sign + code 3 = -1.5 (element 1)
    packed = torch.tensor([[0xB2] * 16], dtype=torch.uint8).view(torch.int8)
    out = dequantize_fp4(packed, _e8m0([[0]]), dtype=torch.float32)
    assert out[0, :2].tolist() == [1.0, -1.5]
    assert out.shape == (1, 32)


def test_dequantize_fp4_every_code_and_group_scales():
    # byte j of each row holds low nibble 15-j and high nibble j: all 16 codes (all magnitudes, both signs) twice
    row = [((j % 16) << 4) | (15 - j % 16) for j in range(32)]
    packed = torch.tensor([row, row], dtype=torch.uint8).view(torch.int8)  # [2, 32] -> K = 64, two groups per row
    exps = [[-1, 3], [0, -2]]
    out = dequantize_fp4(packed, _e8m0(exps), dtype=torch.float32)
    for r in range(2):
        for j, byte in enumerate(row):
            for k, nibble in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
                assert out[r, k].item() == _e2m1_value(nibble) * 2.0 ** exps[r][k // 32]
    assert sorted({abs(v) for v in out[1, :32].tolist()}) == _E2M1  # every magnitude at scale 2^0


def test_quantize_fp8_scale_choice_and_exact_values():
    w = torch.zeros(32, 96)
    w[:, :32] = 448 * 2.0**-3 * torch.linspace(-1, 1, 32)  # amax exactly 448 * 2^-3 -> scale 2^-3
    w[:, 32:64] = 56.5 * torch.linspace(-1, 1, 32)  # amax just above 448 * 2^-3 -> 2^-2; third block all zero
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.view(torch.uint8).tolist() == [[127 - 3, 127 - 2, 1]]
    assert q[0, 0].float().item() == -448.0
    grid = torch.tensor([_e4m3_value(b) for b in range(0x7F)]) * 2.0**-5
    exact = grid[torch.arange(64 * 64) % len(grid)].view(64, 64)
    assert torch.equal(dequantize_fp8(*quantize_fp8(exact), dtype=torch.float32), exact)


def test_quantize_fp4_round_half_even_and_packing():
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 0.3, -6.0, 2.9, 4.9, 5.1]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, -4.0, 0.5, -6.0, 3.0, 4.0, 6.0]
    w = torch.tensor([vals + [0.0] * 16, [6.5] + [0.0] * 31])  # row 1: amax 6.5 -> scale 2, 6.5 / 2 = 3.25 -> 3
    packed, s = quantize_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (2, 16) and s.view(torch.uint8).tolist() == [[127], [128]]
    out = dequantize_fp4(packed, s, dtype=torch.float32)
    assert out[0, :16].tolist() == want and out[1, 0].item() == 6.0
    # element 0 = 6.0 (code 7) in the low nibble, element 1 = 0.0 (code 0) high; -0.25 -> -0 keeps its sign bit
    assert packed.view(torch.uint8)[0, :5].tolist() == [0x07, 0x22, 0x44, 0x66, 0xC8]


# ---------------------------------------------------------------- checkpoint round trips

FP8_PARAMS = {"attn.wqkv_a", "attn.wq_b", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b", "ffn.shared_w13", "ffn.shared_w2"}
FP4_PARAMS = {"ffn.w13", "ffn.w2"}
FP32_IN_CHECKPOINT = {"attn.attn_sink", "ffn.gate_bias"} | {f"hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")}


def _expected(name: str, p: torch.Tensor) -> torch.Tensor:
    """What parameter `name` holds after a save/load round trip. Merged FP8 tensors (wq_a | wkv, w1 | w3) and TP
    row/column slices all start at multiples of 32 in TINY, so quantising the merged / sliced tensor as a whole
    gives the same 32x32 blocks as quantising each checkpoint tensor."""
    local = re.sub(r"^layers\.\d+\.", "", name)
    if local in FP8_PARAMS:
        return dequantize_fp8(*quantize_fp8(p.float()), dtype=p.dtype)
    if local in FP4_PARAMS:
        return torch.stack([dequantize_fp4(*quantize_fp4(w.float()), dtype=p.dtype) for w in p])
    if local in FP32_IN_CHECKPOINT:
        return p.detach().clone()
    return p.detach().bfloat16().to(p.dtype)


def _tiny(seed: int, layer_ids=None) -> DSV41Model:
    return DSV41Model(TINY, layer_ids, max_batch=2, max_context=MAX_CONTEXT, seed=seed)


@pytest.fixture(scope="module")
def model0():
    return _tiny(0)


@pytest.fixture(scope="module")
def expected0(model0):
    return {name: _expected(name, p) for name, p in model0.named_parameters()}


@pytest.fixture(scope="module")
def ckpt(model0, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    files = save_synthetic_checkpoint(model0, path, shards=2)
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    return path


def _rewrite(ckpt, dest, edit) -> None:
    """Copy the checkpoint into one file under `dest` after `edit(tensors)` changed the dict in place."""
    tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(f))
    edit(tensors)
    dest.mkdir()
    save_file(tensors, dest / "model.safetensors")


def test_round_trip_parameters_and_logits(model0, expected0, ckpt):
    assert TINY.q_lora_rank % 32 == 0 and TINY.moe_inter_dim % 32 == 0
    model1 = _tiny(1)
    report = load_checkpoint(model1, ckpt)
    assert sorted(report.loaded) == sorted(expected0)
    assert not report.skipped and not report.missing and not report.mismatched
    for name, p in model1.named_parameters():
        assert p.dtype == expected0[name].dtype, name
        assert torch.equal(p, expected0[name]), name
    model0q = _tiny(0)
    with torch.no_grad():
        for name, p in model0q.named_parameters():
            p.copy_(expected0[name])
    tokens = torch.tensor([3, 77])
    for step in range(2):
        pos = torch.full((2,), step)
        assert torch.equal(model1(tokens, pos), model0q(tokens, pos))


def test_layer_subset_reads_only_its_layers(expected0, ckpt):
    sub = _tiny(1, [0, 2, 3])
    report = load_checkpoint(sub, ckpt)
    for name, p in sub.named_parameters():
        assert torch.equal(p, expected0[name]), name
    layers_read = {int(m.group(1)) for k in report.keys_read if (m := re.match(r"layers\.(\d+)\.", k))}
    assert layers_read == {0, 2, 3}
    assert report.skipped["layers.4.attn.wq_a.scale"] == "layer not in the model"
    assert set(report.skipped.values()) == {"layer not in the model"}


def test_strict_names_missing_key_and_leaves_model_untouched(ckpt, tmp_path):
    def drop(t):
        del t["layers.3.attn.wkv"], t["layers.3.attn.wkv.scale"]

    _rewrite(ckpt, tmp_path / "c", drop)
    model = _tiny(1)
    before = model.layers["0"].attn.wqkv_a.clone()
    with pytest.raises(ValueError, match=r"unset layers\.3\.attn\.wqkv_a: checkpoint lacks layers\.3\.attn\.wkv"):
        load_checkpoint(model, tmp_path / "c")
    assert torch.equal(model.layers["0"].attn.wqkv_a, before)
    report = load_checkpoint(model, tmp_path / "c", strict=False)
    assert report.missing == {"layers.3.attn.wqkv_a": ["layers.3.attn.wkv"]}
    assert "layers.3.attn.wqkv_a" not in report.loaded and "layers.0.attn.wqkv_a" in report.loaded
    assert "not loaded" in report.skipped["layers.3.attn.wq_a"]
    assert torch.equal(model.layers["3"].attn.wqkv_a, _tiny(1).layers["3"].attn.wqkv_a)


def test_strict_names_shape_mismatches(ckpt, tmp_path):
    def reshape(t):
        t["layers.0.attn_norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
        t["layers.5.attn.wo_b"], t["layers.5.attn.wo_b.scale"] = quantize_fp8(torch.ones(128, 32))

    _rewrite(ckpt, tmp_path / "c", reshape)
    with pytest.raises(ValueError) as err:
        load_checkpoint(_tiny(1), tmp_path / "c")
    msg = str(err.value)
    assert "checkpoint layers.0.attn_norm.weight has shape [64], the model expects [128]" in msg
    assert "checkpoint layers.5.attn.wo_b has shape [128, 32], the model expects [128, 64]" in msg
    report = load_checkpoint(_tiny(1), tmp_path / "c", strict=False)
    assert set(report.mismatched) == {"layers.0.attn_norm", "layers.5.attn.wo_b"}


def test_malformed_scale_raises_even_when_not_strict(ckpt, tmp_path):
    _rewrite(ckpt, tmp_path / "c", lambda t: t.pop("layers.1.attn.wo_a.scale"))
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wo_a\.scale is missing"):
        load_checkpoint(_tiny(1), tmp_path / "c", strict=False)


def test_out_of_scope_keys_are_skipped(ckpt, tmp_path):
    def add(t):
        t["mtp.0.attn.wq_a"] = torch.zeros(4, 4, dtype=torch.bfloat16)
        t["layers.1.engram.wkv"], t["layers.1.engram.wkv.scale"] = quantize_fp8(torch.ones(32, 32))
        t["layers.0.ffn.gate.bias_vl"] = torch.zeros(16)
        t["vision.proj"] = torch.zeros(2)

    _rewrite(ckpt, tmp_path / "c", add)
    report = load_checkpoint(_tiny(1), tmp_path / "c")
    assert report.skipped == {
        "mtp.0.attn.wq_a": "mtp (out of scope)",
        "layers.1.engram.wkv": "engram (out of scope)",
        "layers.1.engram.wkv.scale": "engram (out of scope)",
        "layers.0.ffn.gate.bias_vl": "bias_vl (image tokens only; text-only decode)",
        "vision.proj": "not used by the model",
    }


def _tiny_tp(monkeypatch, seed, rank, world=2) -> DSV41Model:
    """A TP shard built as under torch.distributed: the model asks `_tp()` for its rank."""
    monkeypatch.setattr(model_module, "_tp", lambda: (rank, world))
    return _tiny(seed)


def test_tp_shard_slices_like_the_random_init(ckpt, monkeypatch):
    # the sharded seed-0 model holds exactly the slices of the full one, so its round trip is the expectation
    ref = _tiny_tp(monkeypatch, 0, rank=1)
    shard = _tiny_tp(monkeypatch, 1, rank=1)
    assert (shard.tp_rank, shard.tp_size) == (1, 2) and shard.layers["0"].ffn.w13.shape[0] == 8
    report = load_checkpoint(shard, ckpt)
    ref_params = dict(ref.named_parameters())
    for name, p in shard.named_parameters():
        assert torch.equal(p, _expected(name, ref_params[name])), name
    assert report.skipped["layers.0.ffn.experts.7.w1"] == "routed expert of another TP rank"
    assert "layers.0.ffn.experts.8.w2.scale" in report.keys_read
    # an explicit tp overrides the model's own rank
    ref0 = _tiny_tp(monkeypatch, 0, rank=0)
    load_checkpoint(shard, ckpt, tp=(0, 2))
    shard_params = dict(shard.named_parameters())
    for name in ("layers.2.attn.wq_b", "layers.2.attn.wo_b", "layers.2.attn.attn_sink", "layers.2.ffn.w2"):
        assert torch.equal(shard_params[name], _expected(name, dict(ref0.named_parameters())[name])), name


def test_refuses_shared_routed_experts(ckpt, tmp_path):
    model = DSV41Model(TINY, max_batch=2, max_context=MAX_CONTEXT, share_routed_experts=True)
    with pytest.raises(ValueError, match="share_routed_experts"):
        load_checkpoint(model, ckpt)
    with pytest.raises(ValueError, match="share_routed_experts"):
        save_synthetic_checkpoint(model, tmp_path / "c")


def test_argument_errors_name_the_argument(model0, ckpt, tmp_path):
    with pytest.raises(ValueError, match="path_or_dir"):
        load_checkpoint(model0, tmp_path / "absent")
    with pytest.raises(ValueError, match="path_or_dir: no"):
        load_checkpoint(model0, tmp_path)
    with pytest.raises(ValueError, match="tp"):
        load_checkpoint(model0, ckpt, tp=(2, 2))
    with pytest.raises(ValueError, match="tp"):
        load_checkpoint(model0, ckpt, tp=(0, 3))
    with pytest.raises(ValueError, match="strict"):
        load_checkpoint(model0, ckpt, strict="yes")
    with pytest.raises(ValueError, match="model"):
        load_checkpoint(torch.nn.Linear(2, 2), ckpt)
    with pytest.raises(ValueError, match="shards"):
        save_synthetic_checkpoint(model0, tmp_path / "c", shards=0)
    with pytest.raises(ValueError, match="path"):
        save_synthetic_checkpoint(model0, ckpt)
    with pytest.raises(ValueError, match="scale"):
        dequantize_fp8(torch.zeros(32, 64).to(torch.float8_e4m3fn), _e8m0([[0]]))
    with pytest.raises(ValueError, match="w has K=48"):
        quantize_fp4(torch.zeros(2, 48))
