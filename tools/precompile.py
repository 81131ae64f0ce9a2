"""`dsv41 precompile`: fill the on-disk CuTe DSL kernel cache for a model config.

Every kernel is compiled with a symbolic token count, so one binary per (kernel, static config) serves all
batch sizes: ``--tokens`` is accepted for symmetry with the benchmarks and does not change what is built.
Compiling needs no GPU (the target is sm_90a, or ``$CUTE_DSL_ARCH``); the cache is ``$DSV41_CACHE_DIR``
(default ``~/.cache/dsv41/kernels``).
"""

from __future__ import annotations

import argparse
import time

from dsv41.models.config import get_config


def kernels_for(cfg) -> list[tuple[str, object]]:
    """(label, thunk that compiles or loads it) for every kernel a decode step of ``cfg`` uses."""
    from dsv41.kernels import mhc_coeffs, mhc_post_pre, moe_route

    route = (cfg.dim, cfg.n_routed_experts, cfg.n_activated_experts)
    return [
        (f"mhc_coeffs(D={cfg.dim}, iters={cfg.hc_sinkhorn_iters})",
         lambda: mhc_coeffs.compile_for(cfg.dim, cfg.hc_sinkhorn_iters)),
        *[(f"mhc_post_pre(D={cfg.dim}, {n} CTA per token)", lambda n=n: mhc_post_pre.compile_for(cfg.dim, cluster_n=n))
          for n in sorted({mhc_post_pre.cluster_for(cfg.dim, t) for t in (1, mhc_post_pre.LARGE_TOKENS)})],
        # the router runs its reference where the kernel has no build (the tiny config)
        *([(f"moe_route(D={route[0]}, E={route[1]}, k={route[2]})", lambda: moe_route.compile_for(*route))]
          if moe_route.config_reason(*route) is None else []),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv41 precompile", description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("flash", "tiny"), default="flash")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64",
                        help="batch sizes (ignored: the kernels take the token count at run time)")
    args = parser.parse_args(argv)
    from dsv41.kernels import compile_cache

    cfg = get_config(args.config)
    print(f"dsv41 precompile: config {args.config}, arch {compile_cache.target_arch()}, "
          f"cache {compile_cache.cache_dir()} (token counts {args.tokens} share one binary per kernel)")
    for label, build in kernels_for(cfg):
        before = compile_cache.STATS.compiles
        start = time.perf_counter()
        build()
        how = "compiled" if compile_cache.STATS.compiles > before else "found on disk"
        print(f"  {label}: {how} in {time.perf_counter() - start:.2f} s")
    return 0
