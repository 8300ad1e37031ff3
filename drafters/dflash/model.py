"""DFlash drafter: a block-parallel drafter with KV injection (Chen, Liang, Liu 2026; reference
algorithms_dflash_dspark.md sections 1.1-1.3).

A block is [x_a, MASK x (S-1)] at positions a..a+S-1 (S = block_size, a the anchor). A few Qwen3-style layers
(drafters/dflash/layers.py) run over the block with bidirectional attention inside it; every layer also attends to
the target's features of all tokens strictly before the anchor, projected into keys/values by the same k/v
projections ("KV injection"). Slot k (1..S-1) predicts the token at its own position, x_{a+k}; slot 0's output is
discarded. So one drafter forward proposes S-1 tokens.

- Training (`forward`): `num_anchors` anchors per sequence, uniform without replacement among positions whose
  token and next token are both loss tokens, redrawn every epoch from (seed, epoch, sample index); all blocks of a
  row run in one forward against the full-sequence context (mask in anchors.block_attention_mask). `block_logits`
  does the same for given anchors. DraftOutput: one row per kept anchor, depth d = slot d + 1, label position
  a + 1 + d. `loss`: hard-label cross-entropy on the data tokens (or the target's greedy tokens), weighted
  exp(-d / gamma) (paper Eq. 4, d = k-1) or by D-PACE (config.loss_weighting), normalised by the weight sum over
  all processes (losses.global_mean).
- Inference: per-layer caches of the projected context keys/values (k_norm and RoPE applied) of verified tokens only.
  `begin` projects the prompt; `propose(k)` runs ONE forward of the full block [bonus, MASK...] (always S slots, as
  trained) and returns the argmax of slots 1..k with probs None: the engine verifies argmax drafts as one-hot q,
  which is lossless at any temperature (sampling block slots independently would not be a chain distribution).
  The block's own keys/values are dropped (KVCache.rewind); `commit` projects the verified tokens' features.
- Vocabulary: the target's frozen lm_head by default; with draft_vocab_size an `lm_head` parameter over the
  most frequent V_d tokens (warm-started from the target's rows) plus `d2t` / `t2d` buffers, as EAGLE-3.
  The frozen embedding (block inputs) is always the target's own tensor from TargetInfo, never a parameter.
- The final `norm` starts at ones, as in the z-lab drafts, NOT from the target's final norm: a random draft state
  scaled by a real target's final-norm weights (SmolLM2's are large) gives initial logits so peaked that the first
  loss is about 60 nats instead of about ln V.
- Persistence: native (config.json with draftsmith_kind + model.safetensors); the resolved layer ids and mask token
  id are written into the saved config, so a checkpoint names them explicitly. Serving layouts (z-lab,
  speculators) live in drafters/dflash/export.py (`export_module`, to which the base class's `save` / `load`
  dispatch); `export_checks` (drafters/dflash/readers.py, `draftsmith doctor`) says which readers load an export
  correctly.

Parameter names (fixed: the export reads them): fc.weight, hidden_norm.weight, norm.weight,
layers.{i}.{input_layernorm,post_attention_layernorm}.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight,
layers.{i}.self_attn.{q_norm,k_norm}.weight, layers.{i}.mlp.{gate,up,down}_proj.weight; with a reduced vocabulary
also lm_head.weight and the buffers d2t, t2d.

Shapes: B batch, T sequence, D hidden, A anchors per row, S block size, N kept anchors, K = S-1 depths, V_d vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import DraftContext, Drafter, DraftOutput, Proposal, TargetInfo, full_vocab_log_probs
from drafters.dflash import export, readers
from drafters.dflash.anchors import batch_anchors, block_cells
from drafters.dflash.layers import (
    DFlashConfig,
    absorb_context,
    advance_anchors,
    anchored_blocks,
    backbone_modules,
    block_embeddings,
    cached_block_forward,
    check_config,
    committed_rows,
    decay_gamma,
    draft_layer_config,
    fuse_context,
    new_context_caches,
    resolve_layer_ids,
    resolve_mask_token_id,
)
from drafters.layers import FrozenTargetTensors, KVCache
from drafters.losses import depth_loss_weights, global_mean, output_metrics
from drafters.vocab import DraftVocab


class DFlashDrafter(Drafter):
    """DFlash drafter. See the module docstring for the training, inference and persistence contracts."""

    kind = "dflash"
    row_state = ("_caches", "_state")  # per-row inference state (drafters/base.py keep_rows)
    Config = DFlashConfig
    export_module = export  # the serving layouts dflash (z-lab), speculators (save / load in drafters/base.py)

    def __init__(self, config: DFlashConfig, target_info: TargetInfo):
        super().__init__(config, target_info)
        check_config(config, target_info.vocab_size)
        self.layer_ids = resolve_layer_ids(config, target_info.num_layers)
        self.mask_token_id = resolve_mask_token_id(config, target_info)
        # The drafter's own copy names the resolved ids, so checkpoints carry them explicitly.
        self.config = dataclasses.replace(config, layer_ids=self.layer_ids, mask_token_id=self.mask_token_id)
        self.layer_config = draft_layer_config(config, target_info)
        hidden = target_info.hidden_size
        self.fc, self.hidden_norm, self.layers, self.norm, self.rotary = backbone_modules(
            self.layer_config, len(self.layer_ids), config.num_layers)  # the final norm starts at ones (module doc)
        self.lm_head: nn.Linear | None = None
        if config.draft_vocab_size is not None:
            self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
            # Until init_from_data / load: the first draft_vocab_size target ids (d2t all zero).
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(target_info.vocab_size) < config.draft_vocab_size)
        self._frozen = FrozenTargetTensors(target_info)
        self._caches: list[KVCache] = []
        self._state: dict[str, torch.Tensor] = {}
        if not self.fc.weight.is_meta:  # a meta-device build (shape checks) has nothing to initialise
            self._init_head()

    # ---- what the drafter needs from the target ----------------------------------------------------------------
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.layer_ids

    def max_draft_tokens(self) -> int:
        return self.config.block_size - 1

    # ---- vocabulary and warm starts ------------------------------------------------------------------------
    def init_from_data(self, token_counts: torch.Tensor) -> None:
        """With a reduced vocabulary: pick the draft_vocab_size most frequent tokens (ties to the smaller id) and
        warm-start the head from the target's rows. A full-vocabulary drafter has nothing to pick."""
        if self.lm_head is None:
            return
        if token_counts.numel() != self.target_info.vocab_size:
            raise ValueError(f"token_counts has {token_counts.numel()} entries, target vocab is "
                             f"{self.target_info.vocab_size}")
        vocab = DraftVocab.from_counts(token_counts.cpu(), self.config.draft_vocab_size)
        self.d2t.copy_(vocab.d2t.to(self.d2t.device))
        self.t2d.copy_(vocab.t2d.to(self.t2d.device))
        self._init_head()

    def draft_ids(self) -> torch.Tensor | None:
        """int64 [V_d]: the target id of each draft index, or None for the full target vocabulary."""
        if self.lm_head is None:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def _init_head(self) -> None:
        if self.lm_head is not None:
            head = self.target_info.lm_head_weight
            self.lm_head.weight.copy_(head.index_select(0, self.draft_ids().to(head.device)))

    def _target_tensor(self, name: str) -> torch.Tensor:
        """A frozen TargetInfo tensor on this drafter's device/dtype (drafters/layers.FrozenTargetTensors)."""
        return self._frozen.get(name, self.fc.weight)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., D] -> logits [..., V_d] (the frozen target head unless the vocab is reduced)."""
        normed = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(normed)
        return F.linear(normed, self._target_tensor("lm_head_weight"))

    def _block_embeds(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """anchor_tokens [...] -> embeddings [..., S, D] of the blocks [x_a, MASK x (S-1)]."""
        return block_embeddings(anchor_tokens, self.config.block_size, self.mask_token_id,
                                self._target_tensor("embed_weight"))

    # ---- training ------------------------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Any]) -> DraftOutput:
        """Sample this epoch's anchors (anchors.sample_anchors) and run `block_logits` on them."""
        return self.block_logits(batch, *batch_anchors(batch, self.config.num_anchors))

    def block_logits(self, batch: Mapping[str, Any], anchors: torch.Tensor,
                     anchor_valid: torch.Tensor | None = None) -> DraftOutput:
        """Draft logits of the blocks at the given anchors, all blocks of a row in one forward.

        Args:
            batch: input_ids, attention_mask, loss_mask [B, T] (right padding), target_hidden {id: [B, T, D]}.
            anchors: [B, A] anchor positions; anchor_valid: [B, A] bool (default all), False = a padding block.
        Returns:
            DraftOutput over the N kept anchors (row-major): logits [N, S-1, V_d], batch_index [N], label_position
            [N, S-1] = a + 1 + d (clamped to T-1 past the sequence end, where the cell is invalid), depth_valid
            [N, S-1] (label inside the sequence, a real loss token, and inside the draft vocabulary when it is
            reduced), draft_ids.
        """
        input_ids = batch["input_ids"]
        anchors = anchors.to(input_ids.device)
        anchor_valid = torch.ones_like(anchors, dtype=torch.bool) if anchor_valid is None else anchor_valid.bool()
        context = fuse_context(batch["target_hidden"], self.layer_ids, self.fc, self.hidden_norm)  # [B, T, D]
        h = anchored_blocks(self.layers, self.rotary, context, self._block_embeds(input_ids.gather(1, anchors)),
                            anchors, anchor_valid, batch["attention_mask"].bool())  # [B, A, S, D]
        rows, columns, label_position, depth_valid = block_cells(
            anchors, anchor_valid, self.config.block_size - 1, batch["attention_mask"], batch["loss_mask"])
        logits = self._logits(h[rows, columns, 1:])  # [N, S-1, V_d]: slots 1..S-1 only
        if self.lm_head is not None:
            row_index = rows.unsqueeze(1).expand_as(label_position)
            depth_valid &= self.t2d[self._labels(batch, row_index, label_position)]
        return DraftOutput(logits=logits, batch_index=rows, label_position=label_position, depth_valid=depth_valid,
                           draft_ids=self.draft_ids())

    def _labels(self, batch: Mapping[str, Any], rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Target ids each cell is trained to predict (config.label_source): the data token at its position, or the
        target's argmax at the position before it (its greedy choice there given the true prefix)."""
        if self.config.label_source == "target":
            return batch["target_argmax"][rows, (positions - 1).clamp(min=0)]
        return batch["input_ids"][rows, positions]

    def depth_weights(self, num_depths: int, device=None, dtype=torch.float32) -> torch.Tensor:
        """[K] loss weights exp(-d / gamma) for depth d = slot - 1 (paper Eq. 4)."""
        depth = torch.arange(num_depths, device=device, dtype=dtype)
        return torch.exp(-depth / decay_gamma(self.config))

    def loss(self, output: DraftOutput, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """sum of w_d * CE over valid cells / sum of w_d over valid cells of all processes (global_mean). Hard labels:
        the data token at each cell's label position, or the target's argmax before it (config.label_source), as a draft
        index with a reduced vocabulary."""
        logits = output.logits
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        num_rows, depths, vocab = logits.shape
        rows = output.batch_index.unsqueeze(1).expand_as(output.label_position)
        labels = self._labels(batch, rows, output.label_position)
        if self.lm_head is not None:
            labels = DraftVocab(self.draft_ids(), self.target_info.vocab_size).to_draft(labels)
        valid = output.depth_valid
        labels = torch.where(valid, labels, torch.zeros_like(labels))
        cell_ce = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="none")
        cell_ce = cell_ce.view(num_rows, depths)
        decay = self.depth_weights(depths, logits.device, logits.dtype)
        weights = depth_loss_weights(self.config.loss_weighting, decay, cell_ce, valid, self.config.dpace_alpha)
        loss = global_mean((weights * cell_ce).sum(), weights.sum(), batch)
        _, metrics = output_metrics(output, batch, cell_ce)
        return loss, metrics

    # ---- inference: a stateful block proposer --------------------------------------------------------------
    @torch.no_grad()
    def begin(self, context: DraftContext) -> None:
        """Project the valid prompt positions into the context caches; the target's next token is the first
        anchor (the bonus: it has no target feature until the next verify forward)."""
        self._caches = new_context_caches(self.layers, context, self.fc.weight, self.config.block_size)
        self._state = {}
        self._absorb(context, None)

    @torch.no_grad()
    def commit(self, num_accepted: torch.Tensor, context: DraftContext) -> None:
        """context covers the verify forward [previous bonus, d_1..d_k]; row b keeps its first num_accepted[b] + 1
        positions (none for a finished row). Their features join the context; the new bonus is next_tokens."""
        if not self._caches:
            raise ValueError("commit() called before begin()")
        self._absorb(context, committed_rows(num_accepted, context))

    def _absorb(self, context: DraftContext, active: torch.Tensor | None) -> None:
        """Append the projected context K/V of context.valid positions; the bonus token becomes the next anchor."""
        features = fuse_context(context.hidden, self.layer_ids, self.fc, self.hidden_norm)
        absorb_context(self.layers, self._caches, features, self.rotary(context.position_ids, features.dtype),
                       context.valid)
        advance_anchors(self._state, context, active)

    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        """One forward of the block [bonus, MASK x (S-1)] at positions pos..pos+S-1; the argmax of slots
        1..num_tokens (target ids), probs None."""
        block_size = self.config.block_size
        if num_tokens > block_size - 1:
            raise ValueError(f"propose: {num_tokens} tokens asked for, but a block of block_size {block_size} "
                             f"drafts at most {block_size - 1}")
        if not self._state:
            raise ValueError("propose() called before begin()")
        bonus, position = self._state["anchor"], self._state["position"]
        if num_tokens <= 0:
            return Proposal(tokens=bonus.new_zeros(bonus.shape[0], 0))
        h = self._block_embeds(bonus)  # [B, S, D]
        rope = self.rotary(position.unsqueeze(1) + torch.arange(block_size, device=position.device), h.dtype)
        h = cached_block_forward(self.layers, self._caches, h, rope)  # block keys/values are never kept
        logits = self._logits(h[:, 1 : num_tokens + 1])  # [B, k, V_d]
        drafts = logits.argmax(dim=-1)  # [B, k]
        draft_ids = self.draft_ids()
        return Proposal(tokens=drafts if draft_ids is None else draft_ids[drafts],
                        log_probs=full_vocab_log_probs(logits, draft_ids, self.target_info.vocab_size))

    # ---- persistence (save / load / detect_format: drafters/base.py, through export_module) ----------------------
    @staticmethod
    def export_checks(directory: str, target_info: TargetInfo) -> list:
        """What `draftsmith doctor` checks in a checkpoint of this kind: Check(name, status, detail) rows saying
        which readers load it correctly (drafters/dflash/readers.py)."""
        return readers.export_checks(directory, target_info)
