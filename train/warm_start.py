"""train.init_from: a run that starts from a trained drafter's weights instead of fresh ones.

Fine-tuning a published drafter on one's own domain, or continuing an earlier run on new data or with another
recipe: the checkpoint may be a run's final/, any export the recipe's drafter kind reads (speculators, eagle3, sglang,
dflash, deepspec, the MTP layouts...) or a training checkpoint (checkpoints/step_N). Unlike train.resume_from, which
continues the same run exactly, the step, optimizer state, schedule and data order start afresh: only the weights
and the draft vocabulary carry over.

The checkpoint decides the drafter's architecture: every field of the drafter's config but the kind's
TRAINING_OPTIONS (its config.py) comes from it, since those fields shape the weights or what they mean (layer ids,
draft vocabulary, widths). The recipe decides how it trains: those options, the data, optimizer and schedule. A
recipe that sets an architecture field to another value than the checkpoint's is refused naming the field; one that
leaves it at its default takes the checkpoint's, and the run prints what it took. The run's recipe.yaml records the
merged config, so resume and `export` of its checkpoints rebuild the same drafter; a resumed run reads the
architecture there, so the checkpoint it started from may be gone by then.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

import torch

from drafters import DRAFTERS, checkpoint_kind
from drafters.base import TargetInfo
from drafters.configs import to_dict
from inference.engine.target import TargetModel
from train.config import Recipe, load_recipe
from train.fit.checkpoint import is_training_checkpoint, read_training_checkpoint, resolve_resume

FIELD = "train.init_from"


class WarmStart(NamedTuple):
    """The recipe with the checkpoint's architecture, the weights to start from, and the fields taken from the
    checkpoint that the recipe had at another (default) value: name -> (recipe's, checkpoint's)."""

    recipe: Recipe
    state: dict[str, torch.Tensor]
    taken: dict[str, tuple[Any, Any]]

    def summary(self) -> str:
        took = ", ".join(f"{name}={theirs!r}" for name, (_, theirs) in self.taken.items()) or "nothing else"
        return (f"{FIELD}: starting from {self.recipe.train.init_from}; from its architecture the drafter took "
                f"{took}")


def checkpoint_kind_of(path: str) -> str:
    """The drafter kind a checkpoint holds, from its files alone (a training checkpoint's recipe.yaml, else the
    config.json of a native checkpoint or an export); a ValueError naming train.init_from when it holds none."""
    if not os.path.isdir(path):
        raise ValueError(f"{FIELD}: {path!r} is not a directory; give a drafter checkpoint (a run's final/, an export "
                         "or checkpoints/step_N)")
    if is_training_checkpoint(path):
        return load_recipe(os.path.join(path, "recipe.yaml")).drafter_kind
    try:
        return checkpoint_kind(path)
    except ValueError as err:
        raise ValueError(f"{FIELD}: {err}") from None


def read_checkpoint(path: str, kind: str, target_info: TargetInfo) -> tuple[Any, dict[str, torch.Tensor]]:
    """(architecture, state dict) of a checkpoint of `kind` read for `target_info` (a meta-device target's will do):
    the drafter config as its drafter records it (`checkpoint_config`, built on the meta device, no weight copied)
    and the weights the drafter loads."""
    try:
        if is_training_checkpoint(path):
            _, config, state = read_training_checkpoint(path, target_info)
        else:
            config, state = DRAFTERS[kind].read(path, target_info)
    except ValueError as err:
        raise ValueError(f"{FIELD}: {err}") from None
    with torch.device("meta"):
        return DRAFTERS[kind](config, target_info).checkpoint_config(), state


def check_init_from(recipe: Recipe) -> None:
    """What a warm start would refuse, before any weight loads: `check_source`'s refusals, and a recipe setting the
    checkpoint's architecture otherwise (read with the target's config and tokenizer alone)."""
    path = recipe.train.init_from
    if path is None or resume_checkpoint(recipe) is not None:  # a resumed run's architecture is in its checkpoint
        return
    kind = check_source(recipe)
    target = TargetModel.from_config(recipe.target.name_or_path, trust_remote_code=recipe.target.trust_remote_code)
    architecture, _ = read_checkpoint(path, kind, target.target_info())
    merged_config(recipe.drafter, architecture, path)


def check_source(recipe: Recipe) -> str:
    """The drafter kind at train.init_from, from its files alone; refused: a path holding no drafter, a drafter of
    another kind than the recipe trains, the run's own output, and a second source of starting weights (MTP's
    init_from_native)."""
    path = recipe.train.init_from
    kind = checkpoint_kind_of(path)
    if kind != recipe.drafter_kind:
        raise ValueError(f"{FIELD}: {path} holds a drafter of kind {kind} and the recipe trains "
                         f"{recipe.drafter_kind}; set drafter.kind: {kind} or start from a {recipe.drafter_kind} "
                         "checkpoint")
    output = os.path.abspath(recipe.output.dir)
    if os.path.commonpath([os.path.abspath(path), output]) == output:
        raise ValueError(f"{FIELD}: {path} is inside output.dir, which the run writes; continue a run with "
                         "train.resume_from=latest, or copy the checkpoint elsewhere")
    if getattr(recipe.drafter, "init_from_native", False):
        raise ValueError(f"{FIELD} and drafter.init_from_native both give the starting weights; keep one")
    return kind


def merged_config(recipe_config: Any, checkpoint_config: Any, source: str) -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """The drafter config of a warm start: the recipe's TRAINING_OPTIONS, the checkpoint's every other field. A
    field the recipe sets (other than its default) to another value than the checkpoint's is refused; returns the
    config and the fields taken from the checkpoint where the recipe had its default."""
    cls = type(recipe_config)
    default, options = cls(), set(getattr(cls, "TRAINING_OPTIONS", ()))
    mine, theirs, plain_default = to_dict(recipe_config), to_dict(checkpoint_config), to_dict(default)
    values, taken, conflicts = {}, {}, []
    for field in dataclasses.fields(cls):
        name = field.name
        if not field.init:
            continue
        if name in options or mine[name] == theirs[name]:
            values[name] = getattr(recipe_config, name)
            continue
        values[name] = getattr(checkpoint_config, name)
        if mine[name] == plain_default[name]:
            taken[name] = (mine[name], theirs[name])
        else:
            conflicts.append(f"drafter.{name} (recipe {mine[name]!r}, checkpoint {theirs[name]!r})")
    if conflicts:
        raise ValueError(f"{FIELD}: the checkpoint at {source} fixes the drafter's architecture and the recipe sets "
                         f"it otherwise: {', '.join(conflicts)}; remove those fields from the recipe")
    merged = dataclasses.replace(recipe_config, **values)
    if hasattr(merged, "check_recipe"):  # a field a checkpoint may hold but training may not (a reduced DSpark)
        try:
            merged.check_recipe()
        except ValueError as err:
            raise ValueError(f"{FIELD}: {source}: {err}") from None
    return merged, taken


def warm_start(recipe: Recipe, target_info: TargetInfo) -> WarmStart | None:
    """The checkpoint at train.init_from read for `target_info`'s target: the recipe with its architecture (see the
    module doc) and its weights, or None without train.init_from."""
    path = recipe.train.init_from
    if path is None:
        return None
    architecture, state = read_checkpoint(path, check_source(recipe), target_info)
    config, taken = merged_config(recipe.drafter, architecture, path)
    return WarmStart(dataclasses.replace(recipe, drafter=config), state, taken)


def warm_recipe(recipe: Recipe, target_info: TargetInfo) -> Recipe:
    """The recipe a run builds its drafter from: with train.init_from, the checkpoint's architecture (what `prepare`
    and `estimate` read the drafter's features and sizes from; no weight is read into a drafter, so a meta-device
    target's `target_info` will do), or, resuming, the architecture the run's checkpoint recorded; else the recipe."""
    path = recipe.train.init_from
    if path is None:
        return recipe
    resumed = resume_checkpoint(recipe)
    if resumed is not None:
        architecture, path = load_recipe(os.path.join(resumed, "recipe.yaml")).drafter, resumed
    else:
        architecture, _ = read_checkpoint(path, check_source(recipe), target_info)
    config, _ = merged_config(recipe.drafter, architecture, path)
    return dataclasses.replace(recipe, drafter=config)


def resume_checkpoint(recipe: Recipe) -> str | None:
    """The training checkpoint train.resume_from resumes (None: a fresh start)."""
    return resolve_resume(recipe.output.dir, recipe.train.resume_from)


def load_weights(drafter: torch.nn.Module, start: WarmStart) -> None:
    """Put the checkpoint's weights and draft vocabulary into `drafter`, built from start.recipe."""
    try:
        drafter.load_state_dict(start.state, strict=True)
    except RuntimeError as err:  # a TRAINING_OPTIONS field that shapes weights would land here: a bug, said plainly
        first = str(err).strip().splitlines()
        raise ValueError(f"{FIELD}: the drafter the recipe builds does not hold the checkpoint's weights "
                         f"({' '.join(line.strip() for line in first[1:3]) or first[0]})") from None

