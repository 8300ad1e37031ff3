"""The GPU check's orchestrator: runs the sections in a worker process under a global deadline and always leaves
summary.md, summary.json and logs.tgz in the results folder (and nothing else there).

    python -m benchmarks.gpu_check [--cpu] [--work DIR] [--deadline S] [--sections ABCDEFGH] [--slack F] [RESULTS_DIR]

(benchmarks/gpu_check.sh is the way to call it: it sets the environment and an outer timeout.) This process imports
no torch: whatever the worker does (hangs in a kernel, dies, is killed at a section's cap), the summary is rewritten
after each event, the section that was running is recorded as failed with one line saying why, and a fresh worker
runs the sections left. Sections not reached before the deadline are recorded as skipped. Exit status: the number
of sections that did not pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu_check.summary import TITLES, Summary, last_error_line, pack_logs
from benchmarks.gpu_check.worker import MIN_START

# seconds each section may take, per mode; the GPU total must stay inside one lent machine's command (9 minutes)
CAPS = {"gpu": {"A": 60, "B": 200, "C": 60, "D": 150, "E": 150, "F": 150, "G": 150, "H": 90},
        "cpu": {"A": 60, "B": 150, "C": 60, "D": 120, "E": 60, "F": 60, "G": 100, "H": 60}}
DEADLINES = {"gpu": 510.0, "cpu": 280.0}
GRACE = 15.0  # seconds past a section's own deadline before its worker is killed (its checks stop it first)
RESERVE = 5.0  # seconds kept for the last summary and logs.tgz
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS = "runs"  # runs/<section letter>: each section's training runs and reports


def clear_work(work: str, mode: str, sections: list[str]) -> None:
    """What a new run clears in the work dir: its logs, and the runs of the sections it runs (all of them when the
    runs there were made in the other mode). The caches stay (cache/, hf/), and so do the runs of the sections it
    does not run: `--sections D` on the same machine decodes the drafters an earlier call's B trained."""
    shutil.rmtree(os.path.join(work, "logs"), ignore_errors=True)
    runs = os.path.join(work, RUNS)
    stamp = Path(runs, "mode")
    if not stamp.is_file() or stamp.read_text() != mode:
        shutil.rmtree(runs, ignore_errors=True)
    for letter in sections:
        shutil.rmtree(os.path.join(runs, letter.lower()), ignore_errors=True)
    os.makedirs(runs, exist_ok=True)
    stamp.write_text(mode)


