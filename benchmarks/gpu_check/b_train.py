"""B. Every drafter kind trains on the device against a bf16 tiny target, probes, checkpoints and resumes.

Per kind, its debug recipe (recipes/debug/tiny_<kind>.yaml) with target.dtype=bfloat16 and the shipped regenerated
data, built and fitted in this process as `python -m train` does (train.build.build_trainer, Trainer.fit) under bf16
autocast: every logged loss and gradient norm finite, the in-training speculative probe ran (eval/spec_tau logged),
checkpoints at half the steps and at the end. Then a second run resumes from the half-way checkpoint into its own
output dir; its final weights against the straight run's: bitwise equal on CPU (training is bitwise resumable there),
reported on a GPU (its kernels need not be deterministic). D reads the final drafters this section leaves in
<work>/runs/b/<kind>/final.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

from benchmarks.gpu_check.context import (DATA_FILE, KINDS, CheckFailed, Context, each_case, finite, free_memory,
                                          gib, memory_peak, memory_reset_peak, reset_accelerate)


def final_dir(ctx: Context, kind: str) -> str:
    return os.path.join(ctx.work, "runs", "b", kind, "final")


def overrides(ctx: Context, output_dir: str, *extra: str) -> list[str]:
    """The debug recipe's overrides: bf16 target, the shipped data, the mode's sizes, checkpoints at half-way."""
    from train.config import TrainConfig

    s = ctx.sizes
    values = ["target.dtype=bfloat16", f"data.path={ctx.repo_path(DATA_FILE)}", f"data.num_samples={s.num_samples}",
              f"data.num_eval_samples={s.num_eval_samples}", f"data.max_length={s.max_length}",
              f"data.cache_dir={os.path.join(ctx.work, 'hf', 'datasets')}", f"train.max_steps={s.train_steps}",
              "train.epochs=null", f"train.save_every={s.train_steps // 2}", "train.keep_last=null",
              "train.eval_every=null", "train.log_every=1", f"eval.num_prompts={s.probe_prompts}",
              f"eval.max_new_tokens={s.probe_tokens}", "eval.num_batches=1", f"output.dir={output_dir}"]
    if "mixed_precision" in {field.name for field in dataclasses.fields(TrainConfig)}:
        values.append("train.mixed_precision=bf16")  # the recipe field, where this version has it
    return values + list(extra)


def train(ctx: Context, kind: str, output_dir: str, *extra: str) -> dict:
    """One in-process training run; returns its seconds, peak device memory and final step."""
    from train.build import build_trainer
    from train.config import load_recipe

    recipe = load_recipe(ctx.repo_path(f"recipes/debug/tiny_{kind}.yaml"), overrides(ctx, output_dir, *extra))
    reset_accelerate()
    memory_reset_peak(ctx.device)
    started = time.perf_counter()
    trainer = build_trainer(recipe)
    try:
        trainer.fit()
    finally:
        trainer.accelerator.end_training()
    result = {"seconds": round(time.perf_counter() - started, 1), "peak_gib": gib(memory_peak(ctx.device)),
              "step": trainer.step, "mixed_precision": str(trainer.accelerator.mixed_precision),
              "device": str(trainer.accelerator.device)}
    del trainer
    free_memory(ctx.device)
    shutil.copy(os.path.join(output_dir, "metrics.jsonl"),  # the curves travel back in logs.tgz
                os.path.join(ctx.log_dir, f"b_{os.path.basename(output_dir)}_metrics.jsonl"))
    return result


def read_metrics(output_dir: str) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl's train lines and eval lines."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return ([line for line in lines if "train/loss" in line],
            [line for line in lines if any(key.startswith("eval/") for key in line)])


def max_weight_change(first: str, second: str) -> float:
    """max |w1 - w2| over the tensors of two native checkpoints (model.safetensors)."""
    from safetensors.torch import load_file

    a, b = (load_file(os.path.join(path, "model.safetensors")) for path in (first, second))
    if a.keys() != b.keys():
        raise CheckFailed(f"resumed checkpoint holds other tensors: {sorted(set(a) ^ set(b))[:4]}")
    return max(((a[key].double() - b[key].double()).abs().max().item() for key in a if a[key].numel()), default=0.0)


def check_kind(ctx: Context, kind: str) -> tuple[dict, list[str]]:
    """Straight run, then the resumed one; the numbers and what failed."""
    straight = os.path.join(ctx.work, "runs", "b", kind)
    numbers = train(ctx, kind, straight)
    failures = []
    if "bf16" not in numbers["mixed_precision"]:
        failures.append(f"{kind}: trained with mixed precision {numbers['mixed_precision']}, not bf16")
    train_lines, eval_lines = read_metrics(straight)
    losses = [line["train/loss"] for line in train_lines]
    norms = [line["train/grad_norm"] for line in train_lines if "train/grad_norm" in line]
    numbers.update(first_loss=round(losses[0], 4) if losses else None,
                   last_loss=round(losses[-1], 4) if losses else None, logged_steps=len(losses))
    if not losses or not finite(losses + norms):
        failures.append(f"{kind}: a non-finite or missing training loss / gradient norm")
    tau = eval_lines[-1].get("eval/spec_tau") if eval_lines else None
    numbers["probe_tau"] = tau
    if tau is None:
        failures.append(f"{kind}: the in-training probe did not run (no eval/spec_tau)")
    half = ctx.sizes.train_steps // 2
    resumed = os.path.join(ctx.work, "runs", "b", f"{kind}_resumed")
    again = train(ctx, kind, resumed, f"train.resume_from={os.path.join(straight, 'checkpoints', f'step_{half}')}")
    numbers["resumed_seconds"] = again["seconds"]
    resumed_steps = [line["step"] for line in read_metrics(resumed)[0]]
    if again["step"] != ctx.sizes.train_steps or not resumed_steps or min(resumed_steps) != half + 1:
        failures.append(f"{kind}: the resumed run did not continue from step {half} (logged {resumed_steps[:3]})")
    change = max_weight_change(os.path.join(straight, "final"), os.path.join(resumed, "final"))
    numbers["resume_max_abs_weight_change"] = change
    if ctx.device.type == "cpu" and change != 0.0:
        failures.append(f"{kind}: resuming on CPU changed the final weights by {change:.3g} (must be bitwise equal)")
    return numbers, failures


def run(ctx: Context) -> dict:
    numbers: dict = {}
    failures: list[str] = []
    each_case(ctx, KINDS, lambda kind: check_kind(ctx, kind), numbers, failures)
    if failures:
        raise CheckFailed(f"{len(failures)} failure(s): " + "; ".join(failures), numbers)
    return numbers
