"""The GPU check's worker: runs sections one after another in this one process (torch, transformers and accelerate
import once) and reports each as one JSON line in the progress file the orchestrator (benchmarks/gpu_check/__main__.py)
reads: {"section", "event": "start"} then {"section", "event": "end", "status", "cause", "seconds", "numbers"}.

    python -m benchmarks.gpu_check.worker PLAN_JSON SECTIONS

PLAN_JSON holds repo, work, cpu, progress (the file), deadline (epoch s, the whole run's) and caps (seconds per
section). A section that raises is recorded as failed with a one-line cause and the next one runs; a section that
would start with less than MIN_START seconds left is recorded as skipped. A section that hangs or kills the process is
the orchestrator's to record: it kills this worker and starts another for the sections left.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback

MODULES = {"A": "a_env", "B": "b_train", "C": "c_parity", "D": "d_lossless", "E": "e_shapes", "F": "f_engine",
           "G": "g_launchers", "H": "h_families"}
MIN_START = 10.0  # seconds: a section needs at least this much to say anything


def report(progress: str, **fields) -> None:
    with open(progress, "a") as f:
        f.write(json.dumps(fields, default=str) + "\n")


def run_section(letter: str, plan: dict) -> dict:
    """One section: {"status", "cause", "numbers"}."""
    from benchmarks.gpu_check.context import CheckFailed, Context
    from benchmarks.gpu_check.summary import one_line

    deadline = min(plan["deadline"], time.time() + plan["caps"][letter])
    numbers: dict = {}
    try:
        ctx = Context(plan["repo"], plan["work"], plan["cpu"], deadline)
        module = importlib.import_module(f"benchmarks.gpu_check.{MODULES[letter]}")
        numbers = module.run(ctx)
        return {"status": "ok", "cause": "", "numbers": numbers}
    except CheckFailed as failed:
        return {"status": "failed", "cause": str(failed), "numbers": failed.numbers}
    except Exception as err:  # noqa: BLE001 - any error is this section's result; the next section still runs
        traceback.print_exc()
        return {"status": "failed", "cause": f"{type(err).__name__}: {one_line(err)}", "numbers": numbers}


def main(argv: list[str]) -> int:
    plan_path, sections = argv
    with open(plan_path) as f:
        plan = json.load(f)
    for letter in sections:
        left = plan["deadline"] - time.time()
        if left < MIN_START:
            report(plan["progress"], section=letter, event="end", status="skipped",
                   cause=f"global deadline: {max(left, 0):.0f} s left", seconds=0.0, numbers={})
            continue
        report(plan["progress"], section=letter, event="start", time=time.time())
        print(f"==== section {letter}", flush=True)
        started = time.time()
        result = run_section(letter, plan)
        print(f"==== section {letter}: {result['status']} {result['cause']}", flush=True)
        report(plan["progress"], section=letter, event="end", seconds=round(time.time() - started, 1), **result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
