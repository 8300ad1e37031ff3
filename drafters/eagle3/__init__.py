"""EAGLE-3: model.py (the drafter), config.py (its recipe section), layers.py (decoder layer), export.py
(serving formats)."""

from drafters.eagle3.config import Eagle3Config
from drafters.eagle3.model import Eagle3Drafter, detect_format

__all__ = ["Eagle3Config", "Eagle3Drafter", "detect_format"]
