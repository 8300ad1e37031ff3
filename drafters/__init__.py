"""Drafter registry: one explicit dict, kind name -> class (STYLE.md, Registry), and `load_drafter` for any drafter path."""

from __future__ import annotations

import json
import os

from drafters.assistant import AssistantDrafter
from drafters.base import NATIVE_KIND_KEY, DraftContext, Drafter, Proposal, TargetInfo, text_config_of
from drafters.output import DraftOutput
from drafters.dflash import DFlashDrafter
from drafters.draft_model import DraftModelDrafter, is_draft_model_dir
from drafters.dspark import DSparkDrafter
from drafters.eagle3 import Eagle3Drafter
from drafters.medusa import MedusaDrafter
from drafters.mtp import MTPDrafter
from drafters.ngram import NgramDrafter
from drafters.peagle import PEagleDrafter

DRAFTERS: dict[str, type[Drafter]] = {
    "assistant": AssistantDrafter,
    "dflash": DFlashDrafter,
    "draft_model": DraftModelDrafter,
    "dspark": DSparkDrafter,
    "eagle3": Eagle3Drafter,
    "medusa": MedusaDrafter,
    "mtp": MTPDrafter,
    "ngram": NgramDrafter,
    "peagle": PEagleDrafter,
}


# Drafters named by a spec instead of a directory, built from the target itself: "native-mtp" = the MTP modules that
# ship inside the target's own checkpoint (TargetInfo.name_or_path).
NAMED_DRAFTERS = {"native-mtp": MTPDrafter.from_target}


def training_run_hint(directory: str) -> str:
    """"; what to pass instead" for a directory that holds no drafter but is a training run or one of its training
    checkpoints (resume state), else "": the drafter a run trains is its final/."""
    final = os.path.join(directory, "final")
    parent = os.path.dirname(os.path.abspath(directory))
    if os.path.isfile(os.path.join(final, "config.json")):
        return f"; it is a training run: pass its {final}"
    if os.path.isdir(os.path.join(directory, "checkpoints")):
        return (f"; it is a training run without final/ yet: turn a step into a drafter with `draftsmith export "
                f"{os.path.join(directory, 'checkpoints', 'step_N')} --format native --out DIR`")
    if os.path.basename(parent) == "checkpoints" or os.path.isfile(os.path.join(directory, "trainer_state.json")):
        return (f"; it is a training checkpoint (resume state): pass the run's "
                f"{os.path.join(os.path.dirname(parent), 'final')}, or turn this step into a drafter with "
                f"`draftsmith export {directory} --format native --out DIR`")
    return ""


def check_trained_for(source: str, trained: dict, target_config: dict, target_name: str) -> None:
    """A ValueError naming the target `source` was trained for (`trained`: its recorded name_or_path or name,
    hidden_size and vocab_size) when `target_config`, the HF config of `target_name`, has other sizes; run by the
    commands before they load the target, so the mistake costs no model load."""
    text = text_config_of(target_config)
    sizes = ("hidden_size", "vocab_size")
    theirs, ours = [trained.get(key) for key in sizes], [text.get(key) for key in sizes]
    if None in theirs or None in ours or theirs == ours:
        return
    name = trained.get("name_or_path") or trained.get("name")
    raise ValueError(f"{source}: trained for target {name} (hidden_size {theirs[0]}, vocab_size {theirs[1]}), not "
                     f"{target_name} (hidden_size {ours[0]}, vocab_size {ours[1]}); use it with that target, or "
                     f"train a drafter for {target_name}")


def check_drafter_spec(spec: str, target_config: dict, target_name: str) -> None:
    """What load_drafter would refuse, checked without the target's weights: a spec that is no drafter name or
    checkpoint directory (a training run points at its final/), and a native checkpoint trained for a target of
    other sizes. Exports that do not record their target are checked when they load."""
    if spec in ("", "none", "ngram") or spec in NAMED_DRAFTERS:
        return
    if not os.path.isdir(spec):
        raise ValueError(f"drafter {spec!r} is neither 'none', 'ngram', one of {sorted(NAMED_DRAFTERS)} nor an "
                         "existing directory")
    checkpoint_kind(spec)
    with open(os.path.join(spec, "config.json")) as f:
        header = json.load(f)
    if NATIVE_KIND_KEY in header:
        check_trained_for(spec, header.get("target") or {}, target_config, target_name)


def checkpoint_kind(directory: str) -> str:
    """Which registered drafter reads `directory`: the native header names it, else each class's `detect_format`."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{directory}: not a drafter or model directory (no config.json)"
                         f"{training_run_hint(directory)}")
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
