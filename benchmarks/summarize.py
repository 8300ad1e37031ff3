"""The summary tables of docs/benchmarks.md and README.md, generated from the raw results in docs/results/.

    python benchmarks/summarize.py           # rewrite both tables from docs/results/*.json
    python benchmarks/summarize.py --check   # exit 1 naming the file when a committed table differs

Every number in the two tables is read here from a result file; the text around the numbers (which run, which
section holds its command, which readers load an export) is written below. tests/test_summary.py runs --check, so
a table cannot drift from its results. A table sits between `<!-- generated: NAME -->` and `<!-- end: NAME -->`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from functools import lru_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(RESULTS, name + ".json"))


@lru_cache(maxsize=None)
def load(name: str) -> dict:
    with open(os.path.join(RESULTS, name + ".json")) as f:
        return json.load(f)


def record(name: str, drafter: str, k, *, nth: int = 0, budget: int | None = None, batch: int = 1,
           dataset: str | None = None) -> dict:
    """The `nth` record of result file `name` (pooled over categories) for this drafter, k, tree budget and batch.
    Records of one eval call keep the order of its --drafter list, which tells apart checkpoints of the same name."""
    found = [r for r in load(name)["records"]
             if r["drafter"] == drafter and str(r["num_draft_tokens"]) == str(k) and r.get("tree_budget") == budget
             and r.get("batch_size", 1) == batch and r.get("category", "all") == "all"
             and (dataset is None or r["dataset"] == dataset)]
    if len(found) <= nth:
        raise ValueError(f"docs/results/{name}.json: no record {nth} for drafter {drafter!r}, k {k}, "
                         f"tree budget {budget}, batch {batch}")
    return found[nth]


def x(value: float) -> str:
    return f"{value:.2f}x"


def f2(value: float) -> str:
    return f"{value:.2f}"


def link(text: str, anchor: str, prefix: str) -> str:
    return f"[{text}]({prefix}#{anchor})"


def raw(name: str, prefix: str) -> str:
    return f"[{name}.json]({prefix}results/{name}.json)"


# ---- the runs the tables read (setting and the benchmarks.md section that holds the command) ---------------------
@dataclass(frozen=True)
class Run:
    setting: str
    anchor: str
    k1_note: str = ""  # what the reader must know about the run's k = 1 speedups


RUNS = {
    "study": Run("all drafters in one call, MT-Bench 2 x 2 turns, 64 tokens", "all-drafters-in-one-run"),
    "equal_budget": Run("equal CPU budget, MT-Bench 4 x 2 turns, 96 tokens, one call per k",
                        "mtp-3-one-module-reused-and-the-assistant-at-equal-cpu-budget",
                        k1_note="its k = 1 call measured v(1) below one AR step, load noise: about 0.1 high"),
}


@dataclass(frozen=True)
class Drafter:
    label: str
    run: str  # "study" (files study_A/B/C) or "equal_budget" (equal_budget_k1 / _k3)
    file: str  # the study file, or "" for the equal-budget pair
    name: str  # the drafter's name in the records
    nth_k1: int = 0  # which record of that name (order of the call's --drafter list)
    nth_k3: int = 0
    has_k3: bool = True
    read_by: str = ""
    read_anchor: str = ""  # the Exports served subsection with the readers' commands


DRAFTERS = [
    Drafter("EAGLE-3 (the README main job's recipe)", "study", "study_A", "eagle3:final",
            read_by="vLLM CPU 0.32 (served: same acceptance, same outputs), speculators 0.9, SpecForge 0.2; "
                    "SGLang layout written, not run",
            read_anchor="eagle-3-served-by-vllm-read-by-speculators-and-specforge"),
    Drafter("DFlash", "study", "study_A", "dflash:final",
            read_by="vLLM CPU 0.32 (served in the speculators and z-lab layouts: same acceptance, same outputs), "
                    "the `dflash` package 0.1, transformers 5.24, speculators 0.9 (logits to 1.2e-5)",
            read_anchor="dflash-the-dflash-package-transformers-and-speculators"),
    Drafter("DSpark", "study", "study_A", "dspark:final",
            read_by="DeepSpec, speculators 0.9 (logits to 5.2e-6); vLLM 0.32 refuses the dspark method", read_anchor="dspark-deepspec-and-speculators"),
    Drafter("MTP-1", "study", "study_C", "mtp:final", has_k3=False,
            read_by="DeepSeek-V3 / Qwen3-Next / MiMo layouts for vLLM `method: mtp` and speculators, written and "
                    "read back with transformers' classes; no server run"),
    Drafter("MTP-3", "equal_budget", "", "mtp:final", nth_k1=1, nth_k3=0, read_by="as MTP-1"),
    Drafter("one MTP module reused for 3 steps", "equal_budget", "", "mtp:final", nth_k1=2, nth_k3=1,
            read_by="as MTP-1"),
    Drafter("Medusa-3", "study", "study_B", "medusa:final", read_by="native format only"),
    Drafter("KV-sharing assistant (Gemma-4 style)", "equal_budget", "", "assistant:final",
            read_by="Gemma 4 `gemma4_assistant` layout; drafts equal transformers' Gemma4AssistantForCausalLM (test)"),
    Drafter("n-gram (prompt lookup, no training)", "study", "study_C", "ngram", has_k3=False,
            read_by="nothing to export"),
]


def drafter_numbers(d: Drafter) -> dict:
    """tau at k = 1 and 3, speedup at k = 1, auto's speedup and its share of k = 0 rounds, and the source files."""
    if d.run == "study":
        k1, auto = record(d.file, d.name, 1), record(d.file, d.name, "auto")
        k3 = record(d.file, d.name, 3) if d.has_k3 else None
        plain = auto["num_draft_tokens_histogram"][0] / max(sum(auto["num_draft_tokens_histogram"]), 1)
        return {"k1": k1, "k3": k3, "auto": auto, "plain": plain, "files": [d.file]}
    k1 = record("equal_budget_k1", d.name, 1, nth=d.nth_k1)
    k3 = record("equal_budget_k3", d.name, 3, nth=d.nth_k3)
    return {"k1": k1, "k3": k3, "auto": None, "plain": None, "files": ["equal_budget_k1", "equal_budget_k3"]}


