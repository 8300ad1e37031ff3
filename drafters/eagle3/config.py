"""The `drafter:` section of a recipe for kind "eagle3": EAGLE-3's config (rules that resolve its defaults and the
layers it builds: drafters/eagle3/layers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from drafters.layer_ids import AUTO, LayerIds
from drafters.losses import LK_DEFAULT_ETA


@dataclass(kw_only=True)
class Eagle3Config:
    """The `drafter:` section of a recipe for kind "eagle3". None = mirror the target's config.

    fc_init: "random" (nn.Linear default) or "identity_high" (fc starts as picking the highest tapped layer).
    init_layer_from_target: copy that target decoder layer into the first draft layer. Its q/k/v weights go on the
      hidden half of the 2D input (the hidden_norm gets the target layer's input norm); the embedding half keeps
      its random init, so the token path trains exactly as from scratch (zeros there would also train, since the
      hidden half is non-zero, but random keeps the token visible from step one).
    sample_drafts: propose by sampling from the draft distribution q and return it (sampling runs); else argmax.
    layer_ids: target layer ids (vLLM convention) or "auto": (2, N//2, N-3), on a hybrid moved onto full-attention
      layers' outputs (drafters/layer_ids.py); allow_linear_attention_ids keeps ids that read linear-attention layers.
    loss: "soft" = cross-entropy against the target's distribution on the draft vocabulary at each label (logit
      distillation, EAGLE-3's objective); "hard" = against the target's argmax there (one-hot, the same teacher);
      "lk" = -log of the expected acceptance sum_x min(p(x), q(x)) against that distribution; "lk_hybrid" =
      lam KL + (1 - lam)(1 - acceptance), lam = exp(-lk_eta * acceptance) (LK losses, drafters/losses.lk_cell_loss).
      The target's mass outside the draft vocabulary is left out (the teacher is renormalised on it, as for "soft").
    """

    layer_ids: LayerIds = AUTO
    allow_linear_attention_ids: bool = False
    num_layers: int = 1
    draft_vocab_size: int = 8192
    ttt_steps: int = 7
    step_decay: float = 0.8
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float | None = None
    norm_before_residual: bool = False
    init_head_from_target: bool = True
    init_layer_from_target: int | None = None
    fc_init: Literal["random", "identity_high"] = "random"
    sample_drafts: bool = False
    loss: Literal["soft", "hard", "lk", "lk_hybrid"] = "soft"
    lk_eta: float = LK_DEFAULT_ETA

    # What a run started from a trained drafter (train.init_from) takes from its recipe; every other field is the
    # checkpoint's, since it shapes the weights or what they mean (train/warm_start.py).
    TRAINING_OPTIONS: ClassVar[tuple[str, ...]] = ("ttt_steps", "step_decay", "init_head_from_target",
                                                   "init_layer_from_target", "fc_init", "sample_drafts", "loss",
                                                   "lk_eta", "allow_linear_attention_ids")

    def step_shape(self, *, hidden: int, vocab: int, seq_len: int) -> dict:
        """One training step's shape for drafters/step_memory.StepShape: TTT steps over every position."""
        return {"step": "ttt", "depths": self.ttt_steps, "head_vocab": self.draft_vocab_size, "default_features": 3}
