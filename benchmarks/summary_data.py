"""What benchmarks/summarize.py reads from docs/results/: the result files, their records, the machine each recorded,
and docs/results/provenance.json, which holds what a result file cannot record about itself (the recipe, data and
commit that trained its drafters, the commit that recorded it).

A result file is NAME.json, or NAME.json.gz where its per-call records are large (docs/benchmarks.md, "Result
files"); every reader here takes either.
"""

from __future__ import annotations

import gzip
import json
import os
import textwrap
from functools import lru_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")


def file_name(name: str) -> str | None:
    """The file that holds result `name` (NAME.json or NAME.json.gz), None when neither exists."""
    for candidate in (name + ".json", name + ".json.gz"):
        if os.path.exists(os.path.join(RESULTS, candidate)):
            return candidate
    return None


def exists(name: str) -> bool:
    return file_name(name) is not None


@lru_cache(maxsize=None)
def load(name: str) -> dict:
    found = file_name(name)
    if found is None:
        raise ValueError(f"docs/results/{name}.json: no such result file (nor {name}.json.gz)")
    opener = gzip.open if found.endswith(".gz") else open
    with opener(os.path.join(RESULTS, found), "rt") as f:
        return json.load(f)


@lru_cache(maxsize=None)
def provenance() -> dict:
    with open(os.path.join(RESULTS, "provenance.json")) as f:
        return json.load(f)


def run_facts(name: str) -> dict:
    """provenance.json's entry for result `name` ({} when it has none)."""
    return provenance()["runs"].get(name, {})


def record(name: str, drafter: str, k, *, nth: int = 0, budget: int | None = None, batch: int = 1,
           dataset: str | None = None) -> dict:
    """The `nth` record of result file `name` (pooled over categories) for this drafter, k, tree budget and batch.
    Records of one eval call keep the order of its --drafter list, which tells apart checkpoints of the same name."""
    found = [r for r in load(name)["records"]
             if r["drafter"] == drafter and str(r["num_draft_tokens"]) == str(k) and r.get("tree_budget") == budget
             and r.get("batch_size", 1) == batch and r.get("category", "all") == "all"
             and (dataset is None or r["dataset"] == dataset)]
    if len(found) <= nth:
        raise ValueError(f"docs/results/{name}: no record {nth} for drafter {drafter!r}, k {k}, tree budget {budget}, "
                         f"batch {batch}")
    return found[nth]


def environment(name: str) -> dict:
    """The environment a result recorded: eval reports keep it under "config", benchmark scripts at the top (as
    "environment" or "env"), old reports in each record; provenance.json fills in a machine none recorded."""
    data = load(name)
    records = data.get("records")
    first = records[0] if isinstance(records, list) and records else {}
    found = ((data.get("config") or {}).get("environment") or data.get("environment") or data.get("env")
             or first.get("env") or {})
    return {**found, **run_facts(name).get("environment", {})}


def machine(name: str) -> str:
    """`CPU (flags), N thread(s)` as result `name` recorded them; what it did not record is said."""
    env = environment(name)
    flags = ", ".join(env.get("cpu_flags") or ()) or "flags not recorded"
    threads = env.get("threads") or load(name).get("threads") or run_facts(name).get("threads")
    said = "threads not recorded" if threads is None else f"{threads} thread{'s' if threads != 1 else ''}"
    cpu = env.get("cpu", "CPU not recorded").replace("(R)", "").replace(" Processor", "")
    return f"{cpu} ({flags}), {said}"


def workload(name: str) -> str:
    """`PROMPTS: P x N tokens` of the call: from its recorded configuration, else from provenance.json."""
    data, facts = load(name), run_facts(name)
    config = data.get("config") or {}
    records = data.get("records") if isinstance(data.get("records"), list) else []
    prompts = (config.get("num_prompts") or data.get("num_prompts") or facts.get("num_prompts")
               or (records[0].get("num_prompts") if records else None))
    tokens = config.get("max_new_tokens") or data.get("max_new_tokens") or facts.get("max_new_tokens")
    where = facts.get("prompts", "prompts")
    per_set = {r["dataset"]: r["num_prompts"] for r in reversed(records)
               if r.get("category") == "all" and "dataset" in r and "num_prompts" in r}
    if len(per_set) > 1:  # a report appended from calls on several prompt sets: each set's question count
        sets = ", ".join(f"{dataset} {count}" for dataset, count in reversed(per_set.items()))
        return f"{where}: {sets} questions" + (f" x {tokens} tokens" if tokens else "")
    if prompts is None:
        return where if tokens is None else f"{where}, {tokens} tokens"
    count = f"{prompts} prompt{'s' if prompts != 1 else ''}"
    return f"{where}: {count} x {tokens} tokens" if tokens else f"{where}: {count}"


