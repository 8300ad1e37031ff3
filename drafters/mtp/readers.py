"""The checks `draftsmith doctor` runs on an MTP checkpoint in the speculators "mtp" layout (drafters/mtp/export.py).

The readers are vLLM (`vllm serve DIR`: method mtp, the architecture picked from transformer_layer_config.model_type,
num_nextn_predict_layers 1 only) and speculators. An MTP module reads the target's final hidden state, so there are
no layer ids; what can go wrong silently is a verifier config that is not the target's (another family picks another
MTP architecture, other sizes another model), a module tensor missing (a reader keeps it at a random init), or
tensors the readers do not expect. The target-checkpoint layouts (deepseek_v3, qwen3_next, qwen3_5, mimo, nemotron_h)
are target directories with MTP modules in them: drafters/mtp/native_checks.py.
"""

from __future__ import annotations

from typing import Any, Mapping

from drafters.base import TargetInfo
from drafters.mtp.layers import target_text_config
from drafters.readers import Check, Checkpoint, FormatChecks

PREFIX = "mtp_layers.0."
FIXED = ("input_proj.weight", "hidden_layernorm.weight", "token_layernorm.weight", "final_layernorm.weight")
REQUIRED = (("transformer_layer_config", "vLLM and speculators refuse it"),
            ("num_nextn_predict_layers", "readers assume 1"),
            ("speculators_config", "vLLM cannot tell the verifier or how many tokens to propose"))


def fields_check(header: Mapping[str, Any]) -> Check:
    missing = [f"{name} ({consequence})" for name, consequence in REQUIRED if header.get(name) is None]
    proposals = (header.get("speculators_config") or {}).get("proposal_methods") or [{}]
    if header.get("speculators_config") is not None and proposals[0].get("speculative_tokens") is None:
        missing.append("speculators_config.proposal_methods[0].speculative_tokens (vLLM proposes it)")
    if not missing:
        return Check("fields", "pass", "every field a reader looks for is explicit")
    return Check("fields", "fail", "missing: " + "; ".join(missing) + "; re-export with `draftsmith export CKPT"
                 " --format speculators`")


def sizes_check(header: Mapping[str, Any], shapes: Mapping[str, tuple], info: TargetInfo) -> Check:
    """The verifier config is the target's; the module's fixed tensors are there with the target's sizes."""
    layer, target, problems = header.get("transformer_layer_config") or {}, target_text_config(info), []
    for name, want in (("model_type", target.get("model_type")), ("hidden_size", info.hidden_size),
                       ("vocab_size", info.vocab_size), ("num_hidden_layers", info.num_layers)):
        if layer.get(name) != want:
            problems.append(f"transformer_layer_config.{name} {layer.get(name)!r} != the target's {want!r}")
    if int(header.get("num_nextn_predict_layers", 1)) != 1:
        problems.append(f"num_nextn_predict_layers {header['num_nextn_predict_layers']} (readers support 1)")
    hidden = info.hidden_size
    expected = {PREFIX + name: (hidden, 2 * hidden) if name == "input_proj.weight" else (hidden,) for name in FIXED}
    problems += [f"{name} has shape {None if shapes.get(name) is None else list(shapes[name])}, expected {list(want)}"
                 for name, want in expected.items() if tuple(shapes.get(name) or ()) != want]
    stray = sorted(name for name in shapes if not name.startswith(PREFIX))
    if stray:
        problems.append(f"tensors outside {PREFIX}* ({', '.join(stray[:4])}): the readers do not expect them")
    if not set(shapes) - {PREFIX + name for name in FIXED}:
        problems.append(f"no decoder layer under {PREFIX}* (a reader would keep a random one)")
    if problems:
        return Check("sizes", "fail", "; ".join(problems) + " (was it built for another target?)")
    return Check("sizes", "pass", f"verifier config {target.get('model_type')} (hidden {hidden}, vocab"
                 f" {info.vocab_size}, {info.num_layers} layers) is the target's; module tensors present")


def _body(directory: str, opened: Checkpoint, target_info: TargetInfo) -> list[Check]:
    return [fields_check(opened.header), sizes_check(opened.header, opened.shapes, target_info)]


CHECKS = FormatChecks(
    "mtp", "`draftsmith export DIR --format speculators` or a target-checkpoint layout",
    layout=lambda fmt: "speculators mtp layout, meant for vLLM (vllm serve DIR, method mtp) and speculators",
    body=_body)
