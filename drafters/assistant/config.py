"""The `drafter:` section of a recipe for kind "assistant": the Gemma-4-style assistant's config (rules that
resolve its defaults and the layers it builds: drafters/assistant/layers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal


@dataclass(kw_only=True)
class AssistantConfig:
    """The `drafter:` section of a recipe for kind "assistant".

    num_layers: assistant decoder layers (Gemma 4's assistants have 4).
    hidden_size: the assistant's own width W; None = the target's hidden size.
    intermediate_size: its MLP width; None = the target's intermediate size.
    kv_layers: target decoder layer read by each assistant layer (one entry per layer); () = every assistant layer
      reads the target's last layer (Gemma 4 maps each layer to the last target layer of its attention type; a
      Llama/Qwen target has one type).
    num_steps: K, the draft steps trained per position (step k >= 1 reads step k-1's post-projected state and the
      ground-truth token, at the same query position and over the same target K/V as step 0).
    loss_weights: per-step weights of the per-step mean losses; () = 1/K each.
    loss: "soft" = cross-entropy against the target's distribution at the label; "hard" = against the data token.
    embed_scale: factor on the target's token embedding before the pre-projection; None = the scale the target itself
      applies to its embeddings (sqrt(D) for Gemma families, 1 otherwise), i.e. the "scaled target embedding".
    sample_drafts: propose by sampling each step's distribution (returned as probs); else argmax drafts.
    gemma4_config: the assistant's own Gemma 4 text config, as a `gemma4_assistant` checkpoint stores it under
      `text_config` (set by that import, drafters/assistant/export.py). Then the layers are Gemma 4's own decoder
      layers with KV reuse (sandwich norms, layer scalar, GELU MLP, unit attention scale, per-type head dim, RoPE and
      sliding window), and num_layers / hidden_size / intermediate_size must agree with it. None = Llama layers.
    reading: whose reading of the assistant it trains and drafts with, where the two disagree. "transformers" (its
      Gemma4AssistantForCausalLM): every step queries one position past the last cached key, and a sliding layer
      shows it window + 1 keys. "vllm" (vLLM 0.32's Gemma4 MTP, which serves gemma4_assistant exports): every step
      queries at the last cached position, and a sliding layer shows it the target's window of keys.
    """

    num_layers: int = 2
    hidden_size: int | None = None
    intermediate_size: int | None = None
    kv_layers: tuple[int, ...] = ()
    num_steps: int = 3
    loss_weights: tuple[float, ...] = ()
    loss: Literal["soft", "hard"] = "soft"
    embed_scale: float | None = None
    sample_drafts: bool = False
    gemma4_config: dict[str, Any] | None = None
    reading: Literal["transformers", "vllm"] = "transformers"

    # What a run started from a trained drafter (train.init_from) takes from its recipe; every other field is the
    # checkpoint's (train/warm_start.py).
    TRAINING_OPTIONS: ClassVar[tuple[str, ...]] = ("num_steps", "loss_weights", "loss", "sample_drafts",
                                                   "reading")  # a released assistant fine-tuned in vLLM's reading

    def step_shape(self, *, hidden: int, vocab: int, seq_len: int) -> dict:
        """One training step's shape for drafters/step_memory.StepShape: num_steps steps of its layers over every
        position, at its own width, reading the K/V of its target layers (one by default: the last), the loss
        through its own full-vocabulary head."""
        return {"step": "chain", "depths": self.num_steps, "head_vocab": vocab, "default_features": 0,
                "width": int(self.hidden_size or hidden), "kv_features": len(set(self.kv_layers)) or 1}
