"""Compile CuTe DSL kernels once per static configuration, and keep the binaries on disk.

The idiom (shared/design/cutedsl_anchors.md sections 1.5, 1.6, 6):

- a kernel is compiled with *fake* tensors whose row count is a symbolic ``cute.sym_int()``, with
  ``--enable-tvm-ffi`` and the TVM-FFI environment stream, so one binary serves every token count, the
  compiled function is called directly with ``torch.Tensor`` arguments and launches on
  ``torch.cuda.current_stream()`` (which makes it capturable in CUDA graphs);
- ``cute.compile`` has no cache of its own (DSL 4.8.1 forces ``no_cache``), so the compiled function is
  exported to an object file (``export_to_c``) and later processes load it back with
  ``cute.runtime.load_module`` (milliseconds instead of a fraction of a second to seconds per kernel).

Disk layout: ``$DSV41_CACHE_DIR`` (default ``~/.cache/dsv41/kernels``) / ``<fingerprint>`` / ``<name>-<key>.o``.
The fingerprint hashes the target architecture, the Python, CuTe DSL and tvm-ffi versions and this file;
the key hashes the kernel's source files and its static configuration. Writers export to a private temporary
file and ``os.replace`` it into place under an exclusive per-key ``flock``, so concurrent processes never
see a partial object and compile a cold key only once.

``STATS`` counts compiles (and their seconds), disk hits and memory hits, so tests can assert that a second process finds
every kernel on disk and calls ``cute.compile`` zero times.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import cutlass
import cutlass.cute as cute
import torch
import tvm_ffi

DEFAULT_ARCH = "sm_90a"
_EXPORT_NAME = "func"
_FORMAT = 1  # bump to invalidate every cached object


@dataclasses.dataclass
class CacheStats:
    compiles: int = 0
    disk_hits: int = 0
    memory_hits: int = 0
    compile_s: float = 0.0  # wall seconds in compiling, exporting and loading cold keys

    def reset(self) -> None:
        self.compiles = self.disk_hits = self.memory_hits = 0
        self.compile_s = 0.0


STATS = CacheStats()
_compile_lock = threading.Lock()  # cute.compile is not thread-safe (MLIR thread-local state)


def target_arch() -> str:
    """The architecture kernels are compiled for: ``$CUTE_DSL_ARCH`` if set, else ``sm_90a``.

    Only Hopper is targeted; compiling never needs a GPU, so the CPU test suite builds the same binaries.
    """
    return os.environ.get("CUTE_DSL_ARCH") or DEFAULT_ARCH


def cache_dir() -> Path:
    return Path(os.environ.get("DSV41_CACHE_DIR") or Path.home() / ".cache" / "dsv41" / "kernels")


def _versions() -> str:
    return (f"py{sys.version_info.major}.{sys.version_info.minor} cutlass={cutlass.__version__} "
            f"tvm_ffi={tvm_ffi.__version__} format={_FORMAT}")


@functools.lru_cache(maxsize=None)
def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def fingerprint() -> str:
    """Hash of everything outside a kernel's own key that changes its binary."""
    h = hashlib.sha256()
    h.update(f"{target_arch()} {_versions()} {_file_digest(__file__)}".encode())
    return h.hexdigest()[:20]


def kernel_key(name: str, sources: Sequence[str], config: tuple) -> str:
    """Hash of a kernel's name, source files and static configuration (a tuple of reprs-stable scalars)."""
    h = hashlib.sha256(name.encode())
    for src in sources:
        h.update(_file_digest(str(Path(src).resolve())).encode())
    h.update(repr(config).encode())
    return h.hexdigest()[:24]


def object_path(name: str, sources: Sequence[str], config: tuple) -> Path:
    return cache_dir() / fingerprint() / f"{name}-{kernel_key(name, sources, config)}.o"


def compile_tvm_ffi(kernel: object, *args) -> object:
    """``cute.compile`` for the target architecture with TVM-FFI; ``args`` are fake tensors / scalars.

    The last argument must be ``env_stream()`` so the kernel follows the caller's current stream.
    """
    STATS.compiles += 1
    return cute.compile(kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {target_arch()}")


def fake_tensor(dtype: type, shape: tuple, align: int = 16) -> object:
    """A fake row-major compact tensor; a ``cute.sym_int()`` in ``shape`` is a runtime dimension
    (several tensors sharing one sym_int are checked to agree at call time)."""
    return cute.runtime.make_fake_compact_tensor(dtype, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),
                                                 assumed_align=align)


def env_stream() -> object:
    """The fake stream argument: at call time TVM-FFI passes ``torch.cuda.current_stream()``."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def shape_reason(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple) -> str | None:
    """Why ``t`` is not a ``dtype`` tensor of ``shape`` (None when it is)."""
    if t.dtype != dtype:
        return f"{name} must be {dtype}, got {t.dtype}"
    if tuple(t.shape) != tuple(shape):
        return f"{name} must have shape {list(shape)}, got {list(t.shape)}"
    return None


def hopper_reason(**tensors: torch.Tensor) -> str | None:
    """Why a kernel built for sm_90a cannot take these tensors (None when it can): they must be contiguous,
    16-byte aligned and on one Hopper CUDA device."""
    device = None
    for name, t in tensors.items():
        if not t.is_cuda:
            return f"{name} is not a CUDA tensor"
        if device is None:
            device = t.device
            if torch.cuda.get_device_capability(device)[0] != 9:
                return f"the kernels are built for sm_90a (Hopper), {device} is not one"
        elif t.device != device:
            return f"{name} is on {t.device}, not {device}"
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        if t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned"
    return None


class _FileLock:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _load(path: Path) -> Callable:
    return cute.runtime.load_module(str(path), enable_tvm_ffi=True)[_EXPORT_NAME]


def cached_kernel(*sources: str) -> Callable:
    """Decorator for ``compile_fn(*config) -> compiled`` (a function calling ``compile_tvm_ffi``).

    ``sources`` are the files whose contents define the kernel (its module and the helpers it uses).
    The wrapper returns the callable for ``config`` from memory, else from the disk cache, else compiles,
    exports and publishes it. The returned callable is the loaded object file's ``tvm_ffi.Function`` in
    every case, so the disk path is the one always exercised.
    """

    def decorator(compile_fn: Callable) -> Callable:
        name = compile_fn.__qualname__.strip("_")
        memory: dict[tuple, Callable] = {}

        @functools.wraps(compile_fn)
        def get(*config):
            fn = memory.get(config)
            if fn is not None:
                STATS.memory_hits += 1
                return fn
            path = object_path(name, sources, config)
            path.parent.mkdir(parents=True, exist_ok=True)
            with _compile_lock, _FileLock(path.with_suffix(".lock")):
                fn = None
                if path.exists():
                    try:
                        fn = _load(path)
                        STATS.disk_hits += 1
                    except Exception:  # a corrupt object (killed writer of an older format): rebuild it
                        path.unlink(missing_ok=True)
                if fn is None:
                    t0 = time.perf_counter()
                    compiled = compile_fn(*config)
                    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                    try:
                        compiled.export_to_c(object_file_path=str(tmp), function_name=_EXPORT_NAME)
                        os.replace(tmp, path)
                    finally:
                        tmp.unlink(missing_ok=True)
                    fn = _load(path)
                    STATS.compile_s += time.perf_counter() - t0
            memory[config] = fn
            return fn

        get.object_path = lambda *config: object_path(name, sources, config)
        get.cache_clear = memory.clear
        return get

    return decorator
