"""Reduced draft vocabulary (EAGLE-3 style, reference A.3): the V_d most frequent target tokens, sorted by id.

Two tables describe it, exactly as the speculators / vLLM checkpoints store them:
- d2t  int64 [V_d]: offsets, target_id = draft_id + d2t[draft_id];
- t2d  bool  [V]:   whether a target id is in the draft vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftVocab:
    """draft_ids: int64 [V_d], strictly increasing target ids; target_vocab_size: V."""

    draft_ids: torch.Tensor
    target_vocab_size: int

    def __post_init__(self):
        ids = self.draft_ids
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError(f"draft vocab must be a non-empty 1-D id list, got shape {tuple(ids.shape)}")
        if bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError("draft vocab ids must be strictly increasing (sorted, no duplicates)")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.target_vocab_size:
            raise ValueError(f"draft vocab ids must lie in [0, {self.target_vocab_size})")

    @property
    def size(self) -> int:
        return self.draft_ids.numel()

    @classmethod
    def from_counts(cls, token_counts: torch.Tensor, size: int) -> "DraftVocab":
        """The `size` most frequent ids of token_counts [V]; ties (and all-zero counts) go to the smaller id."""
        vocab_size = token_counts.numel()
        if not 0 < size <= vocab_size:
            raise ValueError(f"draft_vocab_size {size} must be in [1, {vocab_size}] (the target vocab size)")
        # A stable sort on descending counts keeps ascending ids among equal counts.
        order = torch.sort(token_counts.reshape(-1).double(), descending=True, stable=True).indices
        return cls(torch.sort(order[:size]).values.long(), vocab_size)

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, target_vocab_size: int) -> "DraftVocab":
        """Rebuild from the offset table d2t [V_d]."""
        return cls(torch.arange(d2t.numel(), device=d2t.device) + d2t.long(), target_vocab_size)

    @property
    def d2t(self) -> torch.Tensor:
        """int64 [V_d] offsets: target_id = draft_id + d2t[draft_id]."""
        return self.draft_ids - torch.arange(self.size, device=self.draft_ids.device)

    @property
    def t2d(self) -> torch.Tensor:
        """bool [V]: membership of each target id in the draft vocab."""
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool, device=self.draft_ids.device)
        mask[self.draft_ids] = True
        return mask

    def to_target(self, draft_index: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids."""
        return self.draft_ids[draft_index]

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape) -> draft ids, -1 where the id is outside the draft vocab."""
        index = torch.searchsorted(self.draft_ids, target_ids.clamp(0, self.target_vocab_size - 1))
        index = index.clamp(max=self.size - 1)
        return torch.where(self.draft_ids[index] == target_ids, index, -1)


def draft_to_target(draft_index: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Draft ids -> target ids with the offset table d2t [V_d] (no DraftVocab needed on the hot path)."""
    return draft_index + d2t[draft_index]
