"""Medusa heads (Cai et al. 2024; reference algorithms_eagle3_mtp.md B.5), Medusa-1: the target stays frozen.

K heads sit on the target's last hidden state after its final norm (what the HF model returns, which Medusa reads);
each is `num_layers` residual SiLU blocks and an lm_head (drafters/medusa/layers.py). Medusa's head k (0-based among
the extra heads; the target's own head would be "head -1") reads the hidden state h_t of position t and predicts the
token at t + k + 2.

Depth mapping (drafters/base.py: the anchor is the last token the drafter knows, depth k predicts the token k + 1
places after it). At inference the anchor is the token x_n the target just emitted; the target has NOT computed its
hidden state yet (it will in the next verify forward), so the newest hidden state is h_{n-1}, of the position before
the anchor. Head k reads h_{n-1} and predicts x_{n-1+k+2} = x_{n+1+k}: exactly depth k. So a row is one position
t = anchor - 1, label position t + k + 2, and head 0 predicts the token after the anchor without seeing the anchor
itself (Medusa conditions only on h). One forward gives all K drafts, so the draft cost per round is flat in k, like a
block drafter's.

- Training (`forward`): all heads at every position with a loss; `loss`: per-depth means of soft (target
  distribution) or hard (data token) cross-entropy, weighted step_decay**k, normalised over all processes.
- Inference: `begin` / `commit` keep each row's final hidden state at its last verified position; `propose(k)` runs
  heads 0..k-1 on it (top-1 chain, or sampled with probs when sample_drafts). max_draft_tokens = num_heads.
- Persistence: native, and vLLM's `medusa` layout (drafters/medusa/export.py; also read: FasterDecoding's releases).

Shapes: B batch, T sequence, N rows, K heads, D hidden, V vocab.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from drafters.base import DraftContext, Drafter, FeatureRequest, Proposal, TargetInfo, full_vocab_log_probs
from drafters.chunked import with_autocast_of_now
from drafters.output import DraftOutput
from drafters.layers import FrozenTargetTensors, draw_drafts
from drafters.losses import acceptance_metric, check_lk_eta, distilled_cells, position_cells, weighted_depth_loss
from drafters.medusa import export as medusa_export
from drafters.medusa.config import MedusaConfig
from drafters.medusa.layers import MedusaHead


class MedusaDrafter(Drafter):
    """Medusa-1 heads. See the module docstring for the depth mapping and the contracts."""

    kind = "medusa"
    row_state = ("_state",)  # per-row inference state (drafters/base.py keep_rows)
    Config = MedusaConfig
    export_module = medusa_export  # vLLM's medusa layout (save / load in drafters/base.py)

    def __init__(self, config: MedusaConfig, target_info: TargetInfo):
        super().__init__(config, target_info)
        if config.num_heads < 1 or config.num_layers < 0:
            raise ValueError(f"drafter.num_heads must be >= 1 and drafter.num_layers >= 0, got {config.num_heads}, "
                             f"{config.num_layers}")
        if config.lm_head not in ("target", "copy", "new"):
            raise ValueError(f"drafter.lm_head {config.lm_head!r} is not one of target, copy, new")
        check_lk_eta(config.lk_eta)
        own_head = config.lm_head != "target"
        self.heads = nn.ModuleList(MedusaHead(target_info.hidden_size, target_info.vocab_size, config.num_layers,
                                              own_head) for _ in range(config.num_heads))
        self._frozen = FrozenTargetTensors(target_info)
        self._state: dict[str, torch.Tensor] = {}
        if config.lm_head == "copy" and not self.heads[0].lm_head.weight.is_meta:
            with torch.no_grad():
                for head in self.heads:
                    head.lm_head.weight.copy_(target_info.lm_head_weight)

    def feature_request(self) -> FeatureRequest:
        return FeatureRequest(layer_ids=tuple(self.target_layer_ids()), final_hidden=True)

    def max_draft_tokens(self) -> int:
        return self.config.num_heads

    def _target_tensor(self, name: str) -> torch.Tensor:
        """A frozen TargetInfo tensor on this drafter's device, in the target's dtype (layers.FrozenTargetTensors)."""
        return self._frozen.on_device(name, next(self.parameters()))

    def head_logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden [..., D] -> logits [..., K, V] of heads 0..num_heads-1."""
        like = next(self.parameters())
        heads = self.heads[: num_heads or self.config.num_heads]
        return torch.stack([head.logits(hidden, lambda x: self._frozen.linear("lm_head_weight", x, like))
                            for head in heads], dim=-2)

    # ---- training ---------------------------------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Any]) -> DraftOutput:
        """Every head at every position t with a loss at some depth.

        Returns:
            DraftOutput: row n = (batch_index, t), logits [N, K, V] of head k on h_t, label_position [N, K] = t + k + 2
            (clamped to T - 1 past the end), depth_valid [N, K] = label inside the sequence and in loss_mask.
        """
        batch_index, position, label_position, depth_valid = position_cells(batch, self.config.num_heads)
        hidden = batch["final_hidden"][batch_index, position].to(next(self.parameters()).dtype)
        head = with_autocast_of_now(lambda rows: self.head_logits(hidden[rows]), hidden.device)  # chunks of N
        return DraftOutput(batch_index=batch_index, label_position=label_position, depth_valid=depth_valid, head=head)

    def loss(self, output: DraftOutput, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """sum_k step_decay**k * mean CE of head k over its valid cells of all processes (see MedusaConfig.loss)."""
        cell_loss, predicted, alpha = distilled_cells(output, batch, self._target_tensor("lm_head_weight"),
                                                      self.config.loss, self.config.lk_eta)
        weights = self.config.step_decay ** torch.arange(cell_loss.shape[1], dtype=cell_loss.dtype,
                                                         device=cell_loss.device)
        loss, metrics = weighted_depth_loss(output, batch, cell_loss, weights, predicted)
        return loss, metrics if alpha is None else {**metrics, **acceptance_metric(alpha, output.depth_valid)}

    # ---- inference --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def begin(self, context: DraftContext) -> None:
        self._state = {}
        self._generator = context.generator
        self._keep_last_hidden(context, torch.ones(context.input_ids.shape[0], dtype=torch.bool,
                                                   device=context.input_ids.device))

    @torch.no_grad()
    def commit(self, num_accepted: torch.Tensor, context: DraftContext) -> None:
        if not self._state:
            raise ValueError("commit() called before begin()")
        self._keep_last_hidden(context, context.valid.any(dim=1))

    def _keep_last_hidden(self, context: DraftContext, active: torch.Tensor) -> None:
        """The final hidden state at each active row's last valid position (the position before the anchor)."""
        if context.final_hidden is None:
            raise ValueError("medusa: the engine served no final_hidden (FeatureRequest.final_hidden)")
        columns = torch.arange(context.valid.shape[1], device=context.valid.device)
        last = torch.where(context.valid, columns, -1).amax(dim=1).clamp(min=0)
        rows = torch.arange(last.shape[0], device=last.device)
        hidden = context.final_hidden[rows, last].to(next(self.parameters()).dtype)
        previous = self._state.get("hidden")
        self._state["hidden"] = hidden if previous is None else torch.where(active[:, None], hidden, previous)

    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        """Heads 0..num_tokens-1 on the last hidden state, in one forward."""
        if num_tokens > self.config.num_heads:
            raise ValueError(f"propose: {num_tokens} tokens asked for, but {self.config.num_heads} Medusa heads "
                             f"draft at most {self.config.num_heads}")
        if not self._state:
            raise ValueError("propose() called before begin()")
        hidden = self._state["hidden"]
        if num_tokens <= 0:
            return Proposal(tokens=torch.zeros(hidden.shape[0], 0, dtype=torch.long, device=hidden.device))
        logits = self.head_logits(hidden, num_tokens)  # [B, k, V]
        drafts, q = draw_drafts(logits, self.config.sample_drafts, self._generator)
        return Proposal(tokens=drafts, probs=None if q is None else q.float(),  # drafts [B, k], q [B, k, V]
                        log_probs=full_vocab_log_probs(logits, None, logits.shape[-1]))
