"""What the ragged cache (drafters/ragged_lm.py) must know about a model family's layers to roll rows back exactly.

The kinds of decoder layer, read from the config's `layer_types` (or `sliding_window` without them):
- full attention: K/V per slot; holes hidden by the mask, rollback a crop. Llama, Qwen3, DeepSeek-V3's MLA (transformers
  caches its decompressed K/V), gpt-oss and MoE layers alike (routing is per token, nothing to roll back). DSA's
  `indexed_attention` (DeepSeek-V3.2, GLM-5) too: its indexer picks each query's keys by score under the mask, so holes
  and tree nodes are masked as keys; its own key cache is cropped, row-selected and path-ordered with the K/V.
- sliding-window attention (Gemma 4, gpt-oss, Mistral): the cache keeps every slot (a full DynamicLayer instead of
  transformers' window-trimmed one, whose crop cannot go back once a sequence outgrows the window), and the mask
  applies the window by POSITION (query position - key position < window), so a row with holes sees the same keys it
  would see alone. Such models get a 4-D mask per layer type (sdpa: boolean, eager: additive). Llama 4's chunked
  attention likewise, the chunk applied by position (query and key in the same `attention_chunk_size` positions).
- linear attention (gated DeltaNet in Qwen3.5 / Qwen3.6 / Qwen3-Next; Mamba in Nemotron-H, Granite 4.0-H, Jamba;
  Kimi Linear's delta attention; transformers caches them the same way): a conv state and a recurrent state with
  no sequence axis, so no holes: after a verify every row needs exactly the state after its accepted tokens. Chosen
  by measurement (docs/benchmarks.md, benchmarks/engine/rollback_cost.py): during a forward after the prefill each
  mixer is stepped one token at a time through transformers' own single-token path and the state after every
  position is kept ("snapshot", as vLLM's hybrid spec decoding keeps per-position states; drafters/linear_state.py);
  `keep_after` then copies each row's state at its accepted count. Slots fed as invalid leave a row's state
  untouched. "rerun" (the block in one chunked call, then the accepted prefix stepped again from a saved state) is
  kept for the measurement. Tree verification steps the nodes in order, each from its parent's state, so every
  node's state is that of its root-to-node path.
- attention and a Mamba mixer in one layer (`hybrid`: Falcon-H1's parallel pair, Zamba2's shared attention block
  before its Mamba-2): transformers' LinearAttentionAndFullAttentionLayer, whose K/V are cropped as full attention's
  and whose states are recorded as linear attention's.
- gated short convolution (LFM2's `conv`): a conv state alone, recorded as linear attention's.
- no mixer (Nemotron-H's `moe` and `mlp` blocks): nothing cached, nothing to roll back.
- slot-anchored sparse attention (MiniMax-M3's `minimax_m3_sparse`): K/V and its indexer's keys per slot, key blocks
  cut by SLOT (taken as the position), so exact in one row's chains only (no holes, no tree nodes); a crop rolls back.
  Llama 4's NoPE layers too, where transformers computes their query temperature from the slot count
  (`slot_anchored`).
Other layer types (DeepSeek-V4's compressed attention), a stateful layer with no such mixer (no Conv1d under one of
MIXERS), and a batch or tree of a slot-anchored family, are refused in one line naming the family and what is
missing.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicIndexedLayer,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from drafters.linear_state import LinearStateRecorder

try:  # transformers >= 5.2x; an older one (e.g. the 5.19 vLLM 0.32 pins) has no placeholder layers to accept
    from transformers.cache_utils import DummyLayer
except ImportError:
    DummyLayer = None

SLOT_ANCHORED = ("minimax_m3_sparse",)
MASKED_INDEXERS = ("deepseek_v32", "glm_moe_dsa")  # whose DSA layers were read to pick keys under the mask
DSA = ("indexed_attention", "deepseek_sparse_attention")  # the DSA layers' name, and transformers 5.17's
NO_CACHE = ("moe", "mlp")  # Nemotron-H's blocks without a mixer
BOTH = ("hybrid",)  # attention and a Mamba mixer in one layer (Falcon-H1's parallel pair, Zamba2's shared block)
STATEFUL = ("linear_attention", "conv") + BOTH  # the layers with a conv state (and a recurrent one; LFM2's conv: none)
WINDOWED = ("sliding_attention", "chunked_attention")  # masked by position: a window (Gemma 4), a chunk (Llama 4)
KV_TYPES = ("full_attention",) + WINDOWED + DSA + SLOT_ANCHORED + BOTH  # the layers that cache K/V
SUPPORTED_LAYER_TYPES = ("full_attention",) + WINDOWED + STATEFUL + DSA + SLOT_ANCHORED + NO_CACHE
# a stateful layer's mixer: gated DeltaNet's, Mamba's (Zamba2's hybrid layer holds its Mamba layer's), LFM2's short
# convolution, Kimi Linear's delta attention (its `self_attn`)
MIXERS = ("linear_attn", "mamba", "mixer", "mamba_decoder.mamba", "conv", "self_attn")
MASKABLE_ATTENTION = ("sdpa", "eager")
MECHANISMS = ("snapshot", "rerun")


class RoomyLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values are views into buffers with room to grow: a block appended
    after the prefill is written into the room, where transformers' DynamicLayer concatenates (a fresh copy of the
    whole layer, and on a CPU fresh pages, every decode step). Crops keep the view; a row selection copies, and the
    next append moves it into a new buffer. The first write (a prefill, or training's one forward) takes no room."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used, new = (self.keys.shape[-2] if self.keys.numel() else 0), key_states.shape[-2]
        if used == 0:  # the first block: its own tensors, no room
            self.keys, self.values = key_states, value_states
            return self.keys, self.values
        if not self._has_room(used + new, key_states):
            room = used + new + max(256, (used + new) // 2)
            self.buffers = tuple(torch.empty(*old.shape[:2], room, old.shape[3], dtype=old.dtype, device=old.device)
                                 for old in (self.keys, self.values))
            for buffer, old in zip(self.buffers, (self.keys, self.values)):
                buffer[:, :, :used] = old
        for buffer, block in zip(self.buffers, (key_states, value_states)):
            buffer[:, :, used:used + new] = block
        self.keys, self.values = (buffer[:, :, :used + new] for buffer in self.buffers)
        return self.keys, self.values

    def _has_room(self, length: int, block: torch.Tensor) -> bool:
        """The current keys are a prefix view of the buffers (no row selection since) and `length` slots fit."""
        if self.buffers is None:
            return False
        keys = self.buffers[0]
        return (self.keys.data_ptr() == keys.data_ptr() and self.keys.shape[:2] == keys.shape[:2] == block.shape[:2]
                and length <= keys.shape[2])

    def reset(self) -> None:
        self.buffers = None
        super().reset()


def _attribute(module, dotted: str):
    """module.a.b for "a.b", or None where a part is missing."""
    for name in dotted.split("."):
        module = getattr(module, name, None)
    return module


def decoder_of(model):
    """The causal LM's decoder, the module holding `.layers`: what `get_decoder()` returns, followed further where that
    is a causal LM again (a vision-language model's `language_model`) or the model itself (Llama 4's text model, whose
    base_model_prefix names no attribute: its `.model`)."""
    module = model
    for _ in range(4):
        if hasattr(module, "layers"):
            return module
        inner = module.get_decoder() if hasattr(module, "get_decoder") else None
        module = inner if inner is not None and inner is not module else getattr(module, "model", None)
        if module is None:
            break
    raise ValueError(f"target {type(model).__name__}: no decoder holding `layers` found through get_decoder(); load a "
                     "causal LM whose decoder holds its layers")


def _convolves(mixer) -> bool:
    """A stateful mixer: one with a causal Conv1d (`conv1d`; LFM2's short convolution names it `conv`)."""
    return any(isinstance(getattr(mixer, name, None), torch.nn.Conv1d) for name in ("conv1d", "conv"))


def layer_types(config) -> list[str]:
    """The decoder's layer types; configs without `layer_types` are all full or all sliding-window attention."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)[: config.num_hidden_layers]
    windowed = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    return ["sliding_attention" if windowed else "full_attention"] * config.num_hidden_layers


def config_dict(config) -> dict:
    """`config.to_dict()`, with the decoder's `layer_types` where the config has them but does not store them under
    that name (Nemotron-H's `layers_block_type`; Jamba's, derived from its layer periods), so that a reader of the
    dict (hybrid layer ids, the assistant's KV mapping) sees the layer kinds the engine sees."""
    values = config.to_dict()
    types = getattr(config, "layer_types", None)
    if types and "layer_types" not in values and config.get_text_config(decoder=True) is config:
        values["layer_types"] = list(types)[: config.num_hidden_layers]
    return values


def unsupported_layer_types(config) -> list[str]:
    """The layer types of text config `config` the engine cannot roll back (so cannot decode), sorted."""
    supported = set(SUPPORTED_LAYER_TYPES) - (set() if config.model_type in MASKED_INDEXERS else set(DSA))
    return sorted(set(layer_types(config)) - supported)


def slot_anchored(config) -> str | None:
    """What of text config `config` reads the cache slot as the position (so holes and tree nodes would move it), or
    None: MiniMax-M3's sparse layers, and Llama 4's NoPE layers under attention temperature tuning (transformers
    scales their queries by the slot count of the cache, where vLLM reads the position)."""
    anchored = sorted(set(layer_types(config)) & set(SLOT_ANCHORED))
    if anchored:
        return f"its {anchored} layers' indexer cuts key blocks by cache slot"
    if getattr(config, "attn_temperature_tuning", False) and 0 in (getattr(config, "no_rope_layers", None) or ()):
        return "its NoPE layers' attention temperature is computed from the cache slot (transformers' Llama 4)"
    return None


def one_row_refusal(config, what: str) -> str | None:
    """Why text config `config` cannot decode `what` (a batch of rows, a tree), or None (`slot_anchored`)."""
    reason = slot_anchored(config)
    return None if reason is None else (f"target family {config.model_type} decodes one row at a time in chains: "
                                        f"{reason}, which {what} would move off the token's position")


class FamilyState:
    """Per-model cache construction, masks and per-row rollback of the layers' states. Built once per RaggedLM.
    Raises ValueError (one line: the family and what is missing) for a model the engine cannot roll back exactly."""

    def __init__(self, model, mechanism: str = "snapshot", decodes: bool = True):
        """decodes: whether the model's decoder runs here; a target that only lends its head (its layers on the meta
        device: the served placement, export, a plan from config.json) is not refused for its layer types."""
        config = model.config.get_text_config(decoder=True)
        self.config, self.family = config, getattr(config, "model_type", type(model).__name__)
        self.types = layer_types(config)
        unknown = unsupported_layer_types(config)
        if unknown and decodes:
            raise ValueError(f"target family {self.family}: layer types {unknown} are not supported by the engine "
                             f"(it rolls back {', '.join(SUPPORTED_LAYER_TYPES)} layers, the DSA ones of "
                             f"{', '.join(MASKED_INDEXERS)} only; missing: a per-row rollback of their cache)")
        if mechanism not in MECHANISMS:
            raise ValueError(f"linear-attention rollback mechanism must be one of {MECHANISMS}, got {mechanism!r}")
        self.anchored = slot_anchored(config) is not None  # one row in chains: see `one_row_refusal`
        self.window = getattr(config, "sliding_window", None)
        self.chunk = getattr(config, "attention_chunk_size", None)
        self.windowed = bool(set(self.types) & set(WINDOWED))
        if "chunked_attention" in self.types and not self.chunk:
            raise ValueError(f"target family {self.family}: chunked_attention layers without attention_chunk_size in "
                             "its config; missing: the chunk to mask by")
        self.kernel = getattr(config, "_attn_implementation", None) or "eager"
        if self.windowed and self.kernel not in MASKABLE_ATTENTION:
            raise ValueError(f"target family {self.family}: sliding-window or chunked layers need attn_implementation "
                             f"in {MASKABLE_ATTENTION} (the engine passes position-masked 4-D masks); the target uses "
                             f"{self.kernel!r}: load it with attn_implementation='sdpa'")
        self.recorders = self._install_recorders(model, mechanism)
        self.dtype = model.dtype
        # Gemma 4's KV-shared tail (num_kv_shared_layers: E2B / E4B) caches nothing, so transformers runs it over the
        # kept logits' positions only when logits_to_keep is an int: see `logits_to_keep`
        self.shares_kv = bool(getattr(config, "num_kv_shared_layers", 0))

    def logits_to_keep(self, keep: int, records: bool):
        """The forward's logits_to_keep for the last `keep` positions (0: all): `keep` itself, or the same positions
        as a slice when the forward records features and a KV-shared tail would otherwise skip the earlier
        positions (the hidden states a drafter reads there and after it, and the final one)."""
        return slice(-keep, None) if keep and records and self.shares_kv else keep

    def _install_recorders(self, model, mechanism: str) -> dict[int, LinearStateRecorder]:
        indices = [i for i, kind in enumerate(self.types) if kind in STATEFUL]
        if not indices:
            return {}
        layers = decoder_of(model).layers
        recorders = {}
        for index in indices:
            mixer = next((m for m in (_attribute(layers[index], name) for name in MIXERS) if _convolves(m)), None)
            if mixer is None:
                raise ValueError(f"target family {self.family}: layer {index} holds a state but has no gated "
                                 f"DeltaNet, Mamba, delta or short-convolution mixer (one of {MIXERS} with a Conv1d); "
                                 "missing: a per-row rollback of its state")
            existing = getattr(mixer, "_draftsmith_recorder", None)
            recorders[index] = existing if existing is not None else LinearStateRecorder(mixer, index)
            recorders[index].mechanism = mechanism
        return recorders

    @property
    def has_linear(self) -> bool:
        return bool(self.recorders)

    def check_kv_layers(self, kv_layers) -> None:
        """A drafter reads K/V of attention layers only (a linear-attention layer holds a state, a block without a
        mixer nothing)."""
        bad = [int(i) for i in kv_layers if 0 <= int(i) < len(self.types) and self.types[int(i)] not in KV_TYPES]
        if bad:
            allowed = [i for i, kind in enumerate(self.types) if kind in KV_TYPES]
            kinds = sorted({self.types[i] for i in bad})
            raise ValueError(f"drafter.kv_layers: target layers {bad} of {self.family} are {', '.join(kinds)} (no "
                             f"K/V to read); choose among its attention layers {allowed}")

    # ---- the cache ---------------------------------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        """A DynamicCache of the model's layer kinds, attention layers (sliding-window ones too: every slot kept) as
        RoomyLayer."""
        cache = DynamicCache(config=self.config)
        for index, layer in enumerate(cache.layers):
            if type(layer).__name__ == "DynamicSlidingWindowLayer" or type(layer) is DynamicLayer:
                cache.layers[index] = RoomyLayer()
            elif type(layer) not in (LinearAttentionLayer, LinearAttentionAndFullAttentionLayer, DummyLayer,
                                     DynamicIndexedLayer) and \
                    getattr(layer, "_layer_type", None) not in SLOT_ANCHORED:
                raise ValueError(f"target family {self.family}: cache layer {index} is a {type(layer).__name__}; "
                                 "missing: a per-row rollback of it in the engine")
        return cache

    @staticmethod
    def crop(cache: DynamicCache, num_drop: int) -> None:
        """Drop the last num_drop slots of every attention layer (linear layers have no slots)."""
        for layer in cache.layers:
            if isinstance(layer, LinearAttentionAndFullAttentionLayer):  # its K/V (its states: keep_states)
                DynamicLayer.crop(layer, -num_drop)
            elif isinstance(layer, CacheLayerMixin):
                layer.crop(-num_drop)

    def keep_rows(self, cache: DynamicCache, rows: torch.Tensor) -> None:
        for layer in cache.layers:
            if isinstance(layer, LinearAttentionLayer):
                layer.reorder_cache(rows)
            else:
                layer.batch_select_indices(rows)
        for recorder in self.recorders.values():
            recorder.clear()

    # ---- masks --------------------------------------------------------------------------------------------------
    def attention_mask(self, slot_mask: torch.Tensor, position_ids: torch.Tensor):
        """What the forward over the last S slots gets as attention_mask: the 2-D slot mask [B, L] for models without
        windows, else {layer type: 4-D mask [B, 1, S, L]} with the window applied by position."""
        if not self.windowed:
            return slot_mask
        valid = slot_mask.bool()
        key_pos = valid.long().cumsum(-1) - 1  # [B, L]
        num_new = position_ids.shape[1]
        allowed = valid[:, None, :] & (key_pos[:, None, :] <= position_ids[:, :, None])  # [B, S, L]
        own = torch.zeros_like(allowed)  # every query sees its own slot (a padding query would see nothing)
        own[:, :, -num_new:] = torch.eye(num_new, dtype=torch.bool, device=own.device)
        allowed = allowed | own
        return self._per_type(allowed, position_ids, key_pos)

    def tree_attention_mask(self, slot_mask: torch.Tensor, ancestors: torch.Tensor, depth: torch.Tensor):
        """The mask of a tree forward: node i sees the row's valid slots and its ancestors (ancestors [B, N, N] bool,
        itself included), windowed by position (node position = row length + depth). One 4-D tensor [B, 1, N, L + N]
        for every layer type, or a dict when the windows differ between types."""
        valid = slot_mask.bool()
        num_nodes = ancestors.shape[1]
        past = valid[:, None, :].expand(-1, num_nodes, -1)
        allowed = torch.cat([past, ancestors.to(valid.device)], dim=-1)
        if not self.windowed:
            return self.to_kernel(allowed)
        lengths = valid.long().sum(-1, keepdim=True)
        key_pos = torch.cat([valid.long().cumsum(-1) - 1, lengths + depth.to(valid.device)], dim=-1)  # [B, L + N]
        query_pos = lengths + depth.to(valid.device)  # [B, N]
        return self._per_type(allowed, query_pos, key_pos)

    def _per_type(self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor):
        """{layer type: mask} from `allowed` [B, S, L] and the positions of the queries [B, S] and keys [B, L]: a
        window keeps the keys less than `window` positions back, a chunk those in the query's chunk of positions; one
        tensor when every layer has the same type (Mistral's forward takes no dict)."""
        masks = {}
        for kind in set(self.types):
            if kind == "sliding_attention":
                masks[kind] = self.to_kernel(allowed & (query_pos[:, :, None] - key_pos[:, None, :] < self.window))
            elif kind == "chunked_attention":
                same = (query_pos // self.chunk)[:, :, None] == (key_pos // self.chunk)[:, None, :]
                masks[kind] = self.to_kernel(allowed & same)
            elif kind in ("full_attention",) + BOTH:
                masks[kind] = self.to_kernel(allowed)
            else:  # linear attention reads no mask after the prefill (the recorder skips invalid slots itself)
                masks[kind] = None
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def to_kernel(self, allowed: torch.Tensor) -> torch.Tensor:
        """[B, S, L] bool -> [B, 1, S, L] as the attention kernel reads it (sdpa: bool, eager: 0 / dtype min)."""
        allowed = allowed[:, None]
        if self.kernel == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(self.dtype).min)

    # ---- linear-attention states --------------------------------------------------------------------------------
    def begin_block(self, cache: DynamicCache, valid: torch.Tensor | None, parents: torch.Tensor | None = None):
        """Before a forward after the prefill: the recorders append the states after each of its positions (tree:
        each node, stepped from its parent's state). valid [B, S] (chain; None = all) marks the slots that advance a
        row's state; parents [B, N] (tree, -1 at the root). The first block after `clear` also keeps the state
        before it (index 0)."""
        if not self.recorders:  # no linear-attention layer: nothing to record, and no host sync on the verify path
            return
        if valid is not None and bool(valid.all()):
            valid = None
        parents = None if parents is None else parents.tolist()  # read on the host once, not once per layer
        for recorder in self.recorders.values():
            recorder.begin(cache, valid, parents)

    def end_block(self) -> None:
        for recorder in self.recorders.values():
            recorder.recording = False

    def keep_states(self, cache: DynamicCache, index: torch.Tensor) -> None:
        """Row b's linear states become those recorded at index[b] (0 = before the first recorded block, i = after
        its i-th position); the records are then dropped."""
        index = index.tolist()  # one host read for every layer
        for recorder in self.recorders.values():
            recorder.select(cache, index)

    def clear(self) -> None:
        for recorder in self.recorders.values():
            recorder.clear()

    def select_recorded_rows(self, rows: torch.Tensor) -> None:
        for recorder in self.recorders.values():
            recorder.keep_rows(rows)
