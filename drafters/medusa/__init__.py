"""Medusa heads: model.py (the drafter), layers.py (config, residual blocks)."""

from drafters.medusa.layers import MedusaConfig
from drafters.medusa.model import MedusaDrafter

__all__ = ["MedusaConfig", "MedusaDrafter"]
