"""weights="checkpoint" (issue #31, the model and loader side): the model holds the FP8 / FP4 GEMM weights as the
checkpoint stores them (spec 1.3) and the head in bf16, and dequantises right before each GEMM.

- the forward's dequantisation helpers (`fn.dequant_fp8_blocks`, `fn.dequant_fp4`) bit for bit against the
  loader's dequantisers and against values decoded here from the bit fields, over every e4m3 / e2m1 code and every
  E8M0 scale byte (byte 255 and e4m3 0x7F / 0xFF are NaN, as torch's dtypes and the OCP MX formats define them;
  the spec says nothing of NaN codes);
- weights="checkpoint" and weights="bf16" built with the same seed hold the same values and give bit-identical
  logits (eager, CPU);
- the checkpoint-held model's parameter bytes are the formats' bytes, by arithmetic from the config;
- save / load round trips in both formats, a load that never dequantises, a TP shard, bad `weights` values.
"""

import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsv41.models.loader as loader
import dsv41.models.model as model_module
from dsv41.models import TINY, DSV41Model
from dsv41.models import functional as fn
from dsv41.models.config import ModelConfig
from dsv41.models.loader import dequantize_fp4, dequantize_fp8, load_checkpoint, save_synthetic_checkpoint

MAX_CONTEXT = 16
BF16, E8M0 = torch.bfloat16, torch.float8_e8m0fnu


