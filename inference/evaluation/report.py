"""Write evaluation records as JSON, a Markdown table and PNG plots (docs/ARCHITECTURE.md, Evaluation).

For `--out runs/report.json` the files are: runs/report.json (`{"config": {...}, "records": [...]}`), runs/report.md
(the table), runs/report_acceptance_<dataset>.png (per-position acceptance, unconditional and conditional, one line per
speculative record of the "all" category), runs/report_speedup_<dataset>.png (measured and predicted speedup vs. k,
one line per drafter, temperature and batch size, adaptive k as a star at its mean chosen k; only when the dataset
has records for two or more k) and runs/report_load_<dataset>.png (throughput and per-request speedup vs. batch
size, one line per drafter and k; only when the dataset has two or more batch sizes).
"""

from __future__ import annotations

import json
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot is imported)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from inference.evaluation.intervals import paired_tau_differences  # noqa: E402

TABLE_COLUMNS = (
    ("dataset", "dataset", "{}"),
    ("category", "category", "{}"),
    ("drafter", "drafter", "{}"),
    ("T", "temperature", "{:g}"),
    ("k", "num_draft_tokens", "{}"),
    ("B", "batch_size", "{}"),
    ("tau", "tau", "{:.2f}"),
    ("tau 95% CI", "tau_ci95", "{0[0]:.2f}-{0[1]:.2f}"),
    ("accept rate", "acceptance_rate", "{:.3f}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("AR tok/s", "tokens_per_s_ar", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}"),
    ("theoretical speedup", "theoretical_speedup", "{:.2f}"),
    ("predicted speedup", "predicted_speedup", "{:.2f}"),
    ("per-request speedup", "per_request_speedup", "{:.2f}"),
    ("d(k)", "draft_cost_per_round", "{:.3f}"),
    ("v(k)", "verify_cost_ratio", "{:.2f}"),
    ("exact-match", "greedy_exact_match", "{:.2f}"),
    ("diverged at near-ties only", "divergences_all_near_ties", "{}"),  # what lossless means in bf16 (lossless.py)
    ("best k", "recommended_num_draft_tokens", "{}"),
    ("k chosen (rounds)", "num_draft_tokens_histogram", None),
)


def _histogram_cell(histogram: list[int]) -> str:
    """[5, 0, 2] -> "0:5 2:2" (adaptive k: rounds per chosen width)."""
    return " ".join(f"{k}:{count}" for k, count in enumerate(histogram) if count)


