"""EAGLE-3 checkpoint formats that serving engines load (reference formats_and_serving.md sections 2.1-2.4).

- "speculators": vLLM speculators layout. config.json has no top-level model_type, `speculators_model_type:
  "eagle3"`, a `transformer_layer_config` (HF Llama dict) and `speculators_config` (proposal methods, verifier).
  Serve with `vllm serve <dir>`; vLLM reads the verifier path and the proposal length from it.
- "eagle3": the plain LlamaForCausalLMEagle3 layout (SpecForge / SafeAILab style, model_type llama) that vLLM
  loads with `--speculative-config '{"method": "eagle3", "model": <dir>, "num_speculative_tokens": K}'`.

Both write one model.safetensors without a "model." prefix: embed_tokens (a frozen copy of the target's), fc,
layers.i.*, norm, lm_head, d2t (int64 offsets), t2d (bool). `norm_before_residual` and the aux layer ids are
always written, because engines default them differently when missing.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file

from drafters.base import NATIVE_KIND_KEY, TargetInfo, check_target_match
from drafters.eagle3.layers import Eagle3Config
from drafters.layers import rope_parameters

EXPORT_FORMATS = ("speculators", "eagle3")
SPECULATORS_VERSION = "0.3.0"  # the speculators config schema this writer follows

_UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "attention_bias", "mlp_bias")


def detect_format(config: Mapping[str, Any], kind: str = "eagle3") -> str | None:
    """"native", "speculators" or "eagle3" for an EAGLE-3 checkpoint's config.json dict, else None."""
    if config.get(NATIVE_KIND_KEY) == kind:
        return "native"
    if config.get("speculators_model_type") == "eagle3" and "speculators_config" in config:
        return "speculators"
    if any("Eagle3" in name for name in config.get("architectures") or ()):
        return "eagle3"
    return None


def write(drafter, directory: str, fmt: str) -> None:
    """Write `drafter` (an Eagle3Drafter) to `directory` in `fmt` ("speculators" or "eagle3")."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown EAGLE-3 export format {fmt!r}; known: {', '.join(EXPORT_FORMATS)}")
    os.makedirs(directory, exist_ok=True)
    config = speculators_config(drafter) if fmt == "speculators" else eagle3_config(drafter)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {"embed_tokens.weight": drafter.target_info.embed_weight}
    tensors |= drafter.state_dict()
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    save_file(tensors, os.path.join(directory, "model.safetensors"))


def _eagle3_fields(drafter) -> dict[str, Any]:
    """Top-level keys both formats carry."""
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
    info = drafter.target_info
    verifier_architectures = list(info.config.get("architectures") or [])
    proposal = {
        "proposal_type": "greedy",
        "speculative_tokens": drafter.config.ttt_steps,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    return {
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": dict(drafter.layer_config),
        **_eagle3_fields(drafter),
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [proposal],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": info.name_or_path, "architectures": verifier_architectures},
        },
    }


def eagle3_config(drafter) -> dict[str, Any]:
    """The plain LlamaForCausalLMEagle3 config.json dict (an HF Llama config plus EAGLE-3 keys)."""
    return {
        **dict(drafter.layer_config),
        "architectures": ["LlamaForCausalLMEagle3"],
        **_eagle3_fields(drafter),
        "num_aux_hidden_states": len(drafter.layer_ids),
        # No standard key holds the training depth here; engines ignore unknown keys, our loader reads it back.
        "draftsmith": {"ttt_steps": drafter.config.ttt_steps, "step_decay": drafter.config.step_decay},
    }


def read(directory: str, header: Mapping[str, Any], fmt: str, target_info: TargetInfo):
    """Parse a speculators / eagle3 checkpoint into (Eagle3Config, state dict for Eagle3Drafter.load_state_dict).

    norm_before_residual defaults like the engines do when a file omits it: True for speculators (vLLM's
    updater), False for the plain format.
    """
    layer = header["transformer_layer_config"] if fmt == "speculators" else header
    hidden = header.get("target_hidden_size") or layer.get("hidden_size")
    check_target_match(target_info, hidden, layer.get("vocab_size"), directory)
    if layer.get("hidden_size") != target_info.hidden_size:
        raise ValueError(f"{directory}: draft hidden_size {layer.get('hidden_size')} differs from the target's"
                         f" {target_info.hidden_size}; draftsmith's EAGLE-3 needs them equal")
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"{directory}: draft layer model_type {layer.get('model_type')!r} is not supported (llama)")
    for flag in _UNSUPPORTED_FLAGS:
        if header.get(flag) or layer.get(flag):
            raise ValueError(f"{directory}: {flag}=true is not supported by draftsmith's EAGLE-3")
    nested = header.get("eagle_config") or {}
    layer_ids = header.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids")
    proposals = header.get("speculators_config", {}).get("proposal_methods") or [{}]
    ours = header.get("draftsmith") or {}
    config = Eagle3Config(
        layer_ids=tuple(layer_ids or ()),
        num_layers=int(layer["num_hidden_layers"]),
        draft_vocab_size=int(header.get("draft_vocab_size") or layer["vocab_size"]),
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
    return config, _read_tensors(directory, config.draft_vocab_size, target_info.vocab_size)


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
    if "d2t" not in state:
        if draft_vocab_size != vocab_size:
            raise ValueError(f"{directory}: no d2t table but draft_vocab_size {draft_vocab_size} != {vocab_size}")
        state["d2t"] = torch.zeros(draft_vocab_size, dtype=torch.long)
    state["d2t"] = state["d2t"].long()
    if "t2d" not in state:
        state["t2d"] = torch.zeros(vocab_size, dtype=torch.bool)
        state["t2d"][torch.arange(draft_vocab_size) + state["d2t"]] = True
    state["t2d"] = state["t2d"].bool()
    return state
