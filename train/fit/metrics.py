"""Training metrics: averaging over micro-batches and processes (read from the device once per log line), the run
log, and the speculative-decoding probe.

Every logged line goes to three places: the trackers accelerate was given (tensorboard, wandb), stdout on the main
process, and <output.dir>/metrics.jsonl (one JSON object per log call, always written, so a run without trackers
still leaves its curves behind).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from accelerate.utils import reduce

from inference.engine.api import speculative_generate
from inference.evaluation.chat_template import render_text
from inference.evaluation.intervals import accept_length_mean
from inference.evaluation.metrics import acceptance_counts
from inference.evaluation.prompts import load_questions


def read_floats(values: list) -> list[float]:
    """float(value) of each of `values` (numbers or 0-dim tensors), the tensors of each device read in one transfer.

    A metric kept as a tensor costs the device no wait when it is recorded; reading a whole log interval's metrics
    then waits once instead of once per value. Each tensor goes through float64 first, which holds every fp32, bf16
    and fp16 value and every count below 2**53 exactly, so the floats equal float(value) one by one."""
    floats = [value if not isinstance(value, torch.Tensor) else None for value in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(i)
    for indices in by_device.values():
        read = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in indices]).tolist()
        for i, value in zip(indices, read):
            floats[i] = value
    return [float(value) for value in floats]


class MeanMeter:
    """Running means of named scalars (loss, per-depth accuracy...) over the calls since the last `pop`. Values may be
    numbers or 0-dim tensors; tensors stay on their device until `pop` reads them all (`read_floats`)."""

    def __init__(self):
        self.values: dict[str, list] = {}

    def add(self, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            self.values.setdefault(key, []).append(value)

    def pop(self) -> dict[str, float]:
        return mean_of_meters([self])[0]


def mean_of_meters(meters: list[MeanMeter]) -> list[dict[str, float]]:
    """Each meter's means (popping it), with every tensor of all of them read at once. A key's values are summed in
    the order they were added, so the means do not depend on when they are read."""
    keys = [list(meter.values) for meter in meters]
    floats = iter(read_floats([value for meter in meters for values in meter.values.values() for value in values]))
    means = []
    for meter, names in zip(meters, keys):
        sums = {key: sum((next(floats) for _ in meter.values[key]), 0.0) for key in names}
        means.append({key: sums[key] / len(meter.values[key]) for key in names})
        meter.values = {}
    return means


def any_nonfinite(values: list, device) -> torch.Tensor:
    """[1] float64 on `device`: 1.0 when any of `values` (numbers or tensors) is inf or nan, else 0.0 (nothing read)."""
    if not values:
        return torch.zeros(1, dtype=torch.float64, device=device)
    stacked = torch.stack([torch.as_tensor(value, device=device).detach().reshape(()).to(torch.float64)
                           for value in values])
    return (~torch.isfinite(stacked)).any().to(torch.float64).reshape(1)


def full_norm(norm):
    """The whole drafter's gradient norm from clip_grad_norm_. Under FSDP2 that is a DTensor whose local value covers
    this process's shard only (read as it is, the norm comes out too small, and different on each process);
    full_tensor() reduces it over the shards, a collective that every process reaches at the same point."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def agree_on_step(state, local: torch.Tensor, preempted: bool, now: float) -> tuple[list[float], float]:
    """What every process must answer alike after a step, in one all-reduce and one read: the sums over processes of
    the flags `local` [n] (on state.device) and `preempted`, and the main process's clock reading `now` (the others
    add 0.0, so the float64 sum is exactly the main process's value, whatever the others' clocks say).

    Args:
        state: the Accelerator or accelerate's PartialState (num_processes, is_main_process, device).
    Returns:
        ([n + 1] summed flags, local's then preempted's, the agreed clock in seconds).
    """
    mine = torch.tensor([float(preempted), now if state.is_main_process else 0.0], dtype=torch.float64,
                        device=state.device)
    values = torch.cat([local.to(torch.float64), mine])
    if state.num_processes > 1:
        values = reduce(values, reduction="sum")
    *counts, agreed = values.tolist()
    return counts, agreed