def format_table(records: list[dict]) -> str:
    """A Markdown table, one row per record; a missing value (None) prints as '-'."""
    lines = ["| " + " | ".join(title for title, _, _ in TABLE_COLUMNS) + " |",
             "|" + "|".join(" --- " for _ in TABLE_COLUMNS) + "|"]
    for record in records:
        cells = ["-" if record.get(key) is None else _histogram_cell(record[key]) if fmt is None
                 else fmt.format(record[key]) for _, key, fmt in TABLE_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    roofline = roofline_line(records)
    return "\n".join(lines + ([""] + [roofline] if roofline else []) + paired_table(records)) + "\n"


def paired_table(records: list[dict]) -> list[str]:
    """The lines of a second table, empty when no group has two drafters: each drafter's tau against the first
    drafter at the same dataset, T, k and B, paired over the questions both answered (category "all";
    intervals.paired_tau_differences). An interval that excludes 0 says the drafters differ on these questions; two
    overlapping tau intervals in the table above do not say they are equal."""
    rows = paired_tau_differences(records)
    if not rows:
        return []
    lines = ["", "tau against the first drafter, paired over the same questions (category all):", "",
             "| dataset | T | k | B | drafter | base | tau - base tau | paired 95% CI | questions |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        ci = "-" if row["ci95"] is None else "{0[0]:+.2f} to {0[1]:+.2f}".format(row["ci95"])
        lines.append(f"| {row['dataset']} | {row['temperature']:g} | {row['num_draft_tokens']} | "
                     f"{row['batch_size']} | {row['drafter']} | {row['base']} | {row['difference']:+.2f} | {ci} | "
                     f"{row['questions']} |")
    return lines


def roofline_line(records: list[dict]) -> str | None:
    """One line per report: which target path ran and the AR step's achieved weight GB/s against the machine's
    stream GB/s (the first baseline record that carries both), None when no record does."""
    for record in records:
        achieved, stream = (record.get("achieved_gb_per_s") or {}).get("ar"), record.get("stream_gb_per_s")
        if achieved and stream:
            return (f"roofline: target path {record.get('target_path')}, AR step reads weights at {achieved:.1f} "
                    f"GB/s, {achieved / stream:.0%} of the {stream:.1f} GB/s stream probe")
    return None


def _stem(out_path: str) -> str:
    return out_path[: -len(".json")] if out_path.endswith(".json") else out_path


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "dataset"


def _label(record: dict) -> str:
    return f"{record['drafter']} k={record['num_draft_tokens']} T={record['temperature']:g} B={record['batch_size']}"


def _is_speculative(record: dict) -> bool:
    return record["num_draft_tokens"] != 0


def mean_chosen_k(record: dict) -> float:
    """Mean width of an adaptive record's rounds (the x of its point on the speedup plot)."""
    histogram = record["num_draft_tokens_histogram"]
    return sum(k * count for k, count in enumerate(histogram)) / max(sum(histogram), 1)


def plot_acceptance(records: list[dict], path: str) -> None:
    """Per-position acceptance of each record: unconditional p_j (left) and conditional alpha_j (right)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for record in records:
        for axis, key in zip(axes, ("per_position_acceptance_unconditional", "per_position_acceptance_conditional")):
            values = record[key]
            positions = [j + 1 for j, value in enumerate(values) if value is not None]
            axis.plot(positions, [value for value in values if value is not None], marker="o", label=_label(record))
    axes[0].set_title("unconditional p_j (prefix survival)")
    axes[1].set_title("conditional alpha_j")
    for axis in axes:
        axis.set_xlabel("draft position j")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylim(0, 1.05)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{records[0]['dataset']}: per-position acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup(records: list[dict], path: str) -> None:
    """Measured (solid) and predicted (dashed) speedup vs. k, one colour per drafter, temperature and batch size;
    an adaptive-k record is a star at its mean chosen k."""
    fig, axis = plt.subplots(figsize=(6.5, 4.2))
    series: dict[tuple, list[dict]] = {}
    for record in records:
        series.setdefault((record["drafter"], record["temperature"], record["batch_size"]), []).append(record)
    for (drafter, temperature, batch_size), group in sorted(series.items()):
        name = f"{drafter} T={temperature:g} B={batch_size}"
        fixed = sorted((r for r in group if r["num_draft_tokens"] != "auto"), key=lambda r: r["num_draft_tokens"])
        ks = [record["num_draft_tokens"] for record in fixed]
        line = axis.plot(ks, [record["speedup"] for record in fixed], marker="o", label=f"{name} measured")[0]
        predicted = [(k, r["predicted_speedup"]) for k, r in zip(ks, fixed) if r["predicted_speedup"] is not None]
        if predicted:
            axis.plot(*zip(*predicted), linestyle="--", marker="x", color=line.get_color(),
                      label=f"{name} predicted")
        for record in group:
            if record["num_draft_tokens"] == "auto":
                axis.plot([mean_chosen_k(record)], [record["speedup"]], marker="*", markersize=12,
                          color=line.get_color(), linestyle="none", label=f"{name} auto (at mean k)")
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xlabel("num_draft_tokens k")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_ylabel("speedup vs. AR")
    axis.set_title(f"{records[0]['dataset']}: speedup vs. k")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_load(records: list[dict], path: str) -> None:
    """Throughput speedup (solid) and per-request speedup (dashed) vs. batch size, one colour per drafter, k and
    temperature: how the gain holds up under load."""
    fig, axis = plt.subplots(figsize=(6.5, 4.2))
    series: dict[tuple, list[dict]] = {}
    for record in records:
        key = (record["drafter"], str(record["num_draft_tokens"]), record["temperature"])
        series.setdefault(key, []).append(record)
    for (drafter, k, temperature), group in sorted(series.items()):
        group = sorted(group, key=lambda record: record["batch_size"])
        sizes = [record["batch_size"] for record in group]
        line = axis.plot(sizes, [r["speedup"] for r in group], marker="o",
                         label=f"{drafter} k={k} T={temperature:g} throughput")[0]
        axis.plot(sizes, [r["per_request_speedup"] for r in group], marker="x", linestyle="--",
                  color=line.get_color(), label=f"{drafter} k={k} T={temperature:g} per request")
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("batch size")
    axis.set_ylabel("speedup vs. AR at the same batch size")
    axis.set_title(f"{records[0]['dataset']}: speedup under load")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(records: list[dict], out_path: str, config: dict | None = None) -> list[str]:
    """Write the JSON report, the Markdown table and the plots beside it.

    Args:
        records: from inference.evaluation.metrics.build_record.
        out_path: the JSON path; the other files share its stem.
        config: the run's configuration (inference/eval.run_config), kept so `--append` can refuse another one.
    Returns:
        The paths written.
    """
    directory = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(directory, exist_ok=True)
    with open(out_path, "w") as f:
        json.dump({"config": config, "records": records}, f, indent=2)
    stem = _stem(out_path)
    written = [out_path, stem + ".md"]
    with open(stem + ".md", "w") as f:
        f.write(format_table(records))
    for dataset in dict.fromkeys(record["dataset"] for record in records):
        overall = [r for r in records if r["dataset"] == dataset and r["category"] == "all"]
        speculative = [r for r in overall if _is_speculative(r) and r["rounds"] > 0]
        if speculative:
            path = f"{stem}_acceptance_{_slug(dataset)}.png"
            plot_acceptance(speculative, path)
            written.append(path)
        if len({r["num_draft_tokens"] for r in speculative}) >= 2:
            baseline = [r for r in overall if r["num_draft_tokens"] == 0]
            path = f"{stem}_speedup_{_slug(dataset)}.png"
            plot_speedup(speculative + _baseline_points(baseline, speculative), path)
            written.append(path)
        if len({r["batch_size"] for r in speculative}) >= 2:
            path = f"{stem}_load_{_slug(dataset)}.png"
            plot_load(speculative, path)
            written.append(path)
    return written


def read_appendable(path: str, config: dict) -> list[dict]:
    """The records of the report at `path` when it was written with `config` (--append); ValueError naming the first
    field that differs (or saying the file is not a report) otherwise. A missing file is an empty report."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--append: {path} is not a JSON report ({err})") from None
    if not isinstance(report, dict) or not isinstance(report.get("records"), list) or "config" not in report:
        raise ValueError(f"--append: {path} is not a draftsmith eval report with a recorded configuration; write a "
                         "new --out instead")
    for key, value in config.items():
        if report["config"].get(key) != value:
            raise ValueError(f"--append: {path} was written with {key} = {report['config'].get(key)!r}, this run has "
                             f"{value!r}; write a new --out or run with the same configuration")
    return report["records"]


def _baseline_points(baseline: list[dict], speculative: list[dict]) -> list[dict]:
    """The AR record (speedup 1 at k = 0) copied under each drafter name so every line starts from k = 0."""
    points = []
    for drafter, temperature, batch_size in dict.fromkeys((r["drafter"], r["temperature"], r["batch_size"])
                                                          for r in speculative):
        for record in baseline:
            if record["temperature"] == temperature and record["batch_size"] == batch_size:
                points.append({**record, "drafter": drafter, "predicted_speedup": 1.0})
    return points
