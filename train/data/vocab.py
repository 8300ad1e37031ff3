"""Token frequencies on loss-masked (assistant) tokens, for choosing a reduced draft vocabulary.

EAGLE-3 keeps the N most frequent target tokens of the training answers as its draft vocabulary; the drafter picks
it from these counts (`Drafter.init_from_data`, drafters/vocab.py builds the sorted ids and the d2t / t2d tables).
Here we count and report how much of the answer text a top-N vocabulary covers: a token outside it can never be
drafted, so coverage caps acceptance.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import numpy as np
import torch

from drafters.vocab import DraftVocab

logger = logging.getLogger(__name__)


def count_tokens(dataset: Any, vocab_size: int, batch_size: int = 1024) -> torch.Tensor:
    """How often each token id appears at loss-masked positions.

    Args:
        dataset: an HF Dataset (or any iterable of dicts) with input_ids and loss_mask lists.
        vocab_size: V, the target vocabulary size.
    Returns:
        counts: LongTensor [V].
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in _iter_columns(dataset, batch_size):
        kept = ids[mask.astype(bool)]
        if kept.size and (kept.min() < 0 or kept.max() >= vocab_size):
            raise ValueError(f"token id {int(kept.max())} outside the vocabulary of size {vocab_size}")
        counts += np.bincount(kept, minlength=vocab_size)
    return torch.from_numpy(counts)


def _iter_columns(dataset: Any, batch_size: int) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    """Concatenated (ids, mask) arrays, one pair per batch of rows."""
    if hasattr(dataset, "iter"):  # an HF Dataset: read columns in batches, not row dicts
        for batch in dataset.select_columns(["input_ids", "loss_mask"]).iter(batch_size=batch_size):
            yield _flatten(batch["input_ids"]), _flatten(batch["loss_mask"])
        return
    for row in dataset:
        yield np.asarray(row["input_ids"], dtype=np.int64), np.asarray(row["loss_mask"], dtype=np.int64)


def _flatten(rows: list[list[int]]) -> np.ndarray:
    return np.concatenate([np.asarray(row, dtype=np.int64) for row in rows]) if rows else np.zeros(0, np.int64)


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Fraction of the counted tokens whose id is in `ids` (0.0 when nothing was counted)."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0


def report_coverage(counts: torch.Tensor, sizes: Iterable[int]) -> dict[int, float]:
    """Coverage of the top-N vocabulary (chosen as the drafter chooses it) for each N in `sizes` (capped at V).

    Also logged, one line: "draft vocab coverage of ... top 8192: 93.1%, ...".
    """
    report = {}
    for size in sizes:
        size = min(int(size), counts.numel())
        report[size] = coverage(counts, DraftVocab.from_counts(counts, size).draft_ids)
    distinct = int((counts > 0).sum())
    logger.info("draft vocab coverage of %d assistant tokens (%d distinct ids): %s", int(counts.sum()), distinct,
                ", ".join(f"top {size}: {value:.2%}" for size, value in report.items()))
    return report
