"""The numbers of benchmarks/summarize.py's larger tables: every drafter at the SmolLM2 budget, the long recipes
(summary and per k), the machines, and the speedup vLLM CPU measures beside ours. Each reads docs/results/ through
benchmarks/summary_data.py and returns Markdown (or the cells of a row).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.summary_data import (Legend, checkpoint_of, exists, f2, load, machine, raw, record, trained,
                                     trained_cell, trained_notes, wrap, x)


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
    Drafter("EAGLE-3", "study", "study_A", "eagle3:final",
            read_by="vLLM CPU 0.32 (served: same acceptance, same outputs; so too on tiny Gemma 4 and gpt-oss "
                    "targets), speculators 0.9, SpecForge 0.2; SGLang layout written, not run",
            read_anchor="eagle-3-served-by-vllm-read-by-speculators-and-specforge"),
    Drafter("DFlash", "study", "study_A", "dflash:final",
            read_by="vLLM CPU 0.32 (served in the speculators and z-lab layouts: same acceptance, same outputs; so "
                    "too on a tiny Gemma 4), "
                    "the `dflash` package 0.1, transformers 5.24, speculators 0.9 (logits to 1.2e-5)",
            read_anchor="dflash-the-dflash-package-transformers-and-speculators"),
    Drafter("DSpark", "study", "study_A", "dspark:final",
            read_by="DeepSpec, speculators 0.9 (logits to 5.2e-6); vLLM 0.32 serves DSpark in its V2 GPU model "
                    "runner only (Triton): its CPU build refuses the method, so no served check has run",
            read_anchor="dspark-deepspec-and-speculators"),
    Drafter("MTP-1", "study", "study_C", "mtp:final", has_k3=False,
            read_by="DeepSeek-V3 / Qwen3-Next / Qwen3.5 / MiMo / Nemotron-H layouts for vLLM `method: mtp` and "
                    "speculators, read back with transformers' classes; the MiMo and DeepSeek-V3 layouts served by "
                    "vLLM CPU 0.32 (tiny MiMo, DeepSeek-V3 and GLM-4.5 targets: same outputs, same acceptance per "
                    "position)"),
    Drafter("MTP-3", "equal_budget", "", "mtp:final", nth_k1=1, nth_k3=0, read_by="as MTP-1"),
    Drafter("one MTP module reused for 3 steps", "equal_budget", "", "mtp:final", nth_k1=2, nth_k3=1,
            read_by="as MTP-1"),
    Drafter("Medusa-3", "study", "study_B", "medusa:final",
            read_by="vLLM's `medusa` layout, served by vLLM CPU 0.32 (SmolLM2, tiny Gemma 4 and gpt-oss: same "
                    "outputs, same acceptance per position); FasterDecoding's releases read"),
    Drafter("KV-sharing assistant (Gemma-4 style)", "equal_budget", "", "assistant:final",
            read_by="Gemma 4 `gemma4_assistant` layout; drafts equal transformers' Gemma4AssistantForCausalLM (test); "
                    "served by vLLM CPU 0.32 with `drafter.reading: vllm` (a tiny Gemma 4: same outputs, same "
                    "acceptance per position)"),
    Drafter("n-gram (prompt lookup, no training)", "study", "study_C", "ngram", has_k3=False,
            read_by="nothing to export"),
]


def drafter_numbers(d: Drafter) -> dict:
    """tau at k = 1 and 3, speedup at k = 1, auto's speedup and its share of k = 0 rounds, the source files and the
    checkpoint that was measured."""
    if d.run == "study":
        k1, auto = record(d.file, d.name, 1), record(d.file, d.name, "auto")
        k3 = record(d.file, d.name, 3) if d.has_k3 else None
        plain = auto["num_draft_tokens_histogram"][0] / max(sum(auto["num_draft_tokens_histogram"]), 1)
        return {"k1": k1, "k3": k3, "auto": auto, "plain": plain, "files": [d.file],
                "checkpoint": checkpoint_of(d.file, d.name)}
    k1 = record("equal_budget_k1", d.name, 1, nth=d.nth_k1)
    k3 = record("equal_budget_k3", d.name, 3, nth=d.nth_k3)
    return {"k1": k1, "k3": k3, "auto": None, "plain": None, "files": ["equal_budget_k1", "equal_budget_k3"],
            "checkpoint": checkpoint_of("equal_budget_k1", d.name, d.nth_k1)}


def drafter_cells(d: Drafter, prefix: str) -> list[str]:
    n = drafter_numbers(d)
    anchor, page = RUNS[d.run].anchor, prefix + "benchmarks.md"
    tau1 = f"[{f2(n['k1']['tau'])}]({page}#{anchor})"
    tau3 = f"[{f2(n['k3']['tau'])}]({page}#{anchor})" if n["k3"] else "-"
    speed = f"[{x(n['k1']['speedup']) + (' *' if RUNS[d.run].k1_note else '')}]({page}#{anchor})"
    auto = "-" if n["auto"] is None else \
        f"[{x(n['auto']['speedup'])} ({n['plain']:.0%} of rounds k = 0)]({page}#{anchor})"
    exact = min(r["greedy_exact_match"] for r in (n["k1"], n["k3"], n["auto"]) if r)
    return [tau1, tau3, speed, auto, f2(exact)]


# ---- the long recipes ---------------------------------------------------------------------------------------------
LONG = [("EAGLE-3", "eagle3"), ("DFlash", "dflash"), ("DSpark", "dspark"), ("MTP-3", "mtp")]  # (label, kind)
HELDOUT = "sharegpt_smollm2_10k.heldout"
LONG_KS = (1, 2, 3, 5, 7)  # the held-out columns; a drafter proposing fewer (MTP-3: 3) shows "-" past its limit


def long_records(kind: str) -> tuple[str, list[dict]]:
    """The drafter's name in long_KIND_eval and its pooled records (the baseline left out)."""
    name = f"long_{kind}_eval"
    records = [r for r in load(name)["records"] if r.get("category", "all") == "all" and r["drafter"] != "none"]
    return records[0]["drafter"], records


