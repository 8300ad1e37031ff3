"""P-EAGLE drafter: EAGLE-3 drafting a whole chain in one forward (parallel drafting; vLLM's `peagle`, speculators'
PEagleDraftModel, SpecForge's and NeMo Automodel's P-EAGLE; reference formats_and_serving.md sections 2.1 and 3.2).

The layers, head, vocabulary and features are EAGLE-3's (drafters/eagle3/model.py); what differs is what the draft
slots after the first one read:
- EAGLE-3 feeds depth k the token it drafted at depth k-1 and its own output there, so a chain of K costs K
  sequential forwards. P-EAGLE feeds every depth k >= 1 the same two placeholders, the embedding of a mask row of the
  target vocabulary (`mask_token_id`) and fc(mask_hidden), a learned vector in the space of the concatenated target
  features, so depths 1..K-1 run in one forward beside each other: depth k attends to the committed context and to
  depths 1..k, causally, at RoPE position anchor + k. The drafts of a proposal do not condition on each other.
- Training is the training-time test with those inputs: depth k at anchor t reads the placeholders at position
  t + k, attends to the depth-0 keys at positions <= t and to its own depths 1..k (the mask speculators writes as
  (same anchor and depth <= k) or (depth 0 and anchor <= t)), and predicts the token t + k + 2, as EAGLE-3's depth
  k does. Every depth runs at every anchor (speculators' COD sampling keeps a shrinking random share of the anchors
  at deeper depths to save memory; here chunked attention and activation checkpointing do, as for EAGLE-3).
- Inference: `commit` absorbs the verified block as EAGLE-3 does (its last output gives the first draft); `propose(K)`
  runs the K-1 placeholder slots through the layers once, over the committed cache, and drops their keys again.
- Trees: the drafts are per-position distributions, so a tree is built from them (DDTree, engine/tree/draft.py) and
  never expanded node by node (`expands_trees` False).
- Export: "speculators" with `speculators_model_type: peagle`, `mask_token_id` and the `mask_hidden` tensor
  [1, n_features * D] (drafters/peagle/export.py), which vLLM serves as method eagle3 with parallel drafting.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from drafters.base import Drafter, Proposal, TargetInfo, full_vocab_log_probs
from drafters.eagle3.model import Eagle3Drafter
from drafters.layers import draw_drafts
from drafters.peagle import export as export_peagle
from drafters.peagle.config import PEagleConfig
from drafters.vocab import resolve_mask_token_id


class PEagleDrafter(Eagle3Drafter):
    """P-EAGLE drafter. See the module docstring for what differs from EAGLE-3."""

    kind = "peagle"
    Config = PEagleConfig
    export_module = export_peagle  # the serving layout speculators (save / load in drafters/base.py)
    expands_trees = False  # a proposal's drafts do not read each other: trees are built from its distributions
    expand_tree = Drafter.expand_tree  # refuses: EAGLE-3's node-by-node expansion feeds drafted tokens

    def __init__(self, config: PEagleConfig, target_info: TargetInfo):
        mask_token_id = resolve_mask_token_id(config.mask_token_id, config.allow_text_mask_token, target_info)
        super().__init__(config, target_info)
        self.config = dataclasses.replace(self.config, mask_token_id=mask_token_id)
        self.mask_token_id = mask_token_id
        # The placeholder hidden input, before fc: one vector of the concatenated target features (vLLM's shape
        # [1, n_features * D] on export). Standard normal as speculators starts it; fc and hidden_norm scale it.
        self.mask_hidden = nn.Parameter(torch.randn(len(self.layer_ids) * target_info.hidden_size,
                                                    dtype=self.fc.weight.dtype, device=self.fc.weight.device))

    def _placeholders(self, batch: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask-token embeddings, fc(mask_hidden)), each [batch, slots, D] in the drafter's dtype."""
        weight = self.fc.weight
        token = torch.full((1, 1), self.mask_token_id, dtype=torch.long, device=weight.device)
        embed = self._frozen.embedding("embed_weight", token, weight)
        hidden = self.fc(self.mask_hidden.to(weight.dtype)).view(1, 1, -1)
        return embed.expand(batch, slots, -1), hidden.expand(batch, slots, -1)

    def _step_inputs(self, step: int, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth 0 reads EAGLE-3's inputs; every later depth the placeholders (see the module docstring)."""
        if step == 0:
            return embeds, hidden
        return self._placeholders(embeds.shape[0], embeds.shape[1])

    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        """Draft num_tokens per row in one forward: the committed state's output gives depth 0, the num_tokens - 1
        placeholder slots at the next positions give the rest. probs [B, K, V] (float32, zero outside the draft
        vocabulary) only when config.sample_drafts; otherwise argmax drafts and probs None."""
        if not self._state:
            raise ValueError("propose() called before begin()")
        for cache in self._caches:
            cache.rewind()
        logits = self._state["logits"].unsqueeze(1)  # [B, 1, V_d]
        batch = logits.shape[0]
        if num_tokens == 0:
            return Proposal(tokens=torch.zeros(batch, 0, dtype=torch.long, device=logits.device))
        if num_tokens > 1:
            slots = num_tokens - 1
            embeds, hidden = self._placeholders(batch, slots)
            positions = self._state["position"].view(-1, 1) + torch.arange(1, slots + 1, device=logits.device)
            valid = torch.ones(batch, slots, dtype=torch.bool, device=logits.device)
            out = self._cached_layers(embeds, hidden, positions, valid)
            logits = torch.cat([logits, self.lm_head(self.norm(out))], dim=1)  # [B, K, V_d]
        draft_ids = self.draft_ids()
        drafts, q = draw_drafts(logits, self.config.sample_drafts, self._generator)
        log_probs = full_vocab_log_probs(logits, draft_ids, self.t2d.numel())
        if q is None:
            return Proposal(tokens=draft_ids[drafts], log_probs=log_probs)
        q = q.float()  # float32 like the engine's target probabilities
        full = q.new_zeros(batch, num_tokens, self.t2d.numel())
        full[:, :, draft_ids] = q
        return Proposal(tokens=draft_ids[drafts], probs=full, log_probs=log_probs)
