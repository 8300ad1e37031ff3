"""MTP heads: model.py (the drafter), layers.py (config, module, cache), export.py (checkpoint layouts)."""

from drafters.mtp.layers import MTPConfig
from drafters.mtp.model import MTPDrafter

__all__ = ["MTPConfig", "MTPDrafter"]
