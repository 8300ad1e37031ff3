"""The KV-sharing assistant: a Gemma-4-style drafter generalised to any Llama/Qwen-like target (reference B.6).

The design notes behind this module: docs/decisions.md, "drafters/assistant/model.py".
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from drafters.assistant import export as assistant_export
from drafters.assistant.config import AssistantConfig
from drafters.assistant.layers import (
    AssistantLayer,
    Gemma4Layer,
    attention_shape,
    check_kv_shapes,
    embedding_scale,
    gemma4_text_config,
    resolve_kv_layers,
    text_config,
    with_family_layers,
)
from drafters.base import DraftContext, Drafter, FeatureRequest, Proposal, TargetInfo, full_vocab_log_probs
from drafters.output import DraftOutput
from drafters.layers import FrozenTargetTensors, RMSNorm, RotaryEmbedding, draw_drafts, rope_inverse_frequencies
from drafters.layers import rope_parameters
from drafters.losses import chained_depths, listed_depth_weights, target_distilled_loss


class AssistantDrafter(Drafter):
    """KV-sharing assistant. See the module docstring for the training, inference and persistence contracts."""

    kind = "assistant"
    row_state = ("_state",)  # per-row inference state (drafters/base.py keep_rows)
    Config = AssistantConfig
    export_module = assistant_export  # Gemma 4's gemma4_assistant layout (save / load in drafters/base.py)

    def __init__(self, config: AssistantConfig, target_info: TargetInfo):
        config = with_family_layers(config, target_info)
        super().__init__(config, target_info)
        if config.num_steps < 1:
            raise ValueError(f"drafter.num_steps must be >= 1, got {config.num_steps}")
        if config.reading not in ("transformers", "vllm"):
            raise ValueError(f"drafter.reading {config.reading!r} must be 'transformers' or 'vllm'")
        self.kv_layers = resolve_kv_layers(config, target_info)
        target = text_config(target_info)
        eps = target_info.rms_norm_eps
        if config.gemma4_config is not None:  # Gemma 4's own layers and RoPE (an imported gemma4_assistant)
            from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

            hf_config = gemma4_text_config(config.gemma4_config)
            theirs = (hf_config.num_hidden_layers, hf_config.hidden_size, hf_config.intermediate_size)
            ours = (config.num_layers, config.hidden_size, config.intermediate_size)
            if theirs != ours:
                raise ValueError(f"drafter.gemma4_config has (num_hidden_layers, hidden_size, intermediate_size) "
                                 f"{theirs}, but drafter sets {ours}")
            width, eps = hf_config.hidden_size, hf_config.rms_norm_eps
            self._widths = (hf_config.num_attention_heads, hf_config.intermediate_size)
            self.layers = nn.ModuleList(Gemma4Layer(hf_config, i) for i in range(config.num_layers))
            rotary = Gemma4TextRotaryEmbedding(hf_config)
            self._rope = lambda x, positions, kind: rotary(x, positions, kind)  # cos, sin [B, n, d]
            self.gemma4_rotary = rotary
        else:
            self.shape = attention_shape(target_info)
            width = int(config.hidden_size or target_info.hidden_size)
            intermediate = int(config.intermediate_size or target.get("intermediate_size") or 4 * width)
            self.layers = nn.ModuleList(AssistantLayer(width, intermediate, self.shape, eps)
                                        for _ in range(config.num_layers))
            self._widths = (self.shape.num_heads, intermediate)
            rope_config = {**target, "hidden_size": target_info.hidden_size, "head_dim": self.shape.head_dim,
                           "num_attention_heads": self.shape.num_heads, "rope_parameters": rope_parameters(target)}
            rotary = RotaryEmbedding(*rope_inverse_frequencies(rope_config))
            self._rope = lambda x, positions, kind: rotary(positions, x.dtype)  # cos, sin [B, 1, n, d]
        check_kv_shapes(target_info, self.kv_layers, [layer.kv_shape for layer in self.layers])
        self.embed_scale = embedding_scale(config, target_info)
        self.pre_projection = nn.Linear(2 * target_info.hidden_size, width, bias=False)
        self.norm = RMSNorm(width, eps)
        self.lm_head = nn.Linear(width, target_info.vocab_size, bias=False)
        self.post_projection = nn.Linear(width, target_info.hidden_size, bias=False)
        self._frozen = FrozenTargetTensors(target_info)
        self._state: dict[str, Any] = {}
        if not self.lm_head.weight.is_meta:
            self._init_weights()

    def feature_request(self) -> FeatureRequest:
        return FeatureRequest(layer_ids=tuple(self.target_layer_ids()), final_hidden=True,
                              kv_layers=tuple(sorted(set(self.kv_layers))))

    @property
    def layer_config(self) -> dict[str, int]:
        """The widths of the assistant's layers (drafters/step_memory.step_shape): its own width and MLP, the
        target's query heads, and the KV heads and head dim of the target layer its first layer reads."""
        kv_heads, head_dim = self.layers[0].kv_shape
        heads, intermediate = self._widths
        return {"hidden_size": self.norm.weight.shape[0], "num_attention_heads": int(heads),
                "num_key_value_heads": int(kv_heads), "head_dim": int(head_dim), "intermediate_size": int(intermediate)}

    # ---- initialisation -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _init_weights(self) -> None:
        """normal(0, std) linears with the target's initializer_range (0.02 without one), unit norms. A warm start
        from the target's last layer, lm_head and final norm was measured worse than this on SmolLM2 (initial soft
        CE 14.8 vs 10.9: the copied layer turns the fed hidden state into a confident wrong distribution)."""
        std = float(text_config(self.target_info).get("initializer_range") or 0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)

    def _target_tensor(self, name: str) -> torch.Tensor:
        """A frozen TargetInfo tensor on this drafter's device, in the target's dtype (layers.FrozenTargetTensors)."""
        return self._frozen.on_device(name, self.lm_head.weight)

    # ---- one draft step over a block of query positions --------------------------------------------------------
    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, query_positions: torch.Tensor,
             kv: Mapping[int, tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
             key_positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One step for n queries per row.

        Args:
            tokens: [B, n] the token each query reads; hidden: [B, n, D] the target's (or fed-back) hidden state.
            query_positions: [B, n] the positions the queries are rotated at.
            kv: {target layer: (keys, values) [B, H_kv, C, d]}, read only; mask: [B, 1, n, C] bool.
            key_positions: [B, C] the position of each key (a sliding-window layer sees the keys with
                query position - key position <= window + 1, as transformers' Gemma 4 assistant does).
        Returns:
            normed output d [B, n, W] (the lm_head's input) and h_next = post_projection(d) [B, n, D].
        """
        weight = self.lm_head.weight
        embeds = self._frozen.embedding("embed_weight", tokens, weight) * self.embed_scale
        x = self.pre_projection(torch.cat([embeds, hidden.to(weight.dtype)], dim=-1))
        rope = {kind: self._rope(x, query_positions, kind) for kind in {layer.layer_type for layer in self.layers}}
        for layer, target_layer in zip(self.layers, self.kv_layers):
            keys, values = kv[target_layer]
            layer_mask = mask
            if layer.window is not None:
                # transformers' Gemma 4 assistant shows a query the last window + 1 keys (its flipped bidirectional
                # window mask), one more than a target query sees; the imported weights were made for that
                distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]  # [B, 1, n, C]
                layer_mask = mask & (distance < layer.window if self.vllm_reading else distance <= layer.window + 1)
            x = layer(x, keys, values, layer_mask, *rope[layer.layer_type])
        normed = self.norm(x)
        return normed, self.post_projection(normed)

    @property
    def vllm_reading(self) -> bool:
        return self.config.reading == "vllm"

    # ---- training ---------------------------------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Any]) -> DraftOutput:
        """K teacher-forced steps at every position (right padding).

        batch["target_kv"]: {target layer: (keys, values) [B, H_kv, T, d]} from the target's forward on input_ids.

        Returns:
            DraftOutput: row n = (batch_index, position i = anchor - 1) for every i with a loss at some step; logits
            [N, K, V] of step k at i; label_position [N, K] = i + k + 2 (clamped to T - 1 past the end);
            depth_valid [N, K] = label inside the sequence and in loss_mask.
        """
        if "target_kv" not in batch:
            raise ValueError("assistant: the batch carries no target_kv (FeatureRequest.kv_layers); train it with "
                             "features.mode=online")
        input_ids = batch["input_ids"]
        batch_size, seq_len = input_ids.shape
        device = input_ids.device
        first = 0 if self.vllm_reading else 1  # AssistantConfig.reading
        query_positions = torch.arange(first, seq_len + first, device=device).expand(batch_size, seq_len)
        columns = torch.arange(seq_len, device=device)
        # row i (query position i + 1, or i in vLLM's reading) sees the target's keys 0..i of its own sequence
        mask = (columns[None, :] <= columns[:, None])[None] & batch["attention_mask"].bool()[:, None, :]
        mask = mask.unsqueeze(1)  # [B, 1, T, T]
        key_positions = columns.expand(batch_size, seq_len)

        def step(_, tokens, hidden):
            normed, hidden = self.step(tokens, hidden, query_positions, batch["target_kv"], mask, key_positions)
            return hidden, normed

        return chained_depths(batch, self.config.num_steps, step, self.lm_head)

    def loss(self, output: DraftOutput, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """sum_k w_k * mean CE of step k over its valid cells of all processes (AssistantConfig.loss_weights)."""
        weights = listed_depth_weights(self.config.loss_weights, output.depth_valid.shape[1])
        return target_distilled_loss(output, batch, self._target_tensor("lm_head_weight"), self.config.loss, weights)

    # ---- inference: steps over the engine's live target cache ---------------------------------------------------
    @torch.no_grad()
    def begin(self, context: DraftContext) -> None:
        self._state = {"generator": context.generator}
        self._absorb(context, torch.ones(context.input_ids.shape[0], dtype=torch.bool, device=context.valid.device))

    @torch.no_grad()
    def commit(self, num_accepted: torch.Tensor, context: DraftContext) -> None:
        """Rows with a valid position in the verified block take its last hidden state and the new next token;
        every row takes the rolled-back cache (finished rows are never proposed for)."""
        if not self._state:
            raise ValueError("commit() called before begin()")
        self._absorb(context, context.valid.any(dim=1))

    def _absorb(self, context: DraftContext, active: torch.Tensor) -> None:
        if context.final_hidden is None or context.target_kv is None or context.target_kv_valid is None:
            raise ValueError("assistant: the engine served no final_hidden / target_kv (FeatureRequest)")
        for layer, target_layer in zip(self.layers, self.kv_layers):
            keys = context.target_kv[target_layer][0]
            if keys.shape[2] != context.target_kv_valid.shape[1]:
                raise ValueError(f"assistant: target layer {target_layer} holds {keys.shape[2]} cached tokens for "
                                 f"{context.target_kv_valid.shape[1]} cache slots (a sliding-window cache dropped "
                                 "the oldest); map drafter.kv_layers to full-attention layers or keep sequences "
                                 "within the target's sliding window")
            if (keys.shape[1], keys.shape[3]) != layer.kv_shape:
                raise ValueError(f"assistant: target layer {target_layer} caches {keys.shape[1]} KV heads of dim "
                                 f"{keys.shape[3]}; the assistant layer reading it expects (heads, dim) "
                                 f"{layer.kv_shape}")
        columns = torch.arange(context.valid.shape[1], device=context.valid.device)
        last = torch.where(context.valid, columns, -1).amax(dim=1).clamp(min=0)  # [B] last valid position
        rows = torch.arange(last.shape[0], device=last.device)
        hidden = context.final_hidden[rows, last]  # [B, D]
        state = self._state
        if "hidden" in state:
            hidden = torch.where(active[:, None], hidden, state["hidden"])
            tokens = torch.where(active, context.next_tokens, state["tokens"])
        else:
            tokens = context.next_tokens
        state.update(hidden=hidden, tokens=tokens, kv={i: context.target_kv[i] for i in self.kv_layers},
                     kv_valid=context.target_kv_valid.bool())

    @torch.no_grad()
    def draft_logits(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """num_tokens steps from the current state: drafts [B, K], their logits [B, K, V], and q [B, K, V] when
        sample_drafts (else None). All steps query from position p = the row's cached length."""
        if not self._state:
            raise ValueError("propose() called before begin()")
        state = self._state
        kv_valid = state["kv_valid"]  # [B, L]
        query_positions = kv_valid.long().sum(dim=1, keepdim=True) - int(self.vllm_reading)  # [B, 1]
        key_positions = kv_valid.long().cumsum(dim=1) - 1  # [B, L]; holes are masked anyway
        mask = kv_valid[:, None, None, :]  # [B, 1, 1, L]
        tokens, hidden = state["tokens"][:, None], state["hidden"][:, None]
        drafts, logits, probs = [], [], []
        for _ in range(num_tokens):
            normed, hidden = self.step(tokens, hidden, query_positions, state["kv"], mask, key_positions)
            step_logits = self.lm_head(normed[:, 0])  # [B, V]
            draft, q = draw_drafts(step_logits, self.config.sample_drafts, state["generator"])
            tokens = draft[:, None]
            drafts.append(draft)
            logits.append(step_logits)
            probs.append(q)
        batch = kv_valid.shape[0]
        if num_tokens <= 0:
            empty = torch.zeros(batch, 0, dtype=torch.long, device=kv_valid.device)
            return empty, self.lm_head.weight.new_zeros(batch, 0, self.target_info.vocab_size), None
        q = torch.stack(probs, dim=1).float() if self.config.sample_drafts else None
        return torch.stack(drafts, dim=1), torch.stack(logits, dim=1), q

    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        """A chain of num_tokens drafts per row; probs [B, K, V] when sample_drafts."""
        drafts, logits, q = self.draft_logits(num_tokens)
        return Proposal(tokens=drafts, probs=q, log_probs=full_vocab_log_probs(logits, None, logits.shape[-1]))
