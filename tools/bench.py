"""`dsv41 bench kernels ...` (per-kernel timings), `dsv41 bench decode ...` (whole decode steps) and `dsv41 bench
foreign ...` (the foreign decode blocks of a checkout, plain Inductor against dsv41)."""

from __future__ import annotations

import sys

# subcommand -> (module with main(argv) -> int, help)
BENCHMARKS = {
    "kernels": ("dsv41.tools.bench_kernels", "each kernel against its Inductor-compiled and eager reference"),
    "decode": ("dsv41.tools.bench_decode", "whole decode steps: eager, Inductor, dsv41, and the memory floor"),
    "foreign": ("dsv41.tools.bench_foreign", "each foreign decode block (tests/passes/foreign): Inductor against dsv41"),
}
USAGE = "usage: dsv41 bench {kernels|decode|foreign} [options]   (dsv41 bench SUBCOMMAND --help for its options)"


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE + "\n\nsubcommands:\n" + "\n".join(f"  {name:8s} {text}" for name, (_, text) in BENCHMARKS.items()))
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        got = f": unknown subcommand {argv[0]!r}" if argv else ""
        print(f"{USAGE}\ndsv41 bench: error{got or ': a subcommand is required'}", file=sys.stderr)
        return 2
    return importlib.import_module(BENCHMARKS[argv[0]][0]).main(argv[1:])
