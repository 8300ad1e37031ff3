"""KV-sharing assistant building blocks (config: config.py): the target's attention shape, and the query-only layer.

Reference: algorithms_eagle3_mtp.md section B.6 (Gemma 4 "assistant" drafters). An assistant layer has no K/V
projections: its queries attend over the K/V the TARGET cached for one of its own layers (already normed and rotated
at their positions by the target), so the query heads, KV heads and head dim are the target's, and the queries are
rotated with the target's RoPE at the assistant's own (constant) query position. The rest is a pre-norm Llama layer
of the assistant's own width: input_layernorm, attention, residual, post_attention_layernorm, SwiGLU MLP, residual.
Parameter names follow HF Llama/Qwen (self_attn.q_proj, self_attn.o_proj, self_attn.q_norm, mlp.gate_proj ...).

Shapes: B batch, n query positions, C key columns (cached target tokens), H query heads, H_kv KV heads, d head dim,
W assistant width, D target hidden, V vocab.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from drafters.assistant.config import AssistantConfig
from drafters.base import TargetInfo
from drafters.layer_ids import ATTENTION
from drafters.layers import RMSNorm, SwiGLU, apply_rope, attention, per_layer_overrides


@dataclass(frozen=True)
class AttentionShape:
    """The target's attention geometry, which the assistant's queries must share."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool  # the target norms its queries per head (Qwen3, Gemma): the assistant's queries get their own


def text_config(target_info: TargetInfo) -> Mapping[str, Any]:
    """The target's (text) HF config dict."""
    return target_info.text_config


def with_family_layers(config: AssistantConfig, target_info: TargetInfo) -> AssistantConfig:
    """A fresh assistant for a Gemma 4 target gets Gemma 4's own layers (as Google's assistants have): a
    gemma4_config derived from the target's text config at the assistant's width, its layers sliding-window but the
    last (full attention), every layer reusing target K/V, dense MLP. Other targets and imports are left as they are."""
    target = text_config(target_info)
    if config.gemma4_config is not None or not str(target.get("model_type") or "").startswith("gemma4"):
        return config
    width = int(config.hidden_size or target_info.hidden_size)
    intermediate = int(config.intermediate_size or target.get("intermediate_size") or 4 * width)
    types = ["sliding_attention"] * (config.num_layers - 1) + ["full_attention"]
    derived = {key: value for key, value in target.items() if key not in ("per_layer_config", "architectures")}
    derived.update(model_type="gemma4_text", hidden_size=width, intermediate_size=intermediate,
                   num_hidden_layers=config.num_layers, num_kv_shared_layers=config.num_layers, layer_types=types,
                   per_layer_config=per_layer_overrides(target, types) or None, hidden_size_per_layer_input=0,
                   vocab_size_per_layer_input=0, enable_moe_block=False)
    return dataclasses.replace(config, hidden_size=width, intermediate_size=intermediate, gemma4_config=derived)


def target_layer_weight(target_info: TargetInfo, layer: int, suffix: str) -> torch.Tensor | None:
    """The target tensor named `...layers.{layer}.{suffix}` (any prefix), or None."""
    ending = f"layers.{layer}.{suffix}"
    for name, tensor in target_info.weights.items():
        if name.endswith(ending) and (name == ending or name[: -len(ending)].endswith(".")):
            return tensor
    return None


def layer_types(config: AssistantConfig) -> tuple[str, ...]:
    """The attention type of each assistant layer: Gemma 4's from its config, else all full attention."""
    if config.gemma4_config is not None:
        return tuple(config.gemma4_config["layer_types"])
    return ("full_attention",) * config.num_layers


def resolve_kv_layers(config: AssistantConfig, target_info: TargetInfo) -> tuple[int, ...]:
    """One target layer per assistant layer; ValueError naming drafter.kv_layers / drafter.num_layers.

    Default: each assistant layer reads the last target layer of its attention type that computes its own K/V
    (before a Gemma target's KV-shared tail), as Gemma 4 wires its assistants; a Llama/Qwen target: its last layer.
    """
    if config.num_layers < 1:
        raise ValueError(f"drafter.num_layers must be >= 1, got {config.num_layers}")
    types = layer_types(config)
    if len(types) != config.num_layers:
        raise ValueError(f"drafter.gemma4_config has {len(types)} layer_types for drafter.num_layers "
                         f"{config.num_layers}")
    if not config.kv_layers:
        target = text_config(target_info)
        target_types = list(target.get("layer_types") or ["full_attention"] * target_info.num_layers)
        computing = target_info.num_layers - int(target.get("num_kv_shared_layers") or 0)
        chosen = []
        for kind in types:
            matches = [i for i in range(computing)  # Falcon-H1's `hybrid` layers: attention beside Mamba-2
                       if target_types[i] == kind or (kind == "full_attention" and target_types[i] in ATTENTION)]
            if not matches:
                raise ValueError(f"drafter.kv_layers: the target has no {kind} layer with its own K/V; map the "
                                 "assistant layers explicitly")
            chosen.append(matches[-1])
        return tuple(chosen)
    layers = tuple(int(i) for i in config.kv_layers)
    if len(layers) != config.num_layers:
        raise ValueError(f"drafter.kv_layers has {len(layers)} entries for drafter.num_layers {config.num_layers}; "
                         "give the target layer each assistant layer reads")
    bad = [i for i in layers if not 0 <= i < target_info.num_layers]
    if bad:
        raise ValueError(f"drafter.kv_layers {bad} do not exist: the target has layers 0..{target_info.num_layers - 1}")
    return layers


