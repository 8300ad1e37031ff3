"""DFlash building blocks, kept free of the drafter so that DSpark (same backbone, other labels and heads) reuses them.

The design notes behind this module: docs/decisions.md, "drafters/dflash/layers.py".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from drafters import chunked
from drafters.base import DraftContext, TargetInfo
from drafters.chunked import maybe_checkpoint
from drafters.dflash.anchors import block_attention_mask, block_positions
from drafters.dflash.config import DFlashConfig
from drafters.layer_ids import auto_layer_ids, check_hybrid_ids, is_auto, nearest_distinct
from drafters.layers import (
    KVCache,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    apply_rope,
    attention,
    hf_layer_config,
    rope_inverse_frequencies,
)

PUBLISHED_DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # paper A.1, Eq. 4
NUM_DEFAULT_LAYER_IDS = 5


def default_layer_ids(num_target_layers: int, count: int = NUM_DEFAULT_LAYER_IDS) -> tuple[int, ...]:
    """The z-lab rule (layer outputs from layer 1 to L-3, uniformly) converted to our ids (+1)."""
    n = num_target_layers
    return tuple(round(1 + i * (n - 4) / (count - 1)) + 1 for i in range(count))


def resolve_layer_ids(config: DFlashConfig, target_info: TargetInfo) -> tuple[int, ...]:
    """The configured ids or `auto`; every id must lie in [0, N-1], and on a hybrid read a full-attention layer."""
    n = target_info.num_layers
    if not is_auto(config.layer_ids):
        layer_ids = tuple(int(i) for i in config.layer_ids)
        bad = [i for i in layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"drafter.layer_ids {list(layer_ids)}: ids {bad} are outside [0, {n - 1}] (id k = the "
                             f"input of decoder layer k; id {n}, the final pre-norm output, is not allowed)")
        check_hybrid_ids(layer_ids, target_info.config, n - 1, "drafter.layer_ids", config.allow_linear_attention_ids)
        return layer_ids
    layer_ids = default_layer_ids(n)
    if len(set(layer_ids)) < len(layer_ids) or not all(0 <= i < n for i in layer_ids):
        if n < 2:
            raise ValueError(f"drafter.layer_ids: a {n}-layer target has no id in [1, {n - 1}]; set drafter.layer_ids")
        layer_ids = nearest_distinct(layer_ids, list(range(1, n)))  # a small (debug) target: its own ids, spread
    return auto_layer_ids(layer_ids, target_info.config, n - 1, "drafter.layer_ids")


def decay_gamma(config: DFlashConfig) -> float:
    """gamma of the loss weights exp(-(k-1)/gamma): configured, published (16/10/8 -> 7/5/4), else block_size / 2."""
    if config.loss_decay_gamma is not None:
        return float(config.loss_decay_gamma)
    return PUBLISHED_DECAY_GAMMA.get(config.block_size, config.block_size / 2)


def check_config(config: DFlashConfig, vocab_size: int) -> None:
    """Raise ValueError naming the field for values no drafter can use."""
    if config.block_size < 2:
        raise ValueError(f"drafter.block_size {config.block_size} must be >= 2 (the anchor plus at least one draft)")
    if config.num_layers < 1:
        raise ValueError(f"drafter.num_layers {config.num_layers} must be >= 1")
    if config.num_anchors < 1:
        raise ValueError(f"drafter.num_anchors {config.num_anchors} must be >= 1")
    if config.loss_decay_gamma is not None and not config.loss_decay_gamma > 0:
        raise ValueError(f"drafter.loss_decay_gamma {config.loss_decay_gamma} must be > 0 (or null for the default)")
    if not 0.0 < config.dpace_alpha <= 1.0:
        raise ValueError(f"drafter.dpace_alpha {config.dpace_alpha} must be in (0, 1]")
    if config.draft_vocab_size is not None and not 0 < config.draft_vocab_size <= vocab_size:
        raise ValueError(f"drafter.draft_vocab_size {config.draft_vocab_size} must be in [1, {vocab_size}] or null")


def draft_layer_config(config: DFlashConfig, target_info: TargetInfo) -> dict[str, Any]:
    """The draft layers as an HF Qwen3 config dict (q/k norms, no biases, full attention), shapes mirrored from the
    target (drafters/layers.hf_layer_config)."""
    extra = {"use_sliding_window": False, "layer_types": ["full_attention"] * config.num_layers}
    return hf_layer_config(config, target_info, "qwen3", extra)


def fuse_context(hidden: Mapping[int, torch.Tensor], layer_ids, fc: nn.Linear, hidden_norm: RMSNorm) -> torch.Tensor:
    """The context c = hidden_norm(fc(concat of the target features in layer_ids order)).

    Args:
        hidden: {layer id: [B, T, D]} target features.
    Returns:
        [B, T, D] in fc's dtype.
    """
    features = torch.cat([hidden[i] for i in layer_ids], dim=-1)
    return hidden_norm(fc(features.to(fc.weight.dtype)))


class DFlashAttention(nn.Module):
    """q/k/v/o projections (no bias) with per-head RMSNorm on q and k (Qwen3), grouped KV heads."""

    def __init__(self, layer_config: Mapping[str, Any]):
        super().__init__()
        hidden, eps = layer_config["hidden_size"], layer_config["rms_norm_eps"]
        self.num_heads = layer_config["num_attention_heads"]
        self.num_kv_heads = layer_config["num_key_value_heads"]
        self.head_dim = layer_config["head_dim"]
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, n, D] -> q [B, H, n, d]: q_norm per head, then RoPE."""
        batch, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, n, self.num_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n, D] -> k, v [B, H_kv, n, d]: k_norm per head then RoPE on k; v unnormed."""
        batch, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """attended [B, H, n, d] -> [B, n, D]."""
        batch, _, n, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(batch, n, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    """Qwen3 pre-norm decoder layer with KV injection. Parameter names follow HF Qwen3 (input_layernorm, self_attn.*,
    post_attention_layernorm, mlp.{gate,up,down}_proj), as z-lab checkpoints store them."""

    def __init__(self, layer_config: Mapping[str, Any]):
        super().__init__()
        hidden, eps = layer_config["hidden_size"], layer_config["rms_norm_eps"]
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = DFlashAttention(layer_config)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, layer_config["intermediate_size"])

    def context_kv(self, context: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of context tokens c [B, T, D] (already fc + hidden_norm): [B, H_kv, T, d] each."""
        return self.self_attn.key_value(context, cos, sin)

    def block_qkv(self, h: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block stream h [B, n, D] -> q [B, H, n, d], k, v [B, H_kv, n, d] (after input_layernorm)."""
        x = self.input_layernorm(h)
        k, v = self.self_attn.key_value(x, cos, sin)
        return self.self_attn.query(x, cos, sin), k, v

    def finish(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual + attention output [B, H, n, d], then the MLP block; returns the new block stream [B, n, D]."""
        h = h + self.self_attn.output(attended)
        return h + self.mlp(self.post_attention_layernorm(h))


def backbone_modules(layer_config: Mapping[str, Any], num_features: int,
                     num_layers: int) -> tuple[nn.Linear, RMSNorm, nn.ModuleList, RMSNorm, RotaryEmbedding]:
    """fc (num_features target features -> D), hidden_norm, the draft layers, the final norm and their RoPE, in the
    order a drafter assigns them (so its parameter names, the ones every layout stores, and its seeded init stay)."""
    hidden, eps = layer_config["hidden_size"], layer_config["rms_norm_eps"]
    return (nn.Linear(num_features * hidden, hidden, bias=False), RMSNorm(hidden, eps),
            nn.ModuleList(DFlashDecoderLayer(layer_config) for _ in range(num_layers)), RMSNorm(hidden, eps),
            RotaryEmbedding(*rope_inverse_frequencies(layer_config)))


@dataclass(frozen=True)
class Blocks:
    """Where a training row's blocks sit (anchors, anchor_valid [B, A], context_valid [B, T], block_size S) and, when
    the whole mask fits one attention chunk, that mask (anchors.block_attention_mask), else None."""

    anchors: torch.Tensor
    anchor_valid: torch.Tensor
    context_valid: torch.Tensor
    block_size: int
    mask: torch.Tensor | None


def _block_chunk(q, k, v, context_k, context_v, anchors, anchor_valid, context_valid, block_size: int):
    """Attention of the blocks at `anchors` (q, k, v [B, H(_kv), c * S, d]) over the context keys before their
    latest anchor and their own block keys, by block_attention_mask: nothing of other blocks or later context."""
    limit = int((anchors * anchor_valid).max()) if anchors.numel() else 0  # a block sees context j < its anchor
    mask = block_attention_mask(anchors, anchor_valid, context_valid[:, :limit], block_size)
    keys = torch.cat([context_k[:, :, :limit], k], dim=2)
    values = torch.cat([context_v[:, :, :limit], v], dim=2)
    return attention(q, keys, values, mask)


def block_attention(q, k, v, context_k, context_v, blocks: Blocks) -> torch.Tensor:
    """Block queries q [B, H, A * S, d] over [context keys [B, H_kv, T, d] ; block keys k] by the training mask.

    One SDPA over the whole mask when it fits one chunk (blocks.mask); else chunks of anchors whose mask has at most
    chunked.ATTENTION_CHUNK_VALUES values, each over the context before its latest anchor only and recomputed in
    the backward pass, so neither the [A * S, T + A * S] mask nor per-chunk copies of the context keys are held.
    """
    if blocks.mask is not None:
        keys, values = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
        return attention(q, keys, values, blocks.mask)
    batch, _, _, _ = q.shape
    size, seq_len = blocks.block_size, context_k.shape[2]
    # c anchors hold a mask of B * cS * (T + cS) values: the largest c within the budget (at least one). SDPA's fused
    # kernel keeps no scores (layers.attention); off the CPU a chunk also holds its T + cS keys and values repeated
    # to every head, which no choice of c shrinks (drafters/step_memory.py counts them)
    slots = (math.sqrt(seq_len**2 + 4 * chunked.ATTENTION_CHUNK_VALUES / batch) - seq_len) / 2
    step = max(1, int(slots) // size)
    parts = []
    for first in range(0, blocks.anchors.shape[1], step):
        last = min(blocks.anchors.shape[1], first + step)
        slots = slice(first * size, last * size)
        parts.append(checkpoint(_block_chunk, q[:, :, slots], k[:, :, slots], v[:, :, slots], context_k, context_v,
                                blocks.anchors[:, first:last], blocks.anchor_valid[:, first:last],
                                blocks.context_valid, size, use_reentrant=False, preserve_rng_state=False))
    return torch.cat(parts, dim=2)


def _block_layer(layer, h, context, block_rope, context_rope, blocks: Blocks) -> torch.Tensor:
    q, k, v = layer.block_qkv(h, *block_rope)
    context_k, context_v = layer.context_kv(context, *context_rope)
    return layer.finish(h, block_attention(q, k, v, context_k, context_v, blocks))


def block_forward(layers, h: torch.Tensor, context: torch.Tensor, block_rope, context_rope, blocks: Blocks,
                  checkpointing: bool = False) -> torch.Tensor:
    """All draft layers over the block stream h [B, n, D], every query seeing [context keys ; block keys] by the
    training mask (block_attention).

    Args:
        layers: DFlashDecoderLayer modules. context: [B, T, D] fused target features.
        block_rope, context_rope: (cos, sin) pairs from RotaryEmbedding for the n block / T context positions.
        blocks: where the blocks sit (Blocks). checkpointing: recompute each layer in the backward pass.
    Returns:
        [B, n, D] pre-norm output.
    """
    for layer in layers:
        h = maybe_checkpoint(checkpointing, _block_layer, layer, h, context, block_rope, context_rope, blocks)
    return h


def anchored_blocks(layers, rotary, context: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor,
                    anchor_valid: torch.Tensor, context_valid: torch.Tensor,
                    checkpointing: bool = False) -> torch.Tensor:
    """Every block of every row through the draft layers in one forward (training; mask: anchors.block_attention_mask).

    Args:
        layers: DFlashDecoderLayer modules; rotary: their RotaryEmbedding. context: [B, T, D] fused target features.
        block_embeds: [B, A, S, D] the block inputs [x_a, MASK x (S-1)]; anchors, anchor_valid: [B, A];
        context_valid: [B, T] bool. checkpointing: recompute each layer's activations in the backward pass.
    Returns:
        [B, A, S, D] pre-norm block states.
    """
    batch_size, num_anchors, block_size, _ = block_embeds.shape
    seq_len = context.shape[1]
    h = block_embeds.flatten(1, 2)  # [B, A*S, D]
    context_positions = torch.arange(seq_len, device=context.device).expand(batch_size, seq_len)
    block_rope = rotary(block_positions(anchors, block_size), h.dtype)
    context_rope = rotary(context_positions, h.dtype)
    slots = num_anchors * block_size
    whole = batch_size * slots * (seq_len + slots) <= chunked.ATTENTION_CHUNK_VALUES  # the mask fits one chunk
    mask = block_attention_mask(anchors, anchor_valid, context_valid, block_size) if whole else None
    blocks = Blocks(anchors, anchor_valid, context_valid, block_size, mask)
    h = block_forward(layers, h, context, block_rope, context_rope, blocks, checkpointing)
    return h.view(batch_size, num_anchors, block_size, -1)


def block_embeddings(anchor_tokens: torch.Tensor, block_size: int, mask_token_id: int,
                     embed_weight: torch.Tensor) -> torch.Tensor:
    """anchor_tokens [...] -> embeddings [..., S, D] of the blocks [x_a, MASK x (S-1)] (the target's embedding)."""
    tokens = anchor_tokens.new_full((*anchor_tokens.shape, block_size), mask_token_id)
    tokens[..., 0] = anchor_tokens
    return F.embedding(tokens, embed_weight)


# ---- inference: per-layer caches of the projected context ----------------------------------------------------------
def new_context_caches(layers, context: DraftContext, weight: torch.Tensor, block_size: int) -> list[KVCache]:
    """One empty KVCache per draft layer for the rows of `context` (the prompt's), on `weight`'s device and dtype,
    with room for the prompt and four blocks (it grows when needed)."""
    batch, seq_len = context.input_ids.shape
    return [KVCache(batch, layer.self_attn.num_kv_heads, layer.self_attn.head_dim, weight.device, weight.dtype,
                    capacity=seq_len + 4 * block_size) for layer in layers]


def absorb_context(layers, caches: list[KVCache], context: torch.Tensor, rope, valid: torch.Tensor) -> None:
    """Append the keys/values of context tokens c [B, n, D] (fused target features at positions whose RoPE is
    `rope`) where valid [B, n] holds, to every layer's cache, and mark the result as committed."""
    for layer, cache in zip(layers, caches):
        k, v = layer.context_kv(context, *rope)
        cache.append(k, v, valid)
        cache.mark()


def cached_block_forward(layers, caches: list[KVCache], h: torch.Tensor, rope) -> torch.Tensor:
    """The block stream h [B, S, D] through every layer: each slot sees its row's committed context (holes stay
    hidden) and the whole block, bidirectionally. The block's own keys/values are dropped again (KVCache.rewind).

    Returns:
        [B, S, D] pre-norm output.
    """
    batch, block_size, _ = h.shape
    slots_valid = torch.ones(batch, block_size, dtype=torch.bool, device=h.device)
    for layer, cache in zip(layers, caches):
        q, k, v = layer.block_qkv(h, *rope)
        block_end = cache.lengths + block_size
        keys, values, _ = cache.append(k, v, slots_valid)
        columns = torch.arange(keys.shape[2], device=h.device)
        mask = cache.valid[:, : keys.shape[2]] & (columns < block_end.unsqueeze(1))
        h = layer.finish(h, attention(q, keys, values, mask[:, None, None, :]))
        cache.rewind()
    return h


def committed_rows(num_accepted: torch.Tensor, context: DraftContext) -> torch.Tensor:
    """[B] bool: the rows a verify forward extended (a finished row has no valid position). Each must mark exactly
    num_accepted + 1 positions valid (the previous anchor and its accepted drafts)."""
    num_valid = context.valid.sum(dim=1)
    active = num_valid > 0
    if bool((active & (num_valid != num_accepted.to(num_valid.device) + 1)).any()):
        raise ValueError("commit: context.valid must mark exactly num_accepted + 1 positions of each active row")
    return active


def advance_anchors(state: dict[str, torch.Tensor], context: DraftContext, active: torch.Tensor | None) -> None:
    """Set state["anchor"] [B] to the token the target emitted last (in no cache yet) and state["position"] [B] to
    its position, for the active rows [B] (None or a first call: all rows)."""
    last_position = context.position_ids.masked_fill(~context.valid, -1).amax(dim=1)
    new = {"anchor": context.next_tokens.to(last_position.device), "position": last_position + 1}
    for name, value in new.items():
        state[name] = value if active is None or name not in state else torch.where(active, value, state[name])
