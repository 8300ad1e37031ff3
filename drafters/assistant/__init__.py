"""KV-sharing assistant (Gemma-4 style): model.py (the drafter), config.py (its recipe section), layers.py
(query-only layers)."""

from drafters.assistant.config import AssistantConfig
from drafters.assistant.model import AssistantDrafter

__all__ = ["AssistantConfig", "AssistantDrafter"]
