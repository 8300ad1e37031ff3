"""The lever screen's result file and table: every lever of `benchmarks/training/levers.sh` that finished, its
held-out tau beside its group's base at equal steps, and what the screen ran on.

    python benchmarks/training/levers_report.py --runs runs/levers --out docs/results/levers_screen.json \
        --md docs/results/levers_screen.md --commit 146d16e --note "beside other work, load 3-4"

Reads <runs>/<lever>/heldout.json (benchmarks/training/heldout_tau.py), or heldout_pq.json where the same decode was
rerun with per-question counts (the paired interval of each lever's difference from its group's base over the same
questions), and the lever's last trainer_state.json; the lever's recipe and overrides come from `levers.sh plan`. tau is a count over the held-out answers, exact whatever
the load; training seconds are wall time, which a loaded machine inflates (the note says what else ran).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

from benchmarks.measure import write_measurement  # noqa: E402
from inference.evaluation.intervals import tau_difference_interval  # noqa: E402
from train.fit.checkpoint import list_checkpoints  # noqa: E402

LEVERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "levers.sh")


def plan() -> list[tuple[str, str, str]]:
    """(lever, recipe, overrides) in levers.sh's order."""
    lines = subprocess.run(["bash", LEVERS, "plan"], capture_output=True, text=True, check=True).stdout.splitlines()
    rows = []
    for line in lines:
        name, _, rest = line.partition(": ")
        recipe, _, overrides = rest.partition(" ")
        rows.append((name, recipe, re.sub(r"\s*\(k = \d+\)$", "", overrides).strip()))
    return rows


def read(runs: str) -> list[dict]:
    rows = []
    for name, recipe, overrides in plan():
        tau_file = os.path.join(runs, name, "heldout.json")
        states = [state for _, path in list_checkpoints(os.path.join(runs, name))
                  if os.path.isfile(state := os.path.join(path, "trainer_state.json"))]
        if not (os.path.isfile(tau_file) and states):
            continue
        held = json.load(open(tau_file))["rows"][0]
        rerun = os.path.join(runs, name, "heldout_pq.json")  # the same decode with per-question counts
        if os.path.isfile(rerun):
            again = json.load(open(rerun))["rows"][0]
            if again["heldout_tau"] != held["heldout_tau"]:
                raise ValueError(f"{rerun}: tau {again['heldout_tau']} differs from {tau_file}'s {held['heldout_tau']}")
            held = again
        state = json.load(open(states[-1]))
        row = {"lever": name, "group": name.split("_")[0], "recipe": recipe, "overrides": overrides,
               "steps": state["step"], "train_seconds": round(state.get("elapsed_seconds", 0.0), 1),
               "heldout_tau": held["heldout_tau"], "heldout_k": held["heldout_k"],
               "heldout_rounds": held["heldout_rounds"], "accepted_per_position": held["heldout_accepted_per_position"],
               "heldout_prompts": held["heldout_prompts"], "heldout_tau_ci95": held.get("heldout_tau_ci95"),
               "heldout_per_question": held.get("heldout_per_question")}
        rows.append(row)
        row["domains"] = {}  # heldout_<set>.json: the same decode on another prompt set (the data-mix lever)
        for path in sorted(glob.glob(os.path.join(runs, name, "heldout_*.json"))):
            prompt_set = os.path.basename(path)[len("heldout_"):-len(".json")]
            if prompt_set != "pq":
                other = json.load(open(path))["rows"][0]
                row["domains"][prompt_set] = {key: other.get(key) for key in (
                    "heldout_tau", "heldout_k", "heldout_tau_ci95", "heldout_prompts", "heldout_per_question")}
    bases = {row["group"]: row for row in rows if row["lever"].endswith("_base") or row["lever"] == "mtp_vocab8k"}
    for row in rows:
        base = bases.get(row["group"])
        row["delta_vs_base"] = None if base is None else round(row["heldout_tau"] - base["heldout_tau"], 4)
        row["delta_ci95"] = paired(row, base)
        for prompt_set, own in row["domains"].items():
            theirs = None if base is None else base["domains"].get(prompt_set)
            own["delta_vs_base"] = None if theirs is None else round(own["heldout_tau"] - theirs["heldout_tau"], 4)
            own["delta_ci95"] = None if row is base else paired(own, theirs)
    return rows


def paired(row: dict, base: dict | None) -> list[float] | None:
    """The paired 95% interval of row's tau less base's over the same questions (None without both counts)."""
    if base is None or row is base or not row.get("heldout_per_question") or not base.get("heldout_per_question"):
        return None
    return [round(x, 4) for x in tau_difference_interval(row["heldout_per_question"], base["heldout_per_question"])]


def delta_cell(row: dict) -> str:
    delta = "-" if row["delta_vs_base"] is None else f"{row['delta_vs_base']:+.3f}"
    return delta + ("" if not row.get("delta_ci95") else " [{0[0]:+.3f}, {0[1]:+.3f}]".format(row["delta_ci95"]))


def tau_cell(row: dict) -> str:
    own = "" if not row.get("heldout_tau_ci95") else " [{0[0]:.2f}, {0[1]:.2f}]".format(row["heldout_tau_ci95"])
    return f"{row['heldout_tau']:.3f} ({row['heldout_k']}){own}"


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# Lever screen: {result['steps']} steps each, batch 4, on the first {result['conversations']} training "
             "conversations of the 10k data drawn (the loader keeps those with an assistant answer left; the data-mix "
             "lever: fewer of them and answers to other prompts, as its overrides say)", "",
             f"{env['cpu']} ({', '.join(env['cpu_flags'])}), {result['threads']} threads, {result['note']}; tree "
             f"{result['commit']}; held-out tau: {result['rows'][0]['heldout_prompts'] if result['rows'] else '-'}, "
             "greedy; the base of each group is the long recipe as written (MTP: the 8k-vocab head).", "",
             "| lever | overrides | steps | train s | held-out tau (k) [95% CI] | vs base [paired 95% CI] | "
             "accepted per position |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        lines.append(f"| {row['lever']} | {row['overrides'] or '(the recipe)'} | {row['steps']} | "
                     f"{row['train_seconds']:.0f} | {tau_cell(row)} | {delta_cell(row)} | "
                     f"{row['accepted_per_position']} |")
    domains = [(row["lever"], prompt_set, own) for row in result["rows"] for prompt_set, own in
               row.get("domains", {}).items()]
    if domains:
        lines += ["", "Per prompt set (the first turns of evaluation sets, never trained on):", "",
                  "| lever | prompt set | tau (k) [95% CI] | vs base [paired 95% CI] |", "| --- | --- | --- | --- |"]
        lines += [f"| {lever} | {own['heldout_prompts']} | {tau_cell(own)} | {delta_cell(own)} |"
                  for lever, prompt_set, own in domains]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs/levers")
    parser.add_argument("--out", required=True)
    parser.add_argument("--md", required=True)
    parser.add_argument("--commit", required=True, help="the tree the screen ran")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--note", default="", help="what else ran on the machine")
    args = parser.parse_args(argv)
    rows = read(args.runs)
    if not rows:
        print(f"levers_report: error: no finished lever under {args.runs}", file=sys.stderr)
        return 2
    result = {"steps": args.steps, "conversations": args.steps * 4, "threads": args.threads, "commit": args.commit,
              "note": args.note, "rows": rows}
    write_measurement(args.out, result)
    with open(args.out) as f:
        result = json.load(f)
    with open(args.md, "w") as f:
        f.write(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
