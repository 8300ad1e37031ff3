"""EAGLE-3 checkpoint formats that serving engines load (reference formats_and_serving.md sections 2.1-2.5).

- "speculators": vLLM speculators layout. config.json has no top-level model_type, `speculators_model_type:
  "eagle3"`, a `transformer_layer_config` (HF Llama dict, with `num_aux_hidden_states`, which vLLM's config code
  passes through to size the fc) and `speculators_config` (proposal methods, verifier). `vllm serve <dir>`; the
  recommendation for vLLM.
- "eagle3": the plain LlamaForCausalLMEagle3 layout vLLM loads with `--speculative-config '{"method": "eagle3",
  "model": <dir>, "num_speculative_tokens": K}'`: top-level aux layer ids (vLLM convention), `layers.i.*` names.
- "sglang": what SGLang (`--speculative-algorithm EAGLE3`) and SpecForge read: the single draft layer as
  `midlayer.*`, the ids in `eagle_config.eagle_aux_hidden_state_layer_ids` in their convention (k = the output of
  decoder layer k = our id k + 1), and no `norm_output` key (SpecForge reads it as "apply the final norm", vLLM and
  SGLang as "feed the post-norm hidden to the next step"). The vLLM-convention ids are also written at the top
  level, which vLLM reads first and SGLang / SpecForge ignore, so vLLM serves this layout correctly too. A drafter
  these readers cannot express (several layers, norm_before_residual, not 3 aux states, our id 0 or N) is refused.

All write one model.safetensors without a "model." prefix: embed_tokens (a frozen copy of the target's), fc, the
draft layers, norm, lm_head, d2t (int64 offsets) and t2d (bool). d2t / t2d are left out of "speculators" and
"eagle3" when the draft vocabulary is the whole target vocabulary (vLLM's strict loader has no parameter for them
then). Ids are sorted and unique (vLLM captures `sorted(set(ids))` and concatenates features in that order).

What each server makes of these files (the layer ids each one reads included), and the checks `draftsmith doctor` runs
on them, are in drafters/eagle3/readers.py; `export_checks` runs those checks, and no layout stores calibration
temperatures (`store_confidence_temperatures` is None).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file

from drafters.base import TargetInfo, check_target_match
from drafters.eagle3.config import Eagle3Config
from drafters.eagle3.layers import fold_fc_columns
from drafters.eagle3.readers import CHECKS, listed_layer_ids, nested_layer_ids
from drafters.layers import rope_parameters
from drafters.speculators import speculators_section
from drafters.vocab import complete_vocab_tables

EXPORT_FORMATS = ("speculators", "eagle3", "sglang")
SPECULATORS_VERSION = "0.3.0"  # the speculators config schema this writer follows
SGLANG_NUM_AUX = 3  # SpecForge's fc reads exactly three aux states

_UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "attention_bias", "mlp_bias")


def detect_format(config: Mapping[str, Any]) -> str | None:
    """"speculators", "eagle3" or "sglang" for an EAGLE-3 export's config.json dict, else None (native is the
    drafter's: Drafter.detect_format).

    A LlamaForCausalLMEagle3-style config with nested `eagle_config` ids is the SGLang / SpecForge layout.
    """
    if config.get("speculators_model_type") == "eagle3" and "speculators_config" in config:
        return "speculators"
    if any("Eagle3" in name for name in config.get("architectures") or ()):
        return "sglang" if nested_layer_ids(config) is not None else "eagle3"
    return None


# ---- writing ---------------------------------------------------------------------------------------------------
def sglang_problems(num_layers: int, norm_before_residual: bool, layer_ids, num_target_layers: int) -> list[str]:
    """Why SGLang / SpecForge would misread an EAGLE-3 drafter of this shape (empty when they read it right)."""
    problems = []
    if num_layers != 1:
        problems.append(f"{num_layers} draft layers (SpecForge builds exactly one, and SGLang uses hidden_norm as the"
                        " pre-attention norm of layers >= 1 where draftsmith and vLLM use input_layernorm)")
    if norm_before_residual:
        problems.append("norm_before_residual (neither has it: both keep the un-normed hidden as the residual)")
    if len(layer_ids) != SGLANG_NUM_AUX:
        problems.append(f"{len(layer_ids)} aux layer ids (SpecForge's fc reads exactly {SGLANG_NUM_AUX})")
    if 0 in layer_ids:
        problems.append("layer id 0 (their ids count decoder-layer outputs, id k = our k + 1: the embeddings"
                        " would be -1)")
    if num_target_layers in layer_ids:
        problems.append(f"layer id {num_target_layers}, the final pre-norm output (their {num_target_layers - 1},"
                        " which SGLang never captures)")
    return problems


def write(drafter, directory: str, fmt: str) -> None:
    """Write `drafter` (an Eagle3Drafter) to `directory` in `fmt` (one of EXPORT_FORMATS).

    Raises ValueError, naming the reader and the format to use instead, when `fmt` cannot carry the drafter.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown EAGLE-3 export format {fmt!r}; known: {', '.join(EXPORT_FORMATS)}")
    if fmt == "sglang":
        problems = sglang_problems(drafter.config.num_layers, drafter.config.norm_before_residual,
                                   drafter.layer_ids, drafter.target_info.num_layers)
        if problems:
            raise ValueError("--format sglang cannot carry this drafter: SGLang and SpecForge would load it and draft"
                             f" garbage: {'; '.join(problems)}. Export --format speculators (or eagle3) and serve it"
                             " with vLLM instead")
    writers = {"speculators": speculators_config, "eagle3": eagle3_config, "sglang": sglang_config}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(writers[fmt](drafter), f, indent=2)
    save_file(export_tensors(drafter, fmt), os.path.join(directory, "model.safetensors"))


