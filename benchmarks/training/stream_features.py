"""Streamed vs offline features on the same SmolLM2 data: peak disk and tokens/s (docs/results/stream_features.json).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/training/stream_features.py --out /tmp/stream_bench

recipes/smollm2/eagle3.yaml's data and drafter (its first --samples conversations, one epoch, features in bf16,
extractor hf), run as a user runs each mode, every process single-threaded:
- offline: `draftsmith prepare` writes the whole train split's cache, then `draftsmith train` reads it;
- streamed: `draftsmith prepare` (the producer) and `draftsmith train` started together, window --window shards of
  one step each.
The modes alternate for --repeats rounds (offline, streamed, offline, ...), so a shared machine's load falls on both.
Per run: wall time from the first process's start to the last one's exit, peak bytes under features.cache_dir
(polled every 50 ms; offline's cache only grows, so its peak is its final size; both include the eval split's
cache, reported apart), the tokens trained (every sample of
the epoch's steps), end-to-end tokens/s = tokens / wall, and the trainer's own tokens/s over its train steps (which
in streamed mode include waiting for shards). `uptime`'s load is recorded before and after each run. With
--extractor vllm --python /work/envs/vllm/bin/python the producer (and offline prepare) run in the vLLM env.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "smollm2", "eagle3.yaml")


def overrides(args, mode: str, run_dir: str) -> list[str]:
    return [f"data.num_samples={args.samples}", "data.num_eval_samples=4", "train.epochs=1", "train.max_steps=null",
            "train.max_time_minutes=null", "train.log_every=1", "eval.num_prompts=0", "eval.num_batches=1",
            f"features.mode={mode}", f"features.cache_dir={run_dir}/features", f"output.dir={run_dir}/out",
            f"features.extractor={args.extractor}", f"features.stream.window_shards={args.window}",
            "features.stream.steps_per_shard=1"]


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average: ")[-1]


def directory_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except FileNotFoundError:  # deleted while counted
                pass
    return total


class DiskPeak:
    """The most bytes seen under `path` at once, polled from a thread."""

    def __init__(self, path: str):
        self.path, self.peak, self.done = path, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.05):
            self.peak = max(self.peak, directory_bytes(self.path))

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.peak, directory_bytes(self.path))


def start(python: str, command: str, args: list[str], log: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": ROOT}
    return subprocess.Popen([python, "-m", "train.cli", command, RECIPE, *args], cwd=ROOT, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def finish(process: subprocess.Popen, log: str) -> None:
    if process.wait():
        raise SystemExit(f"{' '.join(process.args[3:5])} failed (exit {process.returncode}); see {log}")


def step_tokens(args, run_dir: str) -> list[int]:
    """Tokens of each optimizer step of the epoch (the trainer's data order, train/fit/loop.py)."""
    from transformers import AutoTokenizer

    from inference.assets.store import resolve_target
    from train.config import derive, load_recipe
    from train.data.dataset import build_dataset
    from train.features.stream import StreamPlan

    recipe = load_recipe(RECIPE, overrides(args, "offline", run_dir))
    data = build_dataset(AutoTokenizer.from_pretrained(resolve_target(recipe.target.name_or_path)), recipe.data)
    derived = derive(recipe, world_size=1, num_train_samples=len(data.train))
    plan = StreamPlan(len(data.train), recipe.train.seed, derived.global_batch_size, derived.steps_per_epoch,
                      derived.max_steps, 1)
    return [sum(len(data.train[i]["input_ids"]) for i in plan.samples_of(step)) for step in range(derived.max_steps)]


def trainer_tokens_per_s(run_dir: str, tokens: list[int]) -> float:
    """Tokens over the seconds of the logged train steps (each line is one step: train.log_every=1)."""
    seconds = 0.0
    with open(os.path.join(run_dir, "out", "metrics.jsonl")) as f:
        for line in map(json.loads, f):
            if "train/tokens_per_s" in line:
                seconds += tokens[line["step"] - 1] / line["train/tokens_per_s"]
    return sum(tokens) / seconds


def run_mode(args, mode: str, run_dir: str, tokens: list[int]) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(os.path.join(run_dir, "features"))
    before, disk = load(), DiskPeak(os.path.join(run_dir, "features"))
    started = time.perf_counter()
    extra = overrides(args, mode, run_dir)
    producer = start(args.python, "prepare", extra, os.path.join(run_dir, "prepare.log"))
    if mode == "offline":
        finish(producer, os.path.join(run_dir, "prepare.log"))
    prepared = time.perf_counter() - started
    trainer = start(sys.executable, "train", extra, os.path.join(run_dir, "train.log"))
    finish(trainer, os.path.join(run_dir, "train.log"))
    if mode == "streamed":
        finish(producer, os.path.join(run_dir, "prepare.log"))
    wall = time.perf_counter() - started
    peak = disk.stop()
    return {"mode": mode, "wall_s": round(wall, 1), "prepare_s": round(prepared, 1) if mode == "offline" else None,
            "peak_disk_bytes": peak, "eval_cache_bytes": directory_bytes(os.path.join(run_dir, "features", "eval")),
            "tokens": sum(tokens), "tokens_per_s": round(sum(tokens) / wall, 1),
            "trainer_tokens_per_s": round(trainer_tokens_per_s(run_dir, tokens), 1), "load_before": before,
            "load_after": load()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, default=48, help="conversations of the recipe's data")
    parser.add_argument("--window", type=int, default=4, help="features.stream.window_shards")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--extractor", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--python", default=sys.executable, help="interpreter of prepare (the vLLM env for vllm)")
    parser.add_argument("--result", default=os.path.join(ROOT, "docs", "results", "stream_features.json"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tokens = step_tokens(args, os.path.join(args.out, "plan"))
    runs = []
    for repeat in range(args.repeats):
        for mode in ("offline", "streamed"):
            runs.append(run_mode(args, mode, os.path.join(args.out, f"{mode}{repeat}"), tokens))
            print(json.dumps(runs[-1]), flush=True)
    median = {mode: {key: statistics.median(run[key] for run in runs if run["mode"] == mode)
                     for key in ("wall_s", "peak_disk_bytes", "tokens_per_s", "trainer_tokens_per_s")}
              for mode in ("offline", "streamed")}
    summary = {
        "command": "OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/training/stream_features.py "
                   + " ".join(sys.argv[1:]),
        "recipe": os.path.relpath(RECIPE, ROOT), "samples": args.samples, "steps": len(tokens),
        "window_shards": args.window, "extractor": args.extractor, "threads_per_process": 1,
        "cpus": os.cpu_count(), "runs": runs, "median": median,
        "streamed_over_offline": {key: round(median["streamed"][key] / median["offline"][key], 3)
                                  for key in median["offline"]},
    }
    with open(args.result, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({"median": median, "streamed_over_offline": summary["streamed_over_offline"]}, indent=1))


if __name__ == "__main__":
    main()
