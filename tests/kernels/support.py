"""What the kernel test files share: the CuTe DSL guard, the token counts they run at, the fresh-cache compile check."""

import os

import pytest
import torch


def require_cute_dsl() -> None:
    """Skip the calling test module when CuTe DSL (nvidia-cutlass-dsl, apache-tvm-ffi) is not installed, except on
    a CUDA machine, where its absence is an error (the kernel tests must not skip there)."""
    try:
        import cutlass.cute  # noqa: F401
        import tvm_ffi  # noqa: F401
    except ImportError:
        if torch.cuda.is_available():
            raise
        pytest.skip("CuTe DSL (nvidia-cutlass-dsl, apache-tvm-ffi) is not installed", allow_module_level=True)


def tokens_from_env(default: str) -> list[int]:
    """The token counts of DSV41_TEST_TOKENS (comma-separated; the sanitizer runs narrow them), else `default`."""
    return [int(t) for t in os.environ.get("DSV41_TEST_TOKENS", default).split(",")]


def assert_compiles_fresh(monkeypatch, tmp_path, cached, config: tuple, build=None) -> None:
    """`build(*config)` (default: the `cached_kernel` function `cached` itself) compiles into an empty kernel cache,
    so cute.compile really runs for the target architecture, and returns a callable; `cached` wrote its object."""
    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path))
    cached.cache_clear()
    assert callable((build or cached)(*config))
    assert cached.object_path(*config).exists()
    cached.cache_clear()
