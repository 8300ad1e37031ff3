"""An HF causal LM with a KV cache that rows of a batch extend and roll back independently.

Used by the target (inference/engine/target.py) and by the draft-model drafter. Rows of a batch accept different numbers of
draft tokens, so the cache keeps one slot per token fed and a validity mask [B, L] over the slots: rejected slots
stay in the cache as holes the attention mask hides, and trailing slots that no row kept are cropped. With batch size 1
there are never holes: a rejection is a plain crop (so a family whose layers cut key blocks by slot, MiniMax-M3, decodes
one row at a time: drafters/ragged_state.py). Position ids count only a row's valid slots, so a row with holes
sees exactly the positions it would have seen without them. What differs between model families (sliding windows
applied by position, linear-attention states with no slots to leave holes in) is drafters/ragged_state.py.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from drafters.ragged_state import MASKABLE_ATTENTION, FamilyState, one_row_refusal


def path_order(path: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """path [B, W] node ids (-1 past a row's end) -> a permutation [B, N] listing the path first, then the rest."""
    order = []
    for nodes in path.tolist():
        kept = [node for node in nodes if node >= 0]
        order.append(kept + [node for node in range(num_nodes) if node not in kept])
    return torch.tensor(order, dtype=torch.long, device=path.device)


class RaggedLM:
    """Wraps `model` (an HF causal LM). Shapes: B batch, S new tokens, L cache slots, V vocab."""

    def __init__(self, model, block_forward=None, family: FamilyState | None = None):
        """block_forward: what runs the blocks after the prefill over the model's weights (a backend's, e.g.
        inference/engine/cpu/lean.py), `forward(input_ids, position_ids, slot_mask, cache, logits_to_keep, mask=)
        -> logits`; None: the model's own forward. family: the model's FamilyState where the caller built it
        already (TargetModel does, to refuse a family before anything else touches the model)."""
        self.model = model
        # transformers >= 5.2x names the argument `cache`; earlier releases call it `past_key_values`.
        parameters = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in parameters else "past_key_values"
        self.cache: DynamicCache | None = None
        self.slot_mask: torch.Tensor | None = None  # [B, L] long, 1 = a token of the sequence
        self.family = family or FamilyState(model)  # refuses a family it cannot roll back, naming what is missing
        self.state_base: int | None = None  # the slot the linear-attention records start at (None: no records)
        self.block_forward = block_forward

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def lengths(self) -> torch.Tensor:
        """[B] number of tokens of each row in the cache (= the next position id)."""
        return self.slot_mask.sum(-1)

    @property
    def num_slots(self) -> int:
        return 0 if self.slot_mask is None else self.slot_mask.shape[1]

    def reset(self) -> None:
        self.cache, self.slot_mask, self.state_base = None, None, None
        self.family.clear()

    @torch.no_grad()
    def extend(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None, logits_to_keep: int = 0,
               taps=None) -> torch.Tensor:
        """Feed a block of tokens to every row and return its logits.

        Args:
            input_ids: [B, S] new tokens; the first call is the prefill (left padding allowed).
            valid: [B, S] bool; False marks padding slots that never become part of the sequence.
            logits_to_keep: 0 for logits at every position, n for the last n only (a prefill needs one).
            taps: what the caller records of this forward, handed to the block forward (the model's own forward
                is recorded by the caller's hooks).
        Returns:
            logits [B, S, V] (float32), or [B, n, V].
        """
        batch, num_new = input_ids.shape
        if valid is None:
            valid = torch.ones_like(input_ids, dtype=torch.bool)
        valid = valid.to(self.device)
        if self.family.anchored and (batch > 1 or not bool(valid.all())):
            raise ValueError(one_row_refusal(self.family.config, "a batch of several rows or padding"))
        start = (
            torch.zeros(batch, dtype=torch.long, device=self.device) if self.slot_mask is None else self.lengths
        )
        # Padding slots reuse the position of the next real token; they are masked as keys, so it never matters.
        position_ids = start[:, None] + (valid.long().cumsum(-1) - 1).clamp(min=0)
        new_mask = valid.long()
        prefill = self.slot_mask is None
        if prefill:
            self.cache = self.family.new_cache()
            self.slot_mask = new_mask
        else:
            if self.family.has_linear and self.state_base is None:
                self.state_base = self.num_slots
            self.slot_mask = torch.cat([self.slot_mask, new_mask], dim=1)
            self.family.begin_block(self.cache, valid)
        try:
            if self.block_forward is not None and not prefill:
                return self.block_forward.forward(input_ids.to(self.device), position_ids, self.slot_mask, self.cache,
                                                  logits_to_keep, taps=taps).float()
            out = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=self.family.attention_mask(self.slot_mask, position_ids),
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=self.family.logits_to_keep(logits_to_keep, taps is not None and taps.records),
                **{self.cache_arg: self.cache},
            )
        finally:
            self.family.end_block()
        return out.logits.float()

    @torch.no_grad()
    def extend_tree(self, input_ids: torch.Tensor, ancestors: torch.Tensor, depth: torch.Tensor,
                    parents: torch.Tensor, taps=None) -> torch.Tensor:
        """Feed N nodes of a tree after each row's sequence in one forward (the cache must hold a prefill): node i
        sees the row's valid slots, then its ancestors and itself (ancestors [B, N, N] bool), at position length +
        depth[b, i]; linear-attention layers step each node from its parent's state (parents [B, N], -1 = the root's
        parent is the sequence). Every root-to-node path computes what the same tokens fed as a chain would.
        taps: as `extend`'s. Returns logits [B, N, V] (float32)."""
        if self.slot_mask is None:
            raise ValueError("a tree forward needs a prefilled cache (call prefill first)")
        if self.family.anchored:
            raise ValueError(one_row_refusal(self.family.config, "a tree's nodes"))
        kernel = getattr(self.model.config, "_attn_implementation", "eager") or "eager"
        if kernel not in MASKABLE_ATTENTION:
            raise ValueError(f"tree verification needs attn_implementation in {MASKABLE_ATTENTION} (an arbitrary 4-D "
                             f"mask); the target uses {kernel!r}: load it with attn_implementation='sdpa'")
        mask = self.family.tree_attention_mask(self.slot_mask, ancestors, depth)
        position_ids = self.lengths[:, None] + depth.to(self.device)
        self.slot_mask = torch.cat([self.slot_mask, torch.ones_like(input_ids, device=self.device)], dim=1)
        self.family.begin_block(self.cache, None, parents=parents.to(self.device))  # per-node linear states
        try:
            if self.block_forward is not None:  # full attention only: one mask tensor in the form SDPA reads
                return self.block_forward.forward(input_ids.to(self.device), position_ids, self.slot_mask, self.cache,
                                                  mask=mask, taps=taps).float()
            out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask, position_ids=position_ids,
                             use_cache=True, **{self.cache_arg: self.cache})
        finally:
            self.family.end_block()
        return out.logits.float()

    @torch.no_grad()
    def keep_path(self, mark: int, path: torch.Tensor, keep: torch.Tensor) -> None:
        """Roll a tree block fed since `mark` back to a path through it: row b keeps its first keep[b] nodes of
        path[b] ([B, W] node ids, -1 past a row's end; keep 0 for a finished row), in path order. The path's K/V
        move to the first slots of the block, then `keep_after` keeps them and crops the rest: afterwards the cache
        is the cache of the path fed as a chain (linear states: the one recorded after the last kept node)."""
        order = path_order(path, self.num_slots - mark).to(self.device)  # [B, N]
        if self.family.has_linear:
            keep_dev = keep.to(self.device)
            last = path.to(self.device).gather(1, (keep_dev - 1).clamp(min=0)[:, None])[:, 0]
            self.family.keep_states(self.cache, torch.where(keep_dev > 0, last + 1, torch.zeros_like(last)))
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None:  # linear-attention and KV-sharing layers hold no slots
                continue
            for name in ("keys", "values", "indexer_keys"):  # DeepSeek-V3.2's indexer keys: [B, L + N, d]
                tensor = getattr(layer, name, None)  # [B, H_kv, L + N, d]; None: not this layer's
                if tensor is None:
                    continue
                slots = tensor if tensor.dim() == 4 else tensor[:, None]  # a view [B, H, L + N, d]
                block = slots[:, :, mark:]
                index = order[:, None, :, None].expand(-1, block.shape[1], -1, block.shape[3])
                slots[:, :, mark:] = block.gather(2, index)
        self.keep_after(mark, keep)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` [B'] (long, increasing): the engine drops rows that finished, so later forwards
        cost what the remaining rows cost. Trailing slots none of them uses are cropped."""
        rows = rows.to(self.device)
        self.family.keep_rows(self.cache, rows)
        self.family.select_recorded_rows(rows)
        self.slot_mask = self.slot_mask[rows]
        used = self.slot_mask.any(0)
        num_drop = self.slot_mask.shape[1] - (int(used.nonzero().max()) + 1 if bool(used.any()) else 0)
        if num_drop > 0:
            self.family.crop(self.cache, num_drop)
            self.slot_mask = self.slot_mask[:, : self.slot_mask.shape[1] - num_drop]

    def mark(self) -> int:
        """The current number of cache slots, to roll back to with `keep_after`. Linear-attention states recorded
        before it are dropped: a rollback never goes further back than the last mark."""
        self.family.clear()
        self.state_base = None
        return self.num_slots

    def keep_after(self, mark: int, keep: torch.Tensor) -> None:
        """Keep, for row b, only the first keep[b] valid slots added since `mark`; crop slots no row kept.

        Args:
            mark: a value returned by `mark()` before the blocks to roll back were fed.
            keep: [B] long, how many of the row's new valid tokens stay in its sequence.
        """
        new = self.slot_mask[:, mark:]
        rank = new.cumsum(-1)  # 1-based rank of each valid new slot
        keep = keep.to(new.device)
        kept = (new == 1) & (rank <= keep[:, None])
        if self.state_base is not None:  # linear states: the record after the keep[b]-th valid new slot
            if mark < self.state_base:
                raise ValueError(f"keep_after({mark}): linear-attention states are recorded from slot "
                                 f"{self.state_base} only (call mark() before the blocks to roll back)")
            index = (rank < keep[:, None]).sum(-1) + (keep > 0).long() + (mark - self.state_base)
            self.family.keep_states(self.cache, index)
            self.state_base = None
        self.slot_mask = torch.cat([self.slot_mask[:, :mark], kept.long()], dim=1)
        last_kept = int(kept.any(0).nonzero().max()) + 1 if bool(kept.any()) else 0
        num_drop = new.shape[1] - last_kept
        if num_drop > 0:
            self.family.crop(self.cache, num_drop)
            self.slot_mask = self.slot_mask[:, : self.slot_mask.shape[1] - num_drop]
