"""Write evaluation records as JSON, a Markdown table and PNG plots (ARCHITECTURE.md section 5).

For `--out runs/report.json` the files are: runs/report.json (`{"records": [...]}`), runs/report.md (the table),
runs/report_acceptance_<dataset>.png (per-position acceptance, unconditional and conditional, one line per
speculative record of the "all" category) and runs/report_speedup_<dataset>.png (measured and theoretical speedup
vs. k, one line per drafter and temperature; only when the dataset has records for two or more k > 0).
"""

from __future__ import annotations

import json
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot is imported)
from matplotlib.ticker import MaxNLocator  # noqa: E402

TABLE_COLUMNS = (
    ("dataset", "dataset", "{}"),
    ("category", "category", "{}"),
    ("drafter", "drafter", "{}"),
    ("T", "temperature", "{:g}"),
    ("k", "num_draft_tokens", "{}"),
    ("tau", "tau", "{:.2f}"),
    ("accept rate", "acceptance_rate", "{:.3f}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("AR tok/s", "tokens_per_s_ar", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}"),
    ("theoretical speedup", "theoretical_speedup", "{:.2f}"),
    ("d(k)", "draft_cost_per_round", "{:.3f}"),
    ("v(k)", "verify_cost_ratio", "{:.2f}"),
    ("exact-match", "greedy_exact_match", "{:.2f}"),
    ("best k", "recommended_num_draft_tokens", "{}"),
)


def format_table(records: list[dict]) -> str:
    """A Markdown table, one row per record; a missing value (None) prints as '-'."""
    lines = ["| " + " | ".join(title for title, _, _ in TABLE_COLUMNS) + " |",
             "|" + "|".join(" --- " for _ in TABLE_COLUMNS) + "|"]
    for record in records:
        cells = [fmt.format(record[key]) if record.get(key) is not None else "-" for _, key, fmt in TABLE_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _stem(out_path: str) -> str:
    return out_path[: -len(".json")] if out_path.endswith(".json") else out_path


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "dataset"


def _label(record: dict) -> str:
    return f"{record['drafter']} k={record['num_draft_tokens']} T={record['temperature']:g}"


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
    """Measured (solid) and theoretical (dashed) speedup vs. k, one colour per drafter and temperature."""
    fig, axis = plt.subplots(figsize=(6, 4))
    series: dict[tuple, list[dict]] = {}
    for record in records:
        series.setdefault((record["drafter"], record["temperature"]), []).append(record)
    for (drafter, temperature), group in sorted(series.items()):
        group = sorted(group, key=lambda record: record["num_draft_tokens"])
        ks = [record["num_draft_tokens"] for record in group]
        line = axis.plot(ks, [record["speedup"] for record in group], marker="o",
                         label=f"{drafter} T={temperature:g} measured")[0]
        axis.plot(ks, [record["theoretical_speedup"] for record in group], linestyle="--", marker="x",
                  color=line.get_color(), label=f"{drafter} T={temperature:g} theoretical")
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xlabel("num_draft_tokens k")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_ylabel("speedup vs. AR")
    axis.set_title(f"{records[0]['dataset']}: speedup vs. k")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(records: list[dict], out_path: str) -> list[str]:
    """Write the JSON report, the Markdown table and the plots beside it.

    Args:
        records: from inference.metrics.build_record.
        out_path: the JSON path; the other files share its stem.
    Returns:
        The paths written.
    """
    directory = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(directory, exist_ok=True)
    with open(out_path, "w") as f:
        json.dump({"records": records}, f, indent=2)
    stem = _stem(out_path)
    written = [out_path, stem + ".md"]
    with open(stem + ".md", "w") as f:
        f.write(format_table(records))
    for dataset in dict.fromkeys(record["dataset"] for record in records):
        speculative = [r for r in records if r["dataset"] == dataset and r["category"] == "all"
                       and r["num_draft_tokens"] > 0 and r["rounds"] > 0]
        if speculative:
            path = f"{stem}_acceptance_{_slug(dataset)}.png"
            plot_acceptance(speculative, path)
            written.append(path)
        if len({r["num_draft_tokens"] for r in speculative}) >= 2:
            baseline = [r for r in records if r["dataset"] == dataset and r["category"] == "all"
                        and r["num_draft_tokens"] == 0]
            path = f"{stem}_speedup_{_slug(dataset)}.png"
            plot_speedup(speculative + _baseline_points(baseline, speculative), path)
            written.append(path)
    return written


def _baseline_points(baseline: list[dict], speculative: list[dict]) -> list[dict]:
    """The AR record (speedup 1 at k = 0) copied under each drafter name so every line starts from k = 0."""
    points = []
    for drafter, temperature in dict.fromkeys((r["drafter"], r["temperature"]) for r in speculative):
        for record in baseline:
            if record["temperature"] == temperature:
                points.append({**record, "drafter": drafter})
    return points
