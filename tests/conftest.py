"""Test-suite wiring: hardware markers skip themselves when the hardware is absent."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "multi_gpu" in item.keywords and n_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs at least two CUDA devices"))
