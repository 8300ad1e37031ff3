"""DSpark drafter: the DFlash backbone with a sequential head and a confidence head (Cheng et al. 2026, DeepSpec;
reference algorithms_dflash_dspark.md sections 2.1-2.3 and 5.2).

The design notes behind this module: docs/decisions.md, "drafters/dspark/model.py".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import DraftContext, Proposal, TargetInfo, full_vocab_log_probs
from drafters.output import DraftOutput
from drafters.chunked import chunked_rows, with_autocast_of_now
from drafters.dflash.anchors import batch_anchors, block_cells
from drafters.dflash.backbone import BlockBackbone
from drafters.dspark import export
from drafters.dspark.config import FULL_VOCAB_TRAINING, DSparkConfig
from drafters.dspark.layers import (
    ConfidenceHead,
    MarkovHead,
    backbone_config,
    check_config,
    depth_weights,
)
from drafters.losses import depth_loss_weights, global_mean, output_metrics
from drafters.vocab import DraftHead, draft_index


class DSparkDrafter(DraftHead, BlockBackbone):
    """DSpark drafter. See the module docstring for the training, inference and persistence contracts."""

    kind = "dspark"
    Config = DSparkConfig
    export_module = export  # the serving layouts speculators, deepspec (save / load in drafters/base.py)
    reduced_head_formats = ("native",)  # DeepSpec and speculators read a full-vocabulary DSpark

    def __init__(self, config: DSparkConfig, target_info: TargetInfo):
        check_config(config)
        if config.num_layers < 1 or config.num_anchors < 1:
            raise ValueError(f"drafter.num_layers ({config.num_layers}) and drafter.num_anchors ({config.num_anchors})"
                             " must be >= 1")
        super().__init__(config, target_info, backbone_config(config))
        self.config = dataclasses.replace(config, layer_ids=self.layer_ids, mask_token_id=self.mask_token_id,
                                          confidence_temperatures=tuple(map(float, config.confidence_temperatures)))
        hidden = target_info.hidden_size
        self.lm_head = None  # the target's, until a frequency-ranked head (config.draft_vocab_size, after training)
        if config.draft_vocab_size is not None:
            if not 0 < config.draft_vocab_size < target_info.vocab_size:
                raise ValueError(f"drafter.draft_vocab_size {config.draft_vocab_size} must be in [1, "
                                 f"{target_info.vocab_size - 1}] (the target's vocabulary), or null")
            self.add_draft_head(hidden, config.draft_vocab_size)
        self.markov_head: MarkovHead | None = None
        if config.markov_head_type != "none":
            self.markov_head = MarkovHead(config.markov_head_type, target_info.vocab_size, config.markov_rank, hidden,
                                          config.draft_vocab_size)
        self.confidence_head: ConfidenceHead | None = None
        if config.enable_confidence_head:
            with_markov = config.confidence_head_with_markov
            self.confidence_head = ConfidenceHead(hidden + (config.markov_rank if with_markov else 0))

    def max_draft_tokens(self) -> int:
        return self.config.block_size

    @torch.no_grad()
    def reduce_draft_vocab(self, token_counts: torch.Tensor, size: int) -> None:
        """The frequency-ranked head (DraftHead.reduce_draft_vocab), and W2 cut to the same tokens' rows: each kept
        token's logit, U + B, is unchanged. W1 keeps every row (the anchor can be any token)."""
        before = self.draft_ids()
        super().reduce_draft_vocab(token_counts, size)
        if self.markov_head is None:
            return
        kept = self.draft_ids()
        if before is not None:
            kept = draft_index(before, kept, self.target_info.vocab_size)
        w2 = self.markov_head.markov_w2.weight
        self.markov_head.markov_w2 = nn.Linear(w2.shape[1], size, bias=False, device=w2.device, dtype=w2.dtype)
        self.markov_head.markov_w2.weight.copy_(w2.index_select(0, kept.to(w2.device)))

    def _base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """U: post-norm hidden [..., D] -> [..., V] through the target's head, or [..., V_d] through a reduced one."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return self._frozen.linear("lm_head_weight", hidden, self.fc.weight)

    def _markov_embedding(self, previous: torch.Tensor) -> torch.Tensor | None:
        return None if self.markov_head is None else self.markov_head.embed(previous)

    def confidence_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """Confidence logits [...] from post-norm hidden [..., D] and the previous tokens [...]; None without head."""
        if self.confidence_head is None:
            return None
        embedding = self._markov_embedding(previous) if self.config.confidence_head_with_markov else None
        return self.confidence_head(hidden, embedding)

    # ---- training ------------------------------------------------------------------------------------------
    def init_from_data(self, token_counts: torch.Tensor) -> None:
        if self.lm_head is not None:  # before the first step, not at it
            raise ValueError(FULL_VOCAB_TRAINING)

    def forward(self, batch: Mapping[str, Any]) -> DraftOutput:
        """Sample this epoch's anchors (as DFlash) and run `block_outputs` on them."""
        if self.lm_head is not None:  # a resumed or fine-tuned reduced drafter
            raise ValueError(FULL_VOCAB_TRAINING)
        return self.block_outputs(batch, *batch_anchors(batch, self.config.num_anchors))

    def block_outputs(self, batch: Mapping[str, Any], anchors: torch.Tensor,
                      anchor_valid: torch.Tensor | None = None) -> DraftOutput:
        """Teacher-forced DSpark logits of the blocks at the given anchors, all blocks of a row in one forward.

        Args:
            batch: input_ids, attention_mask, loss_mask [B, T] (right padding), hidden {id: [B, T, D]}.
            anchors: [B, A] anchor positions; anchor_valid: [B, A] bool (default all), False = a padding block.
        Returns:
            DraftOutput over the N kept anchors: logits [N, S, V] (base + sequential bias), batch_index [N],
            label_position [N, S] = a + 1 + k (clamped to T - 1 past the end), depth_valid [N, S] (contiguous from
            slot 0), hidden [N, S, D] after the final norm (what the heads read).
        """
        input_ids = batch["input_ids"]
        anchors, anchor_valid, h = self.block_states(batch, anchors, anchor_valid)  # h [B, A, S, D]
        rows, columns, label_position, supervised = block_cells(
            anchors, anchor_valid, self.config.block_size, batch["attention_mask"], batch["loss_mask"])
        hidden = self.norm(h[rows, columns])  # [N, S, D]
        row_index = rows.unsqueeze(1).expand_as(label_position)
        depth_valid = supervised.long().cumprod(dim=1).bool()  # contiguous from the front (DeepSpec)
        previous = input_ids[row_index, label_position - 1]  # x_{a+k}: the anchor at slot 0
        head = with_autocast_of_now(lambda chunk: self.teacher_forced_logits(hidden[chunk], previous[chunk]),
                                    hidden.device)
        return DraftOutput(batch_index=rows, label_position=label_position, depth_valid=depth_valid, hidden=hidden,
                           head=head)

    def teacher_forced_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """U + B for a whole block at once: post-norm hidden [N, S, D], the token before each slot [N, S] (slot 0:
        the anchor) -> logits [N, S, V]. Equals `draw_block`'s slot-by-slot logits when its draws are `previous`."""
        logits = self._base_logits(hidden)
        if self.markov_head is not None:
            logits = logits + self.markov_head.teacher_forced(previous, hidden)
        return logits

    def loss(self, output: DraftOutput, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """ce_weight CE + l1_weight L1 + confidence_weight BCE per valid cell, weighted exp(-k / gamma), over the
        weight sum of all processes (losses.global_mean). See the module docstring."""
        compute = torch.promote_types(self.fc.weight.dtype, torch.float32)
        valid = output.depth_valid
        num_rows, depths = valid.shape
        row_index = output.batch_index.unsqueeze(1).expand_as(output.label_position)
        rows, positions = row_index[valid], output.label_position[valid]
        depth = valid.nonzero(as_tuple=True)[1]
        labels = batch["input_ids"][row_index, output.label_position]  # [N, S]
        teacher_hidden = batch["final_hidden"][row_index, output.label_position - 1]  # [N, S, D]
        lm_head = self._target_tensor("lm_head_weight")

        def cells(chunk):  # one chunk of rows: its logits and teacher [m, V] exist only here
            logits = output.logits_of(chunk)  # [n, S, V]
            keep = valid[chunk]
            log_draft = torch.log_softmax(logits[keep].to(compute), dim=-1)  # [m, V]
            teacher = torch.softmax(F.linear(teacher_hidden[chunk][keep].to(lm_head.dtype), lm_head).to(compute), -1)
            if self.config.loss == "soft":  # the CE term against the target's distribution (distillation)
                ce = -(teacher * log_draft).sum(dim=-1)
            else:
                ce = -log_draft.gather(-1, labels[chunk][keep].unsqueeze(-1)).squeeze(-1)
            l1 = (log_draft.exp() - teacher).abs().sum(dim=-1)
            return ce, l1, logits.detach().argmax(dim=-1)

        ce, l1, predicted = chunked_rows(cells, num_rows, depths * self.target_info.vocab_size)  # ce, l1 [M]
        accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()  # the acceptance probability of rejection sampling
        cell = self.config.ce_weight * ce + self.config.l1_weight * l1
        confidence = self.confidence_logits(output.hidden[valid], batch["input_ids"][rows, positions - 1])
        if confidence is not None:
            bce = F.binary_cross_entropy_with_logits(confidence.to(compute), accept, reduction="none")
            cell = cell + self.config.confidence_weight * bce
        ce_cells = torch.zeros(num_rows, depths, device=ce.device, dtype=compute)
        ce_cells = ce_cells.index_put((*valid.nonzero(as_tuple=True),), ce.detach())
        decay = depth_weights(depths, self.config.loss_decay_gamma, ce.device, compute)
        weights = depth_loss_weights(self.config.loss_weighting, decay, ce_cells, valid, self.config.dpace_alpha,
                                     correct=predicted == labels)[valid]
        loss = global_mean((weights * cell).sum(), weights.sum(), batch)
        cell_loss = torch.zeros(num_rows, depths, device=ce.device, dtype=compute)
        cell_loss = cell_loss.index_put((*valid.nonzero(as_tuple=True),), cell)
        _, metrics = output_metrics(output, batch, cell_loss, predicted)
        if depth.numel():
            metrics.update(ce=float(ce.detach().mean()), l1=float(l1.detach().mean()),
                           accept_rate=float(accept.mean()))
            if confidence is not None:
                metrics.update(confidence_bce=float(bce.detach().mean()),
                               confidence_error=float((torch.sigmoid(confidence.detach()) - accept).abs().mean()))
        return loss, metrics

    # ---- inference: one backbone forward per round, then the block drawn left to right ----------------------------
    def _absorb(self, context: DraftContext, active: torch.Tensor | None) -> None:
        """The backbone's absorb (begin / commit: drafters/dflash/backbone.py), plus how the engine samples."""
        super()._absorb(context, active)
        self._state["temperature"] = float(context.temperature or 0.0)
        self._state["generator"] = context.generator

    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        """One backbone forward of [anchor, MASK x (S-1)] at pos..pos+S-1, then `draw_block` over its first
        num_tokens slots."""
        anchor = self.check_proposal(num_tokens)
        if num_tokens <= 0:
            return Proposal(tokens=anchor.new_zeros(anchor.shape[0], 0))
        h = self.next_block_states()
        return self.draw_block(self.norm(h[:, :num_tokens]), anchor, self._state["temperature"],
                               self._state["generator"])

    def draw_block(self, hidden: torch.Tensor, anchor: torch.Tensor, temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> Proposal:
        """The sequential stage over post-norm hidden [B, K, D] of slots 0..K-1, the anchors [B] first.

        Slot k: logits = U_k + B_k(x_{k-1}), confidence logit from (h_k, x_{k-1}), then x_k = argmax (temperature 0)
        or a draw from q_k = softmax(logits / temperature) (returned as probs [B, K, V]). A frequency-ranked head's
        logits are over its draft ids: the draw is mapped to its target id, q_k is zero outside.
        """
        base = self._base_logits(hidden)  # [B, K, V] or [B, K, V_d]
        draft_ids = self.draft_ids()
        state = None if self.markov_head is None else self.markov_head.initial_state(hidden[:, 0])
        previous = anchor
        tokens, probs, confidences, slot_logits = [], [], [], []
        for k in range(hidden.shape[1]):
            logits = base[:, k]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(self.markov_head.embed(previous), hidden[:, k], state)
                logits = logits + bias
            slot_logits.append(logits / temperature if temperature > 0 else logits)
            confidence = self.confidence_logits(hidden[:, k], previous)
            if confidence is not None:
                confidences.append(confidence)
            if temperature > 0:
                q = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
                previous = torch.multinomial(q, 1, generator=generator).squeeze(-1)
                if draft_ids is not None:
                    q = q.new_zeros(*q.shape[:-1], self.target_info.vocab_size).index_copy_(-1, draft_ids, q)
                probs.append(q)
            else:
                previous = logits.argmax(dim=-1)
            if draft_ids is not None:
                previous = draft_ids[previous]
            tokens.append(previous)
        temperatures = self.config.confidence_temperatures
        return Proposal(
            tokens=torch.stack(tokens, dim=1), probs=torch.stack(probs, dim=1) if probs else None,
            log_probs=full_vocab_log_probs(torch.stack(slot_logits, dim=1), draft_ids, self.target_info.vocab_size),
            confidence_logits=torch.stack(confidences, dim=1) if confidences else None,
            confidence_temperature=(torch.tensor(temperatures[: len(tokens)], device=hidden.device)
                                    if temperatures and confidences else None))

    # ---- calibration and persistence -------------------------------------------------------------------------
    def set_confidence_temperatures(self, temperatures) -> None:
        """Adopt STS temperatures (one per block slot; () = uncalibrated)."""
        config = dataclasses.replace(self.config, confidence_temperatures=tuple(float(t) for t in temperatures))
        check_config(config)
        self.config = config

