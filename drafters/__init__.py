"""Drafter registry: one explicit dict, kind name -> class (STYLE.md, Registry), and `load_drafter` for any drafter path."""

from __future__ import annotations

import json
import os

from drafters.assistant import AssistantDrafter
from drafters.base import NATIVE_KIND_KEY, DraftContext, Drafter, Proposal, TargetInfo
from drafters.output import DraftOutput
from drafters.dflash import DFlashDrafter
from drafters.draft_model import DraftModelDrafter, is_draft_model_dir
from drafters.dspark import DSparkDrafter
from drafters.eagle3 import Eagle3Drafter
from drafters.medusa import MedusaDrafter
from drafters.mtp import MTPDrafter
from drafters.ngram import NgramDrafter

DRAFTERS: dict[str, type[Drafter]] = {
    "assistant": AssistantDrafter,
    "dflash": DFlashDrafter,
    "draft_model": DraftModelDrafter,
    "dspark": DSparkDrafter,
    "eagle3": Eagle3Drafter,
    "medusa": MedusaDrafter,
    "mtp": MTPDrafter,
    "ngram": NgramDrafter,
}


# Drafters named by a spec instead of a directory, built from the target itself: "native-mtp" = the MTP modules that
# ship inside the target's own checkpoint (TargetInfo.name_or_path).
NAMED_DRAFTERS = {"native-mtp": MTPDrafter.from_target}


def checkpoint_kind(directory: str) -> str:
    """Which registered drafter reads `directory`: the native header names it, else each class's `detect_format`."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{directory}: not a drafter or model directory (no config.json)")
    with open(path) as f:
        config = json.load(f)
    if NATIVE_KIND_KEY in config:
        return config[NATIVE_KIND_KEY]
    for kind, cls in DRAFTERS.items():
        if cls.detect_format(config) is not None:
            return kind
    if is_draft_model_dir(directory):
        return "draft_model"
    raise ValueError(f"{directory}: config.json is neither a draftsmith checkpoint, a known export nor an HF model")


def load_drafter(spec: str, target_info: TargetInfo) -> Drafter | None:
    """'none' -> None (plain autoregression); 'ngram' -> prompt lookup; a NAMED_DRAFTERS name ('native-mtp') -> built
    from the target's own checkpoint; a directory -> the drafter it holds."""
    if spec in ("", "none"):
        return None
    if spec == "ngram":
        return NgramDrafter(NgramDrafter.Config(), target_info)
    if spec in NAMED_DRAFTERS:
        return NAMED_DRAFTERS[spec](target_info)
    if not os.path.isdir(spec):
        raise ValueError(f"drafter {spec!r} is neither 'none', 'ngram', one of {sorted(NAMED_DRAFTERS)} nor an "
                         "existing directory")
    kind = checkpoint_kind(spec)
    if kind not in DRAFTERS:
        raise ValueError(f"{spec}: drafter kind {kind!r} is not registered; known: {sorted(DRAFTERS)}")
    return DRAFTERS[kind].load(spec, target_info)


__all__ = ["DRAFTERS", "DraftContext", "DraftOutput", "Drafter", "Proposal", "TargetInfo", "load_drafter"]
