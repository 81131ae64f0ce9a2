"""The eager DeepSeek-V4.1 decode model (spec sections 1-2)."""

from dsv41.models.config import FLASH, TINY, ModelConfig, get_config
from dsv41.models.model import DSV41Model

__all__ = ["DSV41Model", "FLASH", "ModelConfig", "TINY", "get_config"]
