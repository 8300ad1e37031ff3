"""AdamW over the drafter's trainable parameters and the learning-rate schedule (warm-up + cosine / linear / constant).

The schedule is a function of its position only: the optimizer step, so a resumed run and a wall-clock-limited run
see exactly the learning rates an uninterrupted run would at the same step; or with schedule.anneal_on = "time"
the step or the elapsed share of the wall budget, whichever is further along (`schedule_position`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from train.config import OptimConfig, ScheduleConfig


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW on the parameters that require grad (a drafter's frozen copies of target tensors are excluded)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    if not parameters:
        raise ValueError("the drafter has no trainable parameters")
    return torch.optim.AdamW(parameters, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                             weight_decay=config.weight_decay)


# Decay from 1 (progress 0) to 0 (progress 1); lr_factor maps 0 to min_lr_ratio.
DECAY_SHAPES = {
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "linear": lambda progress: 1.0 - progress,
    "constant": lambda progress: 1.0,
}


def lr_factor(step: int, *, max_steps: int, config: ScheduleConfig) -> float:
    """Multiplier on the peak lr for optimizer step `step` (0-based).

    Warm-up rises linearly to 1 over warmup_steps (step 0 already gets 1 / warmup_steps so it is not wasted); the
    decay then goes from 1 to min_lr_ratio at the last step.
    """
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    decay_steps = max(1, max_steps - config.warmup_steps - 1)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    shape = DECAY_SHAPES[config.kind](progress)
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape  # "constant" stays at 1


def schedule_position(step: int, elapsed_seconds: float, *, max_steps: int, config: ScheduleConfig,
                      budget_minutes: float | None) -> float:
    """Where the schedule stands at optimizer step `step`, in (possibly fractional) steps: the step, or with
    anneal_on = "time" and a wall budget the step or the elapsed share of the budget, whichever is further along."""
    if config.anneal_on != "time" or not budget_minutes:
        return float(step)
    return max(float(step), elapsed_seconds / (60.0 * budget_minutes) * max_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, config: ScheduleConfig, max_steps: int,
                    position: Callable[[int], float] = float):
    """A LambdaLR stepping once per optimizer step, lr = peak * lr_factor(position(step)); its state is saved with
    every checkpoint. `position` maps the scheduler's step count to the schedule's position (`schedule_position`
    over the trainer's run clock)."""
    if config.warmup_steps < 0 or not 0.0 <= config.min_lr_ratio <= 1.0:
        raise ValueError(f"schedule: warmup_steps must be >= 0 and min_lr_ratio in [0, 1], got {config}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(position(step), max_steps=max_steps, config=config))
