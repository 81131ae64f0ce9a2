"""Read a DeepSeek-V4.1 checkpoint (spec section 1.3) into a `DSV41Model`, and write synthetic ones.

Checkpoint layout: safetensors shards holding `embed.weight`, `head.weight`, `norm.weight` and per layer
`layers.{l}.<name>`. Three storage formats (spec 1.3):

- FP8: W [N, K] float8_e4m3fn plus `<key>.scale` [ceil(N/32), ceil(K/32)] float8_e8m0fnu, one scale per 32x32
  block: W_deq[n, k] = fp8(W[n, k]) * 2^(scale_byte[n // 32, k // 32] - 127).
- FP4 (routed experts): W [N, K/2] int8, two E2M1 codes per byte (low nibble = element 2j, high nibble =
  element 2j+1; nibble bit 3 = sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}), plus `<key>.scale` [N, K/32]
  float8_e8m0fnu, one scale per 1x32 group along K: W_deq[n, k] = e2m1(code[n, k]) * scale[n, k // 32].
- plain bf16 / fp32 tensors.

E8M0 is stored as torch.float8_e8m0fnu (safetensors dtype F8_E8M0): one exponent byte b meaning 2^(b-127).
The quantisers live in `dsv41.models.formats`.

The loader dispatches on the stored dtype, not on the spec table: an F8_E4M3 tensor is FP8, an I8/U8 tensor is
packed FP4, a float tensor is taken as is (so a checkpoint with e.g. `wo_a` already dequantised to bf16, as the
reference's convert.py writes it, loads too). The saver follows the spec table (`_LAYER_TABLE`, column fmt).

Into a `weights="bf16"` model the FP8 / FP4 tensors are dequantised (`dequantize_fp8` / `dequantize_fp4`). A
`weights="checkpoint"` model holds them as stored (a parameter `<name>` in e4m3 or packed uint8 with its E8M0
`<name>_scale`): the loader copies the stored bytes and scales, an expert at a time, and never makes a
dequantised copy (a float-stored tensor, such as a bf16 `wo_a`, is quantised on load instead); the saver writes
such a model's bytes as they are. `LoadReport.formats` / `.held` say what was read and how it is held.

Model parameters that merge or rename checkpoint tensors (see `_LAYER_TABLE`): `attn.wqkv_a` = wq_a ‖ wkv and
`ffn.shared_w13` = shared w1 ‖ w3 (rows, dim 0); `ffn.w13[e]` = experts.{e}.w1 ‖ w3 and `ffn.w2[e]` =
experts.{e}.w2; the index-key projection `attn.indexer.wk` / `k_norm` lives in `attn.compressor`.

Under TP (rank r of W) each tensor is sliced as the model's random init slices it: the full tensor is
dequantised (or, held as stored, the weight and its block scales), then `chunk(W, dim)[r]` along dim 0 for wq_b,
wo_a, attn_sink and dim 1 for wo_b; rank r holds the
routed experts [r*E/W, (r+1)*E/W) and reads only those. Everything else is replicated.

Ignored: Engram tensors, `mtp.*`, `ffn.gate.bias_vl` (image tokens only; this is text-only decode), and every
tensor of a layer the model does not hold. Shards are opened with `safe_open`, so only the headers and the
tensors of the model's own parameters are read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from dsv41.models.config import ModelConfig
from dsv41.models.formats import E2M1_VALUES, FP4_GROUP, FP8_BLOCK, quantize_fp4, quantize_fp8
from dsv41.models.model import DSV41Model

__all__ = [
    "LoadReport",
    "dequantize_fp4",
    "dequantize_fp8",
    "load_checkpoint",
    "quantize_fp4",
    "quantize_fp8",
    "save_synthetic_checkpoint",
]

_E2M1_SIGNED = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))  # indexed by the 4-bit nibble


# ---------------------------------------------------------------- formats (quantisers: dsv41.models.formats)


def dequantize_fp8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """q [N, K] float8_e4m3fn, scale [ceil(N/32), ceil(K/32)] (E8M0 or any float dtype) ->
    W [N, K] in `dtype`, W[n, k] = q[n, k] * scale[n // 32, k // 32] (exact in bf16 and fp32)."""
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2:
        raise ValueError(f"q must be a 2-D float8_e4m3fn tensor, got {q.dtype} {list(q.shape)}")
    n, k = q.shape
    want = [-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)]
    if list(scale.shape) != want or not scale.is_floating_point():
        raise ValueError(f"scale must be a float/E8M0 tensor of shape {want} for q {[n, k]}, got {scale.dtype} {list(scale.shape)}")
    s = scale.float().repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return (q.float() * s).to(dtype)


