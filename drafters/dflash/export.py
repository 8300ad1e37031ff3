"""DFlash checkpoint layouts that other implementations load (reference formats_and_serving.md 2.1-2.5 and
algorithms_dflash_dspark.md 1.5; field names checked against dflash 0.1.0, speculators 0.9.0, transformers 5.24 and
vLLM's qwen3_dflash.py, see docs/benchmarks.md "DFlash: independent clients").

The design notes behind this module: docs/decisions.md, "drafters/dflash/export.py".
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file

from drafters.base import TargetInfo, check_target_match
from drafters.dflash.config import DFlashConfig
from drafters.dflash.layers import draft_layer_config
from drafters.dflash.readers import CHECKS, ZLAB_DEFAULT_BLOCK_SIZE, zlab_default_layer_ids
from drafters.layers import rope_parameters
from drafters.speculators import speculators_section
from drafters.vocab import complete_vocab_tables

EXPORT_FORMATS = ("dflash", "speculators")
SPECULATORS_VERSION = "0.9.0"  # the speculators schema this writer follows
SPECULATORS_DEFAULT_BLOCK_SIZE = 8  # DFlashSpeculatorConfig's default
_OURS = "draftsmith"  # our own keys (training settings no standard key holds); engines ignore unknown keys
_DROPPED_WEIGHTS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
_TRAINING_FIELDS = ("num_anchors", "loss_decay_gamma", "allow_text_mask_token", "label_source", "loss")  # DFlashConfig


def detect_format(config: Mapping[str, Any]) -> str | None:
    """"speculators" or "dflash" for a DFlash export's config.json dict, else None (native is the drafter's:
    Drafter.detect_format)."""
    if config.get("speculators_model_type") == "dflash" and "speculators_config" in config:
        return "speculators"
    architectures = config.get("architectures") or ()
    if "DFlashDraftModel" in architectures or ("dflash_config" in config and not architectures):
        return "dflash"
    if any(str(name).startswith("DFlash") for name in architectures):
        return "dflash"  # a variant (DFlash2...): `read` names what it cannot load
    return None


# ---- writing ------------------------------------------------------------------------------------------------------
def write(drafter, directory: str, fmt: str) -> None:
    """Write `drafter` (a DFlashDrafter) to `directory` in `fmt` ("dflash" or "speculators")."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown DFlash export format {fmt!r}; known: {', '.join(EXPORT_FORMATS)}")
    if fmt == "speculators" and _has_head(drafter) and _draft_vocab_size(drafter) == drafter.target_info.vocab_size:
        raise ValueError("speculators reloads a full-vocabulary lm_head from the verifier, which would replace this "
                         "drafter's trained full-vocabulary head; export --format dflash or train with a smaller "
                         "drafter.draft_vocab_size")
    os.makedirs(directory, exist_ok=True)
    config = speculators_config(drafter) if fmt == "speculators" else dflash_config(drafter)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in drafter.state_dict().items()}
    if _draft_vocab_size(drafter) == drafter.target_info.vocab_size:
        # An identity mapping; vLLM has no d2t parameter when draft_vocab_size equals the target vocabulary.
        tensors.pop("d2t", None)
        tensors.pop("t2d", None)
    save_file(tensors, os.path.join(directory, "model.safetensors"))


def _has_head(drafter) -> bool:
    return "lm_head.weight" in drafter.state_dict()


def _draft_vocab_size(drafter) -> int:
    """Rows of the drafter's own head, or the target vocabulary when it uses the target's lm_head."""
    state = drafter.state_dict()
    return int(state["lm_head.weight"].shape[0]) if "lm_head.weight" in state else drafter.target_info.vocab_size


def dtype_name(drafter) -> str:
    """The drafter's weight dtype as config.json spells it ("float32", "bfloat16")."""
    return str(drafter.fc.weight.dtype).removeprefix("torch.")


def _ours(drafter) -> dict[str, Any]:
    """Training settings no standard key holds, and our ids (vLLM convention) for the record."""
    settings = {name: getattr(drafter.config, name) for name in _TRAINING_FIELDS if hasattr(drafter.config, name)}
    return {"layer_ids": [int(i) for i in drafter.layer_ids], **settings}


