"""Building a run from a recipe: the target, the data, the drafter, the feature providers, and the Trainer.

`train`, `prepare` and `estimate` share these, so each builds the target and data exactly the same way.
"""

from __future__ import annotations

import copy
import os

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import set_seed

from drafters import DRAFTERS
from inference.assets.store import resolve_target
from inference.engine.target import TargetModel, head_target, resolve_dtype
from train.config import Derived, Recipe, TrainConfig, derive, recipe_to_dict, save_recipe
from train.data.dataset import build_dataset
from train.data.vocab import count_tokens
from train.features.cache import FeatureCache, FeatureProvider, cache_meta, training_request
from train.features.placement import check_sharding_supported, shard_target
from train.features.stream import StreamDir, StreamedEvalFeatures, StreamedFeatures, StreamPlan
from train.fit.checkpoint import load_checkpoint, resolve_resume
from train.fit.launch import PRECISION_ENV, fill_deepspeed_config, process_group_kwargs, resolve_mixed_precision
from train.fit.loop import RunClock, Trainer
from train.fit.metrics import flat_config, load_eval_prompts
from train.fit.optim import build_optimizer, build_scheduler, schedule_position
from train.warm_start import load_weights, warm_recipe, warm_start


def use_cpu() -> bool:
    """True when there is no accelerator. Then a multi-process launch must run gloo on CPU, which accelerate only
    does when told (cpu=True / ACCELERATE_USE_CPU=1); without it every process would train alone."""
    return not torch.accelerator.is_available()


def process_state(recipe: Recipe | None = None) -> PartialState:
    """This process's place in the launch (rank, world size, device), before the Accelerator exists. It creates the
    process group, so the collective timeout (train.dist_timeout_minutes; without a recipe its default) is set here."""
    minutes = (recipe.train if recipe is not None else TrainConfig()).dist_timeout_minutes
    return PartialState(cpu=use_cpu(), **process_group_kwargs(minutes))


def build_accelerator(recipe: Recipe, derived: Derived, mixed_precision: str) -> Accelerator:
    """The run's Accelerator, after `process_state`: `mixed_precision` (`resolve_mixed_precision`), the derived
    gradient accumulation, and under DeepSpeed the batch sizes and clipping in its config (`fill_deepspeed_config`:
    `prepare` gets no dataloader to read them from)."""
    trackers = list(recipe.logging.trackers)
    accelerator = Accelerator(cpu=use_cpu(), mixed_precision=mixed_precision,
                              gradient_accumulation_steps=derived.grad_accum, log_with=trackers or None,
                              project_dir=recipe.output.dir)
    if accelerator.gradient_accumulation_steps != derived.grad_accum:
        raise ValueError(f"the launcher asks for gradient accumulation {accelerator.gradient_accumulation_steps}, "
                         f"the recipe derives {derived.grad_accum}; drop --gradient_accumulation_steps from accelerate "
                         "launch and set train.global_batch_size or train.grad_accum")
    if accelerator.state.deepspeed_plugin is not None:
        fill_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, batch_size=recipe.train.batch_size,
                              grad_accum=derived.grad_accum, global_batch_size=derived.global_batch_size,
                              grad_clip=recipe.optim.grad_clip)
    return accelerator


def shards_target(recipe: Recipe, num_processes: int) -> bool:
    """True when training shards the target across its processes (target.placement: sharded, more than one)."""
    return recipe.target.placement == "sharded" and num_processes > 1


def load_target(recipe: Recipe, device, *, whole: bool = False, num_processes: int = 1) -> TargetModel:
    """The frozen target on `device` in target.dtype (a debug:NAME target is built on first use); with
    target.placement: served only its head, unless `whole` (what computes features or answers needs all of it).
    A target to shard across `num_processes` is loaded on the CPU in the device's dtype: `place_target` moves it
    to `device` a shard at a time, so the whole of it never sits on the device."""
    dtype = resolve_dtype(recipe.target.dtype, device)
    if recipe.target.placement == "served" and not whole:  # features come from the cache: only the head is needed here
        return head_target(resolve_target(recipe.target.name_or_path), dtype, device, recipe.target.trust_remote_code)
    if shards_target(recipe, num_processes) and not whole:
        check_sharding_supported()
        device = "cpu"
    return TargetModel.from_pretrained(recipe.target.name_or_path, dtype=dtype, device=device,
                                       trust_remote_code=recipe.target.trust_remote_code)


def load_data(recipe: Recipe, target: TargetModel, state: PartialState):
    """Tokenised train/eval splits; the main process builds the `datasets` cache first, the others then read it."""
    with state.main_process_first():
        return build_dataset(target.tokenizer, recipe.data)


def build_drafter(recipe: Recipe, target: TargetModel) -> torch.nn.Module:
    """DRAFTERS[kind] on its own copy of the drafter config (phases change the copy, never the recipe)."""
    drafter = DRAFTERS[recipe.drafter_kind](copy.deepcopy(recipe.drafter), target.target_info())
    if recipe.train.activation_checkpointing:
        if not drafter.supports_activation_checkpointing:
            raise ValueError(f"train.activation_checkpointing: drafter kind {recipe.drafter_kind!r} does not "
                             "checkpoint its layers (eagle3, dflash and dspark do); set it to false")
        drafter.activation_checkpointing = True
    try:
        target.check_request(drafter.feature_request())
    except ValueError as err:
        raise ValueError(f"drafter: {err}") from None
    return drafter.to(target.device)


