"""The backend configuration.

Environment overrides (read by `Dsv41Config.from_env`, which `make_backend` applies on top of the config given):

| variable | meaning |
|---|---|
| `DSV41_DISABLE_PASSES=a,b` | turn these fusions (or `streams`) off |
| `DSV41_MAX_TOKENS=N` | the largest token count a decode fusion applies to |
| `DSV41_KERNEL=auto\\|cute\\|reference` | which implementation the fused ops run |
| `DSV41_MODE=inductor\\|fx` | code generation of the leftover graph |
| `DSV41_DUMP_DIR=path` | write graph-diff snapshots of every pass there |
| `DSV41_DEBUG=1` | check graph invariants after every pass |
| `DSV41_STREAM_MAX_TOKENS=N` | the largest token count the side-stream schedule applies to |
| `DSV41_STREAM_BRANCHES=a,b` | the branch kinds the side-stream schedule moves (default: all of `STREAM_BRANCHES`) |
"""

from __future__ import annotations

import dataclasses
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
    # model constants checked by the patterns
    norm_eps: float = 1e-20
    hc_eps: float = 1e-6
    sinkhorn_iters: int = 20
    route_scale: float = 1.5
    gate_temp: float = 1.0
    swiglu_limit: float = 10.0
    fp8_block: int = 32

    def __post_init__(self):
        unknown = set(self.fusions) - set(FUSIONS)
        if unknown:
            raise ValueError(f"fusions: unknown fusion(s) {sorted(unknown)}; known: {list(FUSIONS)}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel: {self.kernel!r} is not one of {KERNELS}")
        if self.mode not in MODES:
            raise ValueError(f"mode: {self.mode!r} is not one of {MODES}")
        unknown = set(self.stream_branches) - set(STREAM_BRANCHES)
        if unknown:
            raise ValueError(f"stream_branches: unknown branch(es) {sorted(unknown)}; known: {list(STREAM_BRANCHES)}")
        if self.max_tokens < 1 or self.stream_max_tokens < 0:
            raise ValueError("max_tokens must be >= 1 and stream_max_tokens >= 0")

    def constants(self) -> dict:
        return {k: getattr(self, k) for k in ("norm_eps", "hc_eps", "sinkhorn_iters", "route_scale", "gate_temp", "swiglu_limit", "fp8_block")}

    def replace(self, **changes) -> "Dsv41Config":
        return dataclasses.replace(self, **changes)

    def with_env(self, env=None) -> "Dsv41Config":
        env = os.environ if env is None else env
        changes: dict = {}
        if env.get("DSV41_DISABLE_PASSES"):
            off = {s.strip() for s in env["DSV41_DISABLE_PASSES"].split(",") if s.strip()}
            if "streams" in off:
                changes["streams"] = False
                off.discard("streams")
            unknown = off - set(FUSIONS)
            if unknown:
                raise ValueError(f"DSV41_DISABLE_PASSES: unknown pass(es) {sorted(unknown)}; known: {list(FUSIONS) + ['streams']}")
            changes["fusions"] = frozenset(self.fusions) - off
        for var, key, conv in (("DSV41_MAX_TOKENS", "max_tokens", int), ("DSV41_KERNEL", "kernel", str), ("DSV41_MODE", "mode", str),
                               ("DSV41_DUMP_DIR", "dump_dir", str), ("DSV41_STREAM_MAX_TOKENS", "stream_max_tokens", int)):
            if env.get(var):
                try:
                    changes[key] = conv(env[var])
                except ValueError:
                    raise ValueError(f"{var}={env[var]!r} is not a valid {conv.__name__}") from None
        if env.get("DSV41_STREAM_BRANCHES"):
            changes["stream_branches"] = frozenset(s.strip() for s in env["DSV41_STREAM_BRANCHES"].split(",") if s.strip())
        if env.get("DSV41_DEBUG"):
            changes["debug"] = env["DSV41_DEBUG"] not in ("0", "")
        return self.replace(**changes)
