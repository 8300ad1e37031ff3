"""Medusa's serving layout besides native: vLLM's `medusa` checkpoint (its MedusaModel; reference B.5), which is also
how we read the FasterDecoding repository's releases (vLLM reads those too).

    config.json        model_type "medusa", architectures ["MedusaModel"], hidden_size, vocab_size, num_heads,
                       num_hidden_layers (residual blocks per head), medusa_fc_bias (the blocks have biases: vLLM's
                       default is none), original_lm_head (every head ends in one stored copy of the target's
                       lm_head), truncated_vocab_size (= vocab_size), and `draftsmith` (the drafter's lm_head and
                       step_decay, which servers ignore)
    model.safetensors  blocks.{h}.layers.{l}.weight [D, D] / .bias [D]; lm_heads.{h}.weight [V, D], or, with
                       original_lm_head, lm_head.weight [V, D] (the target's head, in the dtype it was loaded in)

Read also: the FasterDecoding layout (config.json with medusa_num_heads / medusa_num_layers and neither model_type nor
hidden_size; tensors `{h}.{l}.linear.weight|bias` and `{h}.{num_layers}.weight` for head h's lm_head, optionally
under `medusa_heads.`, in a medusa_lm_head.safetensors: a release's .pt is converted first), and vLLM's own keys
without biases (medusa_fc_bias false: the blocks are read with zero biases, which is what vLLM computes). A file vLLM
would read with a truncated vocabulary (token_map) or a logit_scale is refused by name. With original_lm_head the
drafter is read with the target's own head (lm_head "target"); doctor fails a file whose stored head is not the
target's (drafters/medusa/readers.py), since vLLM drafts with the stored one.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file

from drafters.base import TargetInfo, check_target_match
from drafters.medusa.config import MedusaConfig
from drafters.medusa.readers import CHECKS, expected_shape, layout, vllm_name

EXPORT_FORMATS = ("medusa",)


def detect_format(header: Mapping[str, Any]) -> str | None:
    """"medusa" for vLLM's layout and FasterDecoding's (medusa_num_heads, no model_type), else None."""
    if header.get("model_type") == "medusa" or ("model_type" not in header and "medusa_num_heads" in header):
        return "medusa"
    return None


def load_tensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, FasterDecoding's `medusa_heads.` prefix dropped."""
    files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{directory}: no safetensors weights (model.safetensors or medusa_lm_head.safetensors; "
                         "convert a medusa_lm_head.pt with safetensors.torch.save_file)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update({key.removeprefix("medusa_heads."): value
                        for key, value in load_file(os.path.join(directory, name)).items()})
    return tensors


def read(directory: str, header: Mapping[str, Any], fmt: str, target_info: TargetInfo):
    """(MedusaConfig, state dict) of a vLLM / FasterDecoding Medusa checkpoint for `target_info` (module doc)."""
    scale = header.get("logit_scale", 1.0)
    if scale != 1.0:
        raise ValueError(f"{directory}/config.json: logit_scale {scale} is not read; draftsmith's Medusa heads "
                         "have none")
    truncated = header.get("truncated_vocab_size")
    if truncated is not None and truncated != header.get("vocab_size", truncated):
        raise ValueError(f"{directory}/config.json: truncated_vocab_size {truncated} (a reduced draft vocabulary) "
                         "is not read; draftsmith's Medusa drafts over the full vocabulary")
    tensors = load_tensors(directory)
    found = layout(header, list(tensors), directory)
    d, v = target_info.hidden_size, target_info.vocab_size
    check_target_match(target_info, int(header.get("hidden_size") or d), int(header.get("vocab_size") or v), directory)
    for name, ours in found["ours"].items():  # FasterDecoding's config gives neither width: vLLM takes the target's V
        want = expected_shape(ours, d, v)
        if tuple(tensors[name].shape) != want:
            raise ValueError(f"{directory}: {name} is {list(tensors[name].shape)}; the target's widths make it "
                             f"{list(want)}")
    state = {ours: tensors[name] for name, ours in found["ours"].items() if ours != "lm_head"}
    dtype = next(iter(tensors.values())).dtype
    for h in range(found["num_heads"]):  # no biases: vLLM's medusa_fc_bias false computes none
        for layer in range(found["num_layers"]):
            state.setdefault(f"heads.{h}.blocks.{layer}.linear.bias", torch.zeros(d, dtype=dtype))
    ours = header.get("draftsmith") or {}
    own = ours.get("lm_head") if ours.get("lm_head") in ("copy", "new") else "copy"
    config = MedusaConfig(num_heads=found["num_heads"], num_layers=found["num_layers"],
                          lm_head="target" if found["shared"] else own,
                          step_decay=float(ours.get("step_decay", 0.8)))
    return config, state


def write(drafter, directory: str, fmt: str) -> None:
    """Write `drafter` in vLLM's medusa layout (module doc)."""
    config, info = drafter.config, drafter.target_info
    os.makedirs(directory, exist_ok=True)
    shared = config.lm_head == "target"
    header = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": info.hidden_size,
              "vocab_size": info.vocab_size, "truncated_vocab_size": info.vocab_size, "num_heads": config.num_heads,
              "num_hidden_layers": config.num_layers, "medusa_fc_bias": True, "original_lm_head": shared,
              "torch_dtype": str(next(drafter.parameters()).dtype).removeprefix("torch."),
              "draftsmith": {"lm_head": config.lm_head, "step_decay": config.step_decay}}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(header, f, indent=2)
    tensors = {vllm_name(name): tensor for name, tensor in drafter.state_dict().items()}
    if shared:
        tensors["lm_head.weight"] = info.lm_head_weight
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
              os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


def export_checks(directory: str, target_info: TargetInfo) -> list:
    """Check a Medusa checkpoint directory against `target_info` the way each reader will read it."""
    return CHECKS.run(directory, target_info, detect_format, read)


store_confidence_temperatures = None  # no confidence head
