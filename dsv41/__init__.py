"""dsv41: a torch.compile backend for DeepSeek-V4.1 decode on NVIDIA Hopper."""

import os as _os

# The subpackages live at the repository root (passes/, lowerings/, ...) and are mapped into `dsv41` by
# setuptools' package-dir. An install that only puts the repository on sys.path (a legacy develop install)
# lacks that mapping; then the repository root itself serves as the search path of `dsv41.<subpackage>`.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(_os.path.join(_root, "passes")):
    __path__.append(_root)

from dsv41.backend import Dsv41Backend, dsv41_backend, make_backend
from dsv41.config import FUSIONS, Dsv41Config
from dsv41.passes.manager import CompileReport

__version__ = "0.1.0"
__all__ = ["CompileReport", "Dsv41Backend", "Dsv41Config", "FUSIONS", "dsv41_backend", "make_backend"]
