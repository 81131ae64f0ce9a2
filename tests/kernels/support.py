"""What the kernel test files share: the CuTe DSL guard and the token counts they run at."""

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
