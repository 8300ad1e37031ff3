"""The assistant's serving layout besides native: Gemma 4's `gemma4_assistant` checkpoint (reference B.6).

    config.json        model_type "gemma4_assistant", architectures ["Gemma4AssistantForCausalLM"], text_config (a
                       gemma4_text config whose layers all reuse K/V), backbone_hidden_size (the target's width),
                       use_ordered_embeddings, tie_word_embeddings
    model.safetensors  model.embed_tokens.weight [V, W] (tied: the lm_head), model.layers.{i}.* (Gemma 4 decoder
                       layers without K/V projections), model.norm.weight, pre_projection.weight [W, 2D],
                       post_projection.weight [D, W]

Reading maps it onto an AssistantDrafter whose `gemma4_config` is the checkpoint's text_config (so its layers are
transformers' own Gemma 4 layers); writing is the inverse and needs such a drafter (Llama-style layers have no
Gemma 4 equivalent). Assistants with `use_ordered_embeddings` (centroid-masked logits) are refused by name. The
drafter's AssistantConfig.reading is written as `draftsmith_reading` (servers ignore it) and read back; a checkpoint
without it (a released assistant) is read in transformers' reading.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from safetensors.torch import load_file, save_file

from drafters.assistant.config import AssistantConfig
from drafters.base import TargetInfo, check_target_match

EXPORT_FORMATS = ("gemma4_assistant",)
_OWN = {"model.norm.weight": "norm.weight", "pre_projection.weight": "pre_projection.weight",
        "post_projection.weight": "post_projection.weight", "model.embed_tokens.weight": "lm_head.weight"}


def detect_format(header: Mapping[str, Any]) -> str | None:
    return "gemma4_assistant" if header.get("model_type") == "gemma4_assistant" else None


def _ours(name: str) -> str | None:
    """A checkpoint tensor name -> our state-dict name (None for names we do not hold: lm_head is tied)."""
    if name in _OWN:
        return _OWN[name]
    if name.startswith("model.layers."):
        index, rest = name.removeprefix("model.layers.").split(".", 1)
        return f"layers.{index}.block.{rest}"
    return None


def read(directory: str, header: Mapping[str, Any], fmt: str, target_info: TargetInfo):
    """(AssistantConfig, state dict) of a gemma4_assistant checkpoint for `target_info`."""
    text = dict(header.get("text_config") or {})
    if not text:
        raise ValueError(f"{directory}/config.json: a gemma4_assistant config needs a text_config")
    if header.get("use_ordered_embeddings"):
        raise ValueError(f"{directory}/config.json: use_ordered_embeddings (centroid-masked logits) is not "
                         "supported; only assistants with a plain tied lm_head are read")
    check_target_match(target_info, header.get("backbone_hidden_size"), text.get("vocab_size"), directory)
    config = AssistantConfig(num_layers=int(text["num_hidden_layers"]), hidden_size=int(text["hidden_size"]),
                             intermediate_size=int(text["intermediate_size"]), gemma4_config=text,
                             reading=header.get("draftsmith_reading", "transformers"))
    path = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(path):
        raise ValueError(f"{directory}: no model.safetensors (sharded assistant checkpoints are not read)")
    tensors = load_file(path)
    state = {_ours(name): tensor for name, tensor in tensors.items() if _ours(name) is not None}
    if "lm_head.weight" not in state and "lm_head.weight" in tensors:  # an untied copy of the head
        state["lm_head.weight"] = tensors["lm_head.weight"]
    return config, state


def write(drafter, directory: str, fmt: str) -> None:
    """Write `drafter` (one with gemma4_config) as a gemma4_assistant checkpoint."""
    config = drafter.config
    if config.gemma4_config is None:
        raise ValueError("gemma4_assistant export needs an assistant with Gemma 4 layers (drafter.gemma4_config, "
                         "set when one was imported); this one has Llama-style layers: export it as native")
    os.makedirs(directory, exist_ok=True)
    header = {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
              "backbone_hidden_size": drafter.target_info.hidden_size, "text_config": config.gemma4_config,
              "use_ordered_embeddings": False, "tie_word_embeddings": True, "draftsmith_reading": config.reading}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(header, f, indent=2)
    inverse = {ours: theirs for theirs, ours in _OWN.items()}
    tensors = {}
    for name, tensor in drafter.state_dict().items():
        if name.startswith("layers."):
            index, rest = name.removeprefix("layers.").split(".", 1)
            theirs = f"model.layers.{index}.{rest.removeprefix('block.')}"
        else:
            theirs = inverse.get(name)
        if theirs is not None:
            tensors[theirs] = tensor.detach().contiguous().cpu()
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


export_checks = None  # no format checks modelled for its readers (drafters/base.py: the export module's contract)
store_confidence_temperatures = None  # no confidence head
