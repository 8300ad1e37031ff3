"""DFlash: model.py (the drafter), layers.py (config, backbone shared with DSpark), export.py (serving formats)."""

from drafters.dflash.layers import DFlashConfig
from drafters.dflash.model import DFlashDrafter

__all__ = ["DFlashConfig", "DFlashDrafter"]
