"""The block-parallel backbone DFlash and DSpark share, as one base drafter (`BlockBackbone`).

It holds the modules (fc + hidden_norm fusing the target features into the context, the KV-injected decoder layers,
the final norm, their RoPE), the inference state (per-layer context caches of verified tokens, the next anchor and
its position per row) and the steps both drafters take the same way: the training forward of all blocks of a row at
once, `begin` / `commit` absorbing the verified tokens' features, and the one cached forward of the next block.
The layers themselves are free functions in drafters/dflash/layers.py. A subclass adds its heads and says what the
block's slots mean (DFlash: slots 1..S-1 predict; DSpark: slots 0..S-1 through a sequential head).

The modules sit on the drafter itself, not in a child module, so their parameter names (fc, hidden_norm,
layers.{i}.*, norm: the ones every serving layout stores) and the seeded init order (backbone first, then the
subclass's heads) are those of a drafter that builds them inline.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from drafters.base import DraftContext, Drafter, TargetInfo
from drafters.dflash.config import DFlashConfig
from drafters.dflash.layers import (
    absorb_context,
    advance_anchors,
    anchored_blocks,
    backbone_modules,
    block_embeddings,
    cached_block_forward,
    committed_rows,
    draft_layer_config,
    fuse_context,
    new_context_caches,
    resolve_layer_ids,
)
from drafters.layers import FrozenTargetTensors, KVCache
from drafters.vocab import resolve_mask_token_id


class BlockBackbone(Drafter):
    """A drafter on the DFlash backbone; `backbone` is the DFlash config its layers follow (the drafter's own for
    DFlash, dspark.layers.backbone_config for DSpark). Subclasses implement forward / loss / propose from
    `block_states` and `next_block_states`, and `max_draft_tokens`."""

    row_state = ("_caches", "_state")  # per-row inference state (drafters/base.py keep_rows)
    supports_activation_checkpointing = True

    def __init__(self, config: Any, target_info: TargetInfo, backbone: DFlashConfig):
        super().__init__(config, target_info)
        self.layer_ids = resolve_layer_ids(backbone, target_info)
        self.mask_token_id = resolve_mask_token_id(backbone.mask_token_id, backbone.allow_text_mask_token, target_info)
        self.layer_config = draft_layer_config(backbone, target_info)
        self.fc, self.hidden_norm, self.layers, self.norm, self.rotary = backbone_modules(
            self.layer_config, len(self.layer_ids), backbone.num_layers)  # the final norm starts at ones
        self._frozen = FrozenTargetTensors(target_info)
        self._caches: list[KVCache] = []
        self._state: dict[str, Any] = {}

    def target_layer_ids(self) -> tuple[int, ...]:
        return self.layer_ids

    def _target_tensor(self, name: str) -> torch.Tensor:
        """A frozen TargetInfo tensor on this drafter's device, in the target's dtype (layers.FrozenTargetTensors)."""
        return self._frozen.on_device(name, self.fc.weight)

    def _block_embeds(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """anchor_tokens [...] -> embeddings [..., S, D] of the blocks [x_a, MASK x (S-1)]."""
        return block_embeddings(anchor_tokens, self.config.block_size, self.mask_token_id,
                                self._target_tensor("embed_weight")).to(self.fc.weight.dtype)  # exact

    # ---- training ----------------------------------------------------------------------------------------------
    def block_states(self, batch: Mapping[str, Any], anchors: torch.Tensor, anchor_valid: torch.Tensor | None):
        """All blocks of a row in one forward against the full-sequence context (anchors.block_attention_mask).

        Args: batch input_ids, attention_mask [B, T], hidden {id: [B, T, D]}; anchors [B, A];
        anchor_valid [B, A] bool (None = all), False = a padding block.
        Returns: (anchors on the batch's device, anchor_valid as bool, pre-norm block states [B, A, S, D]).
        """
        input_ids = batch["input_ids"]
        anchors = anchors.to(input_ids.device)
        anchor_valid = torch.ones_like(anchors, dtype=torch.bool) if anchor_valid is None else anchor_valid.bool()
        context = fuse_context(batch["hidden"], self.layer_ids, self.fc, self.hidden_norm)  # [B, T, D]
        h = anchored_blocks(self.layers, self.rotary, context, self._block_embeds(input_ids.gather(1, anchors)),
                            anchors, anchor_valid, batch["attention_mask"].bool(), self.activation_checkpointing)
        return anchors, anchor_valid, h

    # ---- inference ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def begin(self, context: DraftContext) -> None:
        """Project the valid prompt positions into the context caches; the target's next token is the first anchor
        (it has no target feature until the next verify forward)."""
        self._caches = new_context_caches(self.layers, context, self.fc.weight, self.config.block_size)
        self._state = {}
        self._absorb(context, None)

    @torch.no_grad()
    def commit(self, num_accepted: torch.Tensor, context: DraftContext) -> None:
        """context covers the verify forward [previous anchor, drafts...]; row b keeps its first num_accepted[b] + 1
        positions (none for a finished row). Their features join the context; the new anchor is next_tokens."""
        if not self._caches:
            raise ValueError("commit() called before begin()")
        self._absorb(context, committed_rows(num_accepted, context))

    def _absorb(self, context: DraftContext, active: torch.Tensor | None) -> None:
        """Append the projected context K/V of context.valid positions; the token emitted last becomes the anchor."""
        features = fuse_context(context.hidden, self.layer_ids, self.fc, self.hidden_norm)
        absorb_context(self.layers, self._caches, features, self.rotary(context.position_ids, features.dtype),
                       context.valid)
        advance_anchors(self._state, context, active)

    def check_proposal(self, num_tokens: int) -> torch.Tensor:
        """Refuse a proposal longer than the block drafts or one before `begin`; returns the anchors [B]."""
        most = self.max_draft_tokens()
        if num_tokens > most:
            raise ValueError(f"propose: {num_tokens} tokens asked for, but a {self.kind} block of block_size "
                             f"{self.config.block_size} drafts at most {most}")
        if not self._state:
            raise ValueError("propose() called before begin()")
        return self._state["anchor"]

    def next_block_states(self) -> torch.Tensor:
        """One forward of the block [anchor, MASK x (S-1)] at pos..pos+S-1 against the caches (always S slots, as
        trained; the block's own keys/values are never kept): pre-norm states [B, S, D]."""
        anchor, position = self._state["anchor"], self._state["position"]
        h = self._block_embeds(anchor)  # [B, S, D]
        slots = torch.arange(self.config.block_size, device=position.device)
        rope = self.rotary(position.unsqueeze(1) + slots, h.dtype)
        return cached_block_forward(self.layers, self._caches, h, rope)
