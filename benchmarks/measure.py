"""What every benchmark shares: the JSON it writes (with the machine it ran on) and the timing flags.

    sys.path.insert(0, REPO_ROOT)                          # a benchmark run as a script
    from benchmarks.measure import add_timing_arguments, timing_clock, write_measurement
"""

from __future__ import annotations

import time

import torch

from drafters.files import write_json_atomic
from inference.evaluation.environment import environment


def write_measurement(path: str, result: dict, device="cpu") -> None:
    """A benchmark's JSON, written atomically, with the machine it was measured on under "environment" (CPU
    model, ISA flags, threads, versions)."""
    write_json_atomic(path, {**result, "environment": environment(torch.device(device))}, indent=1)


def add_timing_arguments(parser, repeats: int = 15) -> None:
    """The flags every timing benchmark shares: --threads, --repeats, --clock (wall | cpu), --out."""
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                        help="cpu: this thread's CPU seconds (1 thread only), which a loaded machine's scheduling "
                             "does not inflate; wall: elapsed seconds")
    parser.add_argument("--out", default=None)


def timing_clock(args, parser):
    """Sets torch's threads to --threads and returns the clock --clock names (a parser error for cpu with threads)."""
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: use it with --threads 1")
    torch.set_num_threads(args.threads)
    return time.thread_time if args.clock == "cpu" else time.perf_counter