def reduce_mean(accelerator, metrics: dict[str, float]) -> dict[str, float]:
    """Mean of each metric over processes (a collective: every process passes the same keys)."""
    if accelerator.num_processes == 1 or not metrics:
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([metrics[key] for key in keys], dtype=torch.float64, device=accelerator.device)
    values = accelerator.reduce(values, reduction="mean")
    return dict(zip(keys, values.tolist()))


def flat_config(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested recipe dict -> {"optim.lr": 1e-4, ...} with scalar values (what tensorboard's hparams accept)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{name}."))
        elif isinstance(value, (int, float, str, bool)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


class RunLog:
    """Log scalars at a step to trackers, stdout and metrics.jsonl (main process only writes)."""

    def __init__(self, accelerator, output_dir: str):
        self.accelerator = accelerator
        self.path = os.path.join(output_dir, "metrics.jsonl")

    def log(self, step: int, metrics: dict[str, float], prefix: str) -> None:
        named = {f"{prefix}/{key}": value for key, value in metrics.items()}
        self.accelerator.log(named, step=step)
        if self.accelerator.is_main_process:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **named}) + "\n")
            shown = " ".join(f"{key}={value:.4g}" for key, value in named.items())
            self.accelerator.print(f"step {step}: {shown}")


def load_eval_prompts(tokenizer, prompts: str, num_prompts: int, chat_template: str | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> list[list[int]]:
    """The first turn of `num_prompts` questions of a prompt set, rendered with the recipe's chat template and
    template options (data.chat_template, data.chat_template_kwargs), as the training data is."""
    _, questions = load_questions(prompts, num_prompts=num_prompts)
    rendered = []
    for question in questions:
        messages = [{"role": "user", "content": question.turns[0]}]
        text = render_text(tokenizer, messages, chat_template, add_generation_prompt=True,
                           template_kwargs=template_kwargs)
        rendered.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return rendered


@torch.no_grad()
def speculative_probe(target, drafter, prompts: list[list[int]], *, num_draft_tokens: int,
                      max_new_tokens: int) -> dict[str, float]:
    """Real greedy speculative decoding of `prompts` with the current drafter through the engine.

    Returns:
        tau (= 1 + accepted / rounds, bonus token included), acceptance_rate, tokens_per_s, rounds.
    """
    out = speculative_generate(target, drafter, prompts, num_draft_tokens=num_draft_tokens,
                               max_new_tokens=max_new_tokens, temperature=0.0)
    counts = acceptance_counts(out)
    new_tokens = sum(len(tokens) for tokens in out.tokens)
    return {"tau": accept_length_mean(counts["rounds"], counts["accepted"]) or 1.0,
            "acceptance_rate": counts["accepted"] / max(counts["proposed"], 1),
            "tokens_per_s": new_tokens / out.time_total if out.time_total > 0 else 0.0,
            "rounds": float(counts["rounds"])}


# pip distributions of the trackers whose import name differs from the tracker's name
TRACKER_PACKAGES = {"comet_ml": "comet-ml"}


def check_trackers(trackers: list[str]) -> None:
    """ValueError naming logging.trackers for a tracker accelerate does not know, or one that is not installed here:
    accelerate drops an uninstalled tracker without a word, and the run's curves would then reach only
    metrics.jsonl."""
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    known = [name for name in LoggerType.list() if name != "all"]
    available = {str(LoggerType(tracker)) for tracker in get_available_trackers()}
    for name in trackers:
        if name == "all":  # whichever are installed
            continue
        if name not in known:
            raise ValueError(f"logging.trackers: {name!r} is not a tracker; choose from {known}, or [] (metrics.jsonl "
                             "is always written)")
        if name not in available:
            raise ValueError(f"logging.trackers: {name} is not installed here; pip install "
                             f"{TRACKER_PACKAGES.get(name, name)}, or set logging.trackers=[] (metrics.jsonl is always "
                             "written)")
