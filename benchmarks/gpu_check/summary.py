"""The GPU check's record: summary.json and summary.md, rewritten after every section, and logs.tgz.

Standard library only: the orchestrator that writes these never imports torch, so it can always write them, whatever
happened to the worker that ran the sections.

summary.json: {"mode", "started", "deadline_s", "elapsed_s", "finished", "machine", "sections": {letter: {"title",
"status", "cause", "seconds", "numbers"}}}. A section's status is one of STATUSES: "pending" (not reached yet; only
seen in a summary read while the check runs or after it was killed), "running", "ok", "failed" (the cause is one
line) or "skipped" (the global deadline left no time for it).
"""

from __future__ import annotations

import json
import os
import tarfile
import time

STATUSES = ("pending", "running", "ok", "failed", "skipped")
TITLES = {
    "A": "environment and masked-SDPA self-check",
    "B": "every drafter kind trains against a bf16 tiny target (probe, resume)",
    "C": "loss and gradient parity: bf16 on the device against fp32 on the CPU",
    "D": "lossless decoding: eval from disk, fp32 exact, bf16 near-ties, sampling",
    "E": "real shapes with random weights: step memory and time against the estimate",
    "F": "the engine at 8B shape: plain decoding against HF generate, v(k) and d(k)",
    "G": "launchers: FSDP2 with one process, save and resume; DeepSpeed ZeRO-2",
    "H": "the study's target families in bf16: engine against HF generate, chains and trees, near-ties",
}
MAX_CAUSE = 400  # characters of a one-line cause


def one_line(text: str) -> str:
    """The first non-empty line of `text`, cut to MAX_CAUSE characters."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= MAX_CAUSE else line[: MAX_CAUSE - 3] + "..."


def last_error_line(log: str) -> str:
    """The line of a failed command's log that says why: the last one naming an error, else the last line."""
    try:
        with open(log, errors="replace") as f:
            lines = [line.strip() for line in f.read().splitlines() if line.strip()]
    except OSError as err:
        return one_line(err)
    for line in reversed(lines):
        if any(word in line.lower() for word in ("error", "exception", "killed", "traceback")):
            return one_line(line)
    return one_line(lines[-1]) if lines else "(no output)"


class Summary:
    """The record of one run of the check, written to `out_dir` after every change (atomically: a reader never sees
    half a file, and a kill leaves the last complete one)."""

    def __init__(self, out_dir: str, mode: str, sections: list[str], deadline_s: float):
        self.out_dir = out_dir
        self.started = time.time()
        self.data = {"mode": mode, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "deadline_s": deadline_s,
                     "elapsed_s": 0.0, "finished": False, "machine": {},
                     "sections": {letter: {"title": TITLES[letter], "status": "pending", "cause": "",
                                           "seconds": None, "numbers": {}} for letter in sections}}
        os.makedirs(out_dir, exist_ok=True)
        self.write()

    def section(self, letter: str) -> dict:
        return self.data["sections"][letter]

    def update(self, letter: str, **fields) -> None:
        if fields.get("status", "ok") not in STATUSES:
            raise ValueError(f"section status {fields['status']!r}: choose one of {STATUSES}")
        if "cause" in fields:
            fields["cause"] = one_line(fields["cause"])
        self.section(letter).update(fields)
        if letter == "A" and isinstance(fields.get("numbers"), dict) and "machine" in fields["numbers"]:
            self.data["machine"] = fields["numbers"]["machine"]
        self.write()

    def counts(self) -> dict[str, int]:
        counts = {status: 0 for status in STATUSES}
        for section in self.data["sections"].values():
            counts[section["status"]] += 1
        return counts

    def finish(self) -> int:
        """Mark the run finished; returns the exit status: the number of sections that did not pass."""
        self.data["finished"] = True
        self.write()
        for name in os.listdir(self.out_dir):  # a write cut short by a signal leaves its temporary file
            if name.endswith(".tmp"):
                os.remove(os.path.join(self.out_dir, name))
        counts = self.counts()
        return len(self.data["sections"]) - counts["ok"]

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.time() - self.started, 1)
        _write_atomic(os.path.join(self.out_dir, "summary.json"), json.dumps(self.data, indent=1) + "\n")
        _write_atomic(os.path.join(self.out_dir, "summary.md"), render_markdown(self.data))


def render_markdown(data: dict) -> str:
    """summary.md: one table row per section (status, seconds, cause), then each section's numbers."""
    machine = data.get("machine") or {}
    lines = [f"# GPU check ({data['mode']} mode)", "",
             f"started {data['started']}; {data['elapsed_s']} s of a {data['deadline_s']} s deadline; "
             + ("finished" if data["finished"] else "NOT finished (killed or still running)"), ""]
    if machine:
        lines += ["machine: " + ", ".join(f"{key} {value}" for key, value in machine.items()), ""]
    lines += ["| section | status | seconds | cause |", "| --- | --- | --- | --- |"]
    for letter, section in data["sections"].items():
        seconds = "" if section["seconds"] is None else f"{section['seconds']:.0f}"
        cause = section["cause"].replace("|", "/")
        lines.append(f"| {letter}. {section['title']} | {section['status']} | {seconds} | {cause} |")
    for letter, section in data["sections"].items():
        if section["numbers"]:
            lines += ["", f"## {letter}. {section['title']}", ""]
            lines += [f"- {key}: {_compact(value)}" for key, value in section["numbers"].items()]
    return "\n".join(lines) + "\n"


def _compact(value) -> str:
    return json.dumps(value, separators=(", ", ": ")) if isinstance(value, (dict, list)) else str(value)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def pack_logs(log_dir: str, out_path: str, max_file_bytes: int = 4 << 20) -> None:
    """logs.tgz of every file under log_dir (each cut to its last max_file_bytes: a runaway log must not push the
    archive past what a lent machine sends back)."""
    tmp = f"{out_path}.tmp"
    with tarfile.open(tmp, "w:gz") as archive:
        for root, _, files in os.walk(log_dir):
            for name in sorted(files):
                path = os.path.join(root, name)
                info = archive.gettarinfo(path, arcname=os.path.relpath(path, os.path.dirname(log_dir)))
                if info is None or not info.isfile():
                    continue
                with open(path, "rb") as f:
                    if info.size > max_file_bytes:
                        f.seek(info.size - max_file_bytes)
                        info.size = max_file_bytes
                    archive.addfile(info, f)
    os.replace(tmp, out_path)
