"""DFlash building blocks, kept free of the drafter so that DSpark (same backbone, other labels and heads) reuses them.

Reference: algorithms_dflash_dspark.md section 1.1-1.3 (DFlash, Chen et al. 2026) and section 5.1. What lives here:
- `DFlashConfig`, the `drafter:` section of a recipe for kind "dflash", and the rules that resolve its defaults
  (`resolve_layer_ids`, `resolve_mask_token_id`, `decay_gamma`, `draft_layer_config`);
- the context projection `fuse_context` (concat of the target features -> fc -> hidden_norm = context c);
- `DFlashDecoderLayer`, a Qwen3-style pre-norm decoder layer whose keys/values also read the context ("KV
  injection": context and block tokens go through the SAME k/v projections, concatenated along the sequence);
- `block_forward`, the training-time backbone over all blocks of a row at once;
- `block_attention_mask` and `sample_anchors`.

Decisions:
- Layer ids use our (vLLM) convention: id k = residual stream entering decoder layer k = HF hidden_states[k]. The
  z-lab rule counts layer OUTPUTS: its id_i = round(1 + i (L-4) / (n-1)) (Python's round, ties to even) over an
  L-layer target, n = 5, reads HF hidden_states[id_i + 1], so our default is that list + 1 (Qwen3-8B, L = 36: z-lab
  [1, 9, 17, 25, 33] = ours [2, 10, 18, 26, 34]). Id N (the final pre-norm output) is refused: z-lab and HF readers
  would read the post-norm state there, so a checkpoint using it would not transfer.
- The mask token is never hard-coded: config.mask_token_id, else the first of TargetInfo.unused_token_ids (rows
  past the tokenizer, then reserved special tokens). An id the tokenizer uses for text is refused unless
  allow_text_mask_token (the draft could then not tell a masked slot from that text token).
- Loss decay gamma (w_k = exp(-(k-1)/gamma) for slot k): None = the published 7 / 5 / 4 for blocks 16 / 10 / 8,
  else block_size / 2 (which also gives 5 and 4 for 10 and 8).
- The context c enters each layer's k/v projections as it is (no per-layer input norm), as in section 5.1; only the
  block tokens pass through input_layernorm. V is not normed; K gets the per-head k_norm, then RoPE.

Shapes: B batch, T sequence, D hidden, A anchors per row, S block size (slot 0 = anchor token), H / H_kv heads, d head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from drafters.base import TargetInfo
from drafters.layers import RMSNorm, SwiGLU, apply_rope, attention, rope_parameters

PUBLISHED_DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # paper A.1, Eq. 4
NUM_DEFAULT_LAYER_IDS = 5


@dataclass(kw_only=True)
class DFlashConfig:
    """The `drafter:` section of a recipe for kind "dflash". None = derive (see the module docstring).

    layer_ids: target features by our layer ids, () = the z-lab default converted. num_layers: draft layers.
    block_size: S tokens per block (the anchor + S-1 masked slots); a proposal is at most S-1 tokens.
    num_anchors: blocks per training sequence, redrawn every epoch. loss_decay_gamma: depth decay of the loss.
    mask_token_id / allow_text_mask_token: the mask row of the target vocabulary.
    draft_vocab_size: None = the target's full vocabulary through its frozen lm_head; else a trained head over the
      most frequent V_d tokens (d2t / t2d, as EAGLE-3).
    intermediate_size ... rope_theta: the draft layers' shapes, None = mirror the target.
    """

    layer_ids: tuple[int, ...] = ()
    num_layers: int = 5
    block_size: int = 16
    num_anchors: int = 512
    loss_decay_gamma: float | None = None
    mask_token_id: int | None = None
    allow_text_mask_token: bool = False
    draft_vocab_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float | None = None


def default_layer_ids(num_target_layers: int, count: int = NUM_DEFAULT_LAYER_IDS) -> tuple[int, ...]:
    """The z-lab rule (layer outputs from layer 1 to L-3, uniformly) converted to our ids (+1)."""
    n = num_target_layers
    return tuple(round(1 + i * (n - 4) / (count - 1)) + 1 for i in range(count))


def resolve_layer_ids(config: DFlashConfig, num_target_layers: int) -> tuple[int, ...]:
    """The configured ids or the default; every id must lie in [0, N-1]."""
    n = num_target_layers
    if config.layer_ids:
        layer_ids = tuple(int(i) for i in config.layer_ids)
    else:
        layer_ids = default_layer_ids(n)
        if len(set(layer_ids)) < len(layer_ids) or not all(0 <= i < n for i in layer_ids):
            raise ValueError(f"drafter.layer_ids: a {n}-layer target is too small for {NUM_DEFAULT_LAYER_IDS} "
                             f"distinct default ids (got {list(layer_ids)}); set drafter.layer_ids explicitly, "
                             f"ids in [0, {n - 1}]")
    bad = [i for i in layer_ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"drafter.layer_ids {list(layer_ids)}: ids {bad} are outside [0, {n - 1}] (id k = the input "
                         f"of decoder layer k; id {n}, the final pre-norm output, is not allowed)")
    return layer_ids


def resolve_mask_token_id(config: DFlashConfig, target_info: TargetInfo) -> int:
    """config.mask_token_id (checked against the tokenizer's unused rows) or the first unused row."""
    unused = target_info.unused_token_ids
    vocab = target_info.vocab_size
    token = config.mask_token_id
    if token is None:
        if not unused:
            raise ValueError("drafter.mask_token_id: the target has no known unused vocabulary row (no tokenizer, or "
                             "every row is used); set drafter.mask_token_id to a reserved token id")
        return int(unused[0])
    if not 0 <= token < vocab:
        raise ValueError(f"drafter.mask_token_id {token} is outside the target vocabulary [0, {vocab})")
    if unused is not None and token not in unused and not config.allow_text_mask_token:
        allowed = list(unused[:16]) + (["..."] if len(unused) > 16 else [])
        raise ValueError(f"drafter.mask_token_id {token} is a token the tokenizer uses for text; choose an unused id "
                         f"({allowed}) or set drafter.allow_text_mask_token: true")
    return int(token)


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
    if config.draft_vocab_size is not None and not 0 < config.draft_vocab_size <= vocab_size:
        raise ValueError(f"drafter.draft_vocab_size {config.draft_vocab_size} must be in [1, {vocab_size}] or null")


def draft_layer_config(config: DFlashConfig, target_info: TargetInfo) -> dict[str, Any]:
    """The draft layers as an HF Qwen3 config dict (q/k norms, no biases), shapes mirrored from the target."""
    target = target_info.config
    if "hidden_size" not in target and isinstance(target.get("text_config"), Mapping):
        target = target["text_config"]
    hidden = target_info.hidden_size
    heads = config.num_attention_heads or target.get("num_attention_heads")
    head_dim = config.head_dim or target.get("head_dim")
    if not heads or (hidden % heads and not head_dim):
        raise ValueError(f"drafter.num_attention_heads: cannot derive a head count from {heads!r} (hidden {hidden})")
    kv_heads = config.num_key_value_heads or target.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"drafter.num_key_value_heads {kv_heads} must divide num_attention_heads {heads}")
    intermediate = config.intermediate_size or target.get("intermediate_size")
    if not intermediate:
        raise ValueError("drafter.intermediate_size: the target config has none; set it")
    rope = rope_parameters(target)
    if config.rope_theta is not None:
        rope["rope_theta"] = float(config.rope_theta)
    legacy_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope["rope_type"] != "default" else None
    return {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": int(intermediate),
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim or hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": int(target.get("max_position_embeddings", 4096)),
        "rms_norm_eps": float(target_info.rms_norm_eps),
        "vocab_size": target_info.vocab_size,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": legacy_scaling,
        "rope_parameters": rope,
        "attention_bias": False,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * config.num_layers,
        "tie_word_embeddings": False,
    }


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


