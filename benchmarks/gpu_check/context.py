"""What every section of the GPU check shares: the device, the sizes of its mode, the clock, logs and subprocesses.

The sizes differ between the two modes only: `--cpu` is the dry run that keeps the check from rotting between GPU
runs (tiny shapes, a few steps), the default is the run on one GPU (CUDA or ROCm: torch.cuda serves both, and the
code reads the device type off torch.accelerator rather than naming it).
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

from benchmarks.gpu_check.summary import last_error_line, one_line

BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7: the spacing of bf16 numbers in [1, 2)
DATA_FILE = "recipes/smollm2/data/sharegpt_smollm2_regenerated_320.jsonl"
# every trainable kind with a debug recipe
KINDS = ("eagle3", "peagle", "dflash", "dspark", "mtp", "medusa", "assistant")


class CheckFailed(Exception):
    """A section ran but what it checks did not hold; `numbers` are what it measured up to then."""

    def __init__(self, cause: str, numbers: dict | None = None):
        super().__init__(cause)
        self.numbers = numbers or {}


@dataclass(frozen=True)
class Sizes:
    """Every size a section uses, per mode (GPU / CPU below)."""

    train_steps: int  # B and G: optimizer steps of the straight run; checkpoints at half of it
    num_samples: int
    num_eval_samples: int
    max_length: int
    probe_prompts: int
    probe_tokens: int
    parity_rows: int  # C
    parity_length: int
    eval_prompts: int  # D
    eval_tokens: int
    shape: dict = field(default_factory=dict)  # E and F: the target config (LlamaConfig fields)
    shape_layers: int = 6  # E: decoder layers of the real-shape target
    engine_layers: int = 32  # F
    seq_lens: tuple = (2048, 4096)  # E: the short and the long sequence of each kind
    timed_steps: int = 3  # E: after one warm-up step
    engine_prompt: int = 512  # F: prompt tokens
    engine_tokens: int = 64  # F: new tokens
    engine_batches: tuple = (1, 8)
    profile_width: int = 8
    profile_repeats: int = 3


LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)
QWEN3_8B = dict(LLAMA_8B, intermediate_size=12288, vocab_size=151936, head_dim=128, rope_theta=1000000.0,
                rms_norm_eps=1e-6)
GPU_SIZES = Sizes(train_steps=24, num_samples=32, num_eval_samples=8, max_length=320, probe_prompts=2,
                  probe_tokens=16, parity_rows=4, parity_length=256, eval_prompts=4, eval_tokens=48, shape=LLAMA_8B)
TINY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=1024, rope_theta=500000.0, max_position_embeddings=1024, rms_norm_eps=1e-5)
CPU_SIZES = Sizes(train_steps=4, num_samples=8, num_eval_samples=4, max_length=320, probe_prompts=1,
                  probe_tokens=8, parity_rows=2, parity_length=96, eval_prompts=2, eval_tokens=12, shape=TINY_SHAPE,
                  shape_layers=4, engine_layers=4, seq_lens=(64, 96), timed_steps=1, engine_prompt=32,
                  engine_tokens=8, engine_batches=(1, 2), profile_width=3, profile_repeats=1)


@dataclass
class Context:
    """One section's view of the run: repo root, work dir, mode, device, sizes and its own deadline (epoch s)."""

    repo: str
    work: str
    cpu: bool
    deadline: float
    device: torch.device = field(init=False)
    sizes: Sizes = field(init=False)

    def __post_init__(self):
        if not self.cpu and not torch.accelerator.is_available():
            raise RuntimeError("no accelerator is visible to torch; run with --cpu for the CPU dry run")
        self.device = torch.device("cpu") if self.cpu else torch.accelerator.current_accelerator()
        self.sizes = CPU_SIZES if self.cpu else GPU_SIZES
        os.makedirs(self.log_dir, exist_ok=True)

    @property
    def log_dir(self) -> str:
        return os.path.join(self.work, "logs")

    def path(self, *parts: str) -> str:
        """A path under the work dir (its folder created)."""
        path = os.path.join(self.work, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def repo_path(self, relative: str) -> str:
        return os.path.join(self.repo, relative)

    def time_left(self) -> float:
        return self.deadline - time.time()

    def run(self, name: str, argv: list[str], timeout: float | None = None) -> tuple[int, str]:
        """Run a command from the repo root with its output in logs/<name>.log, within the section's time.
        Returns (exit status, one line: the last line of its output that looks like an error, else its last line);
        status 124 when it ran out of time (then it is killed with every process it started)."""
        log = os.path.join(self.log_dir, f"{name}.log")
        limit = max(1.0, min(timeout or math.inf, self.time_left() - 5.0))
        with open(log, "w") as out:
            out.write("$ " + " ".join(argv) + "\n")
            out.flush()
            proc = subprocess.Popen(argv, cwd=self.repo, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()
                rc = 124
                out.write(f"\nkilled: out of time after {limit:.0f} s\n")
        return rc, last_error_line(log) if rc else ""

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]


def kill_tree(pid: int) -> None:
    """Kill a process and every process under it (a launcher's workers hold device memory)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        processes = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def reset_accelerate() -> None:
    """Each in-process training builds its own Accelerator: forget the last one's state first."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def drafter_config(recipe: str, overrides: dict | None = None):
    """(kind, Config) of a recipe's `drafter:` section with `overrides` applied; the rest of the recipe (a GPU
    recipe's target and data paths) is not read."""
    import yaml

    from drafters import DRAFTERS
    from drafters.configs import from_dict

    with open(recipe) as f:
        section = {**yaml.safe_load(f)["drafter"], **(overrides or {})}
    kind = section.pop("kind")
    return kind, from_dict(DRAFTERS[kind].Config, section, "drafter")


def _accelerator_call(device: torch.device, name: str):
    """torch.accelerator's memory function `name`, or the device module's on a torch without it (before 2.9)."""
    return getattr(torch.accelerator, name, None) or getattr(getattr(torch, device.type), name)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type != "cpu":
        _accelerator_call(device, "empty_cache")()


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def memory_reset_peak(device: torch.device) -> None:
    if device.type != "cpu":
        _accelerator_call(device, "reset_peak_memory_stats")()


def memory_allocated(device: torch.device) -> int | None:
    """Bytes the allocator holds for tensors now (None on CPU: no allocator statistics there)."""
    return None if device.type == "cpu" else int(_accelerator_call(device, "memory_allocated")())


def memory_peak(device: torch.device) -> int | None:
    return None if device.type == "cpu" else int(_accelerator_call(device, "max_memory_allocated")())


def gib(num_bytes: float | None) -> float | None:
    return None if num_bytes is None else round(num_bytes / 2**30, 3)


def finite(values) -> bool:
    return all(math.isfinite(float(value)) for value in values)


# what an allocation that does not fit raises (torch.OutOfMemoryError; the device module's alias on older torch)
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def each_case(ctx: Context, names, check, numbers: dict, failures: list[str]) -> None:
    """check(name) -> (its numbers, its failures) for each name in turn, into numbers[name] and failures: a name
    reached with under 10 s left is recorded as not run; one whose check raises is recorded by its error (the
    traceback in the log) and the next one runs; the device's memory is freed after each."""
    for name in names:
        if ctx.time_left() < 10:
            failures.append(f"{name}: no time left")
            continue
        try:
            numbers[name], failed = check(name)
            failures += failed
        except Exception as err:  # noqa: BLE001 - one case's error is recorded and the next case runs
            traceback.print_exc()
            numbers[name] = {"error": f"{type(err).__name__}: {one_line(err)}"}
            failures.append(f"{name}: {type(err).__name__}: {one_line(err)}")
        free_memory(ctx.device)  # after the except block: the error's frames no longer hold the failed case