def place_target(recipe: Recipe, target: TargetModel, drafter: torch.nn.Module,
                 state: PartialState) -> torch.nn.Module:
    """Shard the target (loaded on the CPU by `load_target`) onto this process's device and the drafter after it;
    returns the drafter. The drafter is built first, on the whole target, because warm starts read every weight
    (TargetInfo.weights); `shard_target` then points it at the sharded target's TargetInfo, whose head (embeddings,
    lm_head, final norm) stays whole for the drafter to compute with. A no-op unless the target is sharded."""
    if not shards_target(recipe, state.num_processes):
        return drafter
    shard_target(target, state.num_processes, state.device, drafter)
    return drafter.to(target.device)


def feature_meta(recipe: Recipe, target: TargetModel, request, num_samples: int) -> dict:
    """The meta.json a split's cache (or stream shard) holds for the recipe's features mode: what a reader checks."""
    mode = recipe.features.mode
    return cache_meta(target.target_info(), training_request(request, mode),
                      target.feature_dtype(recipe.features.dtype), num_samples)


def feature_provider(recipe: Recipe, split: str, target: TargetModel, request, num_samples: int,
                     rank: int, derived: Derived | None = None) -> FeatureProvider:
    """The split's provider for the drafter's FeatureRequest; offline/hybrid ones read/write
    <features.cache_dir>/<split>; streamed ones read the stream (train/features/stream.py; the train split needs the run's
    `derived` values, which fix the data order) and the eval cache."""
    mode = recipe.features.mode
    if mode == "online":
        return FeatureProvider(mode, target, request)
    if not recipe.features.cache_dir:
        raise ValueError(f"features.cache_dir must be set for features.mode={mode}")
    meta = feature_meta(recipe, target, request, num_samples)
    if mode == "streamed":
        stream, settings = StreamDir(recipe.features.cache_dir), recipe.features.stream
        if split == "eval":
            cache = FeatureCache(os.path.join(recipe.features.cache_dir, split), meta, rank=rank)
            return StreamedEvalFeatures(target, request, cache, stream, settings, num_samples)
        plan = StreamPlan(num_samples=num_samples, seed=recipe.train.seed, global_batch_size=derived.global_batch_size,
                          steps_per_epoch=derived.steps_per_epoch, max_steps=derived.max_steps,
                          steps_per_shard=settings.steps_per_shard)
        return StreamedFeatures(target, request, meta, stream, plan, settings, main=rank == 0)
    cache = FeatureCache(os.path.join(recipe.features.cache_dir, split), meta, rank=rank)
    return FeatureProvider(mode, target, request, cache)


def build_trainer(recipe: Recipe) -> Trainer:
    """Everything `fit` needs, in order: seed, target, data, derived values, accelerator, drafter (initialised from
    the data, from train.init_from's weights with its architecture, or restored from a checkpoint), optimizer,
    schedule, feature providers, trackers."""
    set_seed(recipe.train.seed)
    precision = resolve_mixed_precision(recipe.train.mixed_precision, accelerator=not use_cpu(),
                                        launcher=os.environ.get(PRECISION_ENV))
    state = process_state(recipe)
    target = load_target(recipe, state.device, num_processes=state.num_processes)
    data = load_data(recipe, target, state)
    derived = derive(recipe, world_size=state.num_processes, num_train_samples=len(data.train))
    trackers = list(recipe.logging.trackers)
    accelerator = build_accelerator(recipe, derived, precision)
    accelerator.print(f"derived: {derived}; data: {data.counts}; mixed precision: {accelerator.mixed_precision}")
    resume = resolve_resume(recipe.output.dir, recipe.train.resume_from)
    start = warm_start(recipe, target.target_info()) if resume is None else None  # a resumed run has its weights
    # with train.init_from, the checkpoint's architecture: what the run builds and its recipe.yaml records
    recipe = start.recipe if start is not None else warm_recipe(recipe, target.target_info())
    if start is not None:
        accelerator.print(start.summary())
    drafter = place_target(recipe, target, build_drafter(recipe, target), state)
    if start is not None:
        load_weights(drafter, start)
    elif resume is None:
        drafter.init_from_data(count_tokens(data.train, target.target_info().vocab_size))
    optimizer = build_optimizer(drafter, recipe.optim)
    clock = RunClock()  # the trainer's; the schedule may follow it (schedule.anneal_on: time)
    scheduler = build_scheduler(optimizer, recipe.schedule, derived.max_steps, lambda step: schedule_position(
        step, clock.now, max_steps=derived.max_steps, config=recipe.schedule,
        budget_minutes=recipe.train.max_time_minutes))
    drafter, optimizer = accelerator.prepare(drafter, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    request = accelerator.unwrap_model(drafter).feature_request()
    rank = accelerator.process_index
    trainer = Trainer(
        recipe=recipe, derived=derived, accelerator=accelerator, target=target, drafter=drafter, optimizer=optimizer,
        scheduler=scheduler, clock=clock, data=data,
        train_features=feature_provider(recipe, "train", target, request, len(data.train), rank, derived),
        eval_features=feature_provider(recipe, "eval", target, request, len(data.eval), rank),
        eval_prompts=(load_eval_prompts(target.tokenizer, recipe.eval.prompts, recipe.eval.num_prompts,
                                        recipe.data.chat_template, recipe.data.chat_template_kwargs)
                      if recipe.eval.num_prompts > 0 else []),
        pad_token_id=target.pad_token_id)
    if resume is not None:
        trainer.restore(load_checkpoint(accelerator, resume, trainer.model.target_info))
        accelerator.print(f"resumed from {resume} at step {trainer.step}")
    if accelerator.is_main_process:
        os.makedirs(recipe.output.dir, exist_ok=True)
        save_recipe(recipe, os.path.join(recipe.output.dir, "recipe.yaml"))
    if trackers:
        accelerator.init_trackers(recipe.logging.project, config=flat_config(recipe_to_dict(recipe)))
    return trainer
