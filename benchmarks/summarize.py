"""The generated tables of README.md and docs/benchmarks.md, written from the result files in docs/results/.

    python benchmarks/summarize.py           # rewrite every table from docs/results/
    python benchmarks/summarize.py --check   # exit 1 naming the file when a committed table differs

Every number in these tables is read here from a result file (benchmarks/summary_data.py); the text around them
says which run, and each table says where its rows were measured: the CPU model and flags and the threads each
result file recorded, the prompts and tokens of the call, and the recipe, data, steps and commit that trained each
drafter (docs/results/provenance.json, for what a result file cannot record). tests/test_summary.py runs --check,
so a table cannot drift from its results. A table sits between `<!-- generated: NAME -->` and `<!-- end: NAME -->`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.summary_data import (ROOT, Legend, checkpoint_of, f2, link, load, raw, record,  # noqa: E402
                                     trained_cell, trained_notes, wrap, x)
from benchmarks.summary_tables import (DRAFTERS, LONG, RUNS, drafter_cells, drafter_numbers,  # noqa: E402
                                       curve_table, domain_table, long_row, machine_table,
                                       server_table)


# ---- README: the main job as run, per drafter, the long recipes --------------------------------------------------
MAIN_JOB = [("the README's commands as written (HF forward)", "main_job_readme_run"),
            ("retrained as written; eval on the fast path, `--num-draft-tokens auto,1,2,3 --threads 2`",
             "main_job_fast_path"),
            ("the README's commands as written, rerun (the fast path is eval's default)", "main_job_readme_rerun")]


def main_job_table(prefix: str = "docs/") -> str:
    legend = Legend(prefix)
    rows = ["| run | tau, k = 1 / 3 | speedup, k = 1 / 3 | auto k | greedy = plain greedy | trained | measured |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    checkpoints = []
    for label, name in MAIN_JOB:
        k1, k3 = record(name, "eagle3:final", 1), record(name, "eagle3:final", 3)
        auto = record(name, "eagle3:final", "auto") if any(
            str(r["num_draft_tokens"]) == "auto" for r in load(name)["records"]) else None
        exact = min(r["greedy_exact_match"] for r in (k1, k3, auto) if r)
        checkpoints.append(checkpoint_of(name, "eagle3:final"))
        rows.append(f"| {label} | {f2(k1['tau'])} / {f2(k3['tau'])} | {x(k1['speedup'])} / {x(k3['speedup'])} | "
                    f"{x(auto['speedup']) if auto else '-'} | {f2(exact)} | {trained_cell(checkpoints[-1])} | "
                    f"{legend.mark([name])} |")
    return "\n".join(rows + [""] + legend.lines() + trained_notes(checkpoints, prefix))


def readme_table(prefix: str = "docs/") -> str:
    """Every drafter at about the same CPU budget and data (links as numbered references so a row stays short),
    where each row was measured, what trained it, and which readers load each drafter's exports."""
    legend = Legend(prefix)
    rows = ["| drafter | tau, k = 1 | tau, k = 3 | speedup, k = 1 | speedup, auto k | greedy = plain greedy | "
            "trained | measured |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    checkpoints = []
    for d in DRAFTERS:
        numbers = drafter_numbers(d)
        files = numbers["files"]
        checkpoints.append(numbers["checkpoint"])
        rows.append("| " + " | ".join([d.label, *drafter_cells(d, prefix), trained_cell(checkpoints[-1]),
                                        legend.mark(files)]) + " |")
    readers = [f"- {d.label}: " + (link(d.read_by, d.read_anchor, prefix + "benchmarks.md") if d.read_anchor
                                   else d.read_by) for d in DRAFTERS]
    body, targets = numbered_links("\n".join(rows + readers))
    lines = body.split("\n")
    return "\n".join(lines[:len(rows)] + [""] + legend.lines() + trained_notes(checkpoints, prefix) +
                     ["", "Exports read by:", ""] + [wrap(line) for line in lines[len(rows):]] + [""] +
                     [f"[{n}]: {url}" for n, url in targets])


def long_table(prefix: str = "docs/") -> str:
    """The long recipes' drafters that have an eval file (docs/results/long_KIND_eval.json[.gz], written by
    benchmarks/training/long_eval.sh), with the vLLM runs and CPU-hours beside them."""
    legend = Legend(prefix)
    rows = ["| drafter | held-out tau, k = 1/2/3/5/7 | tau at best k [95% CI] | MT-Bench, k = 1/3 | best k | auto | "
            "speedup vLLM/ours (1 thread, 2 threads) | CPU-h | trained | measured |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    checkpoints = []
    for label, kind in LONG:
        cells = long_row(kind)
        if cells is None:
            continue
        checkpoints.append(f"{kind}_long")
        rows.append(f"| {label} | {' | '.join(cells['cells'])} | {trained_cell(checkpoints[-1])} | "
                    f"{legend.mark(cells['files'])} |")
    if not checkpoints:
        return "No long recipe evaluated yet (benchmarks/training/long_eval.sh)."
    return "\n".join(rows + [""] + legend.lines() + trained_notes(checkpoints, prefix))


def numbered_links(text: str) -> tuple[str, list[tuple[int, str]]]:
    """`text` with every inline link [t](url) as a reference [t][n], one n per distinct url in order of first use."""
    numbers: dict[str, int] = {}

    def reference(match) -> str:
        number = numbers.setdefault(match.group(2), len(numbers) + 1)
        return f"[{match.group(1)}][{number}]"

    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", reference, text), [(n, url) for url, n in numbers.items()]


# ---- docs/benchmarks.md: one line per measured claim, every topic ------------------------------------------------
def engine_rows(prefix: str) -> list[tuple]:
    ab = load("bench_engine")["ab"]
    same = "same text" if all(ab["outputs_identical"].values()) else "TEXT DIFFERS"
    over = load("engine_overhead")["rows"]
    ratios = sorted(r["v_ratio"] for r in over)
    return [
        ("engine", "engine", "plain autoregression through the engine vs HF `generate`",
         f"{x(ab['ours_ar_vs_hf_generate'])} ({ab['median_tokens_per_s']['ours_ar']:.1f} vs "
         f"{ab['median_tokens_per_s']['hf_generate']:.1f} tokens/s), {same}", ["bench_engine"], []),
        ("engine", "engine",
         f"speculative decoding vs HF assisted generation, same draft model, k = {ab['assisted_k']}",
         f"{x(ab['ours_vs_hf_assisted'])} ({ab['median_tokens_per_s']['ours_draft_model']:.2f} vs "
         f"{ab['median_tokens_per_s']['hf_assisted']:.2f} tokens/s), {same}", ["bench_engine"], []),
        ("engine", "engine", f"the engine's verify cost v(k) vs the bare HF forward's, k = 0-{over[-1]['k']}",
         f"at most {x(ratios[-1])}, median {x(ratios[len(ratios) // 2])}", ["engine_overhead"], []),
    ]


def main_job_rows(prefix: str) -> list[tuple]:
    k1, k3 = record("main_job_readme_run", "eagle3:final", 1), record("main_job_readme_run", "eagle3:final", 3)
    fast1, auto = record("main_job_fast_path", "eagle3:final", 1), record("main_job_fast_path", "eagle3:final", "auto")
    v = {n: load("perf_forward_t2_quiet")["paths"][n]["v"]["1"] for n in ("hf", "fast-cpu-linear")}
    anchor = "the-main-jobs-recipe-chosen-by-measured-held-out-tau-per-cpu-minute"
    return [("EAGLE-3", anchor, "the README's commands as written",
             f"tau {f2(k1['tau'])} at k = 1 ({x(k1['speedup'])}), {f2(k3['tau'])} at k = 3 ({x(k3['speedup'])}); "
             f"greedy output = plain greedy: {f2(min(k1['greedy_exact_match'], k3['greedy_exact_match']))}",
             ["main_job_readme_run"], ["main_job_readme"]),
            ("engine", anchor, "the README recipe's drafter on the target's fast path",
             f"v(1) {f2(v['fast-cpu-linear'])} decode steps (HF path {f2(v['hf'])}); tau {f2(fast1['tau'])} at k = 1 "
             f"({x(fast1['speedup'])}); auto {x(auto['speedup'])}; greedy output = plain greedy: "
             f"{f2(min(fast1['greedy_exact_match'], auto['greedy_exact_match']))}",
             ["main_job_fast_path", "perf_forward_t2_quiet"], ["main_job_quiet"])]


def drafter_rows(prefix: str) -> list[tuple]:
    rows = []
    for d in DRAFTERS:
        n = drafter_numbers(d)
        text = f"tau {f2(n['k1']['tau'])}" + (f" / {f2(n['k3']['tau'])} at k = 1 / 3" if n["k3"] else " at k = 1")
        run = RUNS[d.run]
        text += f"; {x(n['k1']['speedup'])} at k = 1" + (f" ({run.k1_note})" if run.k1_note else "")
        if n["auto"] is not None:
            text += f"; auto {x(n['auto']['speedup'])}"
        rows.append(("drafters", run.anchor, f"{d.label}: {run.setting}", text, n["files"], [n["checkpoint"]]))
    return rows


def other_rows(prefix: str) -> list[tuple]:
    t1 = {n: record("dspark_vs_eagle3_dflash_t1", n, 7) for n in ("dspark:final", "dflash:final")}
    fixed, sched = record("dspark_schedule_b1", "dspark:final", 8), record("dspark_schedule_b1",
                                                                            "dspark:final@scheduler", 8)
    server = load("server_speedup_quiet")
    served = "; ".join(f"k = {r['k']}: {x(r['speedup_ours'])} ours, {x(r['speedup_vllm'])} vLLM, tau "
                       f"{f2(r['tau_ours'])} both, outputs identical {r['identical_outputs']}" for r in server["rows"])
    runs = load("adaptive_vs_ar")
    broken = runs["drafters"][next(n for n in runs["drafters"] if n.rstrip("/").endswith("random_eagle3"))]
    trees = []
    for label, name in (("EAGLE-3", "eagle3:final"), ("DFlash", "dflash:final"), ("DSpark", "dspark:final")):
        chain, tree = record("study_A", name, 7), record("study_A", name + "@tree", 7, budget=8)
        trees.append(f"{label} tau {f2(chain['tau'])} -> {f2(tree['tau'])}, {x(chain['speedup'])} -> "
                     f"{x(tree['speedup'])}")
    batches = (1, 4, 8, 16)
    load3 = " / ".join(f2(record("load_quiet", "eagle3:final", 3, batch=b)["speedup"]) for b in batches)
    load_auto = " / ".join(f2(record("load_quiet", "eagle3:final", "auto", batch=b)["speedup"]) for b in batches)
    return [
        ("DSpark", "dspark", "DSpark vs DFlash at T = 1 (same backbone, data and budget), k = 7",
         f"tau {f2(t1['dspark:final']['tau'])} vs {f2(t1['dflash:final']['tau'])}", ["dspark_vs_eagle3_dflash_t1"],
         ["D_dspark", "D_dflash"]),
        ("DSpark", "dspark", "confidence-scheduled verification vs verifying all 8 drafts, batch 1",
         f"{x(sched['speedup'])} vs {x(fixed['speedup'])}, greedy output = plain greedy: "
         f"{f2(min(sched['greedy_exact_match'], fixed['greedy_exact_match']))}", ["dspark_schedule_b1"], ["D_dspark"]),
        ("exports served", "the-speedup-vllm-cpu-measures-beside-ours",
         f"vLLM CPU {server['vllm']} serving the README recipe's EAGLE-3 export beside our engine",
         served + f"; plain decoding {server['ar_tokens_per_s_ours']:.1f} tokens/s ours, "
                  f"{server['ar_tokens_per_s_vllm']:.1f} vLLM", ["server_speedup_quiet"], ["main_job_quiet"]),
        ("adaptive k", "adaptive-k", f"a random-weights drafter under auto k vs plain decoding, {runs['repeats']} "
         "calls back to back", f"median {x(broken['median_ratio'])}; k = 0 in {broken['chosen_histogram'][0]} of "
         f"{sum(broken['chosen_histogram'])} rounds", ["adaptive_vs_ar"], ["random_eagle3"]),
        ("trees", "all-drafters-in-one-run", "a tree of 8 nodes vs a chain of 7 drafts (equal verify budget)",
         "; ".join(trees), ["study_A"], ["E_cold", "D_dflash", "D_dspark"]),
        ("load", "load", "EAGLE-3 at batch 1 / 4 / 8 / 16", f"k = 3: {load3}x; auto: {load_auto}x", ["load_quiet"],
         ["E_cold"]),
    ]


def summary_table() -> str:
    legend = Legend("", list_files=False)  # each row names its files
    rows = engine_rows("") + main_job_rows("") + drafter_rows("") + other_rows("")
    lines = ["| topic | measured | result | raw result | measured on | drafters trained |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {link(topic, anchor, '')} | {what} | {result} | {', '.join(raw(f, '') for f in files)} | "
              f"{legend.mark(files)} | {'; '.join(trained_cell(c) for c in checkpoints) or '-'} |"
              for topic, anchor, what, result, files, checkpoints in rows]
    checkpoints = [c for *_, found in rows for c in found]
    return "\n".join(lines + [""] + legend.lines() + trained_notes(checkpoints, "", settings=False))


TABLES = {  # file -> {table name: generator}
    os.path.join("docs", "benchmarks.md"): {"summary": summary_table, "machines": machine_table,
                                            "servers": server_table, "long_curves": curve_table,
                                            "long_domains": domain_table},
    "README.md": {"main_job": main_job_table, "measured": readme_table, "long": long_table},
}


def render(text: str, name: str, table: str, path: str) -> str:
    """`text` with the block between the markers of table `name` replaced by `table`."""
    pattern = re.compile(rf"(<!-- generated: {name} -->\n)(?:.*?\n)?(<!-- end: {name} -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"{path}: no '<!-- generated: {name} -->' ... '<!-- end: {name} -->' markers")
    return pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = parser.parse_args(argv)
    stale = []
    for path, tables in TABLES.items():
        full = os.path.join(ROOT, path)
        with open(full) as f:
            text = f.read()
        new = text
        for name, make in tables.items():
            new = render(new, name, make(), path)
        if new != text:
            stale.append(path)
            if not args.check:
                with open(full, "w") as f:
                    f.write(new)
    if args.check and stale:
        print(f"summarize: {', '.join(stale)} differ from docs/results/; run python benchmarks/summarize.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, OSError) as error:
        print(f"summarize: {error}", file=sys.stderr)
        sys.exit(2)
