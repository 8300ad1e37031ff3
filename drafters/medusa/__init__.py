"""Medusa heads: model.py (the drafter), config.py (its recipe section), layers.py (residual blocks)."""

from drafters.medusa.config import MedusaConfig
from drafters.medusa.model import MedusaDrafter

__all__ = ["MedusaConfig", "MedusaDrafter"]
