"""Reduced draft vocabulary (EAGLE-3 style, reference A.3): the V_d most frequent target tokens, sorted by id.

Two tables describe it, exactly as the speculators / vLLM checkpoints store them:
- d2t  int64 [V_d]: offsets, target_id = draft_id + d2t[draft_id];
- t2d  bool  [V]:   whether a target id is in the draft vocab.
`DraftHead` is the LM head over it that EAGLE-3 and DFlash share.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from drafters.base import TargetInfo


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

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape) -> draft ids, -1 where the id is outside the draft vocab."""
        return draft_index(self.draft_ids, target_ids, self.target_vocab_size)


def draft_index(draft_ids: torch.Tensor, target_ids: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """Target ids (any shape) -> their index in the sorted `draft_ids` [V_d], -1 where absent; no check of draft_ids
    (DraftVocab checks once; a training step calls this without a host sync)."""
    index = torch.searchsorted(draft_ids, target_ids.clamp(0, target_vocab_size - 1))
    index = index.clamp(max=draft_ids.numel() - 1)
    return torch.where(draft_ids[index] == target_ids, index, -1)


class DraftHead:
    """A reduced-vocabulary LM head, mixed into a drafter (an nn.Module): `lm_head` [V_d, D] plus the `d2t` / `t2d`
    buffers, warm-started from the target's rows of the draft ids. It lives on the drafter itself, not in a child
    module, so lm_head.weight, d2t and t2d stay the top-level names every serving layout stores. A drafter whose
    lm_head is None uses the target's full vocabulary (draft_ids None)."""

    lm_head: nn.Linear | None  # set by the drafter: None, or by add_draft_head
    reduced_head_formats: tuple[str, ...] | None = None  # the formats that can carry a reduced head; None: every one

    def add_draft_head(self, hidden_size: int, draft_vocab_size: int) -> None:
        """Create the head; until `pick_draft_vocab` or a load it covers the first draft_vocab_size target ids."""
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(self.target_info.vocab_size) < draft_vocab_size)

    def draft_ids(self) -> torch.Tensor | None:
        """int64 [V_d]: the target id of each draft index, or None for the full target vocabulary."""
        if self.lm_head is None:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def pick_draft_vocab(self, token_counts: torch.Tensor) -> None:
        """The V_d most frequent tokens of token_counts [V] (ties to the smaller id) become the draft vocabulary."""
        if token_counts.numel() != self.target_info.vocab_size:
            raise ValueError(f"token_counts has {token_counts.numel()} entries, target vocab is "
                             f"{self.target_info.vocab_size}")
        self.set_vocab(DraftVocab.from_counts(token_counts.cpu(), self.d2t.numel()))

    def set_vocab(self, vocab: DraftVocab) -> None:
        """Install a draft vocabulary (its size must equal the head's)."""
        if vocab.size != self.d2t.numel() or vocab.target_vocab_size != self.t2d.numel():
            raise ValueError(f"vocab of size {vocab.size} / target {vocab.target_vocab_size} does not fit this drafter")
        self.d2t.copy_(vocab.d2t.to(self.d2t.device))
        self.t2d.copy_(vocab.t2d.to(self.t2d.device))

    @torch.no_grad()
    def copy_target_rows(self) -> None:
        """Warm-start the head from the target's lm_head rows of the draft ids."""
        head = self.target_info.lm_head_weight
        self.lm_head.weight.copy_(head.index_select(0, self.draft_ids().to(head.device)))

    @torch.no_grad()
    def reduce_draft_vocab(self, token_counts: torch.Tensor, size: int) -> None:
        """A frequency-ranked head, after training: keep the `size` most frequent tokens of token_counts [V] among
        the drafter's current vocabulary (the target's whole one when it drafts through the target's head) and
        their rows of its head, the trained one or the target's. Each kept token's logit is unchanged; a token left
        out can no longer be drafted, and the head's cost falls to size rows. The config says the new size."""
        ids = self.draft_ids()
        weight = self.target_info.lm_head_weight if ids is None else self.lm_head.weight
        if ids is None:
            ids = torch.arange(self.target_info.vocab_size)
        if not 0 < size < ids.numel():
            raise ValueError(f"draft vocabulary size {size} must be in [1, {ids.numel() - 1}] (the drafter drafts "
                             f"over {ids.numel()} tokens)")
        kept = DraftVocab.from_counts(token_counts.cpu()[ids.cpu()], size).draft_ids  # sorted indices into ids
        vocab = DraftVocab(ids.cpu()[kept], self.target_info.vocab_size)
        reference = next(p for p in self.parameters() if p.is_floating_point() and p is not weight)
        rows = weight.index_select(0, kept.to(weight.device)).to(reference.device, reference.dtype)
        self.lm_head = nn.Linear(rows.shape[1], size, bias=False, device=reference.device, dtype=reference.dtype)
        self.lm_head.weight.copy_(rows)
        self.register_buffer("d2t", vocab.d2t.to(reference.device))
        self.register_buffer("t2d", vocab.t2d.to(reference.device))
        self.config = dataclasses.replace(self.config, draft_vocab_size=size)


def complete_vocab_tables(state: dict[str, torch.Tensor], draft_vocab_size: int, vocab_size: int, source: str,
                          missing_d2t: str) -> None:
    """Give a state dict read from a file the d2t / t2d a DraftHead holds (int64 offsets, bool membership), in place.

    A file without d2t means the identity, which only a full-vocabulary head can be (else ValueError: "source:
    missing_d2t"); a file without t2d gets it from d2t."""
    if "d2t" not in state:
        if draft_vocab_size != vocab_size:
            raise ValueError(f"{source}: {missing_d2t}")
        state["d2t"] = torch.zeros(draft_vocab_size, dtype=torch.long)
    state["d2t"] = state["d2t"].long()
    if state["d2t"].numel() != draft_vocab_size:
        raise ValueError(f"{source}: d2t has {state['d2t'].numel()} entries, the head {draft_vocab_size} rows")
    if "t2d" not in state:
        state["t2d"] = torch.zeros(vocab_size, dtype=torch.bool)
        state["t2d"][torch.arange(draft_vocab_size) + state["d2t"]] = True
    state["t2d"] = state["t2d"].bool()


def resolve_mask_token_id(token: int | None, allow_text: bool, target_info: TargetInfo) -> int:
    """A drafter's mask row of the target vocabulary (DFlash's and P-EAGLE's `drafter.mask_token_id`): `token`
    checked against the tokenizer's unused rows (allow_text: `drafter.allow_text_mask_token`), or the first unused
    row when it is None. ValueError naming the field otherwise."""
    unused = target_info.unused_token_ids
    vocab = target_info.vocab_size
    if token is None:
        if not unused:
            raise ValueError("drafter.mask_token_id: the target has no known unused vocabulary row (no tokenizer, or "
                             "every row is used); set drafter.mask_token_id to a reserved token id")
        return int(unused[0])
    if not 0 <= token < vocab:
        raise ValueError(f"drafter.mask_token_id {token} is outside the target vocabulary [0, {vocab})")
    if unused is not None and token not in unused and not allow_text:
        allowed = list(unused[:16]) + (["..."] if len(unused) > 16 else [])
        raise ValueError(f"drafter.mask_token_id {token} is a token the tokenizer uses for text; choose an unused id "
                         f"({allowed}) or set drafter.allow_text_mask_token: true")
    return int(token)
