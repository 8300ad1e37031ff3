"""The `drafter:` section of a recipe for kind "dspark": DSpark's config (rules that resolve its defaults and the
layers it builds: drafters/dspark/layers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from drafters.dflash.config import BACKBONE_TRAINING_OPTIONS, BlockBackboneConfig


FULL_VOCAB_TRAINING = ("drafter.draft_vocab_size: DSpark trains over the target's full vocabulary; leave it null and "
                       "reduce the trained drafter with `draftsmith export CHECKPOINT --format native "
                       "--draft-vocab-size N`")


@dataclass(kw_only=True)
class DSparkConfig(BlockBackboneConfig):
    """The `drafter:` section of a recipe for kind "dspark": the backbone's fields (BlockBackboneConfig, DFlash's;
    None = derive as DFlash does) and these.

    block_size: S inputs [anchor, MASK x (S-1)] give S drafts (slot k predicts the token anchor + k + 1, the anchor
      slot included), so a proposal is at most S tokens.
    markov_head_type: "vanilla" | "gated" | "rnn" | "none" (no sequential head); markov_rank: r >= 1.
    enable_confidence_head; confidence_head_with_markov: feed W1[x_{k-1}] to it too (needs a sequential head).
    loss: ce_weight * CE + l1_weight * ||p_draft - p_target||_1 + confidence_weight * BCE(c, 1 - L1 / 2), each cell
      weighted exp(-k / loss_decay_gamma) (DeepSpec: 0.1, 0.9, 1.0 and 4.0), or with loss_weighting "dpace" by
      D-PACE from each cell's CE confidence (drafters/losses.dpace_weights, smoothing dpace_alpha), or "auf": the
      decay weights on each block's cells up to and including its first one whose argmax misses the data token
      (Spec-AUF, drafters/losses.auf_support). loss: "hard" =
      the CE term against the data token (DeepSpec); "soft" = against the target's distribution (distillation).
    confidence_temperatures: one per block slot, fitted by `draftsmith calibrate` (Sequential Temperature Scaling);
      () = uncalibrated.
    draft_vocab_size: None in a recipe (DSpark trains over the target's full vocabulary); set by `draftsmith export
      --draft-vocab-size N`, whose frequency-ranked head keeps N rows of the target's lm_head and of W2 (native
      format only; DeepSpec and speculators read a full-vocabulary DSpark).
    """

    block_size: int = 7
    markov_head_type: Literal["vanilla", "gated", "rnn", "none"] = "vanilla"
    markov_rank: int = 256
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    loss_decay_gamma: float = 4.0
    loss: Literal["hard", "soft"] = "hard"
    loss_weighting: Literal["decay", "dpace", "auf"] = "decay"
    dpace_alpha: float = 0.5
    confidence_temperatures: tuple[float, ...] = ()
    draft_vocab_size: int | None = None

    # What a run started from a trained drafter (train.init_from) takes from its recipe; every other field is the
    # checkpoint's (train/warm_start.py). Its temperatures are the recipe's (none): a fine-tune is calibrated again.
    TRAINING_OPTIONS: ClassVar[tuple[str, ...]] = BACKBONE_TRAINING_OPTIONS + (
        "ce_weight", "l1_weight", "confidence_weight", "loss_decay_gamma", "loss", "loss_weighting", "dpace_alpha",
        "confidence_temperatures")

    def check_recipe(self) -> None:
        """What a recipe may not set that a checkpoint may (train.config runs it before anything loads)."""
        if self.draft_vocab_size is not None:
            raise ValueError(FULL_VOCAB_TRAINING)

    def step_shape(self, *, hidden: int, vocab: int, seq_len: int) -> dict:
        """One training step's shape for drafters/step_memory.StepShape: DFlash's blocks, plus the sequential head
        (its Markov embeddings, gates and confidence head) and what each slot keeps for it."""
        rank = self.markov_rank if self.markov_head_type != "none" else 0
        return {"step": "block", "depths": self.block_size, "anchors": min(self.num_anchors, max(1, seq_len - 1)),
                "head_vocab": self.draft_vocab_size or vocab, "default_features": 5,
                "markov_rank": rank, "extra_params": self.head_params(hidden), "slot_extra": hidden + rank}

    def head_params(self, hidden: int) -> int:
        """Parameters of the sequential-head gate (gated: [h ; W1 x] -> r, rnn: [s ; W1 x ; h] -> 3r, with biases)
        and of the confidence head (a linear of [h ; W1 x] or h, with bias); the W1 / W2 tables are counted apart."""
        rank, kind = self.markov_rank, self.markov_head_type
        gate = {"gated": (hidden + rank + 1) * rank, "rnn": (2 * rank + hidden + 1) * 3 * rank}.get(kind, 0)
        confidence = 0
        if self.enable_confidence_head:
            confidence = hidden + (rank if self.confidence_head_with_markov else 0) + 1
        return gate + confidence
