"""Every foreign block is compiled in each of the backend's modes: `inductor` (the default, where Inductor lowers the
rewritten graph) and `fx` (the rewritten graph run as is)."""

import pytest

from dsv41.config import MODES


@pytest.fixture(scope="module", params=MODES)
def mode(request):
    return request.param
