"""The compile cache: keys, the on-disk cache across processes (no cute.compile in a second process), concurrent
writers and corrupt objects. Everything compiles for sm_90a and loads on the CPU; no GPU is needed."""

import json
import os
import subprocess
import sys
import textwrap

from tests.kernels.support import require_cute_dsl

require_cute_dsl()

from dsv41.kernels import compile_cache, mhc_post_pre  # noqa: E402

SOURCES = (mhc_post_pre.__file__,)

# Compiles the tiny model's kernels and prints the counters as JSON.
_CHILD = textwrap.dedent("""
    import json, sys
    from dsv41.kernels import compile_cache, mhc_coeffs, mhc_post_pre
    mhc_post_pre.compile_for(128)
    mhc_coeffs.compile_for(128, 20)
    print(json.dumps(vars(compile_cache.STATS)))
""")


def _child_env(cache_dir):
    return dict(os.environ, DSV41_CACHE_DIR=str(cache_dir), CUTE_DSL_ARCH="sm_90a")


def _run_child(cache_dir):
    out = subprocess.run([sys.executable, "-c", _CHILD], env=_child_env(cache_dir), capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_key_changes_with_config_sources_and_arch(monkeypatch, tmp_path):
    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    base = compile_cache.object_path("k", SOURCES, (5120,))
    assert base.parent.parent == tmp_path
    assert base == compile_cache.object_path("k", SOURCES, (5120,))
    assert base != compile_cache.object_path("k", SOURCES, (128,))
    assert base != compile_cache.object_path("other", SOURCES, (5120,))
    assert base != compile_cache.object_path("k", SOURCES + (compile_cache.__file__,), (5120,))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert compile_cache.target_arch() == "sm_100a"
    assert base.parent != compile_cache.object_path("k", SOURCES, (5120,)).parent


def test_default_cache_dir(monkeypatch):
    monkeypatch.delenv("DSV41_CACHE_DIR", raising=False)
    assert str(compile_cache.cache_dir()).endswith(os.path.join(".cache", "dsv41", "kernels"))


def test_second_process_finds_every_kernel_on_disk(tmp_path):
    first = _run_child(tmp_path)
    assert first["compiles"] == 2 and first["disk_hits"] == 0
    second = _run_child(tmp_path)
    assert second["compiles"] == 0 and second["disk_hits"] == 2
    objects = sorted(p.name for p in tmp_path.rglob("*.o"))
    assert len(objects) == 2 and not list(tmp_path.rglob("*.tmp"))


def test_concurrent_processes_compile_once(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD], env=_child_env(tmp_path), stdout=subprocess.PIPE,
                              text=True) for _ in range(3)]
    stats = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        stats.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(s["compiles"] for s in stats) == 2
    assert sum(s["disk_hits"] for s in stats) == 4


def test_memory_hit_and_corrupt_object(monkeypatch, tmp_path):
    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    get = mhc_post_pre._compile_mhc_post_pre
    get.cache_clear()
    compile_cache.STATS.reset()
    path = get.object_path(128, True, 1)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an object file")
    fn = get(128, True, 1)
    assert compile_cache.STATS.compiles == 1 and path.stat().st_size > 1000
    assert get(128, True, 1) is fn and compile_cache.STATS.memory_hits == 1
    get.cache_clear()
