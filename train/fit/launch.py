"""What the launcher and the recipe settle together before training starts: the mixed precision, the collective
timeout, DeepSpeed's batch sizes and clipping, and whether the drafter's weights end up sharded across processes.

`accelerate launch` hands its config file to the processes as ACCELERATE_* environment variables; what it leaves open
the recipe fills (train.mixed_precision, train.dist_timeout_minutes, train.batch_size, optim.grad_clip). Each function
here is pure, so it is tested without a launch (tests/test_launch.py).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from accelerate import DistributedType

PRECISION_ENV = "ACCELERATE_MIXED_PRECISION"  # what `accelerate launch --mixed_precision` / a config file sets


def resolve_mixed_precision(setting: str, *, accelerator: bool, launcher: str | None) -> str:
    """The Accelerator's mixed_precision. The launcher's when it set one (its value of ACCELERATE_MIXED_PRECISION):
    precision is where-to-run, so an accelerate config keeps the last word. Otherwise the recipe's
    train.mixed_precision, where auto means bf16 on an accelerator (fp32 there runs the matmuls several times slower
    and keeps twice the activations) and "no" on a CPU (fp32, which keeps CPU runs exact and resumable bit for bit).
    fp16 on a CPU is refused (ValueError naming where it came from): accelerate would quietly train in fp32 there."""
    precision = launcher.lower() if launcher else setting
    if precision == "auto":
        precision = "bf16" if accelerator else "no"
    if precision == "fp16" and not accelerator:
        if launcher:
            raise ValueError(f"{PRECISION_ENV}={launcher} (from the launcher): fp16 needs an accelerator; launch "
                             "with --mixed_precision bf16 or no on a CPU")
        raise ValueError("train.mixed_precision: fp16 needs an accelerator (on a CPU accelerate would quietly train "
                         "in fp32); set it to bf16 or no")
    return precision


def process_group_kwargs(timeout_minutes: float) -> dict[str, Any]:
    """init_process_group's arguments for PartialState: the collective timeout. It has to be given where the process
    group is created; the Accelerator comes later, and its InitProcessGroupKwargs would find the group already made
    with NCCL's 10-minute default (gloo's 30)."""
    return {"timeout": timedelta(minutes=timeout_minutes)}


def fill_deepspeed_config(config: dict[str, Any], *, batch_size: int, grad_accum: int, global_batch_size: int,
                          grad_clip: float | None) -> None:
    """Set the batch sizes and clipping a DeepSpeed config needs before `accelerator.prepare` in `config` (the
    plugin's deepspeed_config). accelerate would take the micro-batch from a dataloader, and this loop passes none;
    DeepSpeed clips inside its engine, so its gradient_clipping is the recipe's optim.grad_clip (0 = off). A value
    the config already sets must agree (ValueError naming both otherwise); "auto" or absent is filled in."""
    wanted = {"train_micro_batch_size_per_gpu": (batch_size, "train.batch_size"),
              "gradient_accumulation_steps": (grad_accum, "the derived gradient accumulation"),
              "train_batch_size": (global_batch_size, "the derived global batch"),
              "gradient_clipping": (0.0 if grad_clip is None else float(grad_clip), "optim.grad_clip")}
    for key, (value, source) in wanted.items():
        current = config.get(key, "auto")
        if current != "auto" and current != value:
            raise ValueError(f"the DeepSpeed config sets {key}: {current}, but {source} gives {value}; remove it from "
                             "the DeepSpeed config (the recipe fills it) or make the two agree")
        config[key] = value


def drafter_is_sharded(distributed_type, deepspeed_plugin) -> bool:
    """True when no single process holds the drafter's whole weights: FSDP, or DeepSpeed ZeRO stage 3."""
    if distributed_type == DistributedType.FSDP:
        return True
    return (distributed_type == DistributedType.DEEPSPEED and deepspeed_plugin is not None
            and deepspeed_plugin.zero_stage == 3)
