"""The `dsv41` command: every subcommand answers --help with exit 0; a bad argument or environment variable is
one line on stderr with exit 2, never a traceback; the demo removes its temporary recording unless asked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv41.cli import COMMANDS, main
from dsv41.tools import demo

HELP = [[name] for name in COMMANDS] + [["bench", "kernels"], ["bench", "decode"], ["graphdiff", "show"],
                                        ["graphdiff", "compare"], ["graphdiff", "check"]]


def dsv41(*argv) -> tuple[int, str, str]:
    """`dsv41 ARGV` in a subprocess: (exit code, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "dsv41.cli", *argv], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def dsv41_in_process(capsys, *argv) -> tuple[int, str, str]:
    """`dsv41 ARGV` in this process (argparse exits through SystemExit): (exit code, stdout, stderr)."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_help_of_every_subcommand_exits_0(capsys):
    assert {tuple(c) for c in HELP} >= {(name,) for name in COMMANDS}
    for argv in [[]] + HELP:
        rc, out, err = dsv41_in_process(capsys, *argv, "--help")
        assert rc == 0 and "usage: dsv41" in out and "Traceback" not in err, (argv, err)
    rc, out, err = dsv41("bench", "--help")  # the installed entry point, once
    assert rc == 0 and "usage: dsv41 bench" in out and not err, err


@pytest.mark.parametrize("argv, env, message", [
    (["demo", "--batch", "100"], None, "dsv41 demo: error: argument --batch: must be in [1, 64]"),
    (["demo", "--batch", "0"], None, "dsv41 demo: error: argument --batch: must be in [1, 64]"),
    (["demo", "--batch", "x"], None, "dsv41 demo: error: argument --batch: invalid int value: 'x'"),
    (["demo", "--device", "nowhere"], None, "dsv41 demo: error: argument --device: 'nowhere' is not a device"),
    (["demo"], {"DSV41_DEBUG": "maybe"}, "dsv41 demo: error: environment variable DSV41_DEBUG='maybe'"),
    (["demo"], {"DSV41_MAX_TOKENS": "2"}, "dsv41 demo: error: argument --batch: must be in [1, 2]"),
    (["bench"], None, "dsv41 bench: error: a subcommand is required"),
    (["bench", "nope"], None, "dsv41 bench: error: unknown subcommand 'nope'"),
    (["nope"], None, "dsv41: error: unknown command 'nope'"),
])
def test_bad_arguments_are_one_line_errors(monkeypatch, capsys, argv, env, message):
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    rc, _, err = dsv41_in_process(capsys, *argv)
    assert rc == 2 and "Traceback" not in err, err
    assert message in err.strip().splitlines()[-1], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_demo_on_cuda_without_cuda():
    rc, _, err = dsv41("demo", "--device", "cuda")
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("dsv41 demo: error: argument --device: 'cuda': CUDA is not available "
                                                     "on this machine (use --device cpu)")


@pytest.mark.parametrize("keep, fail", [(False, False), (True, False), (False, True)])
def test_demo_removes_its_recording_unless_kept(monkeypatch, tmp_path, capsys, keep, fail):
    """The demo's compile and steps replaced by a stand-in that writes into the recording directory (the real run
    is ~1 min; `dsv41 demo` itself is part of the README walk)."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    seen = []

    def run(args, device, mode, backend, record_dir):
        seen.append(Path(record_dir))
        (Path(record_dir) / "summary.json").write_text("{}")
        if fail:
            raise KeyboardInterrupt
        return 0

    monkeypatch.setattr(demo, "_run", run)
    argv = ["--batch", "2", "--device", "cpu"] + (["--keep-recording"] if keep else [])
    if fail:
        with pytest.raises(KeyboardInterrupt):
            demo.main(argv)
    else:
        assert demo.main(argv) == 0
    assert len(seen) == 1 and seen[0].parent == tmp_path and seen[0].name.startswith("dsv41_demo_graphdiff_")
    assert seen[0].exists() == keep
