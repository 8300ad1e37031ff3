"""Training checkpoints: `accelerator.save_state` plus the recipe, the trainer position and the target, atomically.

Layout: <output.dir>/checkpoints/step_<N>/ holds what accelerate writes (drafter weights, optimizer, scheduler, one
RNG file per process) and ours: recipe.yaml (the resolved recipe), trainer_state.json (step, tokens seen, wall time,
the data-order parameters) and target.json (the target it was trained against). The directory is written as
.tmp_step_<N> and renamed into place once complete, so a crash mid-save leaves the previous checkpoint as the latest;
a checkpoint that must go (an older one beyond train.keep_last, or step N saved again after a resume) is first
renamed to .old_step_<N> and only then deleted, so a kill during the deletion never leaves a half-deleted step_<N>.
Only names step_<N> count as checkpoints: a half-written or half-deleted directory is never picked as "latest".
A full disk stops the save with a DiskFullError naming the checkpoint and output.dir, the temporary directory
removed and every earlier checkpoint untouched.
The data order is a pure function of (seed, epoch, step) (train/fit/loop.py), so the step fixes the data position.
All processes must share the output directory (one filesystem), as accelerate itself assumes.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
from typing import Any

from safetensors.torch import load_file

from drafters import DRAFTERS, load_drafter
from drafters.files import disk_full_reported
from train.config import Recipe, load_recipe, save_recipe

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_UNFINISHED_DIR = re.compile(r"^\.(tmp|old)_step_\d+$")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints under output_dir, as (step, path), oldest first."""
    root = os.path.join(output_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root) if (m := _STEP_DIR.match(name))]
    return sorted(found)


def resolve_resume(output_dir: str, resume_from: str | None) -> str | None:
    """train.resume_from -> a checkpoint directory, or None to start from scratch.

    "latest" is the newest checkpoint in output_dir (None when there is none yet, so a preemptible job can always
    pass it); anything else must be an existing checkpoint directory.
    """
    if resume_from is None:
        return None
    if resume_from == "latest":
        checkpoints = list_checkpoints(output_dir)
        return checkpoints[-1][1] if checkpoints else None
    if not os.path.isfile(os.path.join(resume_from, "trainer_state.json")):
        raise ValueError(f"train.resume_from: {resume_from!r} is not a checkpoint directory (no trainer_state.json)")
    return resume_from


def target_record(target_info) -> dict[str, Any]:
    """What identifies the target a drafter is trained against."""
    return {"name": os.path.basename(os.path.normpath(target_info.name_or_path)),
            "hidden_size": target_info.hidden_size, "vocab_size": target_info.vocab_size,
            "num_layers": target_info.num_layers}


def check_target(checkpoint_dir: str, target_info) -> None:
    """Raise ValueError naming the field when the checkpoint was trained against a target of another shape.

    A different directory name alone only warns: the same model is often stored under other paths on other machines.
    """
    with open(os.path.join(checkpoint_dir, "target.json")) as f:
        stored = json.load(f)
    current = target_record(target_info)
    for key in ("hidden_size", "vocab_size", "num_layers"):
        if stored.get(key) != current[key]:
            raise ValueError(f"checkpoint {checkpoint_dir} was trained against another target: target {key} is "
                             f"{stored.get(key)!r} there but {current[key]!r} in this run (target.name_or_path)")
    if stored.get("name") != current["name"]:
        print(f"warning: checkpoint {checkpoint_dir} was trained against target {stored.get('name')!r}; this run's "
              f"target is {current['name']!r} (same shapes, so resuming)", file=sys.stderr)


def _retire(directory: str) -> None:
    """Delete a checkpoint directory without ever leaving a partial step_<N>: rename it away, then remove it."""
    parent, name = os.path.split(directory)
    doomed = os.path.join(parent, f".old_{name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(directory, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _write_trainer_files(directory: str, recipe: Recipe, trainer_state: dict[str, Any], target_info) -> None:
    save_recipe(recipe, os.path.join(directory, "recipe.yaml"))
    with open(os.path.join(directory, "trainer_state.json"), "w") as f:
        json.dump(trainer_state, f, indent=2)
    with open(os.path.join(directory, "target.json"), "w") as f:
        json.dump(target_record(target_info), f, indent=2)


def save_checkpoint(accelerator, output_dir: str, step: int, *, recipe: Recipe, trainer_state: dict[str, Any],
                    target_info, keep_last: int | None = None) -> str:
    """Write checkpoints/step_<step> atomically on every process (collective); return its path.

    Raises DiskFullError (drafters/files.py) when the disk fills up, after removing the partial directory."""
    root = os.path.join(output_dir, CHECKPOINTS)
    final_dir = os.path.join(root, f"step_{step}")
    tmp_dir = os.path.join(root, f".tmp_step_{step}")
    previous = list_checkpoints(output_dir)
    remedy = (f"choose another output.dir (the last checkpoint, {previous[-1][1] if previous else 'none yet'}, "
              "is intact)")
    if accelerator.is_main_process:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # left by a process killed while saving or deleting
            if _UNFINISHED_DIR.match(name):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp_dir)
    accelerator.wait_for_everyone()
    try:
        with disk_full_reported(final_dir, remedy):
            accelerator.save_state(tmp_dir)
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                _write_trainer_files(tmp_dir, recipe, trainer_state, target_info)
    except OSError:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        if os.path.isdir(final_dir):  # step <step> saved again after a resume
            _retire(final_dir)
        os.rename(tmp_dir, final_dir)
        if keep_last is not None:
            for _, old in list_checkpoints(output_dir)[:-keep_last]:
                _retire(old)
    accelerator.wait_for_everyone()
    return final_dir


def is_training_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "trainer_state.json"))


def training_checkpoint_target(directory: str) -> str:
    """The target name_or_path of the recipe a training checkpoint was written with."""
    return load_recipe(os.path.join(directory, "recipe.yaml")).target.name_or_path


def read_training_checkpoint(directory: str, target_info) -> tuple[str, Any, dict]:
    """(drafter kind, drafter config, state dict) of a training checkpoint (resume state): its recipe.yaml and
    accelerate's model.safetensors (single process or DDP); the target must have the shapes it was trained against."""
    weights = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(weights):
        raise ValueError(f"{directory}: training checkpoint without model.safetensors (an FSDP run shards the "
                         "drafter's weights): export the run's final/ instead, or resume and finish the run")
    check_target(directory, target_info)
    recipe = load_recipe(os.path.join(directory, "recipe.yaml"))
    return recipe.drafter_kind, copy.deepcopy(recipe.drafter), load_file(weights)


def drafter_of_training_checkpoint(directory: str, target_info):
    """The drafter of a training checkpoint (resume state), rebuilt from its recipe and weights
    (`read_training_checkpoint`)."""
    kind, config, state = read_training_checkpoint(directory, target_info)
    drafter = DRAFTERS[kind](config, target_info)
    drafter.load_state_dict(state, strict=True)
    return drafter


def load_trained_drafter(directory: str, target_info):
    """A training checkpoint's drafter, else what drafters.load_drafter reads there (None: not a trained drafter)."""
    if is_training_checkpoint(directory):
        return drafter_of_training_checkpoint(directory, target_info)
    return load_drafter(directory, target_info)


def load_checkpoint(accelerator, checkpoint_dir: str, target_info) -> dict[str, Any]:
    """Check the target, restore drafter/optimizer/scheduler/RNG state, and return the trainer state."""
    check_target(checkpoint_dir, target_info)
    accelerator.load_state(checkpoint_dir)
    with open(os.path.join(checkpoint_dir, "trainer_state.json")) as f:
        return json.load(f)
