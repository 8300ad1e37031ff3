"""Building blocks shared by drafters: the target's frozen tensors on the drafter's device (in the target's dtype), the
draft layers' HF config, RMSNorm, rotary embeddings, SwiGLU MLP, the argmax-or-sample draft choice, attention over an
explicit mask (on a fused kernel on every device), attention with per-query extra keys (EAGLE-3 training-time test),
and a per-row KV cache with holes.

Shapes: B batch, H query heads, H_kv key/value heads, n query positions, C cache columns, d head dim, D hidden.
Boolean masks use True = may attend, as `torch.nn.functional.scaled_dot_product_attention` does.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import TargetInfo


class FrozenTargetTensors:
    """The target's frozen tensors (TargetInfo.embed_weight, lm_head_weight, ...) as a drafter computes with them.

    They stay in the target's dtype (`on_device`), so an fp32 drafter of a bf16 target holds no fp32 copy of them on
    every rank (about 4 GiB for an 8B target). Embedding rows convert after the lookup (exact: the same as looking
    them up in a converted copy). A product with the head uses the target's tensor where the dtypes agree or autocast
    casts anyway (its cast of an fp32 copy would give that tensor back), and a copy in x's dtype only where neither
    holds (an fp32 drafter without autocast, which then computes in fp32). A copy is made once per (name, device,
    dtype) and is no parameter or buffer: not trained, not saved (native checkpoints stay small), not moved by `.to()`.
    """

    HEADS = ("lm_head_weight",)  # the tensors drafters multiply by (`linear`), which a server may run its own way

    def __init__(self, target_info: TargetInfo):
        self.target_info = target_info
        self._copies: dict[tuple, torch.Tensor] = {}  # only tensors that are not the target's own storage
        self._served: dict[str, nn.Module] = {}

    def reset(self, target_info: TargetInfo) -> None:
        """Hold `target_info` from now on, with no copy and nothing served (Drafter.adopt_target_info)."""
        self.target_info = target_info
        self._copies.clear()
        self._served.clear()

    def copies(self) -> list[torch.Tensor]:
        """The copies made so far in another device or dtype than the target's (what memory counts as the drafter's
        own weights; the target's tensors themselves are not here)."""
        return list(self._copies.values())

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """TargetInfo field `name` (e.g. "embed_weight", [V, D]) on like's device and in like's dtype."""
        return self._on(name, like.device, like.dtype)

    def on_device(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """TargetInfo field `name` on like's device in the target's own dtype (the target's tensor itself there)."""
        return self._on(name, like.device, getattr(self.target_info, name).dtype)

    def _on(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        tensor = getattr(self.target_info, name).detach()
        if (tensor.device, tensor.dtype) == (device, dtype):
            return tensor
        key = (name, device, dtype)
        if key not in self._copies:
            self._copies[key] = tensor.to(device, dtype)
        return self._copies[key]

    def embedding(self, name: str, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [...] of frozen tensor `name` [V, D] -> [..., D] in like's dtype (looked up in the target's)."""
        return F.embedding(ids, self.on_device(name, like)).to(like.dtype)

    def linear(self, name: str, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """x [..., D] times frozen tensor `name` [V, D] transposed -> [..., V]: by the module served for it (`serve`)
        where no gradient flows through x and it holds x's device and dtype, else F.linear on the target's tensor (a
        copy in x's dtype where the dtypes differ and autocast is off)."""
        served = self._served.get(name)
        if (served is not None and not (torch.is_grad_enabled() and x.requires_grad)
                and (served.weight.device, served.weight.dtype) == (x.device, x.dtype)):
            return served(x)
        weight = self.on_device(name, like)
        if weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            weight = self._on(name, like.device, x.dtype)
        return F.linear(x, weight)

    def serve(self, name: str, module: nn.Module | None) -> None:
        """Compute `linear(name, ...)` by `module` (x -> x W^T over this very tensor, e.g. the fast path's FastLinear
        of the target's own head) at inference; None puts F.linear back."""
        if module is None:
            self._served.pop(name, None)
        else:
            self._served[name] = module


def hf_layer_config(config: Any, target_info: TargetInfo, model_type: str,
                    extra: Mapping[str, Any]) -> dict[str, Any]:
    """The draft decoder layers as an HF config dict of `model_type` (exports write it as their layer config), shapes
    mirrored from the target's (text) config unless the drafter's config sets them.

    Args:
        config: a drafter config with num_layers and the overrides intermediate_size, num_attention_heads,
            num_key_value_heads, head_dim, rope_theta (None = the target's).
        extra: the model type's own fields, written after attention_bias (e.g. Llama's mlp_bias).
    """
    target = target_info.text_config
    hidden = target_info.hidden_size
    heads = config.num_attention_heads or target.get("num_attention_heads")
    head_dim = config.head_dim or target.get("head_dim")
    if not heads or (hidden % heads and not head_dim):
        raise ValueError(f"drafter.num_attention_heads: cannot derive a head count from {heads!r} (hidden {hidden})")
    kv_heads = config.num_key_value_heads or target.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"drafter.num_key_value_heads {kv_heads} must divide num_attention_heads {heads}")
    intermediate = config.intermediate_size or target.get("intermediate_size")
    if not intermediate and target.get("moe_intermediate_size") and target.get("num_experts_per_tok"):
        # An MoE target with no dense width (Qwen3.5-MoE): the FFN width a token passes through, routed + shared.
        intermediate = (int(target["moe_intermediate_size"]) * int(target["num_experts_per_tok"])
                        + int(target.get("shared_expert_intermediate_size") or 0))
    if not intermediate:
        raise ValueError("drafter.intermediate_size: the target config has none; set it")
    rope = rope_parameters(target)
    if config.rope_theta is not None:
        rope["rope_theta"] = float(config.rope_theta)
    legacy_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope["rope_type"] != "default" else None
    return {
        "model_type": model_type,
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
        **extra,
        "tie_word_embeddings": False,
    }


def per_layer_overrides(config: Mapping[str, Any], new_types: list[str], first: int = 0) -> dict[str, Any]:
    """Per-layer config overrides (transformers' `per_layer_config`, e.g. Gemma 4's full-attention head dim) for
    layers `first`, `first + 1`, ... of types `new_types`: each copies the override of the target's last layer of
    its type, so a drafter layer of a type has that type's shape in the target."""
    overrides = config.get("per_layer_config") or {}
    types = list(config.get("layer_types") or [])
    by_type = {kind: overrides[str(j)] for j, kind in enumerate(types) if str(j) in overrides}
    return {str(first + i): dict(by_type[kind]) for i, kind in enumerate(new_types) if kind in by_type}


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight (Llama convention: scale by `weight`, not `1 + weight`); computed in >= fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(nn.Module):
    """Llama MLP: down(silu(gate(x)) * up(x)); parameter names match HF/vLLM (gate_proj, up_proj, down_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_by_layer_type(params: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The entries of a `rope_parameters` dict nested by layer type (Gemma 3 / 4), {} for a plain one."""
    return {key: value for key, value in params.items() if isinstance(value, Mapping)}


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of an HF config dict in transformers-5 form: {"rope_type", "rope_theta", ...scaling}.

    Reads `rope_parameters` (transformers 5) or the older `rope_theta` + `rope_scaling` pair. A config whose
    parameters are nested by layer type (Gemma 3 / 4: {"sliding_attention": {...}, "full_attention": {...}}) gives
    its sliding layers' plain RoPE (theta 10,000 on Gemma 4, which the drafters computed before nesting was read):
    written nested into a drafter's config, vLLM's Llama drafter layer cannot build its rotary from it.
    """
    params = dict(config.get("rope_parameters") or {})
    nested = rope_by_layer_type(params)
    if nested:
        params = dict(nested.get("sliding_attention") or next(iter(nested.values())))
    if not params:
        params = dict(config.get("rope_scaling") or {})
        params["rope_theta"] = float(config.get("rope_theta", 10000.0))
    params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
    params.setdefault("rope_theta", float(config.get("rope_theta", 10000.0)))
    return params


def rope_inverse_frequencies(layer_config: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """inv_freq [d/2] and the cos/sin scale for a Llama-style layer config dict (hidden_size, num_attention_heads,
    head_dim, rope_parameters, max_position_embeddings). Scaled variants (linear, llama3, yarn...) are computed by
    transformers' own rope functions so that training matches what a serving engine builds from the same config."""
    params = rope_parameters(layer_config)
    head_dim = int(layer_config["head_dim"])
    if params["rope_type"] == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    hf_config = LlamaConfig(**{**dict(layer_config), "rope_parameters": params})
    inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, None)
    return inv_freq.float(), float(scale)


class RotaryEmbedding:
    """cos/sin tables for arbitrary position ids (rotate-half / NeoX layout, as HF Llama and vLLM use).

    Not a module: inv_freq stays a float64 master copy (a bf16 cast of the drafter must not degrade the angles);
    angles are computed in float32, or float64 for a float64 model, on the device of the position ids.
    """

    def __init__(self, inv_freq: torch.Tensor, scale: float = 1.0):
        self.inv_freq = inv_freq.double()
        self.scale = scale
        self._on_device: dict[tuple, torch.Tensor] = {}

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, n] -> cos, sin [B, 1, n, d] in `dtype`, ready to broadcast over heads."""
        compute = torch.promote_types(dtype, torch.float32)
        key = (position_ids.device, compute)
        if key not in self._on_device:
            self._on_device[key] = self.inv_freq.to(position_ids.device, compute)
        angles = position_ids.to(compute).unsqueeze(-1) * self._on_device[key]  # [B, n, d/2]
        angles = torch.cat([angles, angles], dim=-1)
        return (angles.cos() * self.scale).to(dtype).unsqueeze(1), (angles.sin() * self.scale).to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, n, d] rotated by the angles in cos/sin [B, 1, n, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def draw_drafts(logits: torch.Tensor, sample: bool,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chain drafter's choice: logits [..., V] -> drafts [...] and q [..., V] in >= float32 (None for argmax drafts,
    which verification treats as one-hot q). Sampled drafts draw from `generator` (DraftContext.generator)."""
    if not sample:
        return logits.argmax(dim=-1), None
    q = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    drafts = torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=generator).view(q.shape[:-1])
    return drafts, q


