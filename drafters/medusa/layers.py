"""Medusa building blocks: the recipe config and the residual SiLU block (reference algorithms_eagle3_mtp.md B.5).

Shapes: D hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


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
      data token (Medusa-1's loss).
    sample_drafts: propose by sampling each head's distribution (heads are independent given the hidden state, so q is
      each head's own distribution) and return it; else argmax drafts.
    """

    num_heads: int = 3
    num_layers: int = 1
    step_decay: float = 0.8
    lm_head: Literal["target", "copy", "new"] = "target"
    loss: Literal["soft", "hard"] = "soft"
    sample_drafts: bool = False


class ResBlock(nn.Module):
    """x + SiLU(W x + b). W and b start at zero, so the block starts as the identity (Medusa initialises W to zero;
    zeroing b too makes the start exact: SiLU(0) = 0)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        if not self.linear.weight.is_meta:
            with torch.no_grad():
                self.linear.weight.zero_()
                self.linear.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(nn.Module):
    """num_layers ResBlocks, then (unless the target's head is shared) its own lm_head [V, D]."""

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int, own_head: bool):
        super().__init__()
        self.blocks = nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers)))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False) if own_head else None

    def logits(self, hidden: torch.Tensor, shared_head: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> logits [..., V]; `shared_head` [V, D] is used when the head has none of its own."""
        x = self.blocks(hidden)
        return self.lm_head(x) if self.lm_head is not None else F.linear(x, shared_head)