def _e4m3_value(byte: int) -> float:
    """E4M3 (fn) from its bit fields: sign bit 7, exponent bits 3-6 (bias 7), mantissa bits 0-2, subnormals."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    return sign * (man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))


def _e2m1_value(nibble: int) -> float:
    """E2M1 from its bit fields: sign bit 3, exponent bits 1-2 (bias 1), mantissa bit 0, subnormal at exponent 0."""
    sign = -1.0 if nibble & 8 else 1.0
    exp, man = (nibble >> 1) & 3, nibble & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


def _e8m0_value(byte: int) -> float:
    return math.nan if byte == 255 else 2.0 ** (byte - 127)


def _exact(values: list[float], shape, dtype) -> torch.Tensor:
    """The values (exact in fp64) in `dtype`: rounded once, from fp32, which holds every product here exactly or
    overflows it (to inf, as the fp32 product does)."""
    return torch.tensor(values, dtype=torch.float64).float().to(dtype).view(shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN (and nowhere else)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(0.0, 0.0, 0.0), b.nan_to_num(0.0, 0.0, 0.0)) and torch.equal(a.isinf(), b.isinf())


SCALE_BYTES = list(range(256))  # every E8M0 scale: 2^-127 .. 2^127 and NaN


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_dequant_fp8_blocks_every_code_and_scale(dtype):
    # block row r (32 rows) has scale byte r in all 8 column blocks; every row holds the 256 e4m3 codes in order
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    w = codes.repeat(32 * len(SCALE_BYTES), 1).view(torch.float8_e4m3fn)  # [8192, 256]
    scale = torch.tensor(SCALE_BYTES, dtype=torch.uint8).unsqueeze(1).expand(-1, 8).contiguous().view(E8M0)
    out = fn.dequant_fp8_blocks(w, scale, dtype)
    assert _same(out, dequantize_fp8(w, scale, dtype))
    want = _exact([_e4m3_value(c) * _e8m0_value(b) for b in SCALE_BYTES for c in range(256)], (len(SCALE_BYTES), 256), dtype)
    assert _same(out[::32], want)
    assert _same(out.view(len(SCALE_BYTES), 32, 256), out[::32].unsqueeze(1).expand(-1, 32, -1))
    nan = out[::32].isnan()
    assert nan[:, [0x7F, 0xFF]].all() and nan[-1].all() and nan.sum() == 2 * 255 + 256  # NaN codes and scale byte 255
    # exact in bf16 where the product is a normal bf16 number: scale bytes 100..150 cover 2^-36 .. 448 * 2^23
    normal = [b for b in SCALE_BYTES if 100 <= b <= 150]
    finite = torch.tensor([c not in (0x7F, 0xFF) for c in range(256)])
    assert torch.equal(out[::32][normal][:, finite].double(), torch.tensor(
        [[_e4m3_value(c) * _e8m0_value(b) for c in range(256) if finite[c]] for b in normal], dtype=torch.float64))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_dequant_fp4_every_code_and_scale(dtype):
    # one 32-wide group per row: byte j = code j (low nibble, element 2j) | code 15-j (high nibble, element 2j+1)
    row = [(j % 16) | ((15 - j % 16) << 4) for j in range(16)]
    packed = torch.tensor([row] * len(SCALE_BYTES), dtype=torch.uint8)
    scale = torch.tensor(SCALE_BYTES, dtype=torch.uint8).view(-1, 1).view(E8M0)
    out = fn.dequant_fp4(packed, scale, dtype)
    assert out.shape == (256, 32)
    assert _same(out, dequantize_fp4(packed.view(torch.int8), scale, dtype))
    nibbles = [n for j in range(16) for n in (row[j] & 0xF, row[j] >> 4)]
    assert sorted(set(nibbles)) == list(range(16))
    want = _exact([_e2m1_value(n) * _e8m0_value(b) for b in SCALE_BYTES for n in nibbles], (256, 32), dtype)
    assert _same(out, want)
    assert out[-1].isnan().all() and not out[:-1].isnan().any()
    assert out[127, :2].tolist() == [0.0, -6.0] and out[127, 2:4].tolist() == [0.5, -4.0]  # scale 1: the table itself
    assert torch.equal(torch.signbit(out[127, 16::2]), torch.ones(8, dtype=torch.bool))  # codes 8..15: sign set (-0)


def test_dequant_helpers_on_expert_stacks_and_shape_errors():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 64, 48), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(110, 140, (3, 64, 3), generator=g, dtype=torch.int32).to(torch.uint8).view(E8M0)
    out = fn.dequant_fp4(packed, scale)
    assert out.shape == (3, 64, 96) and out.dtype == BF16
    for e in range(3):
        assert torch.equal(out[e], dequantize_fp4(packed[e], scale[e]))
    w = torch.randint(0, 126, (2, 64, 96), generator=g, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    ws = torch.randint(110, 140, (2, 2, 3), generator=g, dtype=torch.int32).to(torch.uint8).view(E8M0)
    out = fn.dequant_fp8_blocks(w, ws)
    for e in range(2):
        assert torch.equal(out[e], dequantize_fp8(w[e], ws[e]))
    with pytest.raises(ValueError, match=r"dequant_fp8_blocks: weight \[40, 96\] needs N, K multiples of 32"):
        fn.dequant_fp8_blocks(w[0, :40], ws[0])
    with pytest.raises(ValueError, match=r"dequant_fp4: packed \[64, 48\] .* got scale \[64, 2\]"):
        fn.dequant_fp4(packed[0], scale[0, :, :2])


# ---------------------------------------------------------------- the model


def _tiny(weights: str, seed: int = 0, layer_ids=None) -> DSV41Model:
    return DSV41Model(TINY, layer_ids, max_batch=3, max_context=MAX_CONTEXT, seed=seed, weights=weights)


@pytest.fixture(scope="module")
def pair():
    return _tiny("bf16"), _tiny("checkpoint")


def _dequantised(model: DSV41Model) -> dict[str, torch.Tensor]:
    """The checkpoint-held model's parameters as values (FP8 / FP4 dequantised to bf16, the head widened to fp32)."""
    params = dict(model.named_parameters())
    out = {}
    for name, p in params.items():
        if p.dtype == E8M0:  # read with its weight
            continue
        if p.dtype == torch.float8_e4m3fn:
            out[name] = fn.dequant_fp8_blocks(p, params[name + "_scale"])
        elif p.dtype == torch.uint8:
            out[name] = fn.dequant_fp4(p, params[name + "_scale"])
        else:
            out[name] = p.float() if name == "head" else p
    return out


