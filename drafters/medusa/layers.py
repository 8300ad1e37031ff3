"""Medusa building blocks: the residual SiLU block (its config: config.py) (reference algorithms_eagle3_mtp.md B.5).

Shapes: D hidden, V vocab.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


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

    def logits(self, hidden: torch.Tensor, shared_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """hidden [..., D] -> logits [..., V]; `shared_head` (x -> x W^T of the target's head [V, D]) is used when
        the head has none of its own."""
        x = self.blocks(hidden)
        return self.lm_head(x) if self.lm_head is not None else shared_head(x)
