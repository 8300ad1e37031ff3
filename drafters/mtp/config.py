"""The `drafter:` section of a recipe for kind "mtp": MTP's config (rules that resolve its defaults and the
layers it builds: drafters/mtp/layers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from drafters.losses import LK_DEFAULT_ETA


@dataclass(kw_only=True)
class MTPConfig:
    """The `drafter:` section of a recipe for kind "mtp".

    num_modules: D distinct MTP modules (MTP-D). Depth k (0-based) uses module k, or with `reuse` module k % D (one
      module applied for every step, as vLLM runs a checkpoint with fewer modules than speculative tokens).
    num_steps: teacher-forced depths trained per sequence, at most num_modules unless reuse. Read at every forward, so
      a phase may change it.
    loss_weights: per-depth weights of the per-depth mean losses; () = 1/num_steps each, DeepSeek-V3's (lambda/D)
      sum_k L_k with lambda = 1 (its lambda only balances the MTP loss against the main loss, which a frozen target
      does not have). Longer lists are cut to num_steps.
    loss: "soft" = cross-entropy against the target's distribution at the label (distillation, as EAGLE-3 here);
      "hard" = cross-entropy against the data token (DeepSeek-V3's objective); "lk" / "lk_hybrid" = the LK losses
      against that distribution (-log of the expected acceptance; lam KL + (1 - lam) TV, lam = exp(-lk_eta *
      acceptance): drafters/losses.lk_cell_loss).
    draft_vocab_size: None = the target's frozen full-vocabulary lm_head; else one trained head over the V_d most
      frequent target tokens of the training data (EAGLE-3's d2t / t2d, drafters/vocab.py), warm-started from the
      target's rows and shared by every module: the head is most of a draft step's cost on a small target. The teacher
      is then the target's distribution renormalised on V_d, and cells whose token (the target's argmax; the data
      token for "hard") lies outside are not trained, as EAGLE-3's. Only the native format carries it.
    layout: the checkpoint family whose conventions the modules follow and into which they export natively:
      "deepseek_v3", "qwen3_next", "qwen3_5" (Qwen3.5 / 3.6), "mimo", "nemotron_h" (Nemotron 3: a step of several
      blocks) or "speculators" (see the module docstring).
    init_from_native: before training (Drafter.init_from_data), import the MTP weights that ship in the target's own
      checkpoint (drafters/mtp/export.py) instead of starting from fresh modules; a fine-tune of the model's own MTP.
      Fresh modules start as the identity on the hidden path (see `init_module_`).
    sample_drafts: propose by sampling the draft distribution and return it; else argmax drafts.
    proposer: how a draft after the first is computed. "server": as vLLM and SGLang run an MTP checkpoint for several
      tokens, step j runs the module at the next position over the previous step's output and draft j, its attention
      reading one cache of the committed positions' first-step K/V and the steps before it; of several modules only
      the first runs, at every step (vLLM 0.32's proposer passes its MTP models no step index, so the others load and
      never run; SGLang loads one), and it trains one module only. "depths":
      DeepSeek-V3's definition, which training teaches: step j runs module j over the last j + 1 positions with step
      j - 1's outputs there, each step with its own cache. "auto": "server" with one module, "depths" with several.
    """

    num_modules: int = 1
    reuse: bool = False
    num_steps: int | None = None
    loss_weights: tuple[float, ...] = ()
    loss: Literal["soft", "hard", "lk", "lk_hybrid"] = "soft"
    lk_eta: float = LK_DEFAULT_ETA
    draft_vocab_size: int | None = None
    layout: Literal["deepseek_v3", "qwen3_next", "qwen3_5", "mimo", "nemotron_h", "speculators"] = "deepseek_v3"
    init_from_native: bool = False
    sample_drafts: bool = False
    proposer: Literal["auto", "server", "depths"] = "auto"

    # What a run started from a trained drafter (train.init_from) takes from its recipe; every other field is the
    # checkpoint's (train/warm_start.py).
    TRAINING_OPTIONS: ClassVar[tuple[str, ...]] = ("num_steps", "loss_weights", "loss", "lk_eta", "init_from_native",
                                                   "sample_drafts", "proposer")

    def check_recipe(self) -> None:
        """What a recipe may not set that a checkpoint may (train.config runs it before anything loads; training
        forwards run it too)."""
        if self.proposer == "server" and self.num_modules != 1:
            raise ValueError(f"drafter.proposer 'server' trains one module, the one servers run at every step; "
                             f"drafter.num_modules is {self.num_modules}: use proposer 'depths' or 'auto', or "
                             "num_modules 1")

    @property
    def served_steps(self) -> bool:
        """Steps after the first run as servers run them (`proposer`)."""
        return self.proposer == "server" or (self.proposer == "auto" and self.num_modules == 1)

    def step_shape(self, *, hidden: int, vocab: int, seq_len: int) -> dict:
        """One training step's shape for drafters/step_memory.StepShape: num_steps depths of one decoder layer over
        every position, the loss through the target's full vocabulary. The HF layers repeat K/V for their mask on
        every device (transformers' sdpa_attention_forward)."""
        steps = self.num_modules if self.num_steps is None else int(self.num_steps)
        return {"step": "chain", "depths": steps, "num_layers": 1, "modules": self.num_modules,
                "step_keys": self.served_steps,
                "head_vocab": self.draft_vocab_size or vocab, "default_features": 0, "kv_expanded": True,
                "trained_head": self.draft_vocab_size is not None}
