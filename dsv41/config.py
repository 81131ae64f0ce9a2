"""The backend configuration.

Every setting is validated when a config is made (`Dsv41Config(...)`, `.replace(...)`, `.with_env()`): a wrong type
raises TypeError, a wrong value ValueError, each naming the setting (and the environment variable it came from); a
`dump_dir` that exists must be a directory. `torch.compile(m, backend="dsv41", options={...})` takes settings by
name as `make_backend` does.

Environment overrides (read by `Dsv41Config.with_env`, which `make_backend` applies on top of the config given, and
which `dsv41_backend` applies when it is first used, so a bad variable never breaks `import dsv41`):

| variable | meaning |
|---|---|
| `DSV41_DISABLE_PASSES=a,b` | turn these fusions (or `streams`) off |
| `DSV41_MAX_TOKENS=N` | the largest token count a decode fusion applies to |
| `DSV41_KERNEL=auto\\|cute\\|reference` | which implementation the fused ops run |
| `DSV41_MODE=inductor\\|fx` | code generation of the leftover graph |
| `DSV41_DUMP_DIR=path` | write graph-diff snapshots of every pass there |
| `DSV41_DEBUG=1` | check graph invariants after every pass (a boolean: `0/1/false/true/no/yes/off/on`, any case) |
| `DSV41_STREAM_MAX_TOKENS=N` | the largest token count the side-stream schedule applies to |
| `DSV41_STREAM_BRANCHES=a,b` | the branch kinds the side-stream schedule moves (default: all of `STREAM_BRANCHES`) |
| `DSV41_PASS_CACHE=0\\|1` | keep the passes' rewritten graphs on disk for warm starts (`dsv41.pass_cache`; default on) |
| `DSV41_SPECIALIZE_SIZES=N` | the most static compiles of a graph whose sizes Dynamo made symbolic, one per set of sizes that recurs (`dsv41.size_specialization`; default 8; 0: only the symbolic compile, fusions declined at symbolic shapes) |
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from dsv41.passes.registry import FUSION_NAMES as FUSIONS  # noqa: E402  (declared once, in run order)
KERNELS = ("auto", "cute", "reference")
MODES = ("inductor", "fx")
STREAM_BRANCHES = ("mhc_coeffs", "shared_expert", "indexer")  # see dsv41.passes.streams


@dataclass(frozen=True)
class Dsv41Config:
    """What the backend does. The model constants are the DeepSeek-V4.1 numerics the patterns check (spec 2.9):
    a graph with another eps or iteration count is declined, not silently fused."""

    fusions: frozenset = field(default_factory=lambda: frozenset(FUSIONS))
    max_tokens: int = 64
    kernel: str = "auto"
    mode: str = "inductor"
    dump_dir: str | None = None
    debug: bool = False
    streams: bool = True
    stream_max_tokens: int = 16
    stream_branches: frozenset = field(default_factory=lambda: frozenset(STREAM_BRANCHES))
    pass_cache: bool = True
    specialize_sizes: int = 8
    # model constants checked by the patterns
    norm_eps: float = 1e-20
    hc_eps: float = 1e-6
    sinkhorn_iters: int = 20
    route_scale: float = 1.5
    gate_temp: float = 1.0
    swiglu_limit: float = 10.0
    fp8_block: int = 32

    def __post_init__(self):
        for name, kind in _SETTING_TYPES.items():
            value = getattr(self, name)
            if kind is _NAMES:
                object.__setattr__(self, name, _names(name, value))
            elif kind is _PATH:
                if value is not None and not isinstance(value, (str, os.PathLike)):
                    raise TypeError(f"Dsv41Config.{name} must be a path (str) or None, got {value!r} ({type(value).__name__})")
                object.__setattr__(self, name, None if value is None else os.fspath(value))
                if value is not None and os.path.exists(value) and not os.path.isdir(value):
                    raise ValueError(f"Dsv41Config.{name}: {os.fspath(value)!r} exists and is not a directory")
            elif not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                want = {bool: "a bool (True or False)", int: "an int", str: "a str"}.get(kind, "a number")
                raise TypeError(f"Dsv41Config.{name} must be {want}, got {value!r} ({type(value).__name__})")
        unknown = self.fusions - set(FUSIONS)
        if unknown:
            raise ValueError(f"Dsv41Config.fusions: unknown fusion(s) {sorted(unknown)}; known: {list(FUSIONS)}")
        unknown = self.stream_branches - set(STREAM_BRANCHES)
        if unknown:
            raise ValueError(f"Dsv41Config.stream_branches: unknown branch(es) {sorted(unknown)}; known: {list(STREAM_BRANCHES)}")
        for name, choices in (("kernel", KERNELS), ("mode", MODES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"Dsv41Config.{name}: {getattr(self, name)!r} is not one of {choices}")
        for name, low in (("max_tokens", 1), ("stream_max_tokens", 0), ("specialize_sizes", 0), ("sinkhorn_iters", 1),
                          ("fp8_block", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"Dsv41Config.{name} must be >= {low}, got {getattr(self, name)}")
        for name in ("norm_eps", "hc_eps", "route_scale", "gate_temp", "swiglu_limit"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"Dsv41Config.{name} must be finite and > 0, got {getattr(self, name)}")

    def constants(self) -> dict:
        return {k: getattr(self, k) for k in ("norm_eps", "hc_eps", "sinkhorn_iters", "route_scale", "gate_temp", "swiglu_limit", "fp8_block")}

    def replace(self, **changes) -> "Dsv41Config":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"Dsv41Config has no setting(s) {sorted(unknown)}; settings: "
                            f"{[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)

    def with_env(self, env=None) -> "Dsv41Config":
        """This config with the DSV41_* variables of `env` (default os.environ) applied; an empty variable is unset.
        A bad variable raises ValueError naming it."""
        env = os.environ if env is None else env
        config = self
        for var, parse in _ENV:
            text = env.get(var, "")
            if not text.strip():
                continue
            try:
                config = config.replace(**parse(config, text))
            except (TypeError, ValueError) as e:
                raise ValueError(f"environment variable {var}={text!r}: {e}") from None
        return config


def _names(setting: str, value) -> frozenset:
    """A collection of names (not one bare string) as a frozenset."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"Dsv41Config.{setting} must be a collection of names (e.g. a frozenset), got {value!r} "
                        f"({type(value).__name__})")
    names = frozenset(value)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"Dsv41Config.{setting} must hold names (str), got {bad[0]!r} ({type(bad[0]).__name__})")
    return names


