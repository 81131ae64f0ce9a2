"""`dsv41 precompile`: fill the on-disk CuTe DSL kernel cache for a model config, and the traced-pattern library.

Every kernel is compiled with a symbolic token count, so one binary per (kernel, static config) serves all
batch sizes: ``--tokens`` is accepted for symmetry with the benchmarks and does not change what is built.
Compiling needs no GPU (the target is sm_90a, or ``$CUTE_DSL_ARCH``); the cache is ``$DSV41_CACHE_DIR``
(default ``~/.cache/dsv41/kernels``). The fusions' traced patterns (``dsv41.passes.pattern_library``,
``$DSV41_PATTERN_CACHE_DIR``, default ``~/.cache/dsv41/patterns``) are written too, so a process's first compile
reads them instead of tracing them.
"""

from __future__ import annotations

import argparse
import time

from dsv41.models.config import get_config


def kernels_for(cfg, max_context: int | None = None) -> list[tuple[str, object]]:
    """(label, thunk that compiles or loads it) for every kernel a decode step of ``cfg`` uses; the indexer's top-K
    launches depend on the key-cache length, so they are listed only with the model's ``max_context``."""
    from dsv41.kernels import (indexer_topk, mhc_coeffs, mhc_post_pre, moe_experts, moe_finalize, moe_metadata,
                               moe_route, qkv_norm)
    route = (cfg.dim, cfg.n_routed_experts, cfg.n_activated_experts)
    experts = (cfg.dim, cfg.moe_inter_dim, cfg.n_routed_experts, cfg.fp8_block)
    norms = (cfg.q_lora_rank, cfg.head_dim, cfg.rope_head_dim, cfg.fp8_block)
    builds = [
        (f"mhc_coeffs(D={cfg.dim}, iters={cfg.hc_sinkhorn_iters})",
         lambda: mhc_coeffs.compile_for(cfg.dim, cfg.hc_sinkhorn_iters)),
        *[(f"mhc_post_pre(D={cfg.dim}, {n} CTA per token)", lambda n=n: mhc_post_pre.compile_for(cfg.dim, cluster_n=n))
          for n in sorted({mhc_post_pre.cluster_for(cfg.dim, t) for t in (1, mhc_post_pre.LARGE_TOKENS)})],
        # the q/kv norms with the window KV's RoPE and FP8 step, as the model has them
        *([(f"qkv_norm(q={norms[0]}, kv={norms[1]}, rd={norms[2]}, quant_block={norms[3]})",
            lambda: qkv_norm.compile_for(*norms))] if not isinstance(qkv_norm.layout(*norms), str) else []),
        # a kernel without a build for the config (the tiny one) leaves its op on the reference
        *([(f"moe_route(D={route[0]}, E={route[1]}, k={route[2]})", lambda: moe_route.compile_for(*route))]
          if moe_route.config_reason(*route) is None else []),
        *([(f"moe_metadata(E={route[1]}, k={route[2]})", lambda: moe_metadata.compile_for(*route[1:]))]
          if route[1] <= moe_metadata.MAX_EXPERTS else []),
        *([(f"moe_experts(D={experts[0]}, I={experts[1]}, E={experts[2]}, quant_block={experts[3]})",
            lambda: moe_experts.compile_for(*experts))] if moe_experts.config_reason(*experts) is None else []),
        # the decode's combine: rows weighted before w2, the shared expert added (fp32 out under TP: no shared)
        *[(f"moe_finalize(D={cfg.dim}, shared={with_shared})",
           lambda with_shared=with_shared: moe_finalize.compile_for(cfg.dim, False, with_shared))
          for with_shared in (True, False) if moe_finalize.config_reason(cfg.dim) is None],
    ]
    if max_context is None or (cfg.index_n_heads, cfg.index_head_dim) != (indexer_topk.HEADS, indexer_topk.HEAD_DIM):
        return builds
    layers = [layer for layer in range(cfg.n_layers) if layer in cfg.index_source_layers]
    modes = sorted({(cfg.is_reindex(layer), layer == cfg.candidate_source_layer) for layer in layers})
    builds += [(f"indexer_topk scores (candidate-masked={masked}, block maxima={blocks})",
                lambda masked=masked, blocks=blocks: indexer_topk.compile_scores(masked, blocks))
               for masked, blocks in modes]
    widths = sorted({max_context // cfg.ratio(cfg.kv_source(layer)) for layer in layers})
    selects = {(n, min(cfg.index_topk, n)) for n in widths}
    if cfg.candidate_source_layer in layers:
        n_cap = max_context // cfg.ratio(cfg.candidate_source_layer)
        n_blocks = -(-n_cap // cfg.candidate_block_size)
        selects.add((n_blocks, min(cfg.candidate_topk_blocks, n_blocks)))
    builds += [(f"indexer_topk select (N={n}, K={k})", lambda n=n, k=k: indexer_topk.select_launch(n, k))
               for n, k in sorted(selects)]
    if any(n > indexer_topk.CTA_COLUMNS for n, _ in selects):  # the sampled path's first launch
        builds.append(("indexer_topk candidate filter", indexer_topk.filter_launch))
    return builds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv41 precompile", description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("flash", "tiny"), default="flash")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64",
                        help="batch sizes (ignored: the kernels take the token count at run time)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="the model's max_context: also build the indexer's top-K launches for its key caches")
    args = parser.parse_args(argv)
    if args.max_context is not None and args.max_context < 1:
        parser.error(f"argument --max-context: must be >= 1, got {args.max_context}")
    from dsv41.kernels import compile_cache

    cfg = get_config(args.config)
    print(f"dsv41 precompile: config {args.config}, arch {compile_cache.target_arch()}, "
          f"cache {compile_cache.cache_dir()} (token counts {args.tokens} share one binary per kernel)")
    for label, build in kernels_for(cfg, args.max_context):
        before = compile_cache.STATS.compiles
        start = time.perf_counter()
        build()
        how = "compiled" if compile_cache.STATS.compiles > before else "found on disk"
        print(f"  {label}: {how} in {time.perf_counter() - start:.2f} s")
    from dsv41.config import Dsv41Config
    from dsv41.passes import pattern_library

    library = pattern_library.warm(Dsv41Config().with_env())
    print(f"  pattern library {library['dir']}: {len(library['missing'])} of {library['entries']} fusion passes' "
          f"patterns traced in {library['seconds']:.2f} s")
    return 0
