"""Held-out tau against training step and CPU-hours for the long recipes (docs/benchmarks.md, "Long recipes"): every
checkpoint of each run decoded on the same held-out questions, so the slope at the end of a run is visible.

    python benchmarks/training/long_curves.py --run runs/smollm2_eagle3_long --k 3 \
        --run runs/smollm2_dflash_long --k 7 --out docs/results/long_curves.json --png docs/results/long_curves.png

Each checkpoint (<run>/checkpoints/step_N) is read through its recipe and weights and decodes the first turn of
`--num-prompts` questions of `--prompts` greedily with our engine against the target, k drafts a round (one --k per
--run, in order; default the drafter's longest proposal, capped at 7): tau = 1 + accepted / rounds, with the
accepted drafts per position. CPU-hours = the run's wall time at the checkpoint (trainer_state.json, across resumes)
x the threads it trained with (--train-threads). Rows already in --out for the same checkpoint (run, step and its
trainer clock), prompts and k are kept, so a rerun after more steps evaluates only the new checkpoints, and a run
retrained into the same directory is measured anew (its earlier rows dropped, or kept under the run's name +
--earlier-suffix), and so are the rows of runs not named (same prompts), so runs trained in different sessions share
one file (--train-threads applies to the runs named).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.training.heldout_tau import decode, first_turns  # noqa: E402


def checkpoints(run: str) -> list[tuple[int, str, float]]:
    """(step, directory, wall seconds) of every checkpoint of `run`, by step."""
    from train.fit.checkpoint import list_checkpoints

    found = []
    for step, directory in list_checkpoints(run):
        with open(os.path.join(directory, "trainer_state.json")) as f:
            found.append((step, directory, float(json.load(f).get("elapsed_seconds", 0.0))))
    return found


def cpu_hours(seconds: float, train_threads: int) -> float:
    """A checkpoint's CPU-hours as rows record them (rounded: the key a rerun matches a measured row by)."""
    return round(seconds * train_threads / 3600, 4)


def kept_rows(previous: list[dict], found: dict[str, list[tuple[int, str, float]]], described: str,
              train_threads: int, earlier_suffix: str | None) -> list[dict]:
    """The rows of --out that stay before the named runs are (re)read: those of runs not named this time, measured
    on the same prompts (runs trained in different sessions, on machines that no longer hold the other runs'
    checkpoints, share one curve file); with `earlier_suffix`, also a named run's rows that none of its checkpoints
    matches (an earlier training into the same directory), renamed run + suffix."""
    rows = [r for r in previous if r["run"] not in found and r["heldout_prompts"] == described]
    if earlier_suffix:
        clocks = {(run, step, cpu_hours(seconds, train_threads)) for run, steps in found.items()
                  for step, _, seconds in steps}
        rows += [{**r, "run": r["run"] + earlier_suffix} for r in previous if r["run"] in found
                 and r["heldout_prompts"] == described and (r["run"], r["step"], r["cpu_hours"]) not in clocks]
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run in dict.fromkeys(row["run"] for row in rows):
        mine = sorted((row for row in rows if row["run"] == run), key=lambda row: row["step"])
        label = f"{os.path.basename(run)} (k={mine[0]['heldout_k']})"
        for axis, key in zip(axes, ("step", "cpu_hours")):
            axis.plot([row[key] for row in mine], [row["heldout_tau"] for row in mine], marker="o", label=label)
    for axis, name in zip(axes, ("training step", "CPU-hours")):
        axis.set_xlabel(name)
        axis.set_ylabel("held-out tau")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"held-out tau vs training ({rows[0]['heldout_prompts']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.measure import write_measurement
    from inference.engine.target import TargetModel
    from train.fit.checkpoint import load_trained_drafter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, help="a training output.dir with checkpoints/")
    parser.add_argument("--k", action="append", type=int, default=[], help="drafts a round, one per --run")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", default="recipes/smollm2/data/sharegpt_smollm2_10k.heldout.jsonl")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="threads of this evaluation")
    parser.add_argument("--train-threads", type=int, default=2, help="threads the runs trained with (CPU-hours)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--png", default=None)
    parser.add_argument("--earlier-suffix", default=None,
                        help="keep a named run's rows of an earlier training (no checkpoint of this one matches "
                        "them) under the run's name + this suffix, instead of dropping them")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        if args.k and len(args.k) != len(args.run):
            raise ValueError(f"--k: give one per --run ({len(args.run)}), or none")
        found = {run: checkpoints(run) for run in args.run}
        missing = [run for run in args.run if not found[run]]
        if missing:
            raise ValueError(f"--run {missing[0]}: no checkpoints/step_N there (train.save_every)")
        target = TargetModel.from_pretrained(args.target)
        prompts = first_turns(target, args.prompts, args.num_prompts)
    except (ValueError, OSError) as err:
        print(f"long_curves: error: {err}", file=sys.stderr)
        return 2
    described = f"{args.prompts} x {len(prompts)} first turns, {args.max_new_tokens} new tokens"
    previous = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            previous = json.load(f)["rows"]
    rows = kept_rows(previous, found, described, args.train_threads, args.earlier_suffix)
    for i, run in enumerate(args.run):
        for step, directory, seconds in found[run]:
            drafter = load_trained_drafter(directory, target.target_info()).eval()
            k = args.k[i] if args.k else min(drafter.max_draft_tokens() or 7, 7)
            # the checkpoint's own clock is part of the key: a run retrained into the same directory is measured anew
            key = {"run": run, "step": step, "heldout_k": k, "heldout_prompts": described,
                   "cpu_hours": cpu_hours(seconds, args.train_threads)}
            row = next((r for r in previous if all(r.get(name) == value for name, value in key.items())), None)
            if row is None:
                row = {**key, **decode(target, target.serve(drafter), prompts, k, args.max_new_tokens)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_measurement(args.out, {"rows": rows, "threads": args.threads})
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
