"""The `drafter:` section of a recipe for kind "peagle": P-EAGLE's config, EAGLE-3's fields and the mask row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from drafters.eagle3.config import Eagle3Config


@dataclass(kw_only=True)
class PEagleConfig(Eagle3Config):
    """EAGLE-3's fields (drafters/eagle3/config.py; ttt_steps is the number of parallel depths K trained, and the
    longest proposal served without retraining is not bounded by it) and:

    mask_token_id / allow_text_mask_token: the target-vocabulary row every parallel slot reads as its token (None:
      the tokenizer's first unused row, as DFlash's mask; vLLM reads it as `pard_token`).
    """

    mask_token_id: int | None = None
    allow_text_mask_token: bool = False

    TRAINING_OPTIONS: ClassVar[tuple[str, ...]] = Eagle3Config.TRAINING_OPTIONS + ("allow_text_mask_token",)

    def step_shape(self, *, hidden: int, vocab: int, seq_len: int) -> dict:
        """EAGLE-3's TTT step (its depths run beside each other here) and the trained mask_hidden."""
        return {**super().step_shape(hidden=hidden, vocab=vocab, seq_len=seq_len), "placeholder": True}
