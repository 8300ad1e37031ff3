"""The recipe's cross-field checks that `train.config.load_recipe` runs on every recipe: the numeric fields' bounds,
the vLLM engine fields, the stream settings, the target's placement and the collective timeout. Pure functions of the
recipe: nothing is built or imported to check it.
"""

from __future__ import annotations


def check_settings(settings) -> None:
    """ValueError naming the features.vllm field that cannot describe an engine."""
    where = "features.vllm"
    if settings.tensor_parallel_size < 1:
        raise ValueError(f"{where}.tensor_parallel_size must be >= 1, got {settings.tensor_parallel_size}")
    if settings.max_num_seqs < 1:
        raise ValueError(f"{where}.max_num_seqs must be >= 1, got {settings.max_num_seqs}")
    fraction = settings.gpu_memory_utilization
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise ValueError(f"{where}.gpu_memory_utilization must be in (0, 1], got {fraction}")
    if settings.max_model_len is not None and settings.max_model_len < 2:
        raise ValueError(f"{where}.max_model_len must be >= 2, got {settings.max_model_len}")
    size, rank = settings.data_parallel_size, settings.data_parallel_rank
    if (size is None) != (rank is None):
        raise ValueError(f"{where}: set both data_parallel_size and data_parallel_rank, or neither (then the "
                         "launcher's processes are the ranks)")
    if size is not None and not (size >= 1 and 0 <= rank < size):
        raise ValueError(f"{where}.data_parallel_rank {rank} is not in [0, data_parallel_size={size})")


def check_stream(features) -> None:
    """ValueError naming the features.stream field (or features.cache_dir) that cannot describe a stream."""
    settings = features.stream
    for name in ("window_shards", "steps_per_shard"):
        if getattr(settings, name) < 1:
            raise ValueError(f"features.stream.{name} must be >= 1, got {getattr(settings, name)}")
    if not settings.timeout_s > 0:
        raise ValueError(f"features.stream.timeout_s must be > 0 seconds, got {settings.timeout_s}")
    if features.mode == "streamed" and not features.cache_dir:
        raise ValueError("features.cache_dir must be set for features.mode=streamed (the shards and the trainer's "
                         "progress live there, on a disk both producer and trainer see)")


def check_placement(recipe) -> None:
    """ValueError naming the field when the placement cannot work with the rest of the recipe."""
    if recipe.target.placement == "served" and recipe.features.mode not in ("offline", "streamed"):
        raise ValueError(f"target.placement: served needs features.mode: offline or streamed (mode "
                         f"{recipe.features.mode} runs the target in training); fill the cache with draftsmith "
                         "prepare first, or stream it")
    if recipe.target.placement == "sharded" and recipe.features.mode != "online":
        raise ValueError(f"target.placement: sharded needs features.mode: online (mode {recipe.features.mode} runs "
                         "the target on some processes only, and a sharded forward is collective); use a replicated "
                         "target to fill a cache, or features.extractor: vllm")


def check_launch(recipe) -> None:
    """ValueError naming train.dist_timeout_minutes when collectives could not wait long enough: it must be positive,
    and a streamed run's shard wait (features.stream.timeout_s) must end first, or the collective timeout kills the
    waiting processes before the trainer can say which shard is missing."""
    minutes = recipe.train.dist_timeout_minutes
    if not minutes > 0:
        raise ValueError(f"train.dist_timeout_minutes must be > 0, got {minutes}")
    wait = recipe.features.stream.timeout_s
    if recipe.features.mode == "streamed" and wait >= 60.0 * minutes:
        raise ValueError(f"train.dist_timeout_minutes: {minutes} min is not longer than features.stream.timeout_s "
                         f"({wait:g} s); raise it above {wait / 60.0:g} min or lower the stream timeout")


# (field, the test its value must pass, what the test says); None (where a field allows it) passes: it means "off" or
# "derived". The same bounds are enforced again where the values are used; here they fail before anything loads.
NUMBER_BOUNDS = (
    ("train.batch_size", lambda v: v >= 1, ">= 1"),
    ("train.global_batch_size", lambda v: v >= 1, ">= 1"),
    ("train.grad_accum", lambda v: v >= 1, ">= 1"),
    ("train.max_steps", lambda v: v >= 1, ">= 1"),
    ("train.epochs", lambda v: v > 0, "> 0"),
    ("train.max_time_minutes", lambda v: v > 0, "> 0 (null: no wall budget)"),
    ("train.log_every", lambda v: v >= 1, ">= 1"),
    ("train.save_every", lambda v: v >= 0, ">= 0 (0 or null: no periodic checkpoint)"),
    ("train.eval_every", lambda v: v >= 0, ">= 0 (0 or null: evaluate at the end only)"),
    ("train.keep_last", lambda v: v >= 1, ">= 1 (null keeps every checkpoint)"),
    ("data.max_length", lambda v: v >= 2, ">= 2 (tokens)"),
    ("data.num_samples", lambda v: v >= 1, ">= 1 (null: every conversation)"),
    ("data.num_eval_samples", lambda v: v >= 0, ">= 0"),
    ("data.max_skip_fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("data.num_proc", lambda v: v >= 1, ">= 1"),
    ("optim.lr", lambda v: v >= 0, ">= 0"),
    ("optim.weight_decay", lambda v: v >= 0, ">= 0"),
    ("optim.eps", lambda v: v >= 0, ">= 0"),
    ("optim.grad_clip", lambda v: v > 0, "> 0 (null: no clipping)"),
    ("optim.betas", lambda v: all(0 <= beta < 1 for beta in v), "two values in [0, 1)"),
    ("schedule.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("schedule.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("eval.num_batches", lambda v: v >= 0, ">= 0 (null: every eval batch)"),
    ("eval.num_prompts", lambda v: v >= 0, ">= 0 (0: no decoding probe)"),
    ("eval.num_draft_tokens", lambda v: v >= 1, ">= 1"),
    ("eval.max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("regenerate.num_conversations", lambda v: v >= 1, ">= 1 (null: every conversation)"),
    ("regenerate.heldout_conversations", lambda v: v >= 0, ">= 0"),
    ("regenerate.max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("regenerate.temperature", lambda v: v >= 0, ">= 0 (0: greedy)"),
    ("regenerate.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("regenerate.top_k", lambda v: v >= 0, ">= 0 (0: off)"),
    ("regenerate.min_p", lambda v: 0 <= v <= 1, "in [0, 1] (0: off)"),
    ("regenerate.batch_size", lambda v: v >= 1, ">= 1"),
    ("regenerate.max_prompt_tokens", lambda v: v >= 1, ">= 1"),
)


def check_numbers(recipe) -> None:
    """ValueError naming the first numeric field outside its bounds (NUMBER_BOUNDS), so that `train.batch_size=-1`
    fails in one line before the target loads, not at the first use of the value."""
    for dotted, test, bound in NUMBER_BOUNDS:
        section, name = dotted.split(".")
        owner = getattr(recipe, section)  # regenerate: is None in a recipe without that section
        value = None if owner is None else getattr(owner, name)
        if value is not None and not test(value):
            raise ValueError(f"{dotted} must be {bound}, got {value!r}")