def dequantize_fp4(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """packed [N, K/2] int8 or uint8, scale [N, ceil(K/32)] (E8M0 or any float dtype) -> W [N, K] in `dtype`,
    W[n, 2j] = e2m1(byte[n, j] & 0xF) * s, W[n, 2j+1] = e2m1(byte[n, j] >> 4) * s, s = scale[n, k // 32]."""
    if packed.dtype not in (torch.int8, torch.uint8) or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D int8/uint8 tensor, got {packed.dtype} {list(packed.shape)}")
    n, k = packed.shape[0], 2 * packed.shape[1]
    want = [n, -(-k // FP4_GROUP)]
    if list(scale.shape) != want or not scale.is_floating_point():
        raise ValueError(f"scale must be a float/E8M0 tensor of shape {want} for packed {list(packed.shape)}, got {scale.dtype} {list(scale.shape)}")
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).view(n, k).long()
    s = scale.float().repeat_interleave(FP4_GROUP, 1)[:, :k]
    return (_E2M1_SIGNED.to(b.device)[codes] * s).to(dtype)


# ---------------------------------------------------------------- the parameter <-> checkpoint map

# model parameter under `layers.{l}.` -> (checkpoint keys under `layers.{l}.`, concatenated along dim 0;
# checkpoint format per spec 1.3; TP chunk dim). "{e}" marks a routed-expert stack [E/W, ...].
_LAYER_TABLE: dict[str, tuple[tuple[str, ...], str, int | None]] = {
    "attn.wqkv_a": (("attn.wq_a", "attn.wkv"), "fp8", None),
    "attn.q_norm": (("attn.q_norm.weight",), "bf16", None),
    "attn.kv_norm": (("attn.kv_norm.weight",), "bf16", None),
    "attn.wq_b": (("attn.wq_b",), "fp8", 0),
    "attn.wo_a": (("attn.wo_a",), "fp8", 0),
    "attn.wo_b": (("attn.wo_b",), "fp8", 1),
    "attn.attn_sink": (("attn.attn_sink",), "fp32", 0),
    "attn.compressor.wkv": (("attn.compressor.wkv",), "bf16", None),
    "attn.compressor.wgate": (("attn.compressor.wgate",), "bf16", None),
    "attn.compressor.norm": (("attn.compressor.norm.weight",), "bf16", None),
    "attn.compressor.wk": (("attn.indexer.wk",), "bf16", None),
    "attn.compressor.k_norm": (("attn.indexer.k_norm.weight",), "bf16", None),
    "attn.indexer.wq_b": (("attn.indexer.wq_b",), "fp8", None),
    "attn.indexer.weights_proj": (("attn.indexer.weights_proj",), "bf16", None),
    "attn_norm": (("attn_norm.weight",), "bf16", None),
    "ffn_norm": (("ffn_norm.weight",), "bf16", None),
    **{f"hc_{site}_{part}": ((f"hc_{site}_{part}",), "fp32", None) for site in ("attn", "ffn") for part in ("fn", "base", "scale")},
    "ffn.gate": (("ffn.gate.weight",), "bf16", None),
    "ffn.gate_bias": (("ffn.gate.bias",), "fp32", None),
    "ffn.w13": (("ffn.experts.{e}.w1", "ffn.experts.{e}.w3"), "fp4", None),
    "ffn.w2": (("ffn.experts.{e}.w2",), "fp4", None),
    "ffn.shared_w13": (("ffn.shared_experts.w1", "ffn.shared_experts.w3"), "fp8", None),
    "ffn.shared_w2": (("ffn.shared_experts.w2",), "fp8", None),
}
_MODEL_TABLE: dict[str, tuple[tuple[str, ...], str, int | None]] = {
    "embed": (("embed.weight",), "bf16", None),
    "head": (("head.weight",), "bf16", None),
    "norm": (("norm.weight",), "bf16", None),
}
# rows of each concatenated checkpoint key
_SPLIT_ROWS: dict[str, Callable[[ModelConfig], tuple[int, ...]]] = {
    "attn.wqkv_a": lambda c: (c.q_lora_rank, c.head_dim),
    "ffn.w13": lambda c: (c.moe_inter_dim, c.moe_inter_dim),
    "ffn.shared_w13": lambda c: (c.moe_inter_dim, c.moe_inter_dim),
}
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class _Entry:
    """How one model parameter is assembled from checkpoint tensors.

    slots[i] lists the checkpoint keys concatenated along dim 0 into slot i; an expert stack has one slot per
    local expert (stacked along a new dim 0), any other parameter one slot. key_shapes[j] is the full
    (dequantised, unsharded) shape expected of the j-th key of every slot. After assembly the tensor is
    chunked along shard_dim by TP rank when shard_dim is set.
    """

    param: str
    slots: tuple[tuple[str, ...], ...]
    key_shapes: tuple[tuple[int, ...], ...]
    fmt: str
    shard_dim: int | None
    expert_stack: bool


def _held(p: Tensor) -> str:
    """How the model holds a parameter: "fp8" (e4m3, with a `<name>_scale` sibling), "fp4" (packed uint8, with a
    `<name>_scale` sibling) or "float" (its values)."""
    return "fp8" if p.dtype == torch.float8_e4m3fn else "fp4" if p.dtype == torch.uint8 else "float"


def _logical_shape(p: Tensor) -> torch.Size:
    """The (dequantised) shape of a parameter: packed FP4 holds two values per byte along K."""
    return p.shape[:-1] + (2 * p.shape[-1],) if _held(p) == "fp4" else p.shape


def _scale_of(params: dict[str, Tensor], name: str) -> bool:
    """`name` is the E8M0 scale of a parameter the model holds quantised (loaded and saved with it)."""
    base = name.removesuffix("_scale")
    return name.endswith("_scale") and base in params and _held(params[base]) != "float"


def _entry(name: str, shape: torch.Size, cfg: ModelConfig, rank: int, world: int) -> _Entry | None:
    """The `_Entry` of model parameter `name` (local dequantised shape `shape`) for TP rank/world; None if unmapped."""
    m = _LAYER_KEY.fullmatch(name)
    prefix, local = (f"layers.{m.group(1)}.", m.group(2)) if m else ("", name)
    spec = (_LAYER_TABLE if m else _MODEL_TABLE).get(local)
    if spec is None:
        return None
    keys, fmt, shard_dim = spec
    expert_stack = "{e}" in keys[0]
    full = list(shape[1:] if expert_stack else shape)
    if shard_dim is not None:
        full[shard_dim] *= world
    rows = _SPLIT_ROWS[local](cfg) if local in _SPLIT_ROWS else (full[0],)
    key_shapes = tuple((r, *full[1:]) for r in rows)
    if expert_stack:
        per = cfg.n_routed_experts // world
        slots = tuple(tuple(prefix + k.format(e=e) for k in keys) for e in range(rank * per, (rank + 1) * per))
    else:
        slots = (tuple(prefix + k for k in keys),)
    return _Entry(name, slots, key_shapes, fmt, shard_dim, expert_stack)


def _refuse_shared_parameters(model: DSV41Model) -> None:
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            raise ValueError(f"model: parameters {seen[id(p)]} and {name} are the same tensor (built with "
                             "share_routed_experts=True, a benchmark memory saver); checkpoints are loaded into and "
                             "saved from models built without share_routed_experts")
        seen[id(p)] = name


# ---------------------------------------------------------------- reading


class _Shards:
    """The keys of a set of safetensors shards, opened lazily: headers at open, tensors on demand."""

    def __init__(self, files: list[Path], stack: ExitStack):
        self.handles: dict[str, object] = {}
        where: dict[str, Path] = {}
        for f in files:
            h = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for key in h.keys():
                if key in where:
                    raise ValueError(f"path_or_dir: key {key!r} is in both {where[key]} and {f}")
                where[key] = f
                self.handles[key] = h

    def __contains__(self, key: str) -> bool:
        return key in self.handles

    def keys(self):
        return self.handles.keys()

    def header(self, key: str) -> tuple[str, list[int]]:
        s = self.handles[key].get_slice(key)
        return s.get_dtype(), list(s.get_shape())

    def get(self, key: str) -> Tensor:
        return self.handles[key].get_tensor(key)


_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
_SCALE_DTYPES = ("F8_E8M0",) + _FLOAT_DTYPES


def _stored_shape(ck: _Shards, key: str) -> list[int]:
    """The dequantised shape of checkpoint tensor `key`, validating its format and its `.scale` sibling;
    raises ValueError on a malformed checkpoint."""
    dtype, shape = ck.header(key)
    if dtype in _FLOAT_DTYPES:
        return shape
    if dtype == "F8_E4M3":
        kind, want = "FP8", (lambda n, k: [-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)])
    elif dtype in ("I8", "U8"):
        kind, want = "FP4", (lambda n, k: [n, -(-2 * k // FP4_GROUP)])
    else:
        raise ValueError(f"checkpoint tensor {key} has dtype {dtype}; expected F8_E4M3 (FP8), I8 (packed FP4) or a float")
    if len(shape) != 2:
        raise ValueError(f"checkpoint tensor {key} is {kind} but has shape {shape}; quantised weights are 2-D")
    skey = key + ".scale"
    if skey not in ck:
        raise ValueError(f"checkpoint tensor {key} is {kind} but {skey} is missing")
    sdtype, sshape = ck.header(skey)
    if sdtype not in _SCALE_DTYPES or sshape != want(*shape):
        raise ValueError(f"checkpoint scale {skey} is {sdtype} {sshape}; {kind} {key} {shape} needs E8M0 {want(*shape)}")
    return shape if kind == "FP8" else [shape[0], 2 * shape[1]]


def _read(ck: _Shards, key: str, dtype: torch.dtype) -> Tensor:
    """Checkpoint tensor `key` dequantised (FP8, FP4) or cast to `dtype`."""
    t = ck.get(key)
    if t.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(t, ck.get(key + ".scale"), dtype)
    if t.dtype in (torch.int8, torch.uint8):
        return dequantize_fp4(t, ck.get(key + ".scale"), dtype)
    return t.to(dtype)


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
_STORED = {torch.float8_e4m3fn: "fp8", torch.int8: "fp4", torch.uint8: "fp4"}


def _stored_format(ck: _Shards, key: str) -> str:
    """The format checkpoint tensor `key` is stored in: "fp8", "fp4" or its float dtype ("bf16", "fp32", ...)."""
    dtype = ck.header(key)[0]
    return {"F8_E4M3": "fp8", "I8": "fp4", "U8": "fp4", "BF16": "bf16", "F16": "fp16", "F32": "fp32",
            "F64": "fp64", "F8_E8M0": "e8m0"}.get(dtype, dtype)


def _read_as_stored(ck: _Shards, key: str, fmt: str) -> tuple[Tensor, Tensor, str]:
    """Checkpoint tensor `key` for a parameter held in format `fmt` ("fp8" or "fp4"): (weight, E8M0 scale, how),
    as stored (FP4 bytes viewed as uint8, a float-typed scale converted to E8M0: powers of two, exact); a
    float tensor (e.g. `wo_a` dequantised by the reference's convert.py) is quantised here."""
    t = ck.get(key)
    stored = _STORED.get(t.dtype, "float")
    if stored == "float":
        q, s = (quantize_fp8 if fmt == "fp8" else quantize_fp4)(t)
        return (q if fmt == "fp8" else q.view(torch.uint8)), s, f"quantised to {fmt} on load (stored {t.dtype})"
    if stored != fmt:
        raise ValueError(f"checkpoint tensor {key} is {stored.upper()}; the model holds it as {fmt.upper()}")
    s = ck.get(key + ".scale")
    if s.dtype != torch.float8_e8m0fnu:
        s = s.float().to(torch.float8_e8m0fnu)
    return (t if fmt == "fp8" else t.view(torch.uint8)), s, "as stored"


def _cat_rows(ts: list[Tensor]) -> Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def _shape_str(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


@dataclass
class LoadReport:
    """What `load_checkpoint` did.

    weights: the model's `weights` ("bf16" or "checkpoint"). loaded: model parameters set (a parameter held
    quantised sets its `<name>_scale` with it). keys_read: checkpoint keys read (weights and their `.scale`).
    formats: checkpoint key read -> its stored format ("fp8", "fp4", "e8m0", "bf16", "fp32", ...). held: loaded
    parameter -> how it came to be held: "as stored" (weights="checkpoint": the FP8 / FP4 bytes and scales
    copied, no dequantised copy at any point), "dequantised fp8 -> bf16" (weights="bf16"), "quantised to fp8 on
    load (stored torch.bfloat16)", or for a float parameter "bf16 -> fp32" / "bf16". skipped: checkpoint key -> why
    it was not read. missing: model parameter -> the checkpoint keys it lacks (empty list: the loader has no mapping
    for it). mismatched: model parameter -> the shape or layout mismatch. With strict=True, missing and mismatched
    are empty (otherwise load_checkpoint raises).
    """

    weights: str = "bf16"
    loaded: list[str] = field(default_factory=list)
    keys_read: list[str] = field(default_factory=list)
    formats: dict[str, str] = field(default_factory=dict)
    held: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    missing: dict[str, list[str]] = field(default_factory=dict)
    mismatched: dict[str, str] = field(default_factory=dict)


def _checkpoint_files(path_or_dir) -> list[Path]:
    if not isinstance(path_or_dir, (str, os.PathLike)):
        raise ValueError(f"path_or_dir must be a path, got {type(path_or_dir).__name__}")
    p = Path(path_or_dir)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise ValueError(f"path_or_dir: no *.safetensors files in {p}")
        return files
    if p.is_file():
        return [p]
    raise ValueError(f"path_or_dir: {p} does not exist")


def _check_tp(cfg: ModelConfig, tp) -> tuple[int, int]:
    if not (isinstance(tp, tuple) and len(tp) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in tp)):
        raise ValueError(f"tp must be a (rank, world) tuple of ints, got {tp!r}")
    rank, world = tp
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"tp={tp}: need world >= 1 and 0 <= rank < world")
    if cfg.n_heads % world or cfg.o_groups % world or cfg.n_routed_experts % world:
        raise ValueError(f"tp={tp}: world {world} must divide n_heads, o_groups and n_routed_experts")
    return rank, world


def _skip_reason(key: str, layer_ids: set[int], local_experts: range) -> str:
    base = key.removesuffix(".scale")
    m = _LAYER_KEY.fullmatch(base)
    rest = m.group(2) if m else base
    if base.startswith("mtp."):
        return "mtp (out of scope)"
    if rest.startswith("engram."):
        return "engram (out of scope)"
    if rest == "ffn.gate.bias_vl":
        return "bias_vl (image tokens only; text-only decode)"
    if m and int(m.group(1)) not in layer_ids:
        return "layer not in the model"
    e = re.fullmatch(r"ffn\.experts\.(\d+)\..+", rest)
    if e and int(e.group(1)) not in local_experts:
        return "routed expert of another TP rank"
    return "not used by the model"


def load_checkpoint(model: DSV41Model, path_or_dir: str | os.PathLike, *, strict: bool = True, tp: tuple[int, int] | None = None) -> LoadReport:
    """Load the checkpoint at `path_or_dir` (a .safetensors file or a directory of shards) into `model` in place.

    Every parameter of the model is assembled from its checkpoint tensors (module docstring), dequantised,
    sliced for TP rank `tp` = (rank, world) (default: the model's own tp_rank, tp_size) and cast to the
    parameter's dtype. Only the model's layers (and local experts) are read.

    strict=True: raise ValueError, before any parameter is written, naming every model parameter that would be
    left unset (and the checkpoint keys it lacks) and every shape mismatch (the key, its shape and the shape the
    model expects). strict=False: load what matches and report the rest. A malformed checkpoint (a quantised
    tensor without a valid `.scale`, an unknown dtype, a key in two shards) raises in both modes.
    """
    if not isinstance(model, DSV41Model):
        raise ValueError(f"model must be a DSV41Model, got {type(model).__name__}")
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be a bool, got {strict!r}")
    cfg = model.cfg
    rank, world = _check_tp(cfg, (model.tp_rank, model.tp_size) if tp is None else tp)
    files = _checkpoint_files(path_or_dir)
    _refuse_shared_parameters(model)
    report = LoadReport(weights=model.weights)
    params = dict(model.named_parameters())
    with ExitStack() as stack:
        ck = _Shards(files, stack)
        plan: list[_Entry] = []
        owner: dict[str, str] = {}
        for name, p in params.items():
            if _scale_of(params, name):
                continue
            entry = _entry(name, _logical_shape(p), cfg, rank, world)
            if entry is None:
                report.missing[name] = []
                continue
            keys = [k for slot in entry.slots for k in slot]
            owner.update((k, name) for k in keys)
            absent = [k for k in keys if k not in ck]
            if absent:
                report.missing[name] = absent
                continue
            bad = [f"checkpoint {k} has shape {_shape_str(got)}, the model expects {_shape_str(want)}"
                   for slot in entry.slots for k, want in zip(slot, entry.key_shapes)
                   if (got := _stored_shape(ck, k)) != list(want)]
            if _held(p) != "float":
                bad += [f"checkpoint {k} is {f.upper()}, the model holds {_held(p).upper()}" for slot in entry.slots
                        for k in slot if (f := _stored_format(ck, k)) in ("fp8", "fp4") and f != _held(p)]
                if _held(p) == "fp8":
                    bad += [f"checkpoint {k} has {r[0]} rows, not whole 32-row blocks of the merged {name}"
                            for k, r in zip(entry.slots[0], entry.key_shapes) if len(entry.slots[0]) > 1 and r[0] % FP8_BLOCK]
            if entry.expert_stack and len(entry.slots) != p.shape[0]:
                bad.append(f"the model holds {p.shape[0]} experts, TP rank {rank} of {world} owns {len(entry.slots)}")
            if bad:
                report.mismatched[name] = "; ".join(bad)
                continue
            plan.append(entry)
        if strict and (report.missing or report.mismatched):
            lines = [f"  unset {n}: " + (f"checkpoint lacks {', '.join(ks)}" if ks else "the loader has no checkpoint mapping for it")
                     for n, ks in report.missing.items()]
            lines += [f"  shape mismatch {n}: {msg}" for n, msg in report.mismatched.items()]
            raise ValueError(f"load_checkpoint(strict=True) of {path_or_dir}: {len(report.missing)} model parameters would be "
                             f"left unset, {len(report.mismatched)} mismatch:\n" + "\n".join(lines))
        read: set[str] = set()
        with torch.no_grad():
            for entry in plan:
                p = params[entry.param]
                if _held(p) == "float":
                    slots = [torch.cat([_read(ck, k, p.dtype) for k in slot]) for slot in entry.slots]
                    t = torch.stack(slots) if entry.expert_stack else slots[0]
                    if entry.shard_dim is not None:
                        t = t.chunk(world, entry.shard_dim)[rank]
                    p.copy_(t)
                    stored = {_stored_format(ck, k) for slot in entry.slots for k in slot}
                    dst = _DTYPE_NAMES.get(p.dtype, str(p.dtype))
                    report.held[entry.param] = "; ".join(
                        f"dequantised {f} -> {dst}" if f in ("fp8", "fp4") else f if f == dst else f"{f} -> {dst}"
                        for f in sorted(stored))
                else:  # held as stored: copy the stored bytes and scales slot by slot (an expert at a time)
                    scale = params[entry.param + "_scale"]
                    hows = set()
                    for i, slot in enumerate(entry.slots):
                        parts = [_read_as_stored(ck, k, _held(p)) for k in slot]
                        q, sc = _cat_rows([q for q, _, _ in parts]), _cat_rows([sc for _, sc, _ in parts])
                        hows |= {how for _, _, how in parts}
                        if entry.shard_dim is not None:
                            q, sc = q.chunk(world, entry.shard_dim)[rank], sc.chunk(world, entry.shard_dim)[rank]
                        (p[i] if entry.expert_stack else p).copy_(q)
                        (scale[i] if entry.expert_stack else scale).copy_(sc)
                    report.held[entry.param] = "; ".join(sorted(hows))
                report.loaded.append(entry.param)
                for slot in entry.slots:
                    for k in slot:
                        read.add(k)
                        if k + ".scale" in ck:
                            read.add(k + ".scale")
        report.keys_read = [k for k in ck.keys() if k in read]
        report.formats = {k: _stored_format(ck, k) for k in report.keys_read}
        per = cfg.n_routed_experts // world
        local_experts = range(rank * per, (rank + 1) * per)
        for k in ck.keys():
            if k in read:
                continue
            base = k.removesuffix(".scale")
            if base in owner and base in ck:
                report.skipped[k] = f"parameter {owner[base]} not loaded (missing or mismatched)"
            else:
                report.skipped[k] = _skip_reason(k, set(model.layer_ids), local_experts)
    return report


# ---------------------------------------------------------------- writing


def save_synthetic_checkpoint(model: DSV41Model, path: str | os.PathLike, shards: int = 2) -> list[Path]:
    """Write the model's current weights to directory `path` in the checkpoint layout per spec 1.3: FP8 / FP4
    tensors as a weights="checkpoint" model holds them (its bytes and scales, split into the checkpoint's keys), or
    quantised from a "bf16" model's values (`quantize_fp8` / `quantize_fp4`); bf16 / fp32 casts otherwise; split over `shards`
    files `model-0000i-of-0000n.safetensors` of about equal size (a weight and its scale share a file).

    Needs an unsharded model (tp_size 1) without shared routed experts; a layer-subset model writes only its
    layers. Returns the files written.
    """
    if not isinstance(model, DSV41Model):
        raise ValueError(f"model must be a DSV41Model, got {type(model).__name__}")
    if model.tp_size != 1:
        raise ValueError(f"model is TP rank {model.tp_rank} of {model.tp_size}; save_synthetic_checkpoint needs an unsharded model")
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"shards must be an int >= 1, got {shards!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a path, got {type(path).__name__}")
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.glob("*.safetensors"))):
        raise ValueError(f"path: {out} is a file or already holds .safetensors files")
    _refuse_shared_parameters(model)
    groups: list[dict[str, Tensor]] = []
    params = dict(model.named_parameters())
    for name, p in params.items():
        if _scale_of(params, name):
            continue
        entry = _entry(name, _logical_shape(p), model.cfg, 0, 1)
        if entry is None:
            raise ValueError(f"model: the loader has no checkpoint mapping for parameter {name}")
        group: dict[str, Tensor] = {}
        if _held(p) != "float":  # weights="checkpoint": the stored bytes and scales as the model holds them
            scale = params[name + "_scale"]
            rows = [r[0] for r in entry.key_shapes]
            srows = [r // FP8_BLOCK for r in rows] if _held(p) == "fp8" else rows
            for i, slot in enumerate(entry.slots):
                q, sc = (p[i], scale[i]) if entry.expert_stack else (p, scale)
                if _held(p) == "fp4":
                    q = q.view(torch.int8)  # the checkpoint's I8
                for key, qk, sk in zip(slot, q.detach().cpu().split(rows), sc.detach().cpu().split(srows)):
                    group[key], group[key + ".scale"] = qk.contiguous(), sk.contiguous()
            groups.append(group)
            continue
        for i, slot in enumerate(entry.slots):
            full = (p[i] if entry.expert_stack else p).detach().float().cpu()
            for key, part in zip(slot, full.split([s[0] for s in entry.key_shapes])):
                if entry.fmt == "fp8":
                    group[key], group[key + ".scale"] = quantize_fp8(part)
                elif entry.fmt == "fp4":
                    group[key], group[key + ".scale"] = quantize_fp4(part)
                else:
                    group[key] = part.to(torch.bfloat16 if entry.fmt == "bf16" else torch.float32).contiguous()
        groups.append(group)
    sizes = [sum(t.numel() * t.element_size() for t in g.values()) for g in groups]
    total, done = sum(sizes), 0
    files: list[dict[str, Tensor]] = [{} for _ in range(shards)]
    for group, size in zip(groups, sizes):
        files[min(shards - 1, done * shards // max(total, 1))].update(group)
        done += size
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for i, tensors in enumerate(files):
        f = out / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(f), metadata={"format": "pt"})
        written.append(f)
    return written
