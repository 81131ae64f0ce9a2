"""Fuzz of the backend's settings and entry points: every setting of `Dsv41Config` and every DSV41_* variable with
junk values, `torch.compile(..., backend="dsv41", options=...)`, `make_backend`'s config, the CLI on a CPU-only
machine and graph-diff on missing or damaged recordings. Each is either accepted or a TypeError / ValueError (a
one-line CLI error with a non-zero exit) that names the setting, variable or path; never an internal error.

The settings and variables come from `Dsv41Config`'s fields and `dsv41.config._ENV`, so a new one is fuzzed too.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from dsv41 import config as config_module
from dsv41.backend import Dsv41Backend, make_backend
from dsv41.cli import main as cli_main
from dsv41.config import Dsv41Config

JUNK = [None, "maybe", "", -1, 0, 1.5, math.nan, math.inf, -math.inf, [], ["nope"], True, 2**70, object()]
ENV_JUNK = ["maybe", "", " ", "-1", "0", "1e3", "99999999999999999999", "a,b", "\x00"]


@pytest.mark.parametrize("setting", [f.name for f in dataclasses.fields(Dsv41Config)])
def test_every_setting_with_junk(setting, tmp_path):
    """Each junk value is accepted (and then held as given, or normalised) or rejected naming the setting."""
    file = tmp_path / "a_file"
    file.write_text("x")
    for value in JUNK + [str(file)]:
        try:
            config = make_backend(**{setting: value}).config
        except (TypeError, ValueError) as e:
            assert f"Dsv41Config.{setting}" in str(e), (setting, value, e)
            continue
        except Exception as e:  # noqa: BLE001  an internal error is the finding
            pytest.fail(f"{setting}={value!r}: {type(e).__name__}: {e}")
        held = getattr(config, setting)
        if isinstance(value, float) and not math.isfinite(value):
            pytest.fail(f"{setting}={value!r} accepted (held {held!r})")
        if setting == "dump_dir" and value == str(file):
            pytest.fail(f"dump_dir={value!r}, a file, accepted")


@pytest.mark.parametrize("variable", [var for var, _ in config_module._ENV])
def test_every_variable_with_junk(variable, tmp_path):
    """Each junk value is accepted (an empty or blank variable is unset) or a ValueError naming the variable."""
    file = tmp_path / "a_file"
    file.write_text("x")
    for text in ENV_JUNK + [str(file)]:
        try:
            config = Dsv41Config().with_env({variable: text})
        except ValueError as e:
            assert str(e).startswith(f"environment variable {variable}={text!r}: "), (variable, text, e)
            continue
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{variable}={text!r}: {type(e).__name__}: {e}")
        if not text.strip():
            assert config == Dsv41Config(), f"{variable}={text!r} (blank) changed the config"
        assert not (variable == "DSV41_DUMP_DIR" and text == str(file)), "DSV41_DUMP_DIR naming a file was accepted"


def test_make_backend_rejects_a_config_of_another_type():
    for config in ("fx", {"mode": "fx"}, 3):
        with pytest.raises(TypeError, match=f"make_backend: config must be a Dsv41Config or None, got {type(config).__name__}"):
            make_backend(config)


def _double(x):
    return x * 2


@pytest.mark.parametrize("options, error, message", [
    ({"bogus": 1}, TypeError, r"Dsv41Config has no setting\(s\) \['bogus'\]"),
    ({"mode": 3}, TypeError, r"Dsv41Config\.mode must be a str, got 3"),
    ({"max_tokens": -1}, ValueError, r"Dsv41Config\.max_tokens must be >= 1, got -1"),
    ({"hc_eps": math.inf}, ValueError, r"Dsv41Config\.hc_eps must be finite and > 0, got inf"),
    ({"streams": "no"}, TypeError, r"Dsv41Config\.streams must be a bool"),
])
def test_compile_options_are_settings(options, error, message):
    """`options` of torch.compile reach the backend as settings by name: a bad one is the setting's own error,
    which Dynamo reports as BackendCompilerFailed around it (its `inner_exception`)."""
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(_double, backend="dsv41", options=options)(torch.randn(2))
    torch._dynamo.reset()
    assert isinstance(info.value.inner_exception, error), info.value
    assert re.search(message, str(info.value.inner_exception)), info.value


@torch.no_grad()
def test_compile_options_apply():
    backend = Dsv41Backend()
    torch._dynamo.reset()
    x = torch.randn(3)
    assert torch.equal(torch.compile(_double, backend=backend, options={"mode": "fx", "streams": False})(x), x * 2)
    torch._dynamo.reset()
    assert len(backend.reports) == 1 and backend.reports[0].fallback is None
    (used,) = backend._with_options.values()
    assert used.config == Dsv41Config(mode="fx", streams=False) and backend.config == Dsv41Config()
    with pytest.raises(TypeError, match="options must be a dict of settings by name"):
        backend.with_options([("mode", "fx")])


def _cli(capsys, *argv) -> tuple[int, str]:
    try:
        rc = cli_main(list(argv))
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def _recordings(tmp_path) -> dict:
    """Missing and damaged recording directories."""
    file = tmp_path / "a_file"
    file.write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "summary.json").write_text("{not json")
    wrong = tmp_path / "wrong_shape"
    wrong.mkdir()
    (wrong / "summary.json").write_text('["a list", 3]')
    return {"missing": tmp_path / "nowhere", "a file": file, "empty": empty, "corrupt summary": corrupt,
            "summary of the wrong shape": wrong}


@pytest.mark.parametrize("command", ["show", "compare", "check"])
def test_graphdiff_on_missing_or_damaged_recordings(command, tmp_path, capsys):
    expect = tmp_path / "expect.json"
    expect.write_text("{}")
    for what, path in _recordings(tmp_path).items():
        argv = {"show": [path], "compare": [path, path], "check": [path, "--expect", expect]}[command]
        rc, err = _cli(capsys, "graphdiff", command, *map(str, argv))
        assert rc not in (0, None) and "Traceback" not in err, (what, err)
        last = err.strip().splitlines()[-1]
        assert last.startswith("dsv41 graphdiff") and str(path) in last, (what, err)
    rc, err = _cli(capsys, "graphdiff", "check", str(tmp_path / "corrupt"), "--expect", str(tmp_path / "none.json"))
    assert rc == 2 and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a machine without CUDA")
@pytest.mark.parametrize("argv", [["bench", "kernels"], ["bench", "kernels", "--tokens", "0"],
                                  ["bench", "decode", "--batch", "1"], ["bench", "decode", "--context", "-5"],
                                  ["bench", "decode", "--layers", "x"], ["precompile", "--config", "nope"],
                                  ["bench", "kernels", "--tokens", "x"], ["demo", "--mode", "nope"],
                                  ["graphdiff", "nope"], ["bench", "kernels", "--op", "nope"]])
def test_cli_bad_arguments_on_a_cpu_machine(argv, capsys):
    """A non-zero exit and an error line on stderr naming the command (argparse's usage lines may precede it and
    graph-diff's pointer to --help follow it), no traceback."""
    rc, err = _cli(capsys, *argv)
    assert rc not in (0, None) and "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith(f"dsv41 {argv[0]}") and ": " in line], err
