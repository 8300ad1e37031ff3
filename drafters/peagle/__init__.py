"""P-EAGLE: model.py (the drafter, EAGLE-3's with parallel drafting), config.py (its recipe section), export.py
(the serving layout), readers.py (what vLLM reads). It builds on EAGLE-3 (drafters/eagle3/)."""

from drafters.peagle.config import PEagleConfig
from drafters.peagle.model import PEagleDrafter

__all__ = ["PEagleConfig", "PEagleDrafter"]
