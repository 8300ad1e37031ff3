"""The target's decode and verify forwards for a pre-norm attention + gated-MLP decoder (Llama, SmolLM2, Qwen2/3,
Mistral without windows), run straight over the model's own modules' weights instead of through them.

A batch-1 decode step of a 135M model spends about half its time outside the linears, in HF's per-op work: module
calls, keyword plumbing, the mask builder, rotary through slices and concatenation, RMSNorm as five ops. `LeanDecoder`
runs the same arithmetic as about 20 tensor ops per layer: `F.rms_norm`, the model's own linear modules (so the fast
path's kernels still run them; on the fast path q/k/v and gate/up each run stacked as one, `stack`), rotary as a
roll and two products, the cache layer's own `update`, one `scaled_dot_product_attention` with grouped heads, and a
boolean mask built once per forward. It writes the same
cache layers the HF forward writes, so the ragged cache's rollback (crop, row selection, holes) is untouched, and it
serves the features a drafter asks for (a layer's input hidden state, the normed final one) from inside its loop.

Which models it runs is decided by structure and then by measurement, never by model type: every layer full
attention with the module names above, and a probe at construction (a short prefill and a two-token block, HF's
forward against this one, on the model itself) whose logits must agree to float32's summation bound; anything else
(a scaled embedding, norms with an offset, soft-capped logits, extra norms) fails the probe and keeps the HF
forward, with the reason in `TargetModel.lean_refused`. The CPU backend (backend.py) builds it; the ragged cache
receives it when it is built (`RaggedLM(model, block_forward=...)`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drafters.layers import attention as grouped_attention
from drafters.ragged_lm import RaggedLM
from drafters.ragged_state import layer_types
from inference.engine.cpu import fastpath

LEAN, HF_DECODE = "lean", "hf"
PROBE_TOKENS = 6


class LeanDecoder:
    """Forwards a block of tokens after a prefilled cache (`forward`), over the HF model `model`'s weights; the
    features a forward is asked for go into its `taps` (inference/engine/backend.Taps), as the HF forward's hooks
    record them."""

    def __init__(self, model):
        decoder = model.get_decoder()
        self.model = model
        self.layers = [_LayerWeights(layer) for layer in decoder.layers]
        self.embed, self.norm, self.rotary = decoder.embed_tokens, decoder.norm, decoder.rotary_emb
        self.norm_eps = _eps(decoder.norm)
        self.head = model.get_output_embeddings()
        self.stacked_groups: list = []  # the FastLinears `stack` stacked (their weights are views until unstacked)
        self.stacked_kernels: dict = {}  # the kernels chosen per stacked shape (KernelRecord.stacked)

    @classmethod
    def build(cls, model, cache_dir: str) -> tuple["LeanDecoder | None", str | None]:
        """(decoder, None) where the lean forward runs `model` and agrees with its own; else (None, the reason).
        Stacked projections' kernels are chosen with the timings in `cache_dir`."""
        reason = structure_reason(model)
        if reason is not None:
            return None, reason
        lean = cls(model)
        reason = lean.probe()
        if reason is None and lean.stack(cache_dir):  # the same probe over the stacked projections
            reason = lean.probe()
            if reason is not None:
                fastpath.unstack(lean.stacked_groups)
        return (None, reason) if reason is not None else (lean, None)

    def stack(self, cache_dir: str) -> bool:
        """On the fast path, run each layer's q, k, v projections as one linear and its gate and up as one
        (fastpath.stack: one pass over the weights instead of three, the members' weights views into the stacked
        one). True when it did; the model's own forward is unchanged."""
        if any(not isinstance(m, fastpath.FastLinear) for l in self.layers for m in (l.q, l.k, l.v, l.gate, l.up)):
            return False
        self.stacked_groups = [g for l in self.layers for g in ([l.q, l.k, l.v], [l.gate, l.up])]
        modules, self.stacked_kernels = fastpath.stack(self.stacked_groups, cache_dir)
        for index, layer in enumerate(self.layers):
            layer.qkv, layer.gate_up = modules[2 * index], modules[2 * index + 1]
        return True

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, slot_mask: torch.Tensor, cache,
                logits_to_keep: int = 0, mask: torch.Tensor | None = None, taps=None) -> torch.Tensor:
        """input_ids, position_ids [B, S] appended after the cache's slots; slot_mask [B, L] (L includes the S new
        slots, 1 = a token of the row's sequence). Returns logits [B, S, V] (or the last logits_to_keep). `mask`
        [B, 1, S, L] (bool, or additive float as SDPA reads it): who sees whom where it is not the block's causal
        order (a tree's nodes see their ancestors). `taps` (backend.Taps or None): the layer inputs and the normed
        final hidden state it asks for, recorded on the way."""
        num_new = input_ids.shape[1]
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids)  # [B, S, d], the model's own rotary (scaling types included)
        half = cos.shape[-1] // 2
        cos, sin = cos[:, None], torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, None]
        mask = block_mask(slot_mask, num_new) if mask is None else mask
        for index, layer in enumerate(self.layers):
            if taps is not None:
                taps.layer_input(index, hidden)
            hidden = layer.forward(hidden, cos, sin, half, cache.layers[index], mask)
        if taps is not None:
            taps.layer_input(len(self.layers), hidden)
        hidden = F.rms_norm(hidden, hidden.shape[-1:], self.norm.weight, self.norm_eps)
        if taps is not None:
            taps.final(hidden)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.head(hidden)

    @torch.no_grad()
    def probe(self) -> str | None:
        """Feed a prefill and then a two-token block through a ragged cache, once with the model's own forward and
        once with this one for the block; None when the block's logits agree to the float32 bound, else why not."""
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.head.weight.shape[0], (1, PROBE_TOKENS + 2), generator=generator)
        ids = ids.to(self.head.weight.device)
        outputs = []
        for block_forward in (None, self):  # the prefill runs the model's own forward in both
            runner = RaggedLM(self.model, block_forward=block_forward)
            runner.extend(ids[:, :PROBE_TOKENS], logits_to_keep=1)
            outputs.append(runner.extend(ids[:, PROBE_TOKENS:]))
        reference, lean = outputs
        gap = float((reference - lean).abs().max())
        bound = _float32_bound(self.model) * max(float(reference.abs().max()), 1.0)
        if not gap <= bound:
            return (f"the lean forward's logits differ from the model's by {gap:.3g} (bound {bound:.3g}): the model "
                    "does something per layer the lean forward does not")
        return None