def drafter_cells(d: Drafter, prefix: str) -> list[str]:
    n = drafter_numbers(d)
    anchor = RUNS[d.run].anchor
    tau1 = link(f2(n["k1"]["tau"]), anchor, prefix + "benchmarks.md")
    tau3 = link(f2(n["k3"]["tau"]), anchor, prefix + "benchmarks.md") if n["k3"] else "-"
    speed = link(x(n["k1"]["speedup"]) + (" *" if RUNS[d.run].k1_note else ""), anchor, prefix + "benchmarks.md")
    auto = "-" if n["auto"] is None else link(f"{x(n['auto']['speedup'])} ({n['plain']:.0%} of rounds k = 0)",
                                              anchor, prefix + "benchmarks.md")
    exact = min(r["greedy_exact_match"] for r in (n["k1"], n["k3"], n["auto"]) if r)
    return [tau1, tau3, speed, auto, f2(exact)]


# ---- README: what it measures, per drafter ------------------------------------------------------------------------
def readme_table() -> str:
    """The per-drafter table (links as numbered references, so a row fits 120 columns), the machine it was measured
    on, and which readers load each drafter's exports."""
    prefix = "docs/"
    rows = ["| drafter | tau, k = 1 | tau, k = 3 | speedup, k = 1 | speedup, auto k | greedy = plain greedy |",
            "| --- | --- | --- | --- | --- | --- |"]
    rows += ["| " + " | ".join([d.label, *drafter_cells(d, prefix)]) + " |" for d in DRAFTERS]
    readers = [f"- {d.label}: " + (link(d.read_by, d.read_anchor, prefix + "benchmarks.md") if d.read_anchor
                                   else d.read_by) for d in DRAFTERS]
    files = sorted({f for d in DRAFTERS for f in drafter_numbers(d)["files"]})
    body, targets = numbered_links("\n".join(rows + readers))
    lines = body.split("\n")
    wrapped = [textwrap.fill(line, width=118, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
               for line in lines[len(rows):]]
    return "\n".join(lines[:len(rows)] + ["", measured_on(files), "", "Exports read by:", ""] + wrapped + [""] +
                     [f"[{n}]: {url}" for n, url in targets])


LONG = [("EAGLE-3", "eagle3"), ("DFlash", "dflash"), ("DSpark", "dspark"), ("MTP-3", "mtp")]  # (label, kind)
HELDOUT = "sharegpt_smollm2_10k.heldout"
LONG_KS = (1, 2, 3, 5, 7)  # the held-out columns; a drafter proposing fewer (MTP-3: 3) shows "-" past its limit


def long_table() -> str:
    """The long recipes' drafters that have an eval file (docs/results/long_KIND_eval.json, written by
    benchmarks/training/long_eval.sh): held-out tau per k, MT-Bench tau, the best k by measured speedup, speedup at
    it and under auto k, vLLM's and ours from server_speedup_long_KIND_tT.json, and CPU-hours from long_curves.json."""
    rows = [f"| drafter | held-out tau, k = {'/'.join(map(str, LONG_KS))} | MT-Bench, k = 1/3 | best k | auto | "
            "speedup vLLM/ours (1 thread, 2 threads) | CPU-h |", "| --- | --- | --- | --- | --- | --- | --- |"]
    files = []
    for label, kind in LONG:
        name = f"long_{kind}_eval"
        if not exists(name):
            continue
        files.append(name)
        drafter = next(r["drafter"] for r in load(name)["records"] if r["num_draft_tokens"] not in (0, "0"))
        measured = {str(r["num_draft_tokens"]) for r in load(name)["records"]}
        held = {k: record(name, drafter, k, dataset=HELDOUT) for k in LONG_KS if str(k) in measured}
        bench = {k: record(name, drafter, k, dataset="mt_bench") for k in (1, 3)}
        best = max(held, key=lambda k: held[k]["speedup"])
        auto = record(name, drafter, "auto", dataset=HELDOUT)
        served: dict = {}  # "vLLM/ours" per k measured (EAGLE-3: 1 and 3, DFlash: its block), 1 thread then 2
        for threads in (1, 2):
            server = f"server_speedup_long_{kind}_t{threads}"
            if exists(server):
                files.append(server)
                for r in load(server)["rows"]:
                    served.setdefault(r["k"], []).append(f"{r['speedup_vllm']:.2f}/{r['speedup_ours']:.2f}")
        curve = [r for r in load("long_curves")["rows"] if r["run"].endswith(f"smollm2_{kind}_long")] \
            if exists("long_curves") else []
        hours = f"{max(r['cpu_hours'] for r in curve):.2f}" if curve else "-"
        rows.append(f"| {label} | {'/'.join(f2(held[k]['tau']) if k in held else '-' for k in LONG_KS)} | "
                    f"{'/'.join(f2(bench[k]['tau']) for k in bench)} | {best}: {x(held[best]['speedup'])} | "
                    f"{x(auto['speedup'])} | "
                    f"{'; '.join(f'k = {k}: ' + ', '.join(v) for k, v in sorted(served.items())) or '-'} | "
                    f"{hours} |")
    if not files:
        return "No long recipe evaluated yet (benchmarks/training/long_eval.sh)."
    return "\n".join(rows + ["", measured_on(files)])


def numbered_links(text: str) -> tuple[str, list[tuple[int, str]]]:
    """`text` with every inline link [t](url) as a reference [t][n], one n per distinct url in order of first use."""
    numbers: dict[str, int] = {}

    def reference(match) -> str:
        number = numbers.setdefault(match.group(2), len(numbers) + 1)
        return f"[{match.group(1)}][{number}]"

    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", reference, text), [(n, url) for url, n in numbers.items()]


def measured_on(files: list[str]) -> str:
    """Which machine the result files were measured on: their CPU model and flags, threads and torch (from each
    call's recorded environment), so a reader knows where a speedup holds."""
    def environment(name: str) -> dict:  # eval reports keep it under "config", benchmark JSONs at the top
        data = load(name)
        return data.get("config", {}).get("environment") or data.get("environment") or {}

    machines = sorted({(env.get("cpu", "?"), tuple(env.get("cpu_flags") or ()), env.get("threads", "?"),
                        env.get("torch", "?")) for env in map(environment, files)})
    said = "; ".join(f"{cpu} ({', '.join(flags) or 'flags not recorded'}), "
                     f"{threads} thread{'s' if threads != 1 else ''}, torch {torch}"
                     for cpu, flags, threads, torch in machines)
    return textwrap.fill(f"Measured on: {said} (the environment recorded in {', '.join(files)}).", width=118)


# ---- docs/benchmarks.md: one line per measured claim, every topic ------------------------------------------------
def engine_rows(prefix: str) -> list[list[str]]:
    ab = load("bench_engine")["ab"]
    same = "same text" if all(ab["outputs_identical"].values()) else "TEXT DIFFERS"
    over = load("engine_overhead")["rows"]
    ratios = sorted(r["v_ratio"] for r in over)
    median = ratios[len(ratios) // 2]
    anchor = "engine"
    return [
        [link("engine", anchor, prefix), "plain autoregression through the engine vs HF `generate`",
         f"{x(ab['ours_ar_vs_hf_generate'])} ({ab['median_tokens_per_s']['ours_ar']:.1f} vs "
         f"{ab['median_tokens_per_s']['hf_generate']:.1f} tokens/s), {same}", raw("bench_engine", prefix)],
        [link("engine", anchor, prefix), f"speculative decoding vs HF assisted generation, same draft model, "
         f"k = {ab['assisted_k']}",
         f"{x(ab['ours_vs_hf_assisted'])} ({ab['median_tokens_per_s']['ours_draft_model']:.2f} vs "
         f"{ab['median_tokens_per_s']['hf_assisted']:.2f} tokens/s), {same}", raw("bench_engine", prefix)],
        [link("engine", anchor, prefix),
         f"the engine's verify cost v(k) vs the bare HF forward's, k = 0-{over[-1]['k']}",
         f"at most {x(ratios[-1])}, median {x(median)}", raw("engine_overhead", prefix)],
    ]


def main_job_rows(prefix: str) -> list[list[str]]:
    k1, k3 = record("main_job_readme_run", "eagle3:final", 1), record("main_job_readme_run", "eagle3:final", 3)
    return [[link("EAGLE-3", "the-main-jobs-recipe-chosen-by-measured-held-out-tau-per-cpu-minute", prefix),
             "the README main job as written (MT-Bench 4 x 2 turns, 96 tokens)",
             f"tau {f2(k1['tau'])} at k = 1 ({x(k1['speedup'])}), {f2(k3['tau'])} at k = 3 ({x(k3['speedup'])}); "
             f"greedy output = plain greedy: {f2(min(k1['greedy_exact_match'], k3['greedy_exact_match']))}",
             raw("main_job_readme_run", prefix)],
            fast_path_row(prefix)]


def fast_path_row(prefix: str) -> list[str]:
    """The README main job's drafter on the target's fast path, quiet machine, 2 threads."""
    k1, auto = record("main_job_fast_path", "eagle3:final", 1), record("main_job_fast_path", "eagle3:final", "auto")
    paths = load("perf_forward_t2_quiet")["paths"]
    v = {name: paths[name]["v"]["1"] for name in ("hf", "fast-cpu-linear")}
    return [link("engine", "on-the-quiet-machine-the-numbers-to-read", prefix),
            "the README main job's drafter on the target's fast path (MT-Bench 4 x 2 turns, 96 tokens, 2 threads)",
            f"v(1) {f2(v['fast-cpu-linear'])} decode steps (HF path {f2(v['hf'])}); tau {f2(k1['tau'])} at k = 1 "
            f"({x(k1['speedup'])}); auto {x(auto['speedup'])}; greedy output = plain greedy: "
            f"{f2(min(k1['greedy_exact_match'], auto['greedy_exact_match']))}",
            raw("main_job_fast_path", prefix)]


def drafter_rows(prefix: str) -> list[list[str]]:
    rows = []
    for d in DRAFTERS:
        n = drafter_numbers(d)
        text = f"tau {f2(n['k1']['tau'])}" + (f" / {f2(n['k3']['tau'])} at k = 1 / 3" if n["k3"] else " at k = 1")
        run = RUNS[d.run]
        text += f"; {x(n['k1']['speedup'])} at k = 1" + (f" ({run.k1_note})" if run.k1_note else "")
        if n["auto"] is not None:
            text += f"; auto {x(n['auto']['speedup'])}"
        rows.append([link("drafters", run.anchor, prefix), f"{d.label}: {run.setting}", text,
                     ", ".join(raw(f, prefix) for f in n["files"])])
    return rows


def dspark_rows(prefix: str) -> list[list[str]]:
    t1 = {n: record("dspark_vs_eagle3_dflash_t1", n, 7) for n in ("dspark:final", "dflash:final")}
    fixed = record("dspark_schedule_b1", "dspark:final", 8)
    sched = record("dspark_schedule_b1", "dspark:final@scheduler", 8)
    return [
        [link("DSpark", "dspark", prefix), "DSpark vs DFlash at T = 1 (same backbone, data and budget), k = 7",
         f"tau {f2(t1['dspark:final']['tau'])} vs {f2(t1['dflash:final']['tau'])}",
         raw("dspark_vs_eagle3_dflash_t1", prefix)],
        [link("DSpark", "dspark", prefix), "confidence-scheduled verification vs verifying all 8 drafts, batch 1",
         f"{x(sched['speedup'])} vs {x(fixed['speedup'])}, greedy output = plain greedy: "
         f"{f2(min(sched['greedy_exact_match'], fixed['greedy_exact_match']))}", raw("dspark_schedule_b1", prefix)],
    ]


def adaptive_rows(prefix: str) -> list[list[str]]:
    runs = load("adaptive_vs_ar")
    name = next(n for n in runs["drafters"] if n.rstrip("/").endswith("random_eagle3"))
    broken = runs["drafters"][name]
    hist = broken["chosen_histogram"]
    return [[link("adaptive k", "adaptive-k", prefix),
              f"a random-weights drafter under auto k vs plain decoding, {runs['repeats']} calls back to back",
              f"median {x(broken['median_ratio'])}; k = 0 in {hist[0]} of {sum(hist)} rounds",
              raw("adaptive_vs_ar", prefix)]]


def tree_rows(prefix: str) -> list[list[str]]:
    parts = []
    for label, name in (("EAGLE-3", "eagle3:final"), ("DFlash", "dflash:final"), ("DSpark", "dspark:final")):
        chain, tree = record("study_A", name, 7), record("study_A", name + "@tree", 7, budget=8)
        parts.append(f"{label} tau {f2(chain['tau'])} -> {f2(tree['tau'])}, {x(chain['speedup'])} -> "
                     f"{x(tree['speedup'])}")
    return [[link("trees", "all-drafters-in-one-run", prefix),
             "a tree of 8 nodes vs a chain of 7 drafts (equal verify budget)",
             "; ".join(parts), raw("study_A", prefix)]]


def load_rows(prefix: str) -> list[list[str]]:
    batches = (1, 4, 8, 16)
    k3 = [record("load_quiet", "eagle3:final", 3, batch=b)["speedup"] for b in batches]
    auto = [record("load_quiet", "eagle3:final", "auto", batch=b)["speedup"] for b in batches]
    return [[link("load", "load", prefix), "EAGLE-3 at batch 1 / 4 / 8 / 16 (Spec-Bench QA, 32 tokens)",
             f"k = 3: {' / '.join(f'{s:.2f}' for s in k3)}x; auto: {' / '.join(f'{s:.2f}' for s in auto)}x",
             raw("load_quiet", prefix)]]


def server_rows(prefix: str) -> list[list[str]]:
    run = load("server_speedup_quiet")
    parts = [f"k = {r['k']}: {x(r['speedup_ours'])} ours, {x(r['speedup_vllm'])} vLLM, tau {f2(r['tau_ours'])} ours, "
             f"{f2(r['tau_vllm'])} vLLM, outputs identical {r['identical_outputs']}" for r in run["rows"]]
    return [[link("exports served", "on-the-quiet-machine-the-numbers-to-read", prefix),
             f"vLLM CPU {run['vllm']} serving an EAGLE-3 export beside our engine, same prompts, "
             f"{run['threads']} thread each",
             "; ".join(parts) + f"; plain decoding {run['ar_tokens_per_s_ours']:.1f} tokens/s ours, "
             f"{run['ar_tokens_per_s_vllm']:.1f} vLLM",
             raw("server_speedup_quiet", prefix)]]


def summary_table() -> str:
    prefix = ""
    rows = (engine_rows(prefix) + main_job_rows(prefix) + drafter_rows(prefix) + dspark_rows(prefix)
            + server_rows(prefix) + adaptive_rows(prefix) + tree_rows(prefix) + load_rows(prefix))
    lines = ["| topic | measured | result | raw result |", "| --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


TABLES = {  # file -> {table name: generator}
    os.path.join("docs", "benchmarks.md"): {"summary": summary_table},
    "README.md": {"measured": readme_table, "long": long_table},
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
