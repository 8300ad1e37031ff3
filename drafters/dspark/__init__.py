"""DSpark: model.py (the drafter), layers.py (config, sequential and confidence heads), export.py (serving layouts),
calibration.py (Sequential Temperature Scaling and the confidence metrics). The backbone is DFlash's."""

from drafters.dspark.layers import DSparkConfig
from drafters.dspark.model import DSparkDrafter

__all__ = ["DSparkConfig", "DSparkDrafter"]
