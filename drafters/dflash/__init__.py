"""DFlash: model.py (the drafter), config.py (its recipe section), backbone.py and layers.py (the backbone shared
with DSpark), export.py (serving formats), readers.py and checks.py (what each reader makes of an export)."""

from drafters.dflash.config import DFlashConfig
from drafters.dflash.model import DFlashDrafter

__all__ = ["DFlashConfig", "DFlashDrafter"]