def expands_kv_heads(device: torch.device) -> bool:
    """Whether masked attention with grouped KV heads repeats K/V to every query head on `device` before SDPA.

    CUDA's and ROCm's fused kernels that take an explicit mask (memory-efficient, cuDNN) take no grouped heads, so
    SDPA with a mask and `enable_gqa` falls back to the math kernel there: fp32 scores [B, H, n, C] and their softmax
    per call. Repeated K/V (H / H_kv times their bytes) keep a fused kernel. CPU's fused kernel takes both a mask and
    grouped heads, so K/V stay grouped there: repeating them would only cost memory and sum the K/V gradients of a
    group in another order (training on CPU stays bitwise what it was)."""
    return device.type != "cpu"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads over an explicit boolean mask, on a fused kernel on every
    device (`expands_kv_heads`).

    Args:
        q: [B, H, n, d]; k, v: [B, H_kv, C, d] with H a multiple of H_kv.
        mask: [B, 1, n, C] bool, True = may attend (every query row must allow at least one key), or None (all).
        scale: the score scale (None = 1 / sqrt(d)).
    Returns:
        [B, H, n, d]
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and mask is not None and expands_kv_heads(q.device):
        k, v, groups = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)


def attention_with_diagonal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    diagonal_k: list[torch.Tensor],
    diagonal_v: list[torch.Tensor],
) -> torch.Tensor:
    """Attention over [the masked keys k | one extra key per query and per entry of `diagonal_k`].

    Query i additionally sees diagonal_k[j][:, :, i] for every j, at the same position i. This is the EAGLE-3
    training-time-test mask (ARCHITECTURE / reference A.4) without building the (J+1)n x (J+1)n matrix: the
    causal block is a plain score matrix, the diagonal blocks are elementwise dot products, and one softmax runs
    over both.

    Args:
        q: [B, H, n, d]; k, v: [B, H_kv, C, d]; mask: [B, 1, n, C] bool (C = n for the whole sequence, more
            for a chunk of queries: drafters/chunked.causal_attention).
        diagonal_k, diagonal_v: J tensors [B, H_kv, n, d] (one per query).
    Returns:
        [B, H, n, d]
    """
    batch, num_heads, n, head_dim = q.shape
    num_kv = k.shape[1]
    groups = num_heads // num_kv
    qg = q.view(batch, num_kv, groups, n, head_dim) * head_dim**-0.5
    scores = qg @ k.unsqueeze(2).transpose(-1, -2)  # [B, H_kv, G, n, C]
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    dk = torch.stack(diagonal_k, dim=-2)  # [B, H_kv, n, J, d]
    dv = torch.stack(diagonal_v, dim=-2)
    diag_scores = torch.einsum("bhgnd,bhnjd->bhgnj", qg, dk)
    probs = torch.softmax(torch.cat([scores, diag_scores], dim=-1), dim=-1)
    columns = k.shape[2]
    out = probs[..., :columns] @ v.unsqueeze(2) + torch.einsum("bhgnj,bhnjd->bhgnd", probs[..., columns:], dv)
    return out.reshape(batch, num_heads, n, head_dim)


