"""The `drafter:` section of a recipe for kind "medusa": Medusa's config (rules that resolve its defaults and the
layers it builds: drafters/medusa/layers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from drafters.losses import LK_DEFAULT_ETA


@dataclass(kw_only=True)
class MedusaConfig:
    """The `drafter:` section of a recipe for kind "medusa".

    num_heads: K extra heads; head k predicts the token k + 2 places after the position of the hidden state it reads.
    num_layers: residual SiLU blocks per head (Medusa's default 1).
    step_decay: head k's loss weight step_decay**k (Medusa-1's 0.8^k).
    lm_head: "target" = every head ends in the target's frozen lm_head (vLLM's `original_lm_head`; only the blocks
      train); "copy" = a trainable head per head initialised from the target's lm_head (the Medusa paper);
      "new" = a trainable head per head from random (the Medusa repository).
    loss: "soft" = cross-entropy against the target's distribution at the label (distillation); "hard" = against the
      data token (Medusa-1's loss); "lk" / "lk_hybrid" = the LK losses against that distribution (-log of the
      expected acceptance; lam KL + (1 - lam) TV with lam = exp(-lk_eta * acceptance): drafters/losses.lk_cell_loss).
    sample_drafts: propose by sampling each head's distribution (heads are independent given the hidden state, so q is
      each head's own distribution) and return it; else argmax drafts.
    """

    num_heads: int = 3
    num_layers: int = 1
    step_decay: float = 0.8
    lm_head: Literal["target", "copy", "new"] = "target"
    loss: Literal["soft", "hard", "lk", "lk_hybrid"] = "soft"
    lk_eta: float = LK_DEFAULT_ETA
    sample_drafts: bool = False

    # What a run started from a trained drafter (train.init_from) takes from its recipe; every other field is the
    # checkpoint's (train/warm_start.py).
    TRAINING_OPTIONS: ClassVar[tuple[str, ...]] = ("step_decay", "loss", "lk_eta", "sample_drafts")

    def step_shape(self, *, hidden: int, vocab: int, seq_len: int) -> dict:
        """One training step's shape for drafters/step_memory.StepShape: num_heads heads on every position's hidden
        state, the loss through the full vocabulary; each head's own lm_head (copy / new) is trained."""
        own_heads = self.num_heads * vocab * hidden if self.lm_head != "target" else 0
        return {"step": "heads", "depths": self.num_heads, "head_vocab": vocab, "default_features": 0,
                "extra_params": own_heads}
