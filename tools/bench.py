"""`dsv41 bench kernels ...` (per-kernel timings) and `dsv41 bench decode ...` (whole decode steps)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("kernels", "decode"):
        print("usage: dsv41 bench {kernels|decode} [options]   (--help after the subcommand for its options)", file=sys.stderr)
        return 2
    if argv[0] == "kernels":
        from dsv41.tools.bench_kernels import main as run
    else:
        from dsv41.tools.bench_decode import main as run
    return run(argv[1:])