def dflash_config(drafter) -> dict[str, Any]:
    """The z-lab config.json dict: the draft layers' Qwen3 config plus the DFlash keys."""
    info = drafter.target_info
    block_size = int(drafter.config.block_size)
    mask_token_id = int(drafter.mask_token_id)
    zlab_ids = [int(i) - 1 for i in drafter.layer_ids]
    return {
        **dict(drafter.layer_config),
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": zlab_ids, "block_size": block_size},
        "num_target_layers": info.num_layers,
        "target_layer_ids": zlab_ids,
        "mask_token_id": mask_token_id,
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in drafter.layer_ids],
        "target_hidden_size": info.hidden_size,
        "draft_vocab_size": _draft_vocab_size(drafter),
        "vocab_size": info.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name(drafter),
        _OURS: _ours(drafter),
    }


def block_speculators_config(drafter, model_type: str, architecture: str, *, draft_vocab_size: int,
                             num_speculative_tokens: int, sample_from_anchor: bool, ours: Mapping[str, Any],
                             heads: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The speculators config.json dict of a block drafter (DFlash, and DSpark on DFlash's backbone): no top-level
    model_type; vLLM routes on speculators_config. `heads`: extra keys after sample_from_anchor (DSpark's heads)."""
    info = drafter.target_info
    return {
        "speculators_model_type": model_type,
        "speculators_version": SPECULATORS_VERSION,
        "architectures": [architecture],
        "transformer_layer_config": {**dict(drafter.layer_config), "model_type": "qwen3"},
        "draft_vocab_size": draft_vocab_size,
        "block_size": int(drafter.config.block_size),
        "target_hidden_size": info.hidden_size,
        "aux_hidden_state_layer_ids": [int(i) for i in drafter.layer_ids],
        "mask_token_id": int(drafter.mask_token_id),
        "sliding_window_non_causal": False,
        "sample_from_anchor": sample_from_anchor,
        **(heads or {}),
        "torch_dtype": dtype_name(drafter),
        "tie_word_embeddings": False,
        "speculators_config": speculators_section(model_type, info, num_speculative_tokens),
        _OURS: ours,
    }


def speculators_config(drafter) -> dict[str, Any]:
    """DFlash's speculators config.json dict. The anchor is the bonus token (sample_from_anchor false), so a block
    of block_size slots proposes block_size - 1 drafts."""
    return block_speculators_config(drafter, "dflash", "DFlashSpeculator", draft_vocab_size=_draft_vocab_size(drafter),
                                    num_speculative_tokens=int(drafter.config.block_size) - 1,
                                    sample_from_anchor=False, ours=_ours(drafter))


# ---- reading ------------------------------------------------------------------------------------------------------
def read(directory: str, header: Mapping[str, Any], fmt: str, target_info: TargetInfo):
    """Parse a dflash / speculators checkpoint into (DFlashConfig, state dict for DFlashDrafter.load_state_dict).

    Refuses, with a ValueError naming the field: a missing mask token, layer ids that do not fit the target, a
    checkpoint built for another target, and features draftsmith's DFlash does not implement (sliding-window or
    causal draft layers, DFlash2 modules, logit scaling, sampling from the anchor).
    """
    if fmt == "dflash":
        layer, layer_ids, mask_token_id, block_size = _read_dflash_header(directory, header, target_info)
    elif fmt == "speculators":
        layer, layer_ids, mask_token_id, block_size = _read_speculators_header(directory, header, target_info)
    else:
        raise ValueError(f"{directory}: unknown DFlash checkpoint format {fmt!r}; known: {', '.join(EXPORT_FORMATS)}")
    check_target_match(target_info, layer.get("hidden_size"), layer.get("vocab_size"), directory)
    check_supported(directory, header, layer)
    if not 0 <= mask_token_id < target_info.vocab_size:
        raise ValueError(f"{directory}: mask_token_id {mask_token_id} is outside the target vocabulary "
                         f"[0, {target_info.vocab_size})")
    state = _read_tensors(directory, target_info.vocab_size)
    fc = state.get("fc.weight")
    if fc is None:
        raise ValueError(f"{directory}: the weights have no fc.weight")
    expected = len(layer_ids) * target_info.hidden_size
    if fc.shape[1] != expected:
        raise ValueError(f"{directory}: fc.weight takes {fc.shape[1]} features but {len(layer_ids)} layer ids x hidden "
                         f"{target_info.hidden_size} = {expected}; the layer id list does not match the weights")
    head = state.get("lm_head.weight")
    known = {f.name for f in dataclasses.fields(DFlashConfig)}
    ours = {k: v for k, v in (header.get(_OURS) or {}).items() if k in _TRAINING_FIELDS and k in known}
    # A foreign checkpoint's mask row is whatever it was trained with; ours records the choice.
    ours.setdefault("allow_text_mask_token", True)
    ours.setdefault("allow_linear_attention_ids", True)  # and its layer ids (z-lab's Qwen3.5 ones read GDN layers)
    rope = rope_parameters(layer)
    config = DFlashConfig(
        **ours,
        layer_ids=tuple(layer_ids),
        num_layers=int(layer["num_hidden_layers"]),
        block_size=block_size,
        mask_token_id=mask_token_id,
        draft_vocab_size=None if head is None else int(head.shape[0]),
        intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=int(layer["num_attention_heads"]),
        num_key_value_heads=int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        head_dim=int(layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]),
        rope_theta=float(rope["rope_theta"]),
    )
    check_layer_shapes(directory, layer, config, target_info)
    return config, state


def _read_dflash_header(directory, header, target_info):
    """(layer config, our layer ids, mask token id, block size) of a z-lab config."""
    nested = header.get("dflash_config") or {}
    mask = nested.get("mask_token_id", header.get("mask_token_id"))
    if mask is None:
        raise ValueError(f"{directory}: the DFlash config has no dflash_config.mask_token_id; the drafter cannot be "
                         "used without knowing which vocabulary row it was trained to read as a masked slot")
    num_target = header.get("num_target_layers")
    if num_target is not None and int(num_target) != target_info.num_layers:
        raise ValueError(f"{directory}: num_target_layers {num_target} does not match the target's "
                         f"{target_info.num_layers} layers")
    zlab = nested.get("target_layer_ids", header.get("target_layer_ids"))
    field = "dflash_config.target_layer_ids"
    if zlab is None:  # first-release z-lab checkpoints: the package's default rule over num_target_layers
        if num_target is None:
            raise ValueError(f"{directory}: the DFlash config has neither {field} nor num_target_layers")
        zlab = zlab_default_layer_ids(int(num_target), int(header["num_hidden_layers"]))
        field = f"the z-lab default target_layer_ids for num_target_layers={num_target}"
    layer_ids = [int(t) + 1 for t in zlab]  # z-lab id t reads HF hidden_states[t + 1] = our id t + 1
    aux = header.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and [int(i) for i in aux] != layer_ids:
        raise ValueError(f"{directory}: eagle_aux_hidden_state_layer_ids {list(aux)} (vLLM ids) disagree with {field} "
                         f"{list(zlab)} (z-lab ids, expected vLLM ids {layer_ids})")
    _check_ids(directory, field, list(zlab), layer_ids, target_info.num_layers, offset=-1)
    block_size = header.get("block_size", nested.get("block_size", ZLAB_DEFAULT_BLOCK_SIZE))
    return header, layer_ids, int(mask), int(block_size)


def _read_speculators_header(directory, header, target_info):
    """(layer config, our layer ids, mask token id, block size) of a speculators dflash config."""
    layer = header.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        raise ValueError(f"{directory}: the speculators config has no transformer_layer_config")
    layer = dict(layer)
    layer.setdefault("vocab_size", target_info.vocab_size)
    if header.get("mask_token_id") is None:
        raise ValueError(f"{directory}: the speculators config has no mask_token_id (vLLM requires it)")
    aux = header.get("aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError(f"{directory}: the speculators config has no aux_hidden_state_layer_ids (vLLM requires it)")
    layer_ids = [int(i) for i in aux]
    _check_ids(directory, "aux_hidden_state_layer_ids", layer_ids, layer_ids, target_info.num_layers, offset=0)
    if header.get("sample_from_anchor"):
        raise ValueError(f"{directory}: sample_from_anchor=true (the anchor slot also drafts) is not DFlash's 1+N "
                         "block; draftsmith's DFlash (and vLLM's) needs false")
    hidden = header.get("target_hidden_size")
    if hidden is not None and int(hidden) != layer.get("hidden_size"):
        raise ValueError(f"{directory}: target_hidden_size {hidden} differs from the draft hidden_size "
                         f"{layer.get('hidden_size')}; draftsmith's DFlash needs them equal")
    block_size = header.get("block_size", SPECULATORS_DEFAULT_BLOCK_SIZE)
    return layer, layer_ids, int(header["mask_token_id"]), int(block_size)


def _check_ids(directory, field, written, ours, num_layers, offset):
    """Our ids must lie in [0, N-1] (id N, the final pre-norm output, would be read post-norm by HF readers)."""
    if not ours or len(set(ours)) != len(ours):
        raise ValueError(f"{directory}: {field} {written} must be a non-empty list of distinct ids")
    bad = [w for w, i in zip(written, ours) if not 0 <= i < num_layers]
    if bad:
        low, high = offset, num_layers - 1 + offset
        raise ValueError(f"{directory}: {field} {written}: ids {bad} do not fit a {num_layers}-layer target "
                         f"(allowed {low}..{high} in this file's convention)")


def check_supported(directory, header, layer) -> None:
    """Refuse what draftsmith's DFlash backbone (full, non-causal Qwen3 attention; plain logits) does not implement
    (DSpark's export reads with it too)."""
    nested = header.get("dflash_config") or {}
    architectures = [str(a) for a in header.get("architectures") or ()]
    known = ("DFlashDraftModel", "DFlashSpeculator")
    variants = [a for a in architectures if a.startswith("DFlash") and a not in known]
    if variants:
        raise ValueError(f"{directory}: architectures {variants} carry modules draftsmith's DFlash does not have")
    sliding = [t for t in layer.get("layer_types") or () if t != "full_attention"]
    if sliding or layer.get("use_sliding_window") or nested.get("use_swa"):
        raise ValueError(f"{directory}: layer_types / use_sliding_window: sliding-window draft layers are not "
                         "supported (draftsmith's DFlash layers attend to the full context)")
    if layer.get("is_causal") or nested.get("causal") or nested.get("causal_head"):
        raise ValueError(f"{directory}: causal draft attention is not supported (DFlash blocks are bidirectional)")
    if layer.get("attention_bias"):
        raise ValueError(f"{directory}: attention_bias=true is not supported (the draft projections have no bias)")
    for key, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", None),
                         ("attention_sink_bias", False)):
        value = nested.get(key, header.get(key))
        if value not in (None, neutral) and not (key == "final_logit_softcapping" and not value):
            raise ValueError(f"{directory}: {key}={value} is not supported by draftsmith's DFlash")
    if layer.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{directory}: hidden_act {layer.get('hidden_act')!r} is not supported (silu)")


def check_layer_shapes(directory, layer, config: DFlashConfig, target_info: TargetInfo) -> None:
    """What DFlashConfig cannot express must equal what draftsmith derives from the target (norm eps, RoPE type)."""
    derived = draft_layer_config(config, target_info)
    eps = layer.get("rms_norm_eps")
    if eps is not None and abs(float(eps) - derived["rms_norm_eps"]) > 1e-12:
        raise ValueError(f"{directory}: rms_norm_eps {eps} differs from the target's {derived['rms_norm_eps']}; "
                         "draftsmith's DFlash layers use the target's")
    written, ours = rope_parameters(layer), derived["rope_parameters"]
    if written.get("rope_type") != ours.get("rope_type") or {k: v for k, v in written.items() if k != "rope_theta"} != {
            k: v for k, v in ours.items() if k != "rope_theta"}:
        raise ValueError(f"{directory}: rope_parameters {written} differ from the target's {ours} beyond rope_theta; "
                         "draftsmith's DFlash layers mirror the target's RoPE scaling")


def load_weights(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, without a "model." prefix (DSpark's export reads with it
    too)."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ValueError(f"{directory}: no .safetensors weights found")
    return {name.removeprefix("model."): tensor for path in files for name, tensor in load_file(path).items()}


def _read_tensors(directory: str, vocab_size: int) -> dict[str, torch.Tensor]:
    """All safetensors files of the directory, renamed to DFlashDrafter's state-dict names.

    Frozen copies of the target (embed_tokens, verifier_*) are dropped. An lm_head is kept as the drafter's own head
    (a full-vocabulary one, e.g. the verifier copy older speculators versions wrote, gives the same logits); d2t / t2d
    are rebuilt when missing (identity for a full-vocabulary head).
    """
    state = {name: t for name, t in load_weights(directory).items() if name not in _DROPPED_WEIGHTS}
    head = state.get("lm_head.weight")
    if head is None:  # the target's full-vocabulary head
        for name in ("d2t", "t2d"):
            state.pop(name, None)
        return state
    draft_vocab = head.shape[0]  # a full-vocabulary head of its own needs no d2t (identity)
    complete_vocab_tables(state, draft_vocab, vocab_size, directory,
                          f"lm_head.weight has {draft_vocab} rows (a reduced draft vocabulary) but no d2t")
    return state


# ---- the doctor (drafters/base.py: the export module's contract) ------------------------------------------------
def export_checks(directory: str, target_info: TargetInfo) -> list:
    """Check a DFlash checkpoint directory against `target_info` the way each reader will read it."""
    return CHECKS.run(directory, target_info, detect_format, read)


store_confidence_temperatures = None  # no confidence head
