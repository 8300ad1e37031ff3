"""DSpark checkpoint layouts that other implementations load (reference formats_and_serving.md 2.1-2.3 and
algorithms_dflash_dspark.md 2.5; field names checked against speculators 0.9.0's DSparkSpeculatorConfig /
DSparkDraftModel and DeepSpec's Qwen3DSparkModel / build_draft_config).

The design notes behind this module: docs/decisions.md, "drafters/dspark/export.py".
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
from safetensors.torch import save_file

from drafters.base import NATIVE_KIND_KEY, TargetInfo, check_target_match
from drafters.dflash.export import (block_speculators_config, check_layer_shapes, check_supported, dtype_name,
                                    load_weights)
from drafters.dspark.config import DSparkConfig
from drafters.dspark.layers import backbone_config
from drafters.dspark.readers import CHECKS
from drafters.files import write_json_atomic
from drafters.layers import rope_parameters

EXPORT_FORMATS = ("speculators", "deepspec")
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"
_OURS = "draftsmith"
_TRAINING_FIELDS = ("num_anchors", "allow_text_mask_token", "ce_weight", "l1_weight", "confidence_weight",
                    "loss_decay_gamma", "confidence_temperatures", "loss")
_DROPPED_WEIGHTS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def detect_format(config: Mapping[str, Any]) -> str | None:
    """"speculators" or "deepspec" for a DSpark export's config.json dict, else None (native is the drafter's)."""
    if config.get("speculators_model_type") == "dspark" and "speculators_config" in config:
        return "speculators"
    architectures = [str(a) for a in config.get("architectures") or ()]
    if any(a.endswith("DSparkModel") for a in architectures):
        return "deepspec"
    return None


# ---- writing ------------------------------------------------------------------------------------------------------
def write(drafter, directory: str, fmt: str) -> None:
    """Write `drafter` (a DSparkDrafter) to `directory` in `fmt` ("speculators" or "deepspec")."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown DSpark export format {fmt!r}; known: {', '.join(EXPORT_FORMATS)}")
    if drafter.lm_head is not None:
        raise ValueError(f"--format {fmt}: its readers take a DSpark drafter over the full vocabulary, and this one "
                         "has a reduced draft vocabulary; write it with --format native")
    os.makedirs(directory, exist_ok=True)
    config = speculators_config(drafter) if fmt == "speculators" else deepspec_config(drafter)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in drafter.state_dict().items()}
    if fmt == "deepspec":  # DeepSpec's model owns frozen copies of the target's embedding and lm_head
        dtype = drafter.fc.weight.dtype
        tensors["embed_tokens.weight"] = drafter.target_info.embed_weight.detach().to("cpu", dtype).contiguous()
        # .clone(): a target with tied embeddings (SmolLM2) shares one tensor, which safetensors refuses to write twice
        tensors["lm_head.weight"] = drafter.target_info.lm_head_weight.detach().to("cpu", dtype).clone()
    save_file(tensors, os.path.join(directory, "model.safetensors"))


def _heads(drafter) -> dict[str, Any]:
    config = drafter.config
    rank = 0 if config.markov_head_type == "none" else int(config.markov_rank)
    return {"markov_rank": rank, "markov_head_type": "vanilla" if rank == 0 else config.markov_head_type,
            "enable_confidence_head": bool(config.enable_confidence_head),
            "confidence_head_with_markov": bool(config.enable_confidence_head and config.confidence_head_with_markov)}


def _ours(drafter) -> dict[str, Any]:
    settings = {name: getattr(drafter.config, name) for name in _TRAINING_FIELDS}
    settings["confidence_temperatures"] = list(settings["confidence_temperatures"])
    return {"layer_ids": [int(i) for i in drafter.layer_ids], **settings}


def speculators_config(drafter) -> dict[str, Any]:
    """DSpark's speculators config.json dict: slot 0 drafts too (sample_from_anchor), so a block proposes block_size
    speculative tokens; the full target vocabulary; the heads' settings after sample_from_anchor."""
    return block_speculators_config(drafter, "dspark", "DSparkSpeculator",
                                    draft_vocab_size=drafter.target_info.vocab_size,
                                    num_speculative_tokens=int(drafter.config.block_size), sample_from_anchor=True,
                                    ours=_ours(drafter), heads=_heads(drafter))


def deepspec_config(drafter) -> dict[str, Any]:
    """The DeepSpec config.json dict: the draft layers' Qwen3 config plus DeepSpec's DSpark fields."""
    info = drafter.target_info
    return {
        **dict(drafter.layer_config),
        "architectures": [DEEPSPEC_ARCHITECTURE],
        "model_type": "qwen3",
        "num_target_layers": info.num_layers,
        "block_size": int(drafter.config.block_size),
        "mask_token_id": int(drafter.mask_token_id),
        "target_layer_ids": [int(i) - 1 for i in drafter.layer_ids],  # layer outputs, -1 = the embedding output
        "num_anchors": int(drafter.config.num_anchors),
        **_heads(drafter),
        "vocab_size": info.vocab_size,
        "pad_token_id": info.pad_token_id,
        "torch_dtype": dtype_name(drafter),
        _OURS: _ours(drafter),
    }