def measures_row(export: str, checkpoint: str) -> bool:
    """Whether a served export's numbers belong in the row of `checkpoint`: it is that checkpoint, or provenance
    records it as a retraining of that checkpoint's recipe ("retrains")."""
    return export == checkpoint or trained(export).get("retrains") == checkpoint


def long_row(kind: str) -> dict | None:
    """The README long table's cells for one kind, and its files; None without an eval file."""
    name = f"long_{kind}_eval"
    if not exists(name):
        return None
    drafter, records = long_records(kind)
    measured = {str(r["num_draft_tokens"]) for r in records}
    held = {k: record(name, drafter, k, dataset=HELDOUT) for k in LONG_KS if str(k) in measured}
    benched = {str(r["num_draft_tokens"]) for r in records if r["dataset"] == "mt_bench"}
    bench = {k: record(name, drafter, k, dataset="mt_bench") for k in (1, 3) if str(k) in benched}
    best = max(held, key=lambda k: held[k]["speedup"])
    auto = record(name, drafter, "auto", dataset=HELDOUT)
    checkpoint = checkpoint_of(name, drafter)
    # "vLLM/ours" per k measured, 1 thread then 2, of this checkpoint or of a retraining of its recipe (provenance's
    # "retrains": same recipe, data and overrides, another machine or step count), which the cell then names
    files, served, retrainings = [name], {}, []
    for threads in (1, 2):
        server = f"server_speedup_long_{kind}_t{threads}"
        export = checkpoint_of(server, "export") if exists(server) else None
        if export is None or not measures_row(export, checkpoint):
            continue
        files.append(server)
        if export != checkpoint and export not in retrainings:
            retrainings.append(export)
        for r in load(server)["rows"]:
            served.setdefault(r["k"], []).append(f"{r['speedup_vllm']:.2f}/{r['speedup_ours']:.2f}")
    curve = [r for r in load("long_curves")["rows"] if r["run"].endswith(f"smollm2_{kind}_long")] \
        if exists("long_curves") else []
    if curve and max(r["step"] for r in curve) != trained(checkpoint)["steps"]:
        curve = []  # the curve of another training of that directory: its CPU-hours are not this drafter's
    cells = ["/".join(f2(held[k]["tau"]) if k in held else "-" for k in LONG_KS),
             f"{f2(held[best]['tau'])}{interval(held[best])}",
             "/".join(f2(bench[k]["tau"]) for k in bench) or "-", f"{best}: {x(held[best]['speedup'])}",
             x(auto["speedup"]),
             "; ".join(f"k = {k}: " + ", ".join(v) for k, v in sorted(served.items()))
             + "".join(f" (its retraining: {trained(c)['steps']} steps, {trained(c)['commit']})" for c in retrainings)
             or "-",
             f"{max(r['cpu_hours'] for r in curve):.2f}" if curve else "-"]
    return {"cells": cells, "files": files}


