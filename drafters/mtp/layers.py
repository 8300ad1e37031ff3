"""MTP building blocks (config: config.py): the checkpoint layouts' conventions, one MTP module, and its KV cache.

The design notes behind this module: docs/decisions.md, "drafters/mtp/layers.py".
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import TargetInfo, norm_eps
from drafters.layers import per_layer_overrides
from drafters.mtp.config import MTPConfig


@dataclass(frozen=True)
class Convention:
    embedding_first: bool
    mask_first_position: bool
    feed_back_normed: bool

    def describe(self) -> str:
        return ", ".join(["embedding first" if self.embedding_first else "hidden state first",
                          "position-0 embedding zeroed" if self.mask_first_position else "no position-0 masking",
                          "normed output fed back" if self.feed_back_normed else "pre-norm output fed back"])


LAYOUTS: dict[str, Convention] = {
    "deepseek_v3": Convention(embedding_first=True, mask_first_position=True, feed_back_normed=False),
    "qwen3_next": Convention(embedding_first=True, mask_first_position=False, feed_back_normed=True),
    "qwen3_5": Convention(embedding_first=True, mask_first_position=False, feed_back_normed=True),  # Qwen3-Next's
    "mimo": Convention(embedding_first=False, mask_first_position=True, feed_back_normed=True),
    "speculators": Convention(embedding_first=True, mask_first_position=False, feed_back_normed=True),
    "nemotron_h": Convention(embedding_first=True, mask_first_position=False, feed_back_normed=True),
}
# What a served step after the first (MTPConfig.proposer "server") takes as its hidden input, where that differs from
# the layout's own reading (DeepSeek-V3's paper chains module k's pre-norm output into module k + 1: the depths).
# vLLM 0.32 serves the DeepSeek-V3 layout of a deepseek_v3 / deepseek_v32 / glm_moe_dsa target (DeepSeek-V3, V3.2,
# Kimi-K2.5's text model, GLM-5) with its DeepSeek MTP model, which feeds the step's normed output back, as SGLang's
# NextN models do; its GLM-4.5 MTP model (glm4_moe) feeds the pre-norm output back (SGLang's the normed one: the two
# servers differ there, and a glm4_moe target is modelled as vLLM serves it). Keyed by (layout, target model type).
SERVED_FEED_BACK_NORMED = {("deepseek_v3", model_type): True for model_type in ("deepseek_v3", "deepseek_v32",
                                                                               "glm_moe_dsa")}


def convention_of(layout: str, model_type: str | None, served_steps: bool) -> Convention:
    """The conventions an MTP drafter of `layout` on a target of `model_type` runs with: LAYOUTS, and for the steps
    the servers run, SERVED_FEED_BACK_NORMED (another family keeps its layout's, so its drafters run as before)."""
    normed = SERVED_FEED_BACK_NORMED.get((layout, model_type)) if served_steps else None
    return LAYOUTS[layout] if normed is None else replace(LAYOUTS[layout], feed_back_normed=normed)


# Model types whose checkpoints are not a transformers family of their own: the family their decoder layer belongs to.
BLOCK_FAMILY_ALIASES = {"mimo": "qwen2"}
# The config key listing the blocks of one MTP step, in families whose step is several of their one-mixer blocks
# (Nemotron-H: an attention block, then an MoE block, each with its own pre-norm and residual, as vLLM's NemotronHMTP).
STEP_BLOCKS_KEY = "mtp_layers_block_type"


def resolve_num_steps(config: MTPConfig) -> int:
    """The trained depth K; ValueError naming the field when it exceeds the modules without reuse."""
    steps = config.num_modules if config.num_steps is None else int(config.num_steps)
    if config.num_modules < 1:
        raise ValueError(f"drafter.num_modules must be >= 1, got {config.num_modules}")
    if steps < 1:
        raise ValueError(f"drafter.num_steps must be >= 1, got {steps}")
    if steps > config.num_modules and not config.reuse:
        raise ValueError(f"drafter.num_steps {steps} exceeds drafter.num_modules {config.num_modules}: depth k needs "
                         "module k; add modules or set drafter.reuse: true to apply one module for every step")
    return steps


def target_text_config(target_info: TargetInfo) -> dict[str, Any]:
    """The target's (text) HF config as a dict."""
    return dict(target_info.text_config)


@dataclass(frozen=True)
class FamilyClasses:
    """The transformers classes an MTP module borrows from the target's family."""

    decoder_layer: type
    norm: type
    rotary: type | None  # None: the family's attention has no positions (Nemotron-H, Jamba)


def family_classes(model_type: str) -> FamilyClasses:
    """Decoder layer, RMSNorm and rotary embedding classes of the transformers family `model_type`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    family = BLOCK_FAMILY_ALIASES.get(model_type, model_type)
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family)
    if name is None:
        raise ValueError(f"target model_type {model_type!r} is not a causal LM family of the installed transformers; "
                         "the MTP block mirrors the target's own decoder layer class")
    import transformers

    module = sys.modules[getattr(transformers, name).__module__]
    no_split = getattr(getattr(transformers, name), "_no_split_modules", None) or []
    layer_names = [n for n in no_split if n.endswith("DecoderLayer")] or [n for n in no_split if n.endswith("Block")]
    if not layer_names:
        raise ValueError(f"target model_type {model_type!r}: no decoder layer class found in {module.__name__} (the "
                         "MTP block is one of the target's decoder layers); train another drafter kind")
    prefix = layer_names[0].removesuffix("DecoderLayer").removesuffix("Block")
    family = prefix.removesuffix("Text")  # Gemma4TextDecoderLayer beside Gemma4RMSNorm
    names = (layer_names[0], *(next((n for n in (prefix + part, family + part, family + "Text" + part)
                                     if getattr(module, n, None) is not None), prefix + part)
                               for part in ("RMSNorm", "RotaryEmbedding")))
    classes = [getattr(module, n, None) for n in names]  # Qwen3.5: Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding
    if classes[2] is None and not any(n.endswith("RotaryEmbedding") for n in vars(module)):
        classes[2] = False  # a family without RoPE: its attention reads no position embeddings
    if any(c is None for c in classes):
        raise ValueError(f"target model_type {model_type!r}: {module.__name__} lacks one of {prefix}DecoderLayer, "
                         f"{prefix}RMSNorm, {prefix}RotaryEmbedding, which the MTP block is built from; train another "
                         "drafter kind")
    return FamilyClasses(classes[0], classes[1], classes[2] or None)


def step_blocks(target_info: TargetInfo) -> list[str] | None:
    """The block kinds of one MTP step where the family's step is several blocks (STEP_BLOCKS_KEY), else None.
    ValueError when the step holds a block the MTP cache cannot carry (a Mamba block, or more than one attention)."""
    kinds = target_text_config(target_info).get(STEP_BLOCKS_KEY)
    if not isinstance(kinds, (list, tuple)) or not kinds:
        return None
    if "linear_attention" in kinds or list(kinds).count("full_attention") != 1:
        raise ValueError(f"the target's {STEP_BLOCKS_KEY} {list(kinds)}: draftsmith's MTP step runs one attention "
                         "block beside MoE / MLP blocks (no Mamba block); set it so in the target's config.json")
    return list(kinds)


def block_config(target_info: TargetInfo, num_modules: int):
    """The target's HF config object for building MTP blocks at layer indices N .. N + num_modules - 1: attention
    through SDPA (which takes our boolean masks), and hybrid models' `layer_types` extended with full attention for
    those indices (Qwen3-Next's MTP layer is a full-attention layer), and per-layer MLP kinds with the last layer's."""
    from transformers import AutoConfig

    values = target_text_config(target_info)
    model_type = values.pop("model_type", None) or "llama"
    family = BLOCK_FAMILY_ALIASES.get(model_type, model_type)
    num_layers, total = target_info.num_layers, target_info.num_layers + num_modules
    stacked = step_blocks(target_info)
    if stacked:  # each module: len(stacked) blocks (Nemotron-H's layer kinds, under two names)
        total = num_layers + num_modules * len(stacked)
        values.update(layer_types=list(values["layer_types"])[:num_layers] + stacked * num_modules)
        values.pop("layers_block_type", None)
    layer_types = values.get("layer_types")
    if isinstance(layer_types, (list, tuple)):  # families with per-layer settings (Gemma 4) size them by layer count
        added = ["full_attention"] * (total - len(layer_types))
        per_layer = {**(values.get("per_layer_config") or {}), **per_layer_overrides(values, added, len(layer_types))}
        values.update(layer_types=(list(layer_types) + added)[:total], num_hidden_layers=total,
                      **({"per_layer_config": per_layer} if per_layer else {}))
    # per-layer MLP kinds (MiniMax-M3: the blocks' as the last layer's), GLM-5's indexer modes (a block runs its own)
    # and Llama 4's RoPE flags (a block rotates: no NoPE query temperature, which reads the cache slot)
    for key, added in (("mlp_layer_types", None), ("indexer_types", "full"), ("no_rope_layers", 1)):
        kinds = values.get(key)
        if isinstance(kinds, (list, tuple)):
            values[key] = (list(kinds) + [added or kinds[-1]] * num_modules)[:total]
    # Gemma 4 E2B / E4B: a block computes its own K/V (no KV-shared tail) and takes no per-layer input
    values.update({key: 0 for key in ("num_kv_shared_layers", "hidden_size_per_layer_input") if values.get(key)})
    try:
        config = AutoConfig.for_model(family, **values)
    except AttributeError as err:  # Falcon-H1's layer kinds: a property, every layer attention and Mamba alike
        raise ValueError(f"target model_type {model_type!r}: an MTP block cannot be a full-attention layer of the "
                         f"family ({err}); train another drafter kind") from None
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"  # MoE blocks: transformers' exact per-expert loop
    return config


class MTPModule(nn.Module):
    """One MTP module: enorm, hnorm, eh_proj (2D -> D, no bias), the family's decoder layer `block` (or `num_blocks`
    of its blocks, a BlockStack), final_norm.

    Parameter names: enorm.weight, hnorm.weight, eh_proj.weight, final_norm.weight, block.<the HF layer's own names>
    (drafters/mtp/export.py maps them to each checkpoint layout).
    """

    def __init__(self, config, layer_index: int, classes: FamilyClasses, embedding_first: bool, num_blocks: int = 0):
        super().__init__()
        hidden, eps = config.hidden_size, norm_eps(config)
        self.embedding_first = embedding_first
        self.enorm = classes.norm(hidden, eps)
        self.hnorm = classes.norm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = (BlockStack(classes.decoder_layer(config, layer_index + j) for j in range(num_blocks))
                      if num_blocks else classes.decoder_layer(config, layer_index))
        self.final_norm = classes.norm(hidden, eps)
        parameters = inspect.signature((self.block[0] if num_blocks else self.block).forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"
        self._shares_kv = "shared_kv_states" in parameters  # Gemma 4 layers write into a dict a later layer reads

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor,
                position_embeddings, cache=None) -> torch.Tensor:
        """embeds, hidden [B, n, D]; mask [B or 1, 1, n, C] bool; position_ids [B, n] -> pre-norm output [B, n, D]."""
        parts = [self.enorm(embeds), self.hnorm(hidden)]
        x = self.eh_proj(torch.cat(parts if self.embedding_first else parts[::-1], dim=-1))
        extra = {"shared_kv_states": {}} if self._shares_kv else {}
        if position_embeddings is not None:  # None: a family without RoPE
            extra["position_embeddings"] = position_embeddings
        out = self.block(x, attention_mask=mask, position_ids=position_ids, **{self._cache_arg: cache}, **extra)
        return out[0] if isinstance(out, tuple) else out


class BlockStack(nn.ModuleList):
    """One MTP step of several blocks (STEP_BLOCKS_KEY), applied in order, each with the same keywords (a block
    without attention ignores the mask and the cache). Parameter names: {j}.<the HF block's own names>."""

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        for block in self:
            out = block(x, **kwargs)
            x = out[0] if isinstance(out, tuple) else out
        return x


@torch.no_grad()
def init_module_(module: MTPModule, std: float) -> None:
    """Fresh weights: every matrix (linear layers, fused expert tensors, routers) N(0, std), linear biases zero; norms
    keep their constructors' values (scale 1: weight 1, or 0 for zero-centred norms), as the HF models initialise
    them. Then eh_proj's hidden half is the identity, so a fresh module starts close to passing hnorm(h) through its
    block (whose random output projections add little) and predicts about what the target predicts from h, the way
    Medusa's zero-initialised blocks start. Measured on SmolLM2-135M (3 ShareGPT batches): initial loss 7.5 against
    18 with a random eh_proj, and 23 with the target's final-norm weights on final_norm (applied twice to a
    post-norm input) or a block copied from the target's last layer (which expects its residual stream's scale)."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and sub.bias is not None:
            sub.bias.zero_()
    for name, parameter in module.named_parameters():
        if parameter.dim() >= 2:
            parameter.normal_(0.0, std)
    hidden = module.eh_proj.weight.shape[0]
    columns = slice(hidden, 2 * hidden) if module.embedding_first else slice(0, hidden)
    module.eh_proj.weight[:, columns] = torch.eye(hidden, dtype=module.eh_proj.weight.dtype)


def causal_mask(length: int, device) -> torch.Tensor:
    """[1, 1, T, T] bool, True = may attend."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril().view(1, 1, length, length)


def with_room(stored: torch.Tensor, used: int) -> torch.Tensor:
    """`stored` (columns on dim -2) with at least `used` columns: itself, or padded to twice its columns or `used`."""
    if stored.shape[-2] >= used:
        return stored
    return F.pad(stored, (0, 0, 0, max(used, 2 * stored.shape[-2]) - stored.shape[-2]))


class BlockCache:
    """The KV cache of one MTP block at one depth, per row, with holes (the pattern of drafters.layers.KVCache).

    It stores whatever pair of tensors the block's attention caches ([B, h, n, d] each: keys and values, or MLA's
    latent and rotary key, of different widths), through the `update` method HF attention calls. `plan(valid)` must
    run before each block forward: it places the block at each row's own offset and returns the attention mask.
    `mark()` / `rewind()` keep or drop speculative entries.
    """

    def __init__(self, batch: int, device):
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.store: tuple[torch.Tensor, torch.Tensor] | None = None
        self.index: torch.Tensor | None = None  # a DSA indexer's keys [B, C, d]
        self._marked = self.lengths.clone()
        self._columns: torch.Tensor | None = None

    def plan(self, valid: torch.Tensor) -> torch.Tensor:
        """valid [B, n] bool for the next block -> mask [B, 1, n, C] (earlier valid columns, the block causally, and
        always the query's own column). A row advances by its last valid entry."""
        batch, n = valid.shape
        device = valid.device
        columns = self.lengths.unsqueeze(1) + torch.arange(n, device=device)  # [B, n]
        used = int(columns.max()) + 1
        if self.valid.shape[1] < used:
            self.valid = F.pad(self.valid, (0, max(used, 2 * self.valid.shape[1]) - self.valid.shape[1]))
        self.valid[torch.arange(batch, device=device).unsqueeze(1), columns] = valid
        column_ids = torch.arange(used, device=device)
        mask = self.valid[:, None, :used] & (column_ids <= columns.unsqueeze(-1))
        mask |= column_ids == columns.unsqueeze(-1)
        last_valid = torch.where(valid, torch.arange(1, n + 1, device=device), 0).amax(dim=1)
        self.lengths = self.lengths + last_valid
        self._columns = columns
        return mask.unsqueeze(1)

    def update(self, first: torch.Tensor, second: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the planned block's pair [B, h, n, d] and return the cached pair [B, h, C, d] up to the block."""
        columns = self._columns
        assert columns is not None and columns.shape[1] == first.shape[2], "BlockCache.plan must precede the forward"
        used = int(columns.max()) + 1
        if self.store is None:
            self.store = tuple(t.new_zeros(t.shape[0], t.shape[1], max(used, 64), t.shape[3]) for t in (first, second))
        self.store = tuple(with_room(t, used) for t in self.store)
        rows = torch.arange(first.shape[0], device=first.device).unsqueeze(1).expand_as(columns)
        for stored, new in zip(self.store, (first, second)):
            stored[rows, :, columns] = new.transpose(1, 2).to(stored.dtype)
        return self.store[0][:, :, :used], self.store[1][:, :, :used]

    def update_indexer(self, keys: torch.Tensor, *args) -> torch.Tensor:
        """DSA blocks (DeepSeek-V3.2, GLM-5): the indexer's keys [B, n, d] written at the planned columns; returns the
        cached ones [B, C, d] up to the block (its selection is masked by `plan`'s mask, so holes are never chosen)."""
        columns = self._columns
        used = int(columns.max()) + 1
        if self.index is None:
            self.index = keys.new_zeros(keys.shape[0], max(used, 64), keys.shape[2])
        self.index = with_room(self.index, used)
        rows = torch.arange(keys.shape[0], device=keys.device).unsqueeze(1).expand_as(columns)
        self.index[rows, columns] = keys.to(self.index.dtype)
        return self.index[:, :used]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` [B'] (the engine drops finished rows; drafters/base.py keep_rows)."""
        rows = rows.to(self.lengths.device)
        self.lengths, self.valid, self._marked = self.lengths[rows], self.valid[rows], self._marked[rows]
        self.store = None if self.store is None else tuple(t[rows] for t in self.store)
        self.index = None if self.index is None else self.index[rows]
        self._columns = None if self._columns is None else self._columns[rows]

    def mark(self) -> None:
        self._marked = self.lengths.clone()

    def rewind(self) -> None:
        self.lengths = self._marked.clone()


class StepKeys:
    """The K/V of the steps of a training forward that proposes as the servers do (MTPConfig.proposer "server"): step
    j's block at anchor i (row i, position i + j) attends to step 0's K/V at positions <= i and to its own anchor's
    steps 1 .. j (EAGLE-3's test-time-training pattern), which is what a server's cache holds when it runs step j. The
    pairs (and a DSA indexer's keys) keep their graph; `mask(j)` is step j's [1, 1, T, T (j + 1)] bool mask, its key
    blocks in the order the steps ran."""

    def __init__(self, length: int, device):
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.index: list[torch.Tensor] = []
        self._causal = causal_mask(length, device)[0, 0]
        self._diagonal = torch.eye(length, dtype=torch.bool, device=device)

    def mask(self, step: int) -> torch.Tensor:
        length = self._causal.shape[0]
        return torch.cat([self._causal] + [self._diagonal] * step, dim=1).view(1, 1, length, length * (step + 1))

    def update(self, first: torch.Tensor, second: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        self.pairs.append((first, second))
        return tuple(torch.cat([pair[i] for pair in self.pairs], dim=2) for i in (0, 1))

    def update_indexer(self, keys: torch.Tensor, *args) -> torch.Tensor:
        self.index.append(keys)
        return torch.cat(self.index, dim=1)