def store_confidence_temperatures(directory: str, temperatures: list[float]) -> None:
    """Put STS temperatures into the config.json of a DSpark checkpoint in any of our formats (weights untouched)."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        header = json.load(f)
    if header.get(NATIVE_KIND_KEY) == "dspark":
        section = header["drafter_config"]
    elif detect_format(header) is not None:
        section = header.setdefault(_OURS, {})
    else:
        raise ValueError(f"{directory}: not a DSpark checkpoint; cannot store confidence temperatures in it")
    section["confidence_temperatures"] = [float(t) for t in temperatures]
    write_json_atomic(path, header, indent=2)


# ---- reading ------------------------------------------------------------------------------------------------------
def read(directory: str, header: Mapping[str, Any], fmt: str, target_info: TargetInfo):
    """Parse a speculators / DeepSpec DSpark checkpoint into (DSparkConfig, state dict for DSparkDrafter).

    Refuses, with a ValueError naming the field: layer ids that do not fit the target, a checkpoint built for
    another target, a DFlash-style block (sample_from_anchor false), and what our backbone does not implement.
    """
    if fmt == "speculators":
        layer, layer_ids, field = _speculators_header(directory, header)
    elif fmt == "deepspec":
        layer, layer_ids, field = _deepspec_header(directory, header, target_info)
    else:
        raise ValueError(f"{directory}: unknown DSpark checkpoint format {fmt!r}; known: {', '.join(EXPORT_FORMATS)}")
    check_target_match(target_info, layer.get("hidden_size"), layer.get("vocab_size", target_info.vocab_size),
                       directory)
    bad = [i for i in layer_ids if not 0 <= i < target_info.num_layers]
    if not layer_ids or bad or len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"{directory}: {field} (our ids {layer_ids}) must be distinct ids that fit a "
                         f"{target_info.num_layers}-layer target (ours 0..{target_info.num_layers - 1})")
    check_supported(directory, header, layer)
    ours = header.get(_OURS) or {}
    rank = int(header.get("markov_rank", 0))
    rope = rope_parameters(layer)
    config = DSparkConfig(
        layer_ids=tuple(layer_ids),
        allow_linear_attention_ids=True,  # a foreign checkpoint's ids are what it was trained on
        num_layers=int(layer["num_hidden_layers"]),
        block_size=int(header["block_size"]),
        mask_token_id=int(header["mask_token_id"]),
        allow_text_mask_token=bool(ours.get("allow_text_mask_token", True)),
        markov_head_type=str(header.get("markov_head_type", "vanilla")) if rank > 0 else "none",
        markov_rank=rank if rank > 0 else DSparkConfig.markov_rank,
        enable_confidence_head=bool(header.get("enable_confidence_head", False)),
        confidence_head_with_markov=bool(header.get("confidence_head_with_markov", False)),
        intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=int(layer["num_attention_heads"]),
        num_key_value_heads=int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        head_dim=int(layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]),
        rope_theta=float(rope["rope_theta"]),
        **_training_settings(header, ours),
    )
    check_layer_shapes(directory, layer, backbone_config(config), target_info)
    return config, _read_tensors(directory, target_info)


def _training_settings(header, ours) -> dict[str, Any]:
    """Our training settings back from the "draftsmith" key (DeepSpec's own num_anchors when ours is absent)."""
    settings = {name: ours[name] for name in _TRAINING_FIELDS if name in ours and name != "allow_text_mask_token"}
    if "confidence_temperatures" in settings:
        settings["confidence_temperatures"] = tuple(float(t) for t in settings["confidence_temperatures"])
    if "num_anchors" not in settings and header.get("num_anchors") is not None:
        settings["num_anchors"] = int(header["num_anchors"])
    return settings


def _speculators_header(directory, header):
    layer = header.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        raise ValueError(f"{directory}: the speculators config has no transformer_layer_config")
    for key in ("mask_token_id", "aux_hidden_state_layer_ids", "block_size"):
        if header.get(key) is None:
            raise ValueError(f"{directory}: the speculators config has no {key}")
    if not header.get("sample_from_anchor", True):
        raise ValueError(f"{directory}: sample_from_anchor=false is DFlash's 1+N block (the anchor slot does not "
                         "draft); a DSpark block drafts from its anchor slot on")
    return dict(layer), [int(i) for i in header["aux_hidden_state_layer_ids"]], "aux_hidden_state_layer_ids"


def _deepspec_header(directory, header, target_info):
    for key in ("mask_token_id", "target_layer_ids", "block_size"):
        if header.get(key) is None:
            raise ValueError(f"{directory}: the DeepSpec config has no {key}")
    num_target = header.get("num_target_layers")
    if num_target is not None and int(num_target) != target_info.num_layers:
        raise ValueError(f"{directory}: num_target_layers {num_target} does not match the target's "
                         f"{target_info.num_layers} layers")
    return dict(header), [int(t) + 1 for t in header["target_layer_ids"]], "target_layer_ids"


def _read_tensors(directory: str, target_info: TargetInfo) -> dict[str, torch.Tensor]:
    """Every safetensors file, without a "model." prefix and without the target's own tensors (shape-checked)."""
    state = load_weights(directory)
    expected = (target_info.vocab_size, target_info.hidden_size)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in state and tuple(state[name].shape) != expected:
            raise ValueError(f"{directory}: {name} has shape {list(state[name].shape)}, the target's is "
                             f"{list(expected)}")
    return {name: tensor for name, tensor in state.items() if name not in _DROPPED_WEIGHTS}


# ---- the doctor (drafters/base.py: the export module's contract) ------------------------------------------------
def export_checks(directory: str, target_info: TargetInfo) -> list:
    """Check a DSpark checkpoint directory against `target_info` the way its readers will read it."""
    return CHECKS.run(directory, target_info, detect_format, read)