class Stopped(Exception):
    """SIGTERM: the outer timeout (or a person) stops the check."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", default=os.environ.get("OUT") or os.path.join(REPO, "runs/gpu_check"))
    parser.add_argument("--cpu", action="store_true", help="the CPU dry run: every section, tiny sizes")
    parser.add_argument("--work", default="/tmp/gpu_check", help="where runs, caches and logs go")
    parser.add_argument("--deadline", type=float, default=None, help="seconds for the whole check")
    parser.add_argument("--sections", default="".join(TITLES), help="letters of the sections to run, e.g. AB")
    parser.add_argument("--slack", type=float, default=1.0,
                        help="multiply every section's cap and the default deadline by this (a loaded machine: the "
                             "test suite's dry run uses 6, so only a failure, not the load, fails it)")
    args = parser.parse_args(argv)
    if not args.slack >= 1:
        parser.error(f"--slack: a factor >= 1, got {args.slack}")
    unknown = sorted(set(args.sections) - set(TITLES))
    if unknown or not args.sections:
        parser.error(f"--sections: choose letters among {''.join(TITLES)}, got {args.sections!r}")
    args.sections = [letter for letter in TITLES if letter in args.sections]
    args.results, args.work = os.path.abspath(args.results), os.path.abspath(args.work)
    if args.results.startswith(args.work + os.sep) or args.results == args.work:
        parser.error("RESULTS_DIR must lie outside --work (it keeps three files only)")
    return args


def worker_env(work: str, cpu: bool) -> dict[str, str]:
    """The environment of the worker and of every command it runs: the repo importable without installing it, caches
    and HF homes inside the work dir, offline, bf16 autocast for in-process trainings on an accelerator."""
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    env.update(DRAFTSMITH_CACHE=os.path.join(work, "cache"), HF_HOME=os.path.join(work, "hf"),
               HF_DATASETS_CACHE=os.path.join(work, "hf", "datasets"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env["ACCELERATE_MIXED_PRECISION"] = "bf16"  # both modes: the dry run takes the GPU run's autocast path
    if cpu:  # the dry run stays on the CPU even on a machine with a GPU: eval and the launchers too
        env.update(ACCELERATE_USE_CPU="1", CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    return env


class Run:
    """One run of the check: the plan the workers read, the summary, and the workers themselves."""

    def __init__(self, args: argparse.Namespace):
        self.mode = "cpu" if args.cpu else "gpu"
        self.started = time.time()
        self.deadline = self.started + (args.deadline if args.deadline is not None
                                        else DEADLINES[self.mode] * args.slack)
        self.caps = {letter: cap * args.slack for letter, cap in CAPS[self.mode].items()}
        self.work, self.logs = args.work, os.path.join(args.work, "logs")
        clear_work(self.work, self.mode, args.sections)
        os.makedirs(self.logs)
        self.progress = os.path.join(self.logs, "progress.jsonl")
        self.plan_path = os.path.join(self.work, "plan.json")
        plan = {"repo": REPO, "work": self.work, "cpu": args.cpu, "progress": self.progress,
                "deadline": self.deadline - RESERVE - GRACE, "caps": self.caps}
        with open(self.plan_path, "w") as f:
            json.dump(plan, f)
        self.results = args.results
        self.summary = Summary(args.results, self.mode, args.sections, round(self.deadline - self.started))
        self.left = list(args.sections)
        self.env = worker_env(self.work, args.cpu)
        self.proc: subprocess.Popen | None = None
        self.running: str | None = None
        self.running_since = 0.0
        self.offset = 0
        self.attempt = 0

    def pack(self) -> None:
        pack_logs(self.logs, os.path.join(self.results, "logs.tgz"))

    def read_events(self) -> None:
        """Apply the progress file's new lines to the summary."""
        if not os.path.exists(self.progress):
            return
        with open(self.progress) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]  # a line still being written waits for the next read
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            event = json.loads(line)
            letter = event.pop("section")
            if event.pop("event") == "start":
                self.running, self.running_since = letter, time.time()
                self.summary.update(letter, status="running")
                continue
            self.summary.update(letter, **event)
            self.running = None
            if letter in self.left:
                self.left.remove(letter)
            self.pack()

    def fail_running(self, cause: str) -> None:
        if self.running is not None:
            self.summary.update(self.running, status="failed", cause=cause,
                                seconds=round(time.time() - self.running_since, 1))
            self.left.remove(self.running)
            self.running = None

    def stop_worker(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its whole group: the commands a section started too
            self.proc.wait()

    def start_worker(self) -> None:
        self.attempt += 1
        log = open(os.path.join(self.logs, f"worker-{self.attempt}.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.gpu_check.worker", self.plan_path, "".join(self.left)], cwd=REPO,
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def watch_worker(self) -> None:
        """Until the worker exits or a section outlives its time: apply events; kill a section that overruns (its
        cap plus GRACE, or the global deadline)."""
        caps, left_before = self.caps, list(self.left)
        while True:
            self.read_events()
            if self.proc.poll() is not None:
                self.read_events()
                log = os.path.join(self.logs, f"worker-{self.attempt}.log")
                if self.running is None and self.left == left_before:  # died before any section: blame the next
                    self.running, self.running_since = self.left[0], time.time()
                rc = self.proc.returncode
                how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
                self.fail_running(f"the worker died ({how}); its log ends: {last_error_line(log)}")
                return
            if self.running is not None:
                limit = min(self.running_since + caps[self.running] + GRACE, self.deadline - RESERVE)
                if time.time() > limit:
                    self.stop_worker()
                    self.read_events()
                    self.fail_running(f"timed out after {time.time() - self.running_since:.0f} s "
                                      f"(cap {caps[self.running]} s, or the global deadline)")
                    return
            time.sleep(0.5)

    def run(self) -> int:
        try:
            while self.left and time.time() < self.deadline - RESERVE - GRACE - MIN_START:
                self.start_worker()
                self.watch_worker()
        except Stopped:
            self.stop_worker()
            self.read_events()
            self.fail_running("stopped by SIGTERM (the outer timeout?)")
        finally:
            self.stop_worker()
            for letter in self.left:
                if self.summary.section(letter)["status"] in ("pending", "running"):
                    self.summary.update(letter, status="skipped", cause="global deadline: no time left")
            self.pack()
        return self.summary.finish()


def main(argv: list[str]) -> int:
    args = parse_args(argv)

    def on_term(signum, frame):
        raise Stopped()

    signal.signal(signal.SIGTERM, on_term)
    run = Run(args)
    status = run.run()
    with open(os.path.join(args.results, "summary.md")) as f:
        print(f.read())
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
