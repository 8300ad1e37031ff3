"""KV-sharing assistant (Gemma-4 style): model.py (the drafter), layers.py (config, query-only layers)."""

from drafters.assistant.layers import AssistantConfig
from drafters.assistant.model import AssistantDrafter

__all__ = ["AssistantConfig", "AssistantDrafter"]
