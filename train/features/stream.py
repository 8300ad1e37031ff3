"""Streamed features (`features.mode: streamed`): producers write shards while the trainer reads and deletes them.

The design notes behind this module: docs/decisions.md, "train/features/stream.py".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from typing import Any

from drafters.files import write_json_atomic
from train.data.dataset import epoch_order
from train.features.cache import FeatureCache, FeatureProvider

POLL_S = 0.05  # how often a waiting trainer or an idle producer looks again
HEARTBEAT_S = 2.0  # how often a producer rewrites its heartbeat
_RESTART = ("start it again with `draftsmith prepare RECIPE` (the trainer's recipe and overrides): it continues at "
            "the trainer's position")


class ProducerError(RuntimeError):
    """A stream producer is gone or falls behind; the message names it and what to do (exit status 2)."""

    user_error = True  # train/cli.py prints the one line instead of a traceback


@functools.lru_cache(maxsize=2)
def _order(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    return tuple(epoch_order(num_samples, seed, epoch))


@dataclass(frozen=True)
class StreamPlan:
    """What fixes every shard's content: the trainer's data order (train/fit/loop.py) cut into shards."""

    num_samples: int
    seed: int
    global_batch_size: int
    steps_per_epoch: int
    max_steps: int
    steps_per_shard: int

    @property
    def shards_per_epoch(self) -> int:
        return -(-self.steps_per_epoch // self.steps_per_shard)

    @property
    def num_shards(self) -> int:
        return self.shard_of(self.max_steps - 1) + 1

    def shard_of(self, step: int) -> int:
        epoch, position = divmod(step, self.steps_per_epoch)
        return epoch * self.shards_per_epoch + position // self.steps_per_shard

    def steps_of(self, shard: int) -> range:
        epoch, part = divmod(shard, self.shards_per_epoch)
        first = epoch * self.steps_per_epoch + part * self.steps_per_shard
        return range(first, min(first + self.steps_per_shard, (epoch + 1) * self.steps_per_epoch, self.max_steps))

    def samples_of(self, shard: int) -> list[int]:
        """The sample indices of the shard's steps, in the trainer's order (each step's global batch in turn)."""
        steps = self.steps_of(shard)
        epoch = shard // self.shards_per_epoch
        first = (steps.start - epoch * self.steps_per_epoch) * self.global_batch_size
        return list(_order(self.num_samples, self.seed, epoch)[first:first + len(steps) * self.global_batch_size])


def pid_alive(pid: int) -> bool:
    """True while process `pid` (on this host) runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


class StreamDir:
    """The files under <features.cache_dir>/stream (see the module docstring)."""

    def __init__(self, cache_dir: str):
        self.root = os.path.join(cache_dir, "stream")
        self.shards = os.path.join(self.root, "train")
        os.makedirs(self.shards, exist_ok=True)

    def shard_path(self, shard: int) -> str:
        return os.path.join(self.shards, f"{shard:06d}")

    def tmp_path(self, shard: int, rank: int) -> str:
        return os.path.join(self.shards, f".tmp-{shard:06d}-rank{rank}")

    def complete(self) -> list[int]:
        return sorted(int(name) for name in os.listdir(self.shards) if name.isdigit())

    def usage(self) -> tuple[int, int]:
        """(shard directories, complete or being written; their bytes): what the window bounds."""
        count = size = 0
        for name in os.listdir(self.shards):
            count += 1
            for root, _, files in os.walk(os.path.join(self.shards, name)):
                for file in files:
                    try:
                        size += os.path.getsize(os.path.join(root, file))
                    except FileNotFoundError:  # deleted or renamed while counted
                        pass
        return count, size

    def remove(self, shard: int) -> None:
        shutil.rmtree(self.shard_path(shard), ignore_errors=True)

    def progress(self) -> dict[str, Any] | None:
        return _read_json(os.path.join(self.root, "progress.json"))

    def publish(self, plan: StreamPlan, shard: int, end: int, done: bool = False) -> None:
        """The trainer reads `shard`; producers may write the shards in [shard, end)."""
        write_json_atomic(os.path.join(self.root, "progress.json"),
                          {"plan": dataclasses.asdict(plan), "shard": shard, "end": end, "done": done,
                           "pid": os.getpid(), "host": socket.gethostname(), "time": time.time()})

    def heartbeat_path(self, rank: int) -> str:
        return os.path.join(self.root, f"producer-rank{rank}.json")

    def heartbeats(self) -> dict[int, dict[str, Any]]:
        beats = {}
        for name in os.listdir(self.root):
            if name.startswith("producer-rank") and name.endswith(".json"):
                beat = _read_json(os.path.join(self.root, name))
                if beat is not None:
                    beats[beat["rank"]] = beat
        return beats

    def shard_plan(self, shard: int) -> dict[str, Any] | None:
        meta = _read_json(os.path.join(self.shard_path(shard), "meta.json"))
        return None if meta is None else meta.get("stream_plan")

    def prune(self, keep: range, plan: StreamPlan) -> None:
        """Delete the complete shards outside `keep`, and those in it written for another plan. Shards being
        written are their producer's (it deletes one that ends outside the window)."""
        for shard in self.complete():
            if shard not in keep or self.shard_plan(shard) != dataclasses.asdict(plan):
                self.remove(shard)


def producer_problem(stream: StreamDir, shard: int | None, waited_s: float, since: float,
                     timeout_s: float, what: str) -> str | None:
    """Why waiting for `what` (shard `shard`, written by its producer rank; None: written by all ranks) cannot go
    on, else None. A heartbeat older than `since` (the trainer's start) is from an earlier run: that producer has
    not started yet, which is only a problem once timeout_s has passed."""
    beats, host, now = stream.heartbeats(), socket.gethostname(), time.time()
    latest = max(beats.values(), key=lambda beat: beat["time"], default=None)
    ranks = None if latest is None else latest["ranks"]  # the newest producer's launch says how many there are
    if ranks is None:
        if waited_s > timeout_s:
            return (f"no stream producer has started for {stream.root} in {waited_s:.0f} s (the trainer waits for "
                    f"{what}); start one with `draftsmith prepare RECIPE` (the trainer's recipe and overrides)")
        return None
    for rank in (range(ranks) if shard is None else [shard % ranks]):
        beat = beats.get(rank)
        where = f"stream producer rank {rank} of {ranks}"
        if beat is None or beat["time"] < since:
            if waited_s > timeout_s:
                last = "" if beat is None else f" (its last run ended at shard {beat['last_shard']})"
                return (f"{where} is not running{last} and the trainer has waited {waited_s:.0f} s for {what}; "
                        + _RESTART.replace("it again", "it"))
            continue
        where += f" (pid {beat['pid']} on {beat['host']}; last shard written: {beat['last_shard']})"
        if beat["host"] == host and not pid_alive(beat["pid"]):
            return f"{where} is gone (its process exited) while the trainer waits for {what}; {_RESTART}"
        if now - beat["time"] > max(timeout_s, 5 * HEARTBEAT_S):
            return (f"{where} is gone (no heartbeat for {now - beat['time']:.0f} s) while the trainer waits for "
                    f"{what}; {_RESTART}")
        if waited_s > timeout_s:
            return (f"{where} runs but {what} has not come in {waited_s:.0f} s: the producer falls behind; start "
                    "more producer ranks (accelerate launch, or features.vllm.data_parallel_size jobs) or raise "
                    "features.stream.timeout_s")
    return None


class StreamedFeatures(FeatureProvider):
    """The trainer's side of the stream for the train split: at each step, the shard that holds it."""

    def __init__(self, target, request, meta: dict[str, Any], stream: StreamDir, plan: StreamPlan, settings, *,
                 main: bool):
        super().__init__("streamed", target, request)
        self.meta, self.stream, self.plan, self.settings, self.main = meta, stream, plan, settings, main
        self.current: int | None = None
        self.started = time.time()

    def at_step(self, step: int) -> None:
        shard = self.plan.shard_of(step)
        if shard == self.current:
            return
        window = self.settings.window_shards
        if self.main:  # every process has finished the previous step (its stop flags are all-reduced)
            # first move the start without widening the window, so no producer re-writes what is deleted next
            end = shard if self.current is None else max(shard, min(self.current + window, shard + window))
            self.stream.publish(self.plan, shard, end)
            self.stream.prune(range(shard, shard + window), self.plan)
            self.stream.publish(self.plan, shard, shard + window)
        self.cache, self.current = self.wait(shard), shard

    def wait(self, shard: int) -> FeatureCache:
        """Shard `shard` once it is complete and published for this plan; watch the producers meanwhile."""
        steps = self.plan.steps_of(shard)
        what = f"shard {shard} (steps {steps.start + 1}-{steps.stop})"
        plan = dataclasses.asdict(self.plan)
        waiting_since = time.monotonic()
        while True:
            progress = self.stream.progress()  # other processes start reading once the main one has pruned
            if (os.path.isdir(self.stream.shard_path(shard)) and progress is not None
                    and progress["shard"] == shard and progress["end"] == shard + self.settings.window_shards
                    and progress["plan"] == plan):
                break
            problem = producer_problem(self.stream, shard, time.monotonic() - waiting_since, self.started,
                                       self.settings.timeout_s, what)
            if problem:
                raise ProducerError(problem)
            self.pause()
        cache = FeatureCache(self.stream.shard_path(shard), self.meta)
        if cache.meta.get("stream_plan") != plan or sorted(cache.location) != sorted(self.plan.samples_of(shard)):
            raise ValueError(f"stream shard {cache.directory} holds other samples than the trainer's step order "
                             f"needs; delete {self.stream.root} and restart the producers")
        return cache

    def pause(self) -> None:
        time.sleep(POLL_S)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        indices = [int(i) for i in batch["sample_index"]]
        missing = [i for i in indices if self.cache is None or i not in self.cache]
        if missing:
            raise ValueError(f"stream shard {self.current} does not hold samples {missing[:4]}: features.mode "
                             "streamed serves the trainer's steps in order only")
        return self.from_cache(batch, indices)

    def close(self) -> None:
        if self.main:  # done first: a producer that saw the old position could write again what is deleted
            self.stream.publish(self.plan, self.plan.num_shards, self.plan.num_shards, done=True)
            for shard in self.stream.complete():
                self.stream.remove(shard)

    def refresh(self) -> None:
        pass


class StreamedEvalFeatures(FeatureProvider):
    """The eval split in streamed mode: an ordinary cache the producers write in full before streaming (it is small);
    the first evaluation waits until every sample is there."""

    def __init__(self, target, request, cache: FeatureCache, stream: StreamDir, settings, num_samples: int):
        super().__init__("offline", target, request, cache)
        self.stream, self.settings, self.num_samples = stream, settings, num_samples
        self.started, self.complete = time.time(), False

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        waiting_since = time.monotonic()
        while not self.complete:
            self.cache.refresh()
            self.complete = len(self.cache) >= self.num_samples
            problem = None if self.complete else producer_problem(
                self.stream, None, time.monotonic() - waiting_since, self.started, self.settings.timeout_s,
                f"the eval features in {self.cache.directory}")
            if problem:
                raise ProducerError(problem)
            if not self.complete:
                time.sleep(POLL_S)
        return super().__call__(batch)