def interval(r: dict) -> str:
    """tau's 95% bootstrap interval over questions, as eval records it ("-" in records older than it)."""
    ci = r.get("tau_ci95")
    return f" [{f2(ci[0])}, {f2(ci[1])}]" if ci else ""


DOMAINS = ("humaneval", "gsm8k", "spec_bench")  # long_eval.sh's third pass: per category, at the best k and auto


def domain_table(prefix: str = "") -> str:
    """One row per category of the code, math and Spec-Bench sets, one column per long drafter measured on them:
    tau [95% CI] and speedup at the held-out best k, then auto k's speedup (long_eval.sh's third pass)."""
    legend, columns = Legend(prefix), []
    for label, kind in LONG:
        name = f"long_{kind}_eval"
        records = [r for r in load(name)["records"] if r["dataset"] in DOMAINS and r["drafter"] != "none"] \
            if exists(name) else []
        if records:
            columns.append((label, name, records))
    if not columns:
        return "No long drafter measured per category yet (benchmarks/training/long_eval.sh, its third pass)."
    keys = list(dict.fromkeys((r["dataset"], r["category"]) for _, _, records in columns for r in records))
    single = {d for d, _ in keys if sum(key[0] == d for key in keys) == 2}  # "all" and its one category: one row
    keys = [key for key in keys if not (key[1] == "all" and key[0] in single)]
    lines = ["| set | category | questions | " + " | ".join(f"{label}: tau [95% CI], k: speedup; auto"
                                                           for label, _, _ in columns) + " |",
             "| --- | --- | --- |" + " --- |" * len(columns)]
    for key in keys:
        cells, questions = [], "-"
        for _, _, records in columns:
            rows = [r for r in records if (r["dataset"], r["category"]) == key]
            fixed = next((r for r in rows if r["num_draft_tokens"] != "auto"), None)
            auto = next((r for r in rows if r["num_draft_tokens"] == "auto"), None)
            if fixed is None or auto is None:
                cells.append("-")
                continue
            questions = fixed["num_prompts"]
            cells.append(f"{f2(fixed['tau'])}{interval(fixed)}, {fixed['num_draft_tokens']}: {x(fixed['speedup'])}; "
                         f"{x(auto['speedup'])}")
        lines.append(f"| {key[0]} | {key[1]} | {questions} | " + " | ".join(cells) + " |")
    measured = ", ".join(f"{label} {legend.mark([name])}" for label, name, _ in columns)
    raws = ", ".join(raw(name, prefix) for _, name, _ in columns)
    return "\n".join(lines + ["", f"Measured: {measured}. Raw: {raws}."] + legend.lines())


# ---- the machines -------------------------------------------------------------------------------------------------
MACHINES = [  # (target forward file stem, always-rejected drafter under auto k, 1 thread)
    ("target_forward_xeon", "adaptive_random_eagle3_xeon2"),
    ("target_forward_lean_epyc512", None),
    ("target_forward_epyc2", "adaptive_random_eagle3_epyc2"),
]
LEAN = "fast-cpu-linear+lean"