def trained(checkpoint: str) -> dict:
    """provenance.json's record of how a drafter checkpoint was trained (recipe, data, steps, commit)."""
    found = provenance()["trained"].get(checkpoint)
    if found is None:
        raise ValueError(f"docs/results/provenance.json: no 'trained' entry for checkpoint {checkpoint!r}")
    return found


def x(value: float) -> str:
    return f"{value:.2f}x"


def f2(value: float) -> str:
    return f"{value:.2f}"


def link(text: str, anchor: str, prefix: str) -> str:
    return f"[{text}]({prefix}#{anchor})"


def raw(name: str, prefix: str) -> str:
    """A link to the result file as it is stored (plain or gzipped; a name with a suffix is taken as written)."""
    found = name if "." in name else (file_name(name) or name + ".json")
    return f"[{found}]({prefix}results/{found})"


def wrap(line: str) -> str:
    return textwrap.fill(line, width=118, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


class Legend:
    """Where the rows of one table were measured: a letter per distinct (machine, prompts x tokens), in order of
    first use, each listing its result files; a row names the letters of its files."""

    def __init__(self, prefix: str, list_files: bool = True):
        self.prefix, self.list_files = prefix, list_files
        self.files: dict[str, list[str]] = {}  # condition -> result names

    def mark(self, names: list[str]) -> str:
        letters = []
        for name in names:
            condition = f"{machine(name)}; {workload(name)}"
            files = self.files.setdefault(condition, [])
            if name not in files:
                files.append(name)
            letters.append(chr(ord("A") + list(self.files).index(condition)))
        return ", ".join(dict.fromkeys(letters))

    def lines(self) -> list[str]:
        lines = []
        for i, (condition, names) in enumerate(self.files.items()):
            listed = f" ({', '.join(raw(n, self.prefix) for n in names)})" if self.list_files else ""
            lines.append(wrap(f"{chr(ord('A') + i)}: {condition}{listed}"))
        return lines


def trained_cell(checkpoint: str | None) -> str:
    """`recipe, N steps, commit` of a drafter checkpoint ("-" when nothing trained it)."""
    if checkpoint is None:
        return "-"
    t = trained(checkpoint)
    return f"`{os.path.basename(t['recipe'])}`, {t['steps']} steps, {t['commit']}" if t["steps"] else t["as"]


def trained_notes(checkpoints: list[str | None], prefix: str, logs: bool = True, settings: bool = True) -> list[str]:
    """How the trained checkpoints of a table were trained, one line per recipe setting (its commits, the recipe and
    with what, the logs; left out with settings=False, where the rows name recipe and commit), and the data: once
    when every checkpoint shares it."""
    done = [trained(c) for c in dict.fromkeys(c for c in checkpoints if c is not None) if trained(c)["steps"]]
    shared = len({t["data"] for t in done}) == 1
    said = "; by commit (the tree before it trained):" if settings else " (each row's commit recorded the training; " \
        "the tree just before it trained the drafter; how each was run: the README's tables)."
    lines = [wrap(f"Trained on {provenance()['data'][done[0]['data']]}{said}")] if done and shared else []
    groups: dict[tuple, list[dict]] = {}
    for t in done if settings or not shared else []:
        groups.setdefault((t["label"], t["recipe"], t["as"], t["data"]), []).append(t)
    for (label, recipe, how, data), members in groups.items():
        found = [raw(t["log"], prefix) for t in members if t.get("log")] if logs else []
        lines.append(wrap(f"- {', '.join(t['commit'] for t in members)} {label}: {recipe}, {how}"
                          f"{'' if shared else '; ' + provenance()['data'][data]}"
                          f"{'; log ' + ', '.join(found) if found else ''}"))
    return lines


def checkpoint_of(name: str, drafter: str, nth: int = 0) -> str | None:
    """The checkpoint behind drafter name `drafter` (its nth use) in result `name`, from provenance.json."""
    found = run_facts(name).get("drafters", {}).get(drafter)
    return found[nth] if found else None
