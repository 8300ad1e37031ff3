"""P-EAGLE's serving layout: "speculators" (reference formats_and_serving.md sections 2.1-2.3).

EAGLE-3's speculators layout (drafters/eagle3/export.py) with `speculators_model_type: "peagle"`, the algorithm
"peagle" in `speculators_config`, a top-level `mask_token_id` (vLLM's updater requires it and maps it to
`pard_token`) and the tensor `mask_hidden` [1, n_features * D]. `vllm serve DIR` runs it as method eagle3 with
`parallel_drafting: true`. vLLM's P-EAGLE updater defaults norm_before_residual to false where EAGLE-3's defaults it
to true; the writer states it, and the reader defaults it as vLLM's P-EAGLE updater does.

What vLLM makes of these files, and the rows `draftsmith doctor` prints for them: drafters/peagle/readers.py.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
from safetensors.torch import save_file

from drafters.base import TargetInfo
from drafters.eagle3 import export as eagle3_export
from drafters.eagle3.readers import listed_layer_ids
from drafters.peagle.config import PEagleConfig
from drafters.peagle.readers import CHECKS, mask_hidden_problem
from drafters.speculators import speculators_section

EXPORT_FORMATS = ("speculators",)


def detect_format(config: Mapping[str, Any]) -> str | None:
    """"speculators" for a P-EAGLE speculators config.json dict, else None (native is the drafter's)."""
    if config.get("speculators_model_type") == "peagle" and "speculators_config" in config:
        return "speculators"
    return None


def speculators_config(drafter) -> dict[str, Any]:
    """EAGLE-3's speculators config.json dict, retyped as P-EAGLE with its mask row."""
    return {
        **eagle3_export.speculators_config(drafter),
        "speculators_model_type": "peagle",
        "architectures": ["PEagleSpeculator"],
        "mask_token_id": drafter.mask_token_id,
        "speculators_config": speculators_section("peagle", drafter.target_info, drafter.config.ttt_steps),
        "draftsmith": {"ttt_steps": drafter.config.ttt_steps, "step_decay": drafter.config.step_decay},
    }


def write(drafter, directory: str, fmt: str) -> None:
    """Write `drafter` (a PEagleDrafter) to `directory` in `fmt` (one of EXPORT_FORMATS)."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown P-EAGLE export format {fmt!r}; known: {', '.join(EXPORT_FORMATS)}")
    tensors = eagle3_export.export_tensors(drafter, "speculators")
    tensors["mask_hidden"] = tensors["mask_hidden"].view(1, -1)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(speculators_config(drafter), f, indent=2)
    save_file(tensors, os.path.join(directory, "model.safetensors"))


def read(directory: str, header: Mapping[str, Any], fmt: str, target_info: TargetInfo):
    """Parse a P-EAGLE speculators checkpoint into (PEagleConfig, state dict for PEagleDrafter): EAGLE-3's reading
    (drafters/eagle3/export.read) with norm_before_residual defaulting to false, plus the mask row and mask_hidden,
    whose blocks follow the listed layer ids as fc's columns do (ids listed out of order are sorted with them)."""
    if header.get("mask_token_id") is None:
        raise ValueError(f"{directory}: no mask_token_id (vLLM refuses a P-EAGLE config without it)")
    header = {"norm_before_residual": False, **header}
    listed = listed_layer_ids(header, fmt, target_info.num_layers)
    if len(set(listed)) != len(listed):
        raise ValueError(f"{directory}: layer ids {list(listed)} repeat an id; mask_hidden cannot be folded as fc's "
                         "columns are, so a P-EAGLE file needs distinct ids")
    config, state = eagle3_export.read(directory, header, fmt, target_info)
    problem = mask_hidden_problem(tuple(state["mask_hidden"].shape) if "mask_hidden" in state else None,
                                  len(listed), target_info.hidden_size)
    if problem:
        raise ValueError(f"{directory}: {problem}")
    blocks = state["mask_hidden"].reshape(len(listed), target_info.hidden_size)
    state["mask_hidden"] = blocks[torch.tensor(sorted(range(len(listed)), key=lambda b: listed[b]))].reshape(-1)
    return PEagleConfig(**vars(config), mask_token_id=int(header["mask_token_id"]), allow_text_mask_token=True), state


def export_checks(directory: str, target_info: TargetInfo) -> list:
    """Check a P-EAGLE checkpoint directory against `target_info` the way vLLM will read it."""
    return CHECKS.run(directory, target_info, detect_format, read)


store_confidence_temperatures = None  # no confidence head