def machine_table(prefix: str = "") -> str:
    """Per CPU and thread count: the memory stream, the decode step, the verify cost of k + 1 tokens in decode steps
    on HF's forward and on the fast path with the lean forward, and auto k's speedup with a drafter that is always
    rejected."""
    lines = ["| CPU (flags), threads | stream GB/s | decode step ms, HF / fast + lean (% of stream) | "
             "v(1) / v(3) / v(7), HF | v(1) / v(3) / v(7), fast + lean | always-rejected drafter, auto k | raw |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for stem, rejected in MACHINES:
        for threads in (1, 2):
            name = f"{stem}_t{threads}"
            data = load(name)
            hf, lean = data["paths"]["hf"], data["paths"][LEAN]
            share = lean["achieved_gb_per_s"] / data["stream_gb_per_s"]
            v = lambda path: " / ".join(f2(path["v"][k]) for k in ("1", "3", "7"))  # noqa: E731
            files, auto = [name], "-"
            if rejected and threads == 1:
                r = record(rejected, "eagle3:random_eagle3", "auto")
                hist = r["num_draft_tokens_histogram"]
                auto, files = f"{x(r['speedup'])} (k = 0 in {hist[0]} of {sum(hist)} rounds)", files + [rejected]
            lines.append(f"| {machine(name)} | {data['stream_gb_per_s']:.1f} | {hf['ar_step_ms']:.1f} / "
                         f"{lean['ar_step_ms']:.1f} ({share:.0%}) | {v(hf)} | {v(lean)} | {auto} | "
                         f"{', '.join(raw(f, prefix) for f in files)} |")
    return "\n".join(lines)


# ---- the speedup vLLM CPU measures beside ours --------------------------------------------------------------------
SERVERS = ["server_speedup_quiet", "server_speedup_main_job_t1", "server_speedup_main_job_t2",
           "server_speedup_main_job_epyc2_t1", "server_speedup_main_job_epyc2_t2", "server_speedup_main_job_xeon_t1",
           "server_speedup_main_job_xeon_t2", "server_speedup_long_eagle3_t1", "server_speedup_long_eagle3_t2",
           "server_speedup_long_dflash_t1", "server_speedup_long_dflash_t2"]


def server_table(prefix: str = "") -> str:
    """benchmarks/peers/server_speedup.py's files: vLLM CPU and our engine serving the same export on the same
    prompts, k and threads, each speedup over its own plain decoding."""
    legend = Legend(prefix, list_files=False)  # each row names its file
    lines = ["| drafter (trained) | k | tau, both | speedup ours / vLLM | ours / vLLM | plain decoding tokens/s ours / "
             "vLLM | outputs identical | measured | raw |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    checkpoints = []
    for name in SERVERS:
        data = load(name)
        checkpoints.append(checkpoint_of(name, "export"))
        letter = legend.mark([name])
        for r in data["rows"]:
            tau = f2(r["tau_ours"]) if f2(r["tau_ours"]) == f2(r["tau_vllm"]) else \
                f"{f2(r['tau_ours'])} / {f2(r['tau_vllm'])}"
            lines.append(f"| {trained_cell(checkpoints[-1])} | {r['k']} | {tau} | {x(r['speedup_ours'])} / "
                         f"{x(r['speedup_vllm'])} | {r['speedup_ours'] / r['speedup_vllm']:.2f} | "
                         f"{data['ar_tokens_per_s_ours']:.1f} / {data['ar_tokens_per_s_vllm']:.1f} | "
                         f"{r['identical_outputs']} | {letter} | {raw(name, prefix)} |")
    return "\n".join(lines + [""] + legend.lines() + trained_notes(checkpoints, prefix))



CURVE_STEPS = (250, 500, 750, 1000)


def curve_table(prefix: str = "") -> str:
    """benchmarks/training/long_curves.py's rows: held-out tau of every kept checkpoint of each long run, and the
    CPU-hours spent to reach it (wall time x the training's threads)."""
    rows = load("long_curves")["rows"]
    lines = [f"| run | k | held-out tau at step {' / '.join(map(str, CURVE_STEPS))} / end | "
             "CPU-hours at the same steps |", "| --- | --- | --- | --- |"]
    for run in dict.fromkeys(r["run"] for r in rows):
        mine = {r["step"]: r for r in rows if r["run"] == run}
        steps = [s for s in CURVE_STEPS if s in mine] + [max(mine)]
        lines.append(f"| {run.rsplit('/', 1)[-1]} | {mine[max(mine)]['heldout_k']} | "
                     f"{' / '.join(f2(mine[s]['heldout_tau']) for s in steps)} | "
                     f"{' / '.join(f2(mine[s]['cpu_hours']) for s in steps)} |")
    note = (f"Raw: {raw('long_curves', prefix)}: the run's own checkpoints, the last at the end of training, each "
            "decoded on the machine its run trained on; the file records the environment of the last run written only "
            f"({machine('long_curves')}).")
    return "\n".join(lines + ["", wrap(note)])
