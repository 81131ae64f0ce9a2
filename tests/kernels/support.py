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


def assert_replays_bit_identical(call, static: list, sets: list[list], out: torch.Tensor, direct: list,
                                 replays: int = 500) -> None:
    """Capture ``call()`` (which reads ``static`` and writes ``out``) in one CUDA graph, after a warm-up on a side
    stream, then replay it ``replays`` times round robin over ``sets``: before each replay the set is copied into
    ``static`` (None entries are absent arguments) and ``out`` is poisoned with NaN; the replay's ``out`` must equal
    the direct call's output ``direct[i]`` of that set bit for bit."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for i in range(replays):
        for dst, src in zip(static, sets[i % len(sets)], strict=True):
            if dst is not None:
                dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, direct[i % len(sets)]), f"replay {i}"