FP8_HELD = {"attn.wqkv_a", "attn.wq_b", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b", "ffn.shared_w13", "ffn.shared_w2"}
FP4_HELD = {"ffn.w13", "ffn.w2"}


def test_checkpoint_model_holds_the_stored_formats(pair):
    bf16, ckpt = pair
    held = {}
    for name, p in ckpt.named_parameters():
        local = re.sub(r"^layers\.\d+\.", "", name)
        held.setdefault(local, set()).add(p.dtype)
    for local in FP8_HELD:
        assert held[local] == {torch.float8_e4m3fn} and held[local + "_scale"] == {E8M0}, local
    for local in FP4_HELD:
        assert held[local] == {torch.uint8} and held[local + "_scale"] == {E8M0}, local
    assert held["head"] == {BF16}
    others = set(held) - FP8_HELD - FP4_HELD - {f"{n}_scale" for n in FP8_HELD | FP4_HELD} - {"head"}
    bf16_params = dict(bf16.named_parameters())
    for name, p in ckpt.named_parameters():  # norms, mHC, router, compressor, sink, embed: as the bf16 model holds them
        if re.sub(r"^layers\.\d+\.", "", name) in others:
            assert p.dtype == bf16_params[name].dtype and torch.equal(p, bf16_params[name]), name
    assert not any(p.dtype == E8M0 for p in bf16.parameters())
    assert bf16.head.dtype == torch.float32 and torch.equal(bf16.head, ckpt.head.float())


def test_same_seed_same_values(pair):
    bf16, ckpt = pair
    values = _dequantised(ckpt)
    bf16_params = dict(bf16.named_parameters())
    assert values.keys() == bf16_params.keys()
    for name, p in bf16_params.items():
        assert values[name].dtype == p.dtype and torch.equal(values[name], p), name


@torch.no_grad()
def test_same_seed_bit_identical_logits(pair):
    bf16, ckpt = pair
    bf16.reset_caches(), ckpt.reset_caches()
    for step in range(6):  # ratio-2 entries complete at odd positions; row 2 runs ahead
        tokens, positions = torch.tensor([1, 77, 300]) + step, torch.tensor([step, step + 3, 2 * step])
        got, want = ckpt(tokens, positions), bf16(tokens, positions)
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert torch.equal(got, want), f"step {step}: max |diff| {(got - want).abs().max().item()}"


def format_bytes(cfg: ModelConfig, layer_ids, world: int = 1) -> dict[str, int]:
    """Bytes of the weights a weights="checkpoint" model holds in the checkpoint's formats, by arithmetic:
    FP8 [N, K]: N*K + (N/32)*(K/32) (one e4m3 byte a value, one E8M0 byte a 32x32 block); FP4 [N, K] per
    expert: N*K/2 + N*K/32 (two e2m1 a byte, one E8M0 byte per 32 along K); the bf16 head 2*V*D."""
    def fp8(n, k):
        return n * k + (n // 32) * (k // 32)

    def fp4(n, k):
        return n * k // 2 + n * k // 32

    d, hd, ql, inter = cfg.dim, cfg.head_dim, cfg.q_lora_rank, cfg.moe_inter_dim
    out = {"head": 2 * cfg.vocab_size * d}
    for layer in layer_ids:
        attn = fp8(ql + hd, d) + fp8(cfg.n_heads * hd // world, ql) + fp8(cfg.o_groups * cfg.o_lora_rank // world,
                                                                          cfg.n_heads // cfg.o_groups * hd)
        attn += fp8(d, cfg.o_groups * cfg.o_lora_rank // world)
        if layer in cfg.index_source_layers:
            attn += fp8(cfg.index_n_heads * cfg.index_head_dim, ql)
        out[f"layers.{layer}.attn"] = attn
        out[f"layers.{layer}.shared_expert"] = fp8(2 * inter, d) + fp8(d, inter)
        out[f"layers.{layer}.routed_experts"] = cfg.n_routed_experts // world * (fp4(2 * inter, d) + fp4(d, inter))
    return out


def test_parameter_bytes_are_the_formats_bytes(pair):
    bf16, ckpt = pair
    want = format_bytes(TINY, range(TINY.n_layers))
    got: dict[str, int] = {}
    for name, p in ckpt.named_parameters():
        local = re.sub(r"^layers\.\d+\.", "", name).removesuffix("_scale")
        prefix = name[: len(name) - len(re.sub(r"^layers\.\d+\.", "", name))]
        group = ("attn" if local in FP8_HELD and local.startswith("attn.") else "shared_expert" if local in FP8_HELD
                 else "routed_experts" if local in FP4_HELD else "head" if local == "head" else None)
        if group:
            key = "head" if group == "head" else prefix + group
            got[key] = got.get(key, 0) + p.numel() * p.element_size()
    assert got == want
    # TINY by hand: layer 0 (no indexer) wqkv_a [128, 128] + wq_b [512, 64] + wo_a [64, 256] + wo_b [128, 64] in
    # e4m3 with 16 + 32 + 16 + 8 scale bytes; 16 experts x (w13 [128, 128] + w2 [128, 64]) FP4 + E8M0 per 32
    assert want["layers.0.attn"] == 16384 + 16 + 32768 + 32 + 16384 + 16 + 8192 + 8
    assert want["layers.0.routed_experts"] == 16 * (8192 + 512 + 4096 + 256) and want["head"] == 2 * 512 * 128
    # the rest of the model holds exactly what the bf16 model holds
    ckpt_total = sum(p.numel() * p.element_size() for p in ckpt.parameters())
    bf16_held = sum(p.numel() * p.element_size() for n, p in bf16.named_parameters()
                    if re.sub(r"^layers\.\d+\.", "", n) in FP8_HELD | FP4_HELD or n == "head")
    bf16_total = sum(p.numel() * p.element_size() for p in bf16.parameters())
    assert ckpt_total == bf16_total - bf16_held + sum(want.values())


def test_bad_weights_values_name_the_argument():
    for bad in ("fp8", "BF16", None, 1, ["bf16"]):
        with pytest.raises(ValueError, match=r"weights must be one of \('bf16', 'checkpoint'\), got "):
            DSV41Model(TINY, [0], max_batch=1, max_context=16, weights=bad)


def test_shared_routed_experts_share_the_scales():
    m = DSV41Model(TINY, [0, 1], max_batch=1, max_context=16, weights="checkpoint", share_routed_experts=True)
    a, b = m.layers["0"].ffn, m.layers["1"].ffn
    assert a.w13 is b.w13 and a.w13_scale is b.w13_scale and a.w2_scale is b.w2_scale


# ---------------------------------------------------------------- the loader


@pytest.fixture(scope="module")
def saved(pair, tmp_path_factory):
    """The checkpoint-held and the bf16-held seed-0 models, each saved."""
    root = tmp_path_factory.mktemp("ckw")
    save_synthetic_checkpoint(pair[1], root / "from_checkpoint")
    save_synthetic_checkpoint(pair[0], root / "from_bf16")
    return root


def _bytes(p: torch.Tensor) -> torch.Tensor:
    return p.view(torch.uint8) if p.element_size() == 1 else p


def test_save_writes_the_held_bytes(pair, saved):
    ckpt = pair[1]
    tensors = {}
    for f in sorted((saved / "from_checkpoint").glob("*.safetensors")):
        tensors.update(load_file(f))
    attn, ffn, ql = ckpt.layers["2"].attn, ckpt.layers["2"].ffn, TINY.q_lora_rank
    assert tensors["layers.2.attn.wq_a"].dtype == torch.float8_e4m3fn and tensors["layers.2.attn.wq_a.scale"].dtype == E8M0
    assert torch.equal(_bytes(tensors["layers.2.attn.wq_a"]), _bytes(attn.wqkv_a[:ql]))
    assert torch.equal(_bytes(tensors["layers.2.attn.wkv.scale"]), _bytes(attn.wqkv_a_scale[ql // 32:]))
    w3 = tensors["layers.2.ffn.experts.5.w3"]
    assert w3.dtype == torch.int8 and w3.shape == (TINY.moe_inter_dim, TINY.dim // 2)  # the checkpoint's I8
    assert torch.equal(w3.view(torch.uint8), ffn.w13[5, TINY.moe_inter_dim:])
    assert torch.equal(_bytes(tensors["layers.2.ffn.experts.5.w3.scale"]), _bytes(ffn.w13_scale[5, TINY.moe_inter_dim:]))
    assert tensors["head.weight"].dtype == BF16 and torch.equal(tensors["head.weight"], ckpt.head)


def _expected_float(name: str, p: torch.Tensor) -> torch.Tensor:
    """A float parameter after a round trip: the checkpoint stores it in bf16 or fp32 (the loader's test)."""
    return p if "attn_sink" in name or "gate_bias" in name or "hc_" in name else p.bfloat16().to(p.dtype)


@pytest.mark.parametrize("source", ["from_checkpoint", "from_bf16"])
def test_round_trip_into_a_checkpoint_held_model(pair, saved, source):
    ckpt = pair[1]
    model = _tiny("checkpoint", seed=1)
    report = load_checkpoint(model, saved / source)
    assert report.weights == "checkpoint" and not report.missing and not report.mismatched and not report.skipped
    assert report.held["layers.6.attn.indexer.wq_b"] == report.held["layers.0.ffn.w2"] == "as stored"
    assert report.formats["layers.0.ffn.experts.3.w1"] == "fp4" and report.formats["layers.0.attn.wo_b"] == "fp8"
    assert report.formats["layers.0.ffn.experts.3.w1.scale"] == "e8m0" and report.formats["head.weight"] == "bf16"
    assert not any(n.endswith("_scale") and n.removesuffix("_scale") in report.loaded for n in report.loaded)
    got, want = _dequantised(model), _dequantised(ckpt)
    for name, p in got.items():
        assert torch.equal(p, _expected_float(name, want[name])), name
    if source == "from_checkpoint":  # the stored bytes themselves
        ref = dict(ckpt.named_parameters())
        for name, p in model.named_parameters():
            if p.element_size() == 1:
                assert torch.equal(_bytes(p), _bytes(ref[name])), name


def test_round_trip_into_a_bf16_model(pair, saved):
    model = _tiny("bf16", seed=1)
    report = load_checkpoint(model, saved / "from_checkpoint")
    assert report.weights == "bf16" and report.held["layers.0.ffn.w13"] == "dequantised fp4 -> bf16"
    assert report.held["layers.0.attn.wqkv_a"] == "dequantised fp8 -> bf16" and report.held["head"] == "bf16 -> fp32"
    for name, p in pair[0].named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], _expected_float(name, p)), name


def test_checkpoint_load_never_dequantises(saved, monkeypatch):
    """No FP8 / FP4 tensor passes through a dequantiser or a float cast on the way into a checkpoint-held model."""
    def refuse(*args, **kwargs):
        raise AssertionError("dequantised during a weights='checkpoint' load")

    real_read = loader._read

    def read(ck, key, dtype):
        assert ck.header(key)[0] not in ("F8_E4M3", "I8", "U8"), key
        return real_read(ck, key, dtype)

    monkeypatch.setattr(loader, "dequantize_fp8", refuse)
    monkeypatch.setattr(loader, "dequantize_fp4", refuse)
    monkeypatch.setattr(loader, "_read", read)
    load_checkpoint(_tiny("checkpoint", seed=1, layer_ids=[0, 2, 3]), saved / "from_checkpoint")


def test_float_stored_weight_is_quantised_on_load(pair, saved, tmp_path):
    """A checkpoint with `wo_a` already dequantised to bf16 (the reference's convert.py) loads into both models."""
    tensors = {}
    for f in sorted((saved / "from_checkpoint").glob("*.safetensors")):
        tensors.update(load_file(f))
    tensors["layers.1.attn.wo_a"] = dequantize_fp8(tensors["layers.1.attn.wo_a"], tensors.pop("layers.1.attn.wo_a.scale"))
    (tmp_path / "c").mkdir()
    save_file(tensors, tmp_path / "c" / "model.safetensors")
    model = _tiny("checkpoint", seed=1, layer_ids=[0, 1])
    report = load_checkpoint(model, tmp_path / "c", strict=False)
    assert report.held["layers.1.attn.wo_a"] == "quantised to fp8 on load (stored torch.bfloat16)"
    assert report.formats["layers.1.attn.wo_a"] == "bf16"
    assert torch.equal(fn.dequant_fp8_blocks(model.layers["1"].attn.wo_a, model.layers["1"].attn.wo_a_scale),
                       pair[0].layers["1"].attn.wo_a)


def test_mismatched_format_is_named(saved, tmp_path):
    tensors = load_file(next((saved / "from_checkpoint").glob("*00001*.safetensors")))
    for f in sorted((saved / "from_checkpoint").glob("*.safetensors"))[1:]:
        tensors.update(load_file(f))
    packed, scale = loader.quantize_fp4(loader.dequantize_fp8(tensors["layers.0.attn.wo_b"], tensors["layers.0.attn.wo_b.scale"]).float())
    tensors["layers.0.attn.wo_b"], tensors["layers.0.attn.wo_b.scale"] = packed, scale
    (tmp_path / "c").mkdir()
    save_file(tensors, tmp_path / "c" / "model.safetensors")
    with pytest.raises(ValueError, match=r"checkpoint layers\.0\.attn\.wo_b is FP4, the model holds FP8"):
        load_checkpoint(_tiny("checkpoint", seed=1, layer_ids=[0]), tmp_path / "c")


def test_tp_shard_holds_the_full_models_slices(pair, saved, monkeypatch):
    monkeypatch.setattr(model_module, "_tp", lambda: (1, 2))
    shard = _tiny("checkpoint", seed=0, layer_ids=[0])
    full = dict(pair[1].named_parameters())
    params = dict(shard.named_parameters())
    for local, dim in (("attn.wq_b", 0), ("attn.wo_a", 0), ("attn.wo_b", 1)):
        for suffix in ("", "_scale"):
            name = f"layers.0.{local}{suffix}"
            assert torch.equal(_bytes(params[name]), _bytes(full[name].chunk(2, dim)[1])), name
    assert torch.equal(params["layers.0.ffn.w2_scale"].view(torch.uint8), full["layers.0.ffn.w2_scale"][8:].view(torch.uint8))
    loaded = _tiny("checkpoint", seed=1, layer_ids=[0])
    load_checkpoint(loaded, saved / "from_checkpoint")
    for name, p in loaded.named_parameters():
        if p.element_size() == 1:
            assert torch.equal(_bytes(p), _bytes(params[name])), name
