"""G. The launchers: `accelerate launch` with the FSDP2 config and one process, save and resume; DeepSpeed ZeRO-2.

    python -m accelerate.commands.launch --config_file recipes/accelerate/8gpu_fsdp.yaml --num_processes 1 \\
        -m train recipes/debug/tiny_dspark.yaml <B's overrides>

as users launch it (`python -m train` under accelerate, from the repo, nothing installed): the drafter's parameters
become DTensors, checkpoints are sharded (distributed checkpoint files) and the export is gathered. Then the same
command with train.resume_from=latest and half as many steps again: it must continue from the last checkpoint. On a
GPU the checkpoint must hold FSDP's sharded files; on CPU accelerate runs the config as a plain process (recorded).
When deepspeed imports (and on a device), recipes/accelerate/8gpu_zero2.yaml with one process trains the EAGLE-3
debug recipe; otherwise that part is recorded as not run.
"""

from __future__ import annotations

import importlib.util
import os
import socket

from benchmarks.gpu_check.b_train import overrides, read_metrics
from benchmarks.gpu_check.context import CheckFailed, Context, finite


def free_port() -> int:
    """A TCP port nothing listens on now: each launch gets its own, so a launcher left over from a killed run (its
    children may hold the default 29500) cannot stop the next one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(ctx: Context, name: str, config: str, recipe: str, output_dir: str, *extra: str) -> tuple[int, str]:
    cpu = ["--cpu"] if ctx.cpu else []
    return ctx.run(name, ctx.python("-m", "accelerate.commands.launch", *cpu, "--config_file", ctx.repo_path(config),
                                    "--num_processes", "1", "--main_process_port", str(free_port()), "-m", "train",
                                    ctx.repo_path(recipe), *overrides(ctx, output_dir, *extra)))


def sharded_files(output_dir: str) -> list[str]:
    """Names in the checkpoints that only FSDP's sharded state dict writes (distributed-checkpoint files, fsdp
    folders)."""
    found = set()
    for _, dirs, files in os.walk(os.path.join(output_dir, "checkpoints")):
        found.update(name for name in dirs + files if "fsdp" in name or name.endswith(".distcp"))
    return sorted(found)


def fsdp(ctx: Context) -> tuple[dict, list[str]]:
    """Train, then resume for half as many steps again; the numbers and the failures."""
    output_dir = os.path.join(ctx.work, "runs", "g", "fsdp")
    config, recipe, steps = "recipes/accelerate/8gpu_fsdp.yaml", "recipes/debug/tiny_dspark.yaml", ctx.sizes.train_steps
    rc, why = launch(ctx, "g_fsdp_train", config, recipe, output_dir)
    if rc:
        return {}, [f"FSDP training exited {rc}: {why}"]
    first, _ = read_metrics(output_dir)
    more = steps + steps // 2
    rc, why = launch(ctx, "g_fsdp_resume", config, recipe, output_dir, "train.resume_from=latest",
                     f"train.max_steps={more}")
    if rc:
        return {"sharded_files": sharded_files(output_dir)}, [f"FSDP resume exited {rc}: {why}"]
    every, _ = read_metrics(output_dir)
    resumed = [line["step"] for line in every[len(first):]]
    with open(os.path.join(ctx.log_dir, "g_fsdp_resume.log"), errors="replace") as f:
        said_resumed = "resumed from" in f.read()
    numbers = {"steps": [steps, more], "resumed_steps": resumed[:1] + resumed[-1:], "sharded_files": sharded_files(
        output_dir), "final": os.path.isfile(os.path.join(output_dir, "final", "config.json")),
        "losses": [round(line["train/loss"], 4) for line in every[:1] + every[-1:]]}
    failures = []
    if not said_resumed or not resumed or resumed[0] != steps + 1 or resumed[-1] != more:
        failures.append(f"FSDP resume did not continue from step {steps} to {more} (logged {resumed[:2]}...)")
    if not finite(line["train/loss"] for line in every):
        failures.append("FSDP: a non-finite loss")
    norms = [line["train/grad_norm"] for line in every if "train/grad_norm" in line]
    numbers["grad_norms"] = [round(v, 4) for v in norms[:1] + norms[-1:]]
    if not norms or not any(v > 0 for v in norms):  # gradients that never reached the sharded parameters
        failures.append(f"FSDP: the gradient norm was never above 0 ({norms[:3]}...): the optimizer stepped nothing")
    if not numbers["final"]:
        failures.append("FSDP: no gathered export in final/")
    if not ctx.cpu and not numbers["sharded_files"]:
        failures.append("FSDP: the checkpoints hold no sharded (FSDP) files: the launch did not run FSDP")
    return numbers, failures


def deepspeed(ctx: Context) -> tuple[dict | str, list[str]]:
    if ctx.cpu:
        return "not run: DeepSpeed needs an accelerator (CPU dry run)", []
    if importlib.util.find_spec("deepspeed") is None:
        return "not run: deepspeed does not import here", []
    output_dir = os.path.join(ctx.work, "runs", "g", "zero2")
    rc, why = launch(ctx, "g_zero2", "recipes/accelerate/8gpu_zero2.yaml", "recipes/debug/tiny_eagle3.yaml",
                     output_dir)
    if rc:
        return {"exit": rc}, [f"ZeRO-2 exited {rc}: {why}"]
    lines, _ = read_metrics(output_dir)
    return {"steps": len(lines), "last_loss": round(lines[-1]["train/loss"], 4) if lines else None}, []


def run(ctx: Context) -> dict:
    numbers: dict = {}
    numbers["fsdp2_one_process"], failures = fsdp(ctx)
    numbers["deepspeed_zero2"], failed = deepspeed(ctx)
    failures += failed
    if failures:
        raise CheckFailed("; ".join(failures), numbers)
    return numbers
