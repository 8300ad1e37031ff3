"""What the target serves a drafter after one forward: one record, the same names in the engine and in training.

    logits, served = target.extend(block, request)                  # inference/engine/target.TargetModel
    drafter.commit(accepted, DraftContext(block, valid, positions, next_tokens=..., **served.context()))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch


@dataclass
class Served:
    """The target's features of one forward, as a drafter's FeatureRequest asks for them and under the names
    DraftContext gives them (the engine's one feature record, from TargetModel.extend to the drafter).

    hidden:      {layer_id: [B, S, D]} (FeatureRequest.layer_ids, vLLM layer-id convention).
    final_hidden: [B, S, D] the last hidden state after the final norm (FeatureRequest.final_hidden), or None.
    top_k:       (values, ids) [B, S, k] the target's top-k logits (FeatureRequest.top_k_logits), or None.
    target_kv:   {layer index: (keys, values) [B, H_kv, L, d]} the live KV cache of FeatureRequest.kv_layers, with
                 target_kv_valid [B, L]; a rollback changes the cache, so the view is re-read after it (`with_kv`).
    """

    hidden: dict[int, torch.Tensor]
    final_hidden: torch.Tensor | None = None
    top_k: tuple[torch.Tensor, torch.Tensor] | None = None
    target_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    target_kv_valid: torch.Tensor | None = None

    def context(self) -> dict[str, Any]:
        """These features as DraftContext keyword arguments: DraftContext(ids, valid, positions, **served.context())."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def with_kv(self, view: Mapping[str, Any]) -> "Served":
        """The same features with the KV view `view` (TargetModel.kv_view: target_kv, target_kv_valid)."""
        return dataclasses.replace(self, **view)

    def along(self, path: torch.Tensor) -> "Served":
        """The per-node features [B, N, ...] of a tree forward gathered along path [B, W] -> [B, W, ...] (padding,
        -1, reads node 0); no KV view (the tree's cache is rolled back to the path first, then re-read)."""
        index = path.clamp(min=0)

        def take(tensor: torch.Tensor) -> torch.Tensor:
            rows = torch.arange(tensor.shape[0], device=tensor.device)[:, None]
            return tensor[rows, index.to(tensor.device)]

        return Served({layer_id: take(value) for layer_id, value in self.hidden.items()},
                      None if self.final_hidden is None else take(self.final_hidden),
                      None if self.top_k is None else tuple(take(part) for part in self.top_k))
