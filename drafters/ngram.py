"""ngram: prompt lookup decoding (vLLM's `ngram` method). Needs no model and no training.

Propose the tokens that followed the most recent earlier occurrence of the sequence's last n tokens, trying n from
`max_ngram` down to `min_ngram`. A row with no match proposes nothing that round (num_valid = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafters.base import DraftContext, Drafter, Proposal


@dataclass(kw_only=True)
class NgramConfig:
    min_ngram: int = 1
    max_ngram: int = 4


class NgramDrafter(Drafter):
    kind = "ngram"
    Config = NgramConfig

    def __init__(self, config: NgramConfig, target_info):
        super().__init__(config, target_info)
        if not 1 <= config.min_ngram <= config.max_ngram:
            raise ValueError(f"ngram: need 1 <= min_ngram <= max_ngram, got {config.min_ngram}, {config.max_ngram}")
        self.history: list[list[int]] = []

    def begin(self, context: DraftContext) -> None:
        self.history = []
        for row in range(context.input_ids.shape[0]):
            tokens = context.input_ids[row][context.valid[row]].tolist()
            self.history.append(tokens + [int(context.next_tokens[row])])

    def commit(self, num_accepted: torch.Tensor, context: DraftContext) -> None:
        for row, history in enumerate(self.history):
            if bool(context.valid[row].any()):
                # Block position 0 is already the history's last token; append accepted drafts and the new token.
                history.extend(context.input_ids[row, 1 : int(num_accepted[row]) + 1].tolist())
                history.append(int(context.next_tokens[row]))

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.history = [self.history[row] for row in rows.tolist()]

    def propose(self, num_tokens: int) -> Proposal:
        tokens = torch.zeros((len(self.history), num_tokens), dtype=torch.long)
        num_valid = torch.zeros(len(self.history), dtype=torch.long)
        for row, history in enumerate(self.history):
            found = self._lookup(history, num_tokens)
            tokens[row, : len(found)] = torch.tensor(found, dtype=torch.long)
            num_valid[row] = len(found)
        return Proposal(tokens, None, num_valid)

    def _lookup(self, history: list[int], num_tokens: int) -> list[int]:
        for n in range(min(self.config.max_ngram, len(history) - 1), self.config.min_ngram - 1, -1):
            suffix = history[-n:]
            for start in range(len(history) - n - 1, -1, -1):  # most recent earlier match first
                if history[start : start + n] == suffix:
                    return history[start + n : start + n + num_tokens]
        return []

    def save(self, directory: str, fmt: str = "native") -> None:
        raise ValueError("the ngram drafter has no weights to save; pass --drafter ngram")
