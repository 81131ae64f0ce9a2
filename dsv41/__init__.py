"""dsv41: a torch.compile backend for DeepSeek-V4.1 decode on NVIDIA Hopper."""

from dsv41.backend import Dsv41Backend, dsv41_backend, make_backend
from dsv41.config import FUSIONS, Dsv41Config
from dsv41.passes.manager import CompileReport

__version__ = "0.1.0"
__all__ = ["CompileReport", "Dsv41Backend", "Dsv41Config", "FUSIONS", "dsv41_backend", "make_backend"]
