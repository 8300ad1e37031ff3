"""DFlash drafter: a block-parallel drafter with KV injection (Chen, Liang, Liu 2026; reference
algorithms_dflash_dspark.md sections 1.1-1.3).

The design notes behind this module: docs/decisions.md, "drafters/dflash/model.py".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from drafters.base import Proposal, TargetInfo, full_vocab_log_probs
from drafters.output import DraftOutput
from drafters.chunked import chunked_rows, with_autocast_of_now
from drafters.dflash import export
from drafters.dflash.anchors import batch_anchors, block_cells
from drafters.dflash.backbone import BlockBackbone
from drafters.dflash.config import DFlashConfig
from drafters.dflash.layers import check_config, decay_gamma
from drafters.losses import depth_loss_weights, global_mean, output_metrics, soft_cross_entropy
from drafters.vocab import DraftHead, draft_index


class DFlashDrafter(DraftHead, BlockBackbone):
    """DFlash drafter. See the module docstring for the training, inference and persistence contracts."""

    kind = "dflash"
    Config = DFlashConfig
    export_module = export  # the serving layouts dflash (z-lab), speculators (save / load in drafters/base.py)

    def __init__(self, config: DFlashConfig, target_info: TargetInfo):
        check_config(config, target_info.vocab_size)
        super().__init__(config, target_info, config)
        # The drafter's own copy names the resolved ids, so checkpoints carry them explicitly.
        self.config = dataclasses.replace(config, layer_ids=self.layer_ids, mask_token_id=self.mask_token_id)
        self.lm_head = None
        if config.draft_vocab_size is not None:
            self.add_draft_head(target_info.hidden_size, config.draft_vocab_size)
        if not self.fc.weight.is_meta:  # a meta-device build (shape checks) has nothing to initialise
            self._init_head()

    def max_draft_tokens(self) -> int:
        return self.config.block_size - 1

    # ---- vocabulary and warm starts ------------------------------------------------------------------------
    def init_from_data(self, token_counts: torch.Tensor) -> None:
        """With a reduced vocabulary: pick the draft_vocab_size most frequent tokens (ties to the smaller id) and
        warm-start the head from the target's rows. A full-vocabulary drafter has nothing to pick."""
        if self.lm_head is None:
            return
        self.pick_draft_vocab(token_counts)
        self._init_head()

    def _init_head(self) -> None:
        if self.lm_head is not None:
            self.copy_target_rows()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., D] -> logits [..., V_d] (the frozen target head unless the vocab is reduced)."""
        normed = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(normed)
        return self._frozen.linear("lm_head_weight", normed, self.fc.weight)

    # ---- training ------------------------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Any]) -> DraftOutput:
        """Sample this epoch's anchors (anchors.sample_anchors) and run `block_logits` on them."""
        return self.block_logits(batch, *batch_anchors(batch, self.config.num_anchors))

    def block_logits(self, batch: Mapping[str, Any], anchors: torch.Tensor,
                     anchor_valid: torch.Tensor | None = None) -> DraftOutput:
        """Draft logits of the blocks at the given anchors, all blocks of a row in one forward.

        Args:
            batch: input_ids, attention_mask, loss_mask [B, T] (right padding), hidden {id: [B, T, D]}.
            anchors: [B, A] anchor positions; anchor_valid: [B, A] bool (default all), False = a padding block.
        Returns:
            DraftOutput over the N kept anchors (row-major): logits [N, S-1, V_d], batch_index [N], label_position
            [N, S-1] = a + 1 + d (clamped to T-1 past the sequence end, where the cell is invalid), depth_valid
            [N, S-1] (label inside the sequence, a real loss token, and inside the draft vocabulary when it is
            reduced), draft_ids.
        """
        anchors, anchor_valid, h = self.block_states(batch, anchors, anchor_valid)  # h [B, A, S, D]
        rows, columns, label_position, depth_valid = block_cells(
            anchors, anchor_valid, self.config.block_size - 1, batch["attention_mask"], batch["loss_mask"])
        head_input = h[rows, columns, 1:]  # [N, S-1, D]: slots 1..S-1 only; logits when the loss asks (chunks of N)
        if self.lm_head is not None:
            row_index = rows.unsqueeze(1).expand_as(label_position)
            depth_valid &= self.t2d[self._labels(batch, row_index, label_position)]
        head = with_autocast_of_now(lambda chunk: self._logits(head_input[chunk]), head_input.device)
        return DraftOutput(batch_index=rows, label_position=label_position, depth_valid=depth_valid,
                           draft_ids=self.draft_ids(), head=head)

    def _labels(self, batch: Mapping[str, Any], rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Target ids each cell is trained to predict (config.label_source): the data token at its position, or the
        target's argmax at the position before it (its greedy choice there given the true prefix)."""
        if self.config.label_source == "target":
            return batch["target_argmax"][rows, (positions - 1).clamp(min=0)]
        return batch["input_ids"][rows, positions]

    @torch.no_grad()
    def _teacher(self, batch: Mapping[str, Any], rows: torch.Tensor, positions: torch.Tensor, dtype) -> torch.Tensor:
        """[n, S-1, V_d] the target's distribution at the position before each cell's label, on the draft vocab: its
        head's product in the target's dtype (as the target computes it, on tensor cores for bf16), softmax in dtype."""
        head = self._target_tensor("lm_head_weight")
        if self.draft_ids() is not None:
            head = head.index_select(0, self.draft_ids())
        hidden = batch["final_hidden"][rows, (positions - 1).clamp(min=0)].to(head.dtype)
        return torch.softmax(F.linear(hidden, head).to(dtype), dim=-1)

    def depth_weights(self, num_depths: int, device=None, dtype=torch.float32) -> torch.Tensor:
        """[K] loss weights exp(-d / gamma) for depth d = slot - 1 (paper Eq. 4)."""
        depth = torch.arange(num_depths, device=device, dtype=dtype)
        return torch.exp(-depth / decay_gamma(self.config))

    def loss(self, output: DraftOutput, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """sum of w_d * CE over valid cells / sum of w_d over valid cells of all processes (global_mean). Hard labels:
        the data token at each cell's label position, or the target's argmax before it (config.label_source), as a draft
        index with a reduced vocabulary; config.loss "soft": the target's distribution there (`_teacher`)."""
        num_rows, depths = output.depth_valid.shape
        rows = output.batch_index.unsqueeze(1).expand_as(output.label_position)
        labels = self._labels(batch, rows, output.label_position)
        if self.lm_head is not None:
            labels = draft_index(self.draft_ids(), labels, self.target_info.vocab_size)  # per step: no validation
        valid = output.depth_valid
        labels = torch.where(valid, labels, torch.zeros_like(labels))

        def cells(chunk):  # one chunk of rows: its logits [n, S-1, V_d] (and the teacher's) exist only here
            logits = output.logits_of(chunk)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            if self.config.loss == "soft":
                return soft_cross_entropy(logits, self._teacher(batch, rows[chunk], output.label_position[chunk],
                                                                logits.dtype)), logits.detach().argmax(dim=-1)
            ce = F.cross_entropy(logits.flatten(0, 1), labels[chunk].flatten(), reduction="none")
            return ce.view(logits.shape[:2]), logits.detach().argmax(dim=-1)

        vocab = self.target_info.vocab_size if self.lm_head is None else self.lm_head.out_features
        cell_ce, predicted = chunked_rows(cells, num_rows, depths * vocab)
        decay = self.depth_weights(depths, cell_ce.device, cell_ce.dtype)
        weights = depth_loss_weights(self.config.loss_weighting, decay, cell_ce, valid, self.config.dpace_alpha,
                                     correct=predicted == labels)
        loss = global_mean((weights * cell_ce).sum(), weights.sum(), batch)
        _, metrics = output_metrics(output, batch, cell_ce, predicted)
        return loss, metrics

    # ---- inference: a stateful block proposer (begin / commit: drafters/dflash/backbone.py) --------------------
    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        """One forward of the block [bonus, MASK x (S-1)] at positions pos..pos+S-1; the argmax of slots
        1..num_tokens (target ids), probs None."""
        bonus = self.check_proposal(num_tokens)
        if num_tokens <= 0:
            return Proposal(tokens=bonus.new_zeros(bonus.shape[0], 0))
        logits = self._logits(self.next_block_states()[:, 1 : num_tokens + 1])  # [B, k, V_d]
        drafts = logits.argmax(dim=-1)  # [B, k]
        draft_ids = self.draft_ids()
        return Proposal(tokens=drafts if draft_ids is None else draft_ids[drafts],
                        log_probs=full_vocab_log_probs(logits, draft_ids, self.target_info.vocab_size))

