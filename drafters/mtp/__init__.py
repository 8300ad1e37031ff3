"""MTP heads: model.py (the drafter), config.py (its recipe section), layers.py (module, cache), export.py
(checkpoint layouts)."""

from drafters.mtp.config import MTPConfig
from drafters.mtp.model import MTPDrafter

__all__ = ["MTPConfig", "MTPDrafter"]