def export_tensors(drafter, fmt: str) -> dict[str, torch.Tensor]:
    """The weights as `fmt` names them (see the module docstring)."""
    tensors = {"embed_tokens.weight": drafter.target_info.embed_weight, **drafter.state_dict()}
    if fmt != "sglang" and drafter.config.draft_vocab_size == drafter.target_info.vocab_size:
        tensors = {name: t for name, t in tensors.items() if name not in ("d2t", "t2d")}
    if fmt == "sglang":
        tensors = {name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name: t
                   for name, t in tensors.items()}
    return {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}


def _eagle3_fields(drafter) -> dict[str, Any]:
    """Top-level keys the vLLM layouts carry; norm flags are explicit because readers default them differently."""
    return {
        "draft_vocab_size": drafter.config.draft_vocab_size,
        "norm_before_residual": drafter.config.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "target_hidden_size": drafter.target_info.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(drafter.layer_ids),
        "torch_dtype": str(drafter.fc.weight.dtype).removeprefix("torch."),
        "tie_word_embeddings": False,
    }


def speculators_config(drafter) -> dict[str, Any]:
    """The speculators config.json dict (no top-level model_type; vLLM routes on speculators_config)."""
    return {
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {**drafter.layer_config, "num_aux_hidden_states": len(drafter.layer_ids)},
        **_eagle3_fields(drafter),
        "embed_requires_grad": False,
        "speculators_config": speculators_section("eagle3", drafter.target_info, drafter.config.ttt_steps),
    }


def _training_fields(drafter) -> dict[str, Any]:
    # No standard key holds the training depth; engines ignore unknown keys, our loader reads it back.
    return {"draftsmith": {"ttt_steps": drafter.config.ttt_steps, "step_decay": drafter.config.step_decay}}


def eagle3_config(drafter) -> dict[str, Any]:
    """The plain LlamaForCausalLMEagle3 config.json dict vLLM reads (an HF Llama config plus EAGLE-3 keys)."""
    return {
        **dict(drafter.layer_config),
        "architectures": ["LlamaForCausalLMEagle3"],
        **_eagle3_fields(drafter),
        "num_aux_hidden_states": len(drafter.layer_ids),
        **_training_fields(drafter),
    }


def sglang_config(drafter) -> dict[str, Any]:
    """The SGLang / SpecForge config.json dict: nested ids in their convention (our id - 1), no norm_output."""
    return {
        **dict(drafter.layer_config),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": drafter.config.draft_vocab_size,
        "target_hidden_size": drafter.target_info.hidden_size,
        "num_aux_hidden_states": len(drafter.layer_ids),
        "eagle_config": {"use_aux_hidden_state": True,
                         "eagle_aux_hidden_state_layer_ids": [i - 1 for i in drafter.layer_ids]},
        "eagle_aux_hidden_state_layer_ids": list(drafter.layer_ids),  # vLLM convention; vLLM reads it first
        "norm_before_residual": False,  # vLLM's reading; SGLang and SpecForge have no such option
        "torch_dtype": str(drafter.fc.weight.dtype).removeprefix("torch."),
        "tie_word_embeddings": False,
        **_training_fields(drafter),
    }


