"""draft_model: an independent small causal LM with the target's vocabulary (vLLM's `draft_model` method).

Needs no training and no target hidden states. For SmolLM2, `draftsmith assets --draft-model-layers N` writes a fair
draft model: a copy of the target's first N layers with its final norm and head.

Cache invariant between rounds: the draft LM's cache holds every token of the sequence except a short per-row
`pending` suffix (the newly emitted token, preceded by the last draft when all drafts were accepted).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from drafters.base import DraftContext, Drafter, Proposal, TargetInfo, check_target_match
from drafters.ragged_lm import RaggedLM


@dataclass(kw_only=True)
class DraftModelConfig:
    path: str  # an HF causal-LM directory
    sample_drafts: bool = False  # draft by sampling q at temperature 1 (probs returned) instead of argmax


class DraftModelDrafter(Drafter):
    kind = "draft_model"
    Config = DraftModelConfig

    def __init__(self, config: DraftModelConfig, target_info: TargetInfo, model=None):
        super().__init__(config, target_info)
        if model is None:
            dtype = target_info.embed_weight.dtype
            model = AutoModelForCausalLM.from_pretrained(config.path, dtype=dtype)
            model = model.to(target_info.embed_weight.device)
        check_target_match(target_info, target_info.hidden_size, model.get_output_embeddings().weight.shape[0],
                           f"draft model {config.path}")
        self.lm = model.eval()
        self.runner = RaggedLM(self.lm)
        self.pending: list[list[int]] = []
        self._mark = 0
        self._num_tokens: int | None = None

    @classmethod
    def load(cls, directory: str, target_info: TargetInfo) -> "DraftModelDrafter":
        return cls(DraftModelConfig(path=directory), target_info)

    def save(self, directory: str, fmt: str = "native") -> None:
        if fmt != "native":
            raise ValueError(f"drafter 'draft_model' cannot export format {fmt!r}; it writes: native")
        self.lm.save_pretrained(directory)

    def begin(self, context: DraftContext) -> None:
        self.runner.reset()
        self.runner.extend(context.input_ids, context.valid, logits_to_keep=1)
        self.pending = [[int(t)] for t in context.next_tokens.tolist()]
        self.generator = context.generator
        self._num_tokens = None  # drafts of the outstanding proposal; None = nothing proposed since the last commit

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.runner.keep_rows(rows)
        self.pending = [self.pending[row] for row in rows.tolist()]

    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        """Feed the pending tokens, then draft num_tokens one at a time. tokens [B, K], probs [B, K, V] or None."""
        device = self.runner.device
        width = max(len(p) for p in self.pending)
        block = torch.zeros((len(self.pending), width), dtype=torch.long, device=device)
        valid = torch.zeros_like(block, dtype=torch.bool)
        for row, tokens in enumerate(self.pending):  # left-pad rows with a single pending token
            block[row, width - len(tokens):] = torch.tensor(tokens, device=device)
            valid[row, width - len(tokens):] = True
        self._mark = self.runner.mark()
        logits = self.runner.extend(block, valid)[:, -1]
        tokens, probs = [], []
        for step in range(num_tokens):
            token, prob = self._pick(logits)
            tokens.append(token)
            probs.append(prob)
            if step + 1 < num_tokens:
                logits = self.runner.extend(token[:, None])[:, -1]
        self._num_tokens = num_tokens
        return Proposal(torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1))

    def _pick(self, logits):
        if self.config.sample_drafts:
            prob = torch.softmax(logits, -1)
            return torch.multinomial(prob, 1, generator=self.generator).squeeze(-1), prob
        return logits.argmax(-1), None

    def commit(self, num_accepted: torch.Tensor, context: DraftContext) -> None:
        block = context.input_ids.tolist()
        if self._num_tokens is None:  # a catch-up (no proposal since the last commit): every valid token is pending
            for row, accepted in enumerate(num_accepted.tolist()):
                if bool(context.valid[row].any()):
                    self.pending[row] += block[row][1: accepted + 1] + [int(context.next_tokens[row])]
            return
        # Kept: the pending tokens and the first min(a, k-1) drafts (the last draft was never fed).
        kept_drafts = num_accepted.clamp(max=self._num_tokens - 1).to(self.runner.device)
        pending_len = torch.tensor([len(p) for p in self.pending], device=self.runner.device)
        active = context.valid.any(-1).to(self.runner.device)
        self.runner.keep_after(self._mark, torch.where(active, pending_len + kept_drafts, torch.zeros_like(kept_drafts)))
        pending = []
        for row, accepted in enumerate(num_accepted.tolist()):
            last = [block[row][accepted]] if accepted == self._num_tokens else []
            pending.append(last + [int(context.next_tokens[row])])
        self.pending = pending
        self._num_tokens = None


def is_draft_model_dir(directory: str) -> bool:
    """An HF causal-LM directory (config.json with architectures/model_type), not a drafter checkpoint."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        config = json.load(f)
    return "model_type" in config and not any(
        key in config for key in ("draftsmith_kind", "speculators_model_type", "eagle_aux_hidden_state_layer_ids")
    )
