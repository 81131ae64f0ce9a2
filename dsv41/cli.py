"""The `dsv41` command: `dsv41 demo`, `dsv41 bench kernels|decode|foreign`, `dsv41 graphdiff ...`, `dsv41 precompile`."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with main(argv) -> int, help)
COMMANDS = {
    "demo": ("dsv41.tools.demo", "compile the tiny model with the backend; fusion counts, agreement with eager, timings on a GPU"),
    "bench": ("dsv41.tools.bench", "benchmarks: `dsv41 bench kernels ...`, `dsv41 bench decode ...` or `dsv41 bench foreign ...`"),
    "graphdiff": ("dsv41.tools.graphdiff", "show, compare and check recorded pass-by-pass graph diffs"),
    "precompile": ("dsv41.tools.precompile", "fill the on-disk CuTe DSL kernel cache for a model config"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1 decode backend for torch.compile on Hopper.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
