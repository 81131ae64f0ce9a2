"""Test-suite wiring: hardware markers skip themselves when the hardware is absent; a 1-process gloo group; the
pass cache off (tests/backend/test_pass_cache.py turns it on in its own directory), so that no test is served a
rewrite that an earlier test or run stored (a monkeypatched pass or reference would silently not run)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist

os.environ["DSV41_PASS_CACHE"] = "0"


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "multi_gpu" in item.keywords and n_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs at least two CUDA devices"))


@pytest.fixture(scope="module")
def gloo_group():
    """A 1-process gloo group as the default group for the module's tests; yields its group_name."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
