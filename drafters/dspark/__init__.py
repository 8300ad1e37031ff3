"""DSpark: model.py (the drafter), config.py (its recipe section), layers.py (sequential and confidence heads),
export.py (serving layouts). The backbone is DFlash's (drafters/dflash/backbone.py); calibration of its confidences
is drafters/calibration.py."""

from drafters.dspark.config import DSparkConfig
from drafters.dspark.model import DSparkDrafter

__all__ = ["DSparkConfig", "DSparkDrafter"]