_NAMES, _PATH = object(), object()  # kinds of setting besides the plain types
_SETTING_TYPES = {"fusions": _NAMES, "max_tokens": int, "kernel": str, "mode": str, "dump_dir": _PATH, "debug": bool,
                  "streams": bool, "stream_max_tokens": int, "stream_branches": _NAMES, "pass_cache": bool,
                  "specialize_sizes": int, "norm_eps": (int, float),
                  "hc_eps": (int, float), "sinkhorn_iters": int, "route_scale": (int, float), "gate_temp": (int, float),
                  "swiglu_limit": (int, float), "fp8_block": int}

BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_bool(text: str) -> bool:
    """An environment variable's boolean: 0/1/false/true/no/yes/off/on in any case; anything else is a ValueError."""
    value = BOOLEANS.get(text.strip().lower())
    if value is None:
        raise ValueError(f"{text!r} is not a boolean; use one of {'/'.join(BOOLEANS)}")
    return value


def _parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


def _name_list(text: str) -> frozenset:
    return frozenset(s.strip() for s in text.split(",") if s.strip())


def _disabled_passes(config: Dsv41Config, text: str) -> dict:
    off = _name_list(text)
    unknown = off - set(FUSIONS) - {"streams"}
    if unknown:
        raise ValueError(f"unknown pass(es) {sorted(unknown)}; known: {list(FUSIONS) + ['streams']}")
    changes: dict = {"fusions": config.fusions - off}
    if "streams" in off:
        changes["streams"] = False
    return changes


# (variable, parse(config, text) -> setting changes), applied in this order
_ENV = (
    ("DSV41_DISABLE_PASSES", _disabled_passes),
    ("DSV41_MAX_TOKENS", lambda c, t: {"max_tokens": _parse_int(t)}),
    ("DSV41_KERNEL", lambda c, t: {"kernel": t.strip()}),
    ("DSV41_MODE", lambda c, t: {"mode": t.strip()}),
    ("DSV41_DUMP_DIR", lambda c, t: {"dump_dir": t}),
    ("DSV41_DEBUG", lambda c, t: {"debug": parse_bool(t)}),
    ("DSV41_STREAM_MAX_TOKENS", lambda c, t: {"stream_max_tokens": _parse_int(t)}),
    ("DSV41_STREAM_BRANCHES", lambda c, t: {"stream_branches": _name_list(t)}),
    ("DSV41_PASS_CACHE", lambda c, t: {"pass_cache": parse_bool(t)}),
    ("DSV41_SPECIALIZE_SIZES", lambda c, t: {"specialize_sizes": _parse_int(t)}),
)
