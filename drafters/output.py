"""The training output every drafter's `forward` returns and its `loss` reads (drafters/base.py, the contract).

Shapes: N prediction rows, K depths, V_d the draft vocabulary, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class _Logits:
    """DraftOutput.logits: the tensor given, else computed once through `head` on first access (a loss that reads
    `logits_of` chunks never builds the whole [N, K, V_d] tensor)."""

    def __get__(self, output, owner=None):
        if output is None:
            return None  # the dataclass default
        if output._logits is None and output.head is not None:
            output._logits = output.head(slice(None))
        return output._logits

    def __set__(self, output, value):
        output._logits = value


@dataclass
class DraftOutput:
    """Training output: N prediction rows of K depths each.

    Depth has one meaning for every drafter: the anchor is the last token the drafter is given as known (at
    inference, the token the target just emitted); depth k (0-based) predicts the token k + 1 places after it. A row
    is whatever the drafter computes together (EAGLE-3: one target position reached from K anchors; DFlash: one
    anchor's block), so each cell names its own label.

    logits:         [N, K, V_d] draft logits (V_d = the draft vocabulary; `draft_ids` maps it to target ids); given,
                    or computed through `head` when first read.
    batch_index:    [N] the sequence row of the batch each prediction row belongs to.
    label_position: [N, K] the position in that sequence of the token each cell predicts (anchor + 1 + k), always
                    in 1..T-1: a cell whose label would fall past the end is clamped to T-1 and marked invalid.
    depth_valid:    [N, K] bool, the cells the loss and the metrics use.
    draft_ids:      [V_d] target id of each draft-vocabulary index, or None when V_d is the target vocabulary.
    hidden:         [N, K, D] the drafter's final hidden state per cell, for heads that read it (or None).
    head:           rows (a slice or index over N) -> the logits of those rows; lets a loss compute logits a chunk
                    of rows at a time (`logits_of`, drafters/chunked.py) instead of holding [N, K, V_d].
    """

    logits: torch.Tensor | None = _Logits()
    batch_index: torch.Tensor = None
    label_position: torch.Tensor = None
    depth_valid: torch.Tensor = None
    draft_ids: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    head: Any = field(default=None, repr=False)

    def logits_of(self, rows) -> torch.Tensor:
        """Logits [n, K, V_d] of rows `rows`: a slice of the given (or already computed) logits, else head(rows)."""
        if self._logits is None and self.head is not None:
            return self.head(rows)
        return self.logits[rows]

    @property
    def num_rows(self) -> int:
        return int(self.depth_valid.shape[0])

    def target_ids(self, draft_index: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices (any shape) -> target ids."""
        return draft_index if self.draft_ids is None else self.draft_ids[draft_index]
