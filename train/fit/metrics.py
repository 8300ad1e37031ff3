"""Training metrics: averaging over micro-batches and processes, the run log, and the speculative-decoding probe.

Every logged line goes to three places: the trackers accelerate was given (tensorboard, wandb), stdout on the main
process, and <output.dir>/metrics.jsonl (one JSON object per log call, always written, so a run without trackers
still leaves its curves behind).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from inference.engine.generate import speculative_generate
from inference.evaluation.chat_template import render_text
from inference.evaluation.metrics import accept_length_mean, acceptance_counts
from inference.evaluation.prompts import load_questions


class MeanMeter:
    """Running means of named scalars (loss, per-depth accuracy...) over the calls since the last `pop`."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
            self.counts[key] = self.counts.get(key, 0) + 1

    def pop(self) -> dict[str, float]:
        means = {key: self.sums[key] / self.counts[key] for key in self.sums}
        self.sums, self.counts = {}, {}
        return means


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