def block_forward(layers, h: torch.Tensor, context: torch.Tensor, block_rope, context_rope,
                  mask: torch.Tensor) -> torch.Tensor:
    """All draft layers over the block stream h [B, n, D], every query seeing [context keys ; block keys] by `mask`.

    Args:
        layers: DFlashDecoderLayer modules. context: [B, T, D] fused target features.
        block_rope, context_rope: (cos, sin) pairs from RotaryEmbedding for the n block / T context positions.
        mask: [B, 1, n, T + n] bool (block_attention_mask).
    Returns:
        [B, n, D] pre-norm output.
    """
    for layer in layers:
        q, k, v = layer.block_qkv(h, *block_rope)
        context_k, context_v = layer.context_kv(context, *context_rope)
        keys, values = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
        h = layer.finish(h, attention(q, keys, values, mask))
    return h


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """anchors [B, A] -> positions [B, A * S] of every block slot (slot j of the block at a sits at a + j)."""
    slots = torch.arange(block_size, device=anchors.device)
    return (anchors.unsqueeze(-1) + slots).flatten(1)


def block_attention_mask(anchors: torch.Tensor, anchor_valid: torch.Tensor, context_valid: torch.Tensor,
                         block_size: int) -> torch.Tensor:
    """The training mask over keys [T context ; A * S block slots] (section 1.2, step 4).

    A query of a kept block at anchor a sees context keys j < a (strictly: the anchor's own target feature does not
    exist yet at inference) where context_valid holds, and every slot of its own block (bidirectional); nothing of
    other blocks. A padding block (anchor_valid False) sees its own block only, so no row is empty.

    Args:
        anchors: [B, A] positions; anchor_valid: [B, A] bool; context_valid: [B, T] bool (attention mask).
    Returns:
        [B, 1, A * S, T + A * S] bool, True = may attend.
    """
    batch, num_anchors = anchors.shape
    seq_len = context_valid.shape[1]
    device = anchors.device
    columns = torch.arange(seq_len, device=device)
    context = (columns < anchors.unsqueeze(-1)) & context_valid.unsqueeze(1) & anchor_valid.unsqueeze(-1)  # [B, A, T]
    context = context.repeat_interleave(block_size, dim=1)  # [B, A*S, T]
    block_of = torch.arange(num_anchors, device=device).repeat_interleave(block_size)  # [A*S]
    own = (block_of.unsqueeze(1) == block_of.unsqueeze(0)).expand(batch, -1, -1)  # [B, A*S, A*S]
    return torch.cat([context, own], dim=-1).unsqueeze(1)