def check_kv_shapes(target_info: TargetInfo, kv_layers: tuple[int, ...], shapes: list[tuple[int, int]]) -> None:
    """ValueError naming drafter.kv_layers when a mapped target layer caches K/V of another shape than the
    assistant layer's queries expect. shapes: per assistant layer (KV heads, head dim)."""
    for layer, (kv_heads, head_dim) in zip(kv_layers, shapes):
        keys = target_layer_weight(target_info, layer, "self_attn.k_proj.weight")  # [H_kv * d, D]
        if keys is not None and keys.shape[0] != kv_heads * head_dim:
            raise ValueError(f"drafter.kv_layers: target layer {layer} caches keys of width {keys.shape[0]}, not "
                             f"{kv_heads} heads x head dim {head_dim} as the assistant's queries; map it to a layer "
                             "with the target's head dim")


def attention_shape(target_info: TargetInfo) -> AttentionShape:
    """The target's head counts and head dim (its config), which Llama-style assistant layers mirror."""
    config = text_config(target_info)
    if config.get("kv_lora_rank"):  # MLA caches keys as [no-RoPE part ; decoupled RoPE part] of their own widths
        raise ValueError(f"drafter: the assistant's plain multi-head queries cannot read the MLA cache of a "
                         f"{config.get('model_type')} target (compressed K/V, decoupled RoPE keys); train another "
                         "drafter kind (eagle3, dflash, dspark, medusa; mtp where the family's layers allow)")
    heads = int(config.get("num_attention_heads") or 0)
    if heads < 1:
        raise ValueError("drafter: the target config has no num_attention_heads; the assistant mirrors its heads")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or target_info.hidden_size // heads)
    qk_norm = any(name.endswith("self_attn.q_norm.weight") for name in target_info.weights)
    return AttentionShape(heads, kv_heads, head_dim, qk_norm)


def embedding_scale(config: AssistantConfig, target_info: TargetInfo) -> float:
    """See AssistantConfig.embed_scale."""
    if config.embed_scale is not None:
        return float(config.embed_scale)
    model_type = str(text_config(target_info).get("model_type") or "")
    return float(target_info.hidden_size) ** 0.5 if model_type.startswith("gemma") else 1.0


class QueryOnlyAttention(nn.Module):
    """Queries of the assistant's width over the target's cached K/V: q_proj (W -> H*d), optional per-head q_norm,
    RoPE at the query position, attention, o_proj (H*d -> W). No K/V projections and nothing written anywhere."""

    def __init__(self, width: int, shape: AttentionShape, eps: float):
        super().__init__()
        self.shape = shape
        self.q_proj = nn.Linear(width, shape.num_heads * shape.head_dim, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * shape.head_dim, width, bias=False)
        self.q_norm = RMSNorm(shape.head_dim, eps) if shape.qk_norm else None

    def forward(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, n, W]; keys, values [B, H_kv, C, d] (read only); mask [B, 1, n, C] bool; cos, sin [B, 1, n, d]
        -> [B, n, W]."""
        batch, n, _ = x.shape
        q = self.q_proj(x).view(batch, n, self.shape.num_heads, self.shape.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, n, d]
        out = attention(q, keys.to(q.dtype), values.to(q.dtype), mask)  # .to makes a copy when dtypes differ
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, -1))


class AssistantLayer(nn.Module):
    """One pre-norm decoder layer whose attention is query-only over one target layer's K/V (full attention)."""

    layer_type = "full_attention"
    window = None  # no sliding window

    def __init__(self, width: int, intermediate: int, shape: AttentionShape, eps: float):
        super().__init__()
        self.kv_shape = (shape.num_kv_heads, shape.head_dim)
        self.input_layernorm = RMSNorm(width, eps)
        self.self_attn = QueryOnlyAttention(width, shape, eps)
        self.post_attention_layernorm = RMSNorm(width, eps)
        self.mlp = SwiGLU(width, intermediate)

    def forward(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, n, W] -> [B, n, W]; see QueryOnlyAttention for the others."""
        x = x + self.self_attn(self.input_layernorm(x), keys, values, mask, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def gemma4_text_config(values: Mapping[str, Any]):
    """transformers' Gemma4TextConfig of an assistant (every layer reuses K/V), attention through SDPA."""
    from transformers import Gemma4TextConfig

    values = dict(values)
    values.pop("model_type", None)
    config = Gemma4TextConfig(**values)
    config._attn_implementation = "sdpa"
    if config.num_kv_shared_layers != config.num_hidden_layers:
        raise ValueError("drafter.gemma4_config: an assistant's layers must all share K/V (num_kv_shared_layers = "
                         f"num_hidden_layers = {config.num_hidden_layers}, got {config.num_kv_shared_layers})")
    return config


class Gemma4Layer(nn.Module):
    """Gemma 4's own decoder layer (transformers' Gemma4TextDecoderLayer, KV "reuse" mode: no K/V projections),
    composed rather than copied, so an imported assistant computes what its checkpoint's model computes. Its queries
    read the target's K/V through `shared_kv_states`, which a reuse layer only reads."""

    def __init__(self, config, index: int):
        super().__init__()
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer

        self.block = Gemma4TextDecoderLayer(config, index)
        self.layer_type = config.layer_types[index]
        self.window = config.sliding_window if self.layer_type == "sliding_attention" else None
        per_layer = config.per_layer_config[index]
        self.kv_shape = (int(per_layer.num_key_value_heads), int(per_layer.head_dim))

    def forward(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, n, W]; keys, values [B, H_kv, C, d] (read only); mask [B, 1, n, C] bool; cos, sin [B, n, d]."""
        shared = {self.layer_type: (keys.to(x.dtype), values.to(x.dtype))}
        return self.block(x, shared_kv_states=shared, position_embeddings=(cos, sin), attention_mask=mask)
