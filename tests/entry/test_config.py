"""Settings: `Dsv41Config` validates types and values naming the setting; the DSV41_* variables parse strictly,
name themselves in their errors, and are read when `dsv41_backend` is first used, never at import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dsv41.backend import Dsv41Backend, make_backend
from dsv41.config import BOOLEANS, Dsv41Config


@pytest.mark.parametrize("overrides, error, message", [
    (dict(streams="no"), TypeError, r"Dsv41Config\.streams must be a bool \(True or False\), got 'no' \(str\)"),
    (dict(debug=1), TypeError, r"Dsv41Config\.debug must be a bool"),
    (dict(max_tokens="8"), TypeError, r"Dsv41Config\.max_tokens must be an int, got '8' \(str\)"),
    (dict(max_tokens=True), TypeError, r"Dsv41Config\.max_tokens must be an int, got True"),
    (dict(max_tokens=0), ValueError, r"Dsv41Config\.max_tokens must be >= 1, got 0"),
    (dict(stream_max_tokens=-1), ValueError, r"Dsv41Config\.stream_max_tokens must be >= 0"),
    (dict(fusions="wo_a"), TypeError, r"Dsv41Config\.fusions must be a collection of names"),
    (dict(fusions={"wo_a", "nope"}), ValueError, r"Dsv41Config\.fusions: unknown fusion\(s\) \['nope'\]"),
    (dict(stream_branches=["indexer", 3]), TypeError, r"Dsv41Config\.stream_branches must hold names \(str\), got 3"),
    (dict(kernel="fast"), ValueError, r"Dsv41Config\.kernel: 'fast' is not one of"),
    (dict(mode=None), TypeError, r"Dsv41Config\.mode must be a str, got None"),
    (dict(dump_dir=3), TypeError, r"Dsv41Config\.dump_dir must be a path"),
    (dict(norm_eps="1e-20"), TypeError, r"Dsv41Config\.norm_eps must be a number"),
    (dict(hc_eps=0.0), ValueError, r"Dsv41Config\.hc_eps must be finite and > 0"),
    (dict(sinkhorn_iters=2.0), TypeError, r"Dsv41Config\.sinkhorn_iters must be an int"),
    (dict(max_tokns=8), TypeError, r"Dsv41Config has no setting\(s\) \['max_tokns'\]"),
])
def test_make_backend_rejects_bad_settings(overrides, error, message):
    with pytest.raises(error, match=message):
        make_backend(**overrides)


def test_collections_are_normalised():
    config = Dsv41Config(fusions=["wo_a", "qkv_norm"], stream_branches=("indexer",))
    assert config.fusions == frozenset({"wo_a", "qkv_norm"}) and config.stream_branches == frozenset({"indexer"})
    assert hash(config) == hash(Dsv41Config(fusions={"qkv_norm", "wo_a"}, stream_branches={"indexer"}))


@pytest.mark.parametrize("text", sorted(BOOLEANS) + ["TRUE", "Off", " yes ", "No"])
def test_debug_accepts_the_usual_boolean_spellings(text):
    assert Dsv41Config().with_env({"DSV41_DEBUG": text}).debug is BOOLEANS[text.strip().lower()]


def test_debug_false_turns_debug_off():
    assert Dsv41Config(debug=True).with_env({"DSV41_DEBUG": "false"}).debug is False


@pytest.mark.parametrize("env, message", [
    ({"DSV41_DEBUG": "maybe"}, r"DSV41_DEBUG='maybe': 'maybe' is not a boolean; use one of 1/true/yes/on/0/false/no/off"),
    ({"DSV41_DEBUG": "2"}, r"DSV41_DEBUG='2'"),
    ({"DSV41_MAX_TOKENS": "eight"}, r"DSV41_MAX_TOKENS='eight': 'eight' is not an integer"),
    ({"DSV41_MAX_TOKENS": "0"}, r"DSV41_MAX_TOKENS='0': Dsv41Config\.max_tokens must be >= 1"),
    ({"DSV41_STREAM_MAX_TOKENS": "-3"}, r"DSV41_STREAM_MAX_TOKENS='-3'"),
    ({"DSV41_MODE": "fast"}, r"DSV41_MODE='fast': Dsv41Config\.mode: 'fast' is not one of"),
    ({"DSV41_KERNEL": "triton"}, r"DSV41_KERNEL='triton'"),
    ({"DSV41_DISABLE_PASSES": "wo_a,nope"}, r"DSV41_DISABLE_PASSES='wo_a,nope': unknown pass\(es\) \['nope'\]"),
    ({"DSV41_STREAM_BRANCHES": "indexer,moe"}, r"DSV41_STREAM_BRANCHES='indexer,moe': .*unknown branch\(es\) \['moe'\]"),
])
def test_bad_environment_names_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        Dsv41Config().with_env(env)


def test_environment_values_apply():
    config = Dsv41Config().with_env({"DSV41_DISABLE_PASSES": "streams, wo_a", "DSV41_MAX_TOKENS": " 8 ", "DSV41_MODE": "fx",
                                     "DSV41_DEBUG": "", "DSV41_STREAM_BRANCHES": "indexer"})
    assert config.fusions == Dsv41Config().fusions - {"wo_a"} and not config.streams
    assert (config.max_tokens, config.mode, config.debug, config.stream_branches) == (8, "fx", False, frozenset({"indexer"}))


def test_env_backend_reads_the_environment_when_first_used(monkeypatch):
    monkeypatch.setenv("DSV41_DEBUG", "maybe")
    backend = Dsv41Backend(from_env=True)  # what `dsv41_backend` is: constructing it reads nothing
    with pytest.raises(ValueError, match="DSV41_DEBUG='maybe'"):
        backend.config
    with pytest.raises(ValueError, match="DSV41_DEBUG='maybe'"):
        backend(None, [])  # the compile call raises before doing anything, instead of falling back
    assert backend.reports == []
    monkeypatch.setenv("DSV41_DEBUG", "on")
    assert backend.config.debug is True and backend.pass_manager.config is backend.config


def test_backend_rejects_a_config_of_another_type():
    with pytest.raises(TypeError, match="Dsv41Backend: config must be a Dsv41Config or None, got dict"):
        Dsv41Backend({"mode": "fx"})


def test_bad_variable_breaks_neither_import_nor_help():
    env = {"DSV41_DEBUG": "maybe", "DSV41_MAX_TOKENS": "x", "PATH": "/usr/bin:/bin"}
    code = ("import dsv41, torch\n"
            "try:\n"
            "    dsv41.dsv41_backend.config\n"
            "except ValueError as e:\n"
            "    print('first use:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("first use: environment variable DSV41_MAX_TOKENS='x'"), proc.stdout
    proc = subprocess.run([sys.executable, "-m", "dsv41.cli", "--help"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "usage: dsv41" in proc.stdout and not proc.stderr, proc.stderr