def anchor_candidates(attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions a where attention_mask and loss_mask hold at a and at a + 1 (section 1.2, step 2)."""
    usable = attention_mask.bool() & loss_mask.bool()
    candidates = torch.zeros_like(usable)
    candidates[:, :-1] = usable[:, :-1] & usable[:, 1:]
    return candidates


def anchor_seed(seed: int, epoch: int, sample_index: int) -> int:
    """The generator seed of one sequence's anchors in one epoch (a pure function: resume and any process split
    draw the same anchors)."""
    return ((int(seed) * 1_000_003 + int(epoch)) * 1_000_033 + int(sample_index)) % (2**63 - 1)


def sample_anchors(attention_mask: torch.Tensor, loss_mask: torch.Tensor, num_anchors: int, *, seed: int = 0,
                   epoch: int = 0, sample_index=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to num_anchors anchors per row, uniform without replacement among `anchor_candidates`, sorted.

    Row b draws from a CPU generator seeded by anchor_seed(seed, epoch, sample_index[b]) (sample_index defaults to the
    row number). A row with fewer candidates takes all of them; rows are padded to a common A (at least 1) with
    anchor 0 marked invalid.

    Returns:
        anchors [B, A] long and anchor_valid [B, A] bool, on the device of the masks.
    """
    candidates = anchor_candidates(attention_mask, loss_mask).cpu()
    batch = candidates.shape[0]
    indices = range(batch) if sample_index is None else [int(i) for i in sample_index]
    chosen = []
    for row, index in zip(range(batch), indices):
        positions = candidates[row].nonzero().flatten()
        generator = torch.Generator().manual_seed(anchor_seed(seed, epoch, index))
        pick = torch.randperm(positions.numel(), generator=generator)[:num_anchors]
        chosen.append(positions[pick].sort().values)
    width = max(1, max(c.numel() for c in chosen))
    anchors = torch.zeros(batch, width, dtype=torch.long)
    valid = torch.zeros(batch, width, dtype=torch.bool)
    for row, positions in enumerate(chosen):
        anchors[row, : positions.numel()] = positions
        valid[row, : positions.numel()] = True
    return anchors.to(attention_mask.device), valid.to(attention_mask.device)