# ---- reading ---------------------------------------------------------------------------------------------------
def read(directory: str, header: Mapping[str, Any], fmt: str, target_info: TargetInfo):
    """Parse a speculators / eagle3 / sglang checkpoint into (Eagle3Config, state dict for Eagle3Drafter).

    norm_before_residual defaults like the servers do when a file omits it: True for speculators (vLLM's
    updater), False for the plain layouts. Unsorted or repeated ids are folded into sorted unique order
    (layers.fold_fc_columns), reading the fc blocks in the order the file lists the ids.
    """
    layer = header["transformer_layer_config"] if fmt == "speculators" else header
    hidden = header.get("target_hidden_size") or layer.get("hidden_size")
    check_target_match(target_info, hidden, layer.get("vocab_size"), directory)
    if layer.get("hidden_size") != target_info.hidden_size:
        raise ValueError(f"{directory}: draft hidden_size {layer.get('hidden_size')} differs from the target's"
                         f" {target_info.hidden_size}; draftsmith's EAGLE-3 needs them equal")
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"{directory}: draft layer model_type {layer.get('model_type')!r} is not supported (llama)")
    if fmt == "sglang" and "norm_output" in header:
        raise ValueError(f"{directory}: norm_output is set; SpecForge reads it as 'apply the final norm before"
                         " lm_head', SGLang and vLLM as 'feed the post-norm hidden to the next step', so this file"
                         " means different drafters to different servers; remove the key that does not apply")
    for flag in _UNSUPPORTED_FLAGS:
        if header.get(flag) or layer.get(flag):
            raise ValueError(f"{directory}: {flag}=true is not supported by draftsmith's EAGLE-3")
    if (header.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise ValueError(f"{directory}: eagle_config.use_aux_hidden_state=false (EAGLE-1/2 style) is not supported")
    try:
        listed = listed_layer_ids(header, fmt, target_info.num_layers)
    except ValueError as err:
        raise ValueError(f"{directory}: {err}") from None
    proposals = header.get("speculators_config", {}).get("proposal_methods") or [{}]
    ours = header.get("draftsmith") or {}
    draft_vocab_size = int(header.get("draft_vocab_size") or layer["vocab_size"])
    state = _read_tensors(directory, draft_vocab_size, target_info.vocab_size)
    if "fc.weight" not in state:
        raise ValueError(f"{directory}: no fc.weight in the checkpoint")
    try:
        layer_ids, state["fc.weight"] = fold_fc_columns(state["fc.weight"], listed, target_info.hidden_size)
    except ValueError as err:
        raise ValueError(f"{directory}: {err}") from None
    config = Eagle3Config(
        layer_ids=layer_ids,
        allow_linear_attention_ids=True,  # a foreign checkpoint's ids are what it was trained on
        num_layers=int(layer["num_hidden_layers"]),
        draft_vocab_size=draft_vocab_size,
        ttt_steps=int(ours.get("ttt_steps") or proposals[0].get("speculative_tokens", 7)),
        step_decay=float(ours.get("step_decay", 0.8)),
        intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=int(layer["num_attention_heads"]),
        num_key_value_heads=int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        head_dim=layer.get("head_dim"),
        rope_theta=rope_parameters(layer)["rope_theta"],
        norm_before_residual=bool(header.get("norm_before_residual", fmt == "speculators")),
        init_head_from_target=False,
    )
    return config, state


def _read_tensors(directory: str, draft_vocab_size: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """All safetensors files of the directory, renamed to Eagle3Drafter's state-dict names."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ValueError(f"{directory}: no .safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in load_file(path).items():
            name = name.removeprefix("model.")
            if name.startswith("midlayer."):  # SafeAILab / SpecForge name for the single draft layer
                name = "layers.0." + name.removeprefix("midlayer.")
            if name == "embed_tokens.weight" or name.startswith("verifier_"):
                continue  # the target's own embedding is used; verifier copies are not ours
            state[name] = tensor
    complete_vocab_tables(state, draft_vocab_size, vocab_size, directory,
                          f"no d2t table but draft_vocab_size {draft_vocab_size} != {vocab_size}")
    return state


# ---- the doctor (drafters/base.py: the export module's contract) ------------------------------------------------
def export_checks(directory: str, target_info: TargetInfo) -> list:
    """Check an EAGLE-3 checkpoint directory against `target_info` the way each server will read it."""
    return CHECKS.run(directory, target_info, detect_format, read)


store_confidence_temperatures = None  # no confidence head
