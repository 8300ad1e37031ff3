"""EAGLE-3 building blocks: the rules of its recipe config (drafters/eagle3/config.py), the draft layer's HF-style
config, the decoder layer, and the warm starts of the fc and the first layer from the target (fc_init,
init_layer_from_target).

The drafter itself (training-time test, proposer, persistence) is drafters/eagle3/model.py; the export formats read and
write the config here (drafters/eagle3/export.py). Shapes: B batch, T sequence, D hidden.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from drafters.base import TargetInfo
from drafters.eagle3.config import Eagle3Config
from drafters.layer_ids import auto_layer_ids, check_hybrid_ids, is_auto
from drafters.layers import RMSNorm, SwiGLU, apply_rope, hf_layer_config


def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default taps (2, N//2, N-3) as listed (unsorted, with repeats on targets of fewer than 8 layers)."""
    n = num_target_layers
    return (2, n // 2, n - 3)


def resolve_layer_ids(config: Eagle3Config, target_info: TargetInfo) -> tuple[int, ...]:
    """The target layer ids the drafter reads, sorted and unique, every id in [0, N] (vLLM convention).

    vLLM captures each aux layer once, in increasing id order, and concatenates the features in that order
    (`sorted(set(ids))`), so the drafter orders its fc input the same way: a configured list is sorted, and a
    configured id listed twice is an error (it would give the fc a block vLLM never fills). The default
    (2, N//2, N-3) repeats ids on targets of fewer than 8 layers; it is de-duplicated, as vLLM does. On a hybrid
    target the ids must read full-attention layers (drafters/layer_ids.py).
    """
    n, auto = target_info.num_layers, is_auto(config.layer_ids)
    layer_ids = default_layer_ids(n) if auto else tuple(int(i) for i in config.layer_ids)
    bad = [i for i in layer_ids if not 0 <= i <= n]
    if bad:
        source = f" (the default (2, N//2, N-3) for N={n}; set it explicitly)" if auto else ""
        raise ValueError(f"drafter.layer_ids {list(layer_ids)}{source}: ids {bad} are outside [0, {n}]")
    repeated = sorted({i for i in layer_ids if layer_ids.count(i) > 1})
    if repeated and not auto:
        raise ValueError(f"drafter.layer_ids {list(layer_ids)}: ids {repeated} are listed more than once; vLLM captures"
                         " each layer once (sorted, unique), so list each id once")
    if auto:
        return auto_layer_ids(tuple(sorted(set(layer_ids))), target_info.config, n, "drafter.layer_ids")
    check_hybrid_ids(layer_ids, target_info.config, n, "drafter.layer_ids", config.allow_linear_attention_ids)
    return tuple(sorted(set(layer_ids)))


def fold_fc_columns(weight: torch.Tensor, listed_ids, hidden_size: int) -> tuple[tuple[int, ...], torch.Tensor]:
    """Rewrite an fc weight [D, n*H] whose input blocks follow `listed_ids` (any order, repeats allowed) into the
    sorted unique order: a repeated id's blocks are summed (they read the same feature, so the output is
    unchanged). Returns (sorted unique ids, weight [D, m*H])."""
    listed = [int(i) for i in listed_ids]
    if weight.shape[1] != len(listed) * hidden_size:
        raise ValueError(f"fc.weight has {weight.shape[1]} input features, {len(listed)} layer ids x hidden"
                         f" {hidden_size} = {len(listed) * hidden_size} expected (eagle_aux_hidden_state_layer_ids)")
    ids = tuple(sorted(set(listed)))
    folded = weight.new_zeros(weight.shape[0], len(ids) * hidden_size)
    for block, layer_id in enumerate(listed):
        target = ids.index(layer_id)
        source = weight[:, block * hidden_size : (block + 1) * hidden_size]
        folded[:, target * hidden_size : (target + 1) * hidden_size] += source
    return ids, folded


_QKV_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


@torch.no_grad()
def init_fc_identity_high(weight: torch.Tensor, layer_ids: tuple[int, ...], hidden_size: int) -> None:
    """fc_init: identity_high: fc [D, n*D] starts as the identity on the highest tap's block, zero elsewhere."""
    block = layer_ids.index(max(layer_ids))
    weight.zero_()
    weight[:, block * hidden_size : (block + 1) * hidden_size] = torch.eye(hidden_size)


@torch.no_grad()
def copy_target_layer(layer: nn.Module, target_weights: Mapping[str, torch.Tensor], index: int,
                      hidden_size: int) -> None:
    """init_layer_from_target: copy target decoder layer `index` into draft `layer` (see Eagle3Config for the 2D
    inputs)."""
    prefix = f"model.layers.{index}."
    copies = {f"self_attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")}
    copies |= {f"mlp.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    copies |= {"post_attention_layernorm.weight": "post_attention_layernorm.weight"}
    copies |= {"hidden_norm.weight": "input_layernorm.weight"}
    params = dict(layer.named_parameters())
    for ours, theirs in copies.items():
        source = target_weights.get(prefix + theirs)
        if source is None:
            raise ValueError(f"drafter.init_layer_from_target: target weight {prefix + theirs} not found")
        # q/k/v read [embedding ; hidden]: the target weights go on the hidden half (columns D..2D).
        target = params[ours][:, hidden_size:] if ours in _QKV_WEIGHTS else params[ours]
        if target.shape != source.shape:
            raise ValueError(f"drafter.init_layer_from_target: {prefix + theirs} has shape {tuple(source.shape)},"
                             f" the draft layer expects {tuple(target.shape)} (head/intermediate overrides?)")
        target.copy_(source)


def draft_layer_config(config: Eagle3Config, target_info: TargetInfo) -> dict[str, Any]:
    """The draft decoder layer as an HF Llama config dict (also written as speculators transformer_layer_config;
    drafters/layers.hf_layer_config)."""
    return hf_layer_config(config, target_info, "llama", {"mlp_bias": False})


class Eagle3Attention(nn.Module):
    """q/k/v/o projections (no bias); q/k/v read `in_features` (2D for the first draft layer, D after)."""

    def __init__(self, in_features: int, layer_config: Mapping[str, Any]):
        super().__init__()
        self.num_heads = layer_config["num_attention_heads"]
        self.num_kv_heads = layer_config["num_key_value_heads"]
        self.head_dim = layer_config["head_dim"]
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, layer_config["hidden_size"], bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, n, in] -> q [B, H, n, d], k and v [B, H_kv, n, d], RoPE applied to q and k."""
        batch, n, _ = x.shape
        q = self.q_proj(x).view(batch, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """attended [B, H, n, d] -> [B, n, D]."""
        batch, _, n, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(batch, n, self.num_heads * self.head_dim))


class Eagle3DecoderLayer(nn.Module):
    """A Llama decoder layer; the first one reads [input_layernorm(embedding) ; hidden_norm(hidden)] (2D)."""

    def __init__(self, layer_config: Mapping[str, Any], first: bool, norm_before_residual: bool):
        super().__init__()
        hidden, eps = layer_config["hidden_size"], layer_config["rms_norm_eps"]
        self.first = first
        self.norm_before_residual = norm_before_residual
        self.self_attn = Eagle3Attention(2 * hidden if first else hidden, layer_config)
        self.mlp = SwiGLU(hidden, layer_config["intermediate_size"])
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        if first:
            self.hidden_norm = RMSNorm(hidden, eps)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (attention input [B, n, 2D or D], residual [B, n, D]). Concat order is [embedding ; hidden]."""
        if not self.first:
            return self.input_layernorm(hidden), hidden
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [B, H, n, d] + residual, then the MLP block; returns the pre-norm output [B, n, D]."""
        x = residual + self.self_attn.output(attended)
        return x + self.mlp(self.post_attention_layernorm(x))