class _LayerWeights:
    """One decoder layer's modules, read once: norms' weights and eps, the four attention and three MLP linears
    (called as modules: the fast path's kernels run them), the head shapes, optional per-head q/k norms."""

    def __init__(self, layer):
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.input_eps = layer.input_layernorm.weight, _eps(layer.input_layernorm)
        self.post_norm, self.post_eps = layer.post_attention_layernorm.weight, _eps(layer.post_attention_layernorm)
        self.q, self.k, self.v, self.o = attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.qkv_sizes = [self.q.out_features, self.k.out_features, self.v.out_features]
        self.gate_up_sizes = [self.gate.out_features, self.up.out_features]
        self.qkv = self.gate_up = None  # the stacked projections, where LeanDecoder.stack made them
        self.head_dim, self.scaling = attention.head_dim, attention.scaling
        q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        self.q_norm = None if q_norm is None else (q_norm.weight, _eps(q_norm))
        self.k_norm = None if k_norm is None else (k_norm.weight, _eps(k_norm))

    def forward(self, hidden, cos, sin, half, cache_layer, mask):
        batch, num_new, width = hidden.shape
        x = F.rms_norm(hidden, (width,), self.input_norm, self.input_eps)
        q, k, v = (self.q(x), self.k(x), self.v(x)) if self.qkv is None else self.qkv(x).split(self.qkv_sizes, -1)
        q = q.view(batch, num_new, -1, self.head_dim)
        k = k.view(batch, num_new, -1, self.head_dim)
        v = v.view(batch, num_new, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q = F.rms_norm(q, (self.head_dim,), *self.q_norm)
            k = F.rms_norm(k, (self.head_dim,), *self.k_norm)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, S, d]
        q = q * cos + q.roll(half, -1) * sin  # rotate_half(x) * sin, with sin's first half negated
        k = k * cos + k.roll(half, -1) * sin
        keys, values = cache_layer.update(k, v)
        attended = grouped_attention(q, keys, values, mask, scale=self.scaling)  # K/V repeated where a mask needs it
        hidden = hidden + self.o(attended.transpose(1, 2).reshape(batch, num_new, -1))
        x = F.rms_norm(hidden, (width,), self.post_norm, self.post_eps)
        gate, up = (self.gate(x), self.up(x)) if self.gate_up is None else self.gate_up(x).split(self.gate_up_sizes, -1)
        return hidden + self.down(F.silu(gate) * up)


def block_mask(slot_mask: torch.Tensor, num_new: int) -> torch.Tensor | None:
    """The attention mask of S = num_new queries in the last slots over L = slot_mask.shape[1] keys: key j is seen by
    query i when it belongs to the row's sequence and comes no later (slot order); every query sees its own slot (a
    padding query would otherwise see nothing). None when that is every key for every query (one token, no holes)."""
    valid = slot_mask.bool()
    if num_new == 1 and bool(valid.all()):
        return None
    length = valid.shape[1]
    queries = torch.arange(length - num_new, length, device=valid.device)
    keys = torch.arange(length, device=valid.device)
    allowed = valid[:, None, :] & (keys[None, None, :] <= queries[None, :, None])
    allowed |= keys[None, None, :] == queries[None, :, None]
    return allowed[:, None]  # [B, 1, S, L]


def structure_reason(model) -> str | None:
    """Why the lean forward cannot run `model` by its structure (None when it may: the probe decides)."""
    config = model.config.get_text_config(decoder=True)
    kinds = sorted(set(layer_types(config)))
    if kinds != ["full_attention"]:
        return f"layer types {kinds} (the lean forward runs full attention only)"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} (the lean forward's MLP is SiLU-gated)"
    decoder = model.get_decoder()
    for name in ("embed_tokens", "norm", "rotary_emb", "layers"):
        if not hasattr(decoder, name):
            return f"the decoder has no `{name}`"
    for layer in decoder.layers:
        for path in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj",
                     "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.head_dim",
                     "self_attn.scaling", "self_attn.num_key_value_groups", "mlp.gate_proj", "mlp.up_proj",
                     "mlp.down_proj"):
            module = layer
            for part in path.split("."):
                module = getattr(module, part, None)
            if module is None:
                return f"a decoder layer has no `{path}`"
        if len(list(layer.children())) != 4:
            return f"a decoder layer holds {[n for n, _ in layer.named_children()]} (the lean forward knows " \
                   "input_layernorm, self_attn, post_attention_layernorm, mlp)"
    return None


def _eps(norm) -> float:
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if value is not None:
            return float(value)
    raise ValueError(f"{type(norm).__name__} has no variance_epsilon / eps")


def _float32_bound(model) -> float:
    """Relative bound on two float32 forwards that differ in summation order: a few units of float32's epsilon per
    layer, times the inner dimension's square root (random-walk rounding of a dot product)."""
    config = model.config.get_text_config(decoder=True)
    epsilon = torch.finfo(torch.float32).eps
    return 8 * epsilon * config.num_hidden_layers * max(config.hidden_size, config.intermediate_size) ** 0.5