class KVCache:
    """Per-row key/value cache for one attention layer, with holes.

    Each row b holds `lengths[b]` used columns; `valid[b, c]` says which of them are real (left padding of the
    prompt stays as holes). `append` writes a block at each row's own offset and advances the row by its last
    valid entry, so rejected drafts (a valid prefix followed by invalid entries) are overwritten by the next block
    instead of leaving holes. `mark()` / `rewind()` save and restore the lengths (speculative entries).
    """

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, device, dtype, capacity: int = 256):
        self.keys = torch.zeros(batch, num_kv_heads, capacity, head_dim, device=device, dtype=dtype)
        self.values = torch.zeros_like(self.keys)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self._marked = self.lengths.clone()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` [B'] (the engine drops finished rows; drafters/base.py keep_rows)."""
        for name in ("keys", "values", "valid", "lengths", "_marked"):
            setattr(self, name, getattr(self, name)[rows.to(self.keys.device)])

    def append(
        self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write a block and return what its queries may attend to.

        Args:
            k, v: [B, H_kv, n, d] keys/values of the new block (RoPE applied); valid: [B, n] bool.
        Returns:
            keys, values [B, H_kv, C, d] and mask [B, 1, n, C] (True = may attend): the row's earlier valid
            columns, the block causally, and always the query's own column so no row is empty.
        """
        batch, _, n, _ = k.shape
        self._reserve(int(self.lengths.max()) + n)
        columns = self.lengths.unsqueeze(1) + torch.arange(n, device=k.device)  # [B, n]
        rows = torch.arange(batch, device=k.device).unsqueeze(1).expand(batch, n)
        self.keys[rows, :, columns] = k.transpose(1, 2)
        self.values[rows, :, columns] = v.transpose(1, 2)
        self.valid[rows, columns] = valid
        used = int(columns.max()) + 1
        column_ids = torch.arange(used, device=k.device)
        mask = self.valid[:, None, :used] & (column_ids <= columns.unsqueeze(-1))  # [B, n, C]
        mask |= column_ids == columns.unsqueeze(-1)
        last_valid = torch.where(valid, torch.arange(1, n + 1, device=k.device), 0).amax(dim=1)
        self.lengths = self.lengths + last_valid
        return self.keys[:, :, :used], self.values[:, :, :used], mask.unsqueeze(1)

    def mark(self) -> None:
        """Remember the current lengths (the committed state)."""
        self._marked = self.lengths.clone()

    def rewind(self) -> None:
        """Drop everything appended since the last `mark()`."""
        self.lengths = self._marked.clone()

    def _reserve(self, needed: int) -> None:
        capacity = self.keys.shape[2]
        if needed <= capacity:
            return
        grow = max(needed, 2 * capacity) - capacity
        self.keys = F.pad(self.keys, (0, 0, 0, grow))
        self.values = F.pad(self.values, (0, 0, 0, grow))
        self.valid = F.pad(self.valid, (0, grow), value=False)
