"""The producer of streamed features: `draftsmith prepare RECIPE` when features.mode is streamed (train/features/stream.py).

Each producer rank (one process, or every process of an `accelerate launch`; with features.extractor: vllm also an
independent job per features.vllm.data_parallel_rank) first writes its share of the eval split into the ordinary
cache <features.cache_dir>/eval, then follows the trainer: it reads the trainer's plan and position from
progress.json and writes, in order, the shards of the window it owns (p % ranks == rank) that are not on disk yet,
each into a temporary directory renamed into place when complete. It writes a heartbeat every HEARTBEAT_S seconds
and exits once the trainer that started after it says it is done; until then it waits (a resumed trainer needs it).

With features.extractor: hf a shard's samples are extracted train.batch_size at a time in the trainer's order, i.e.
as the trainer's own micro-batches, so the features are what online training computes for them.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import threading
import time
from typing import Any, Callable

from drafters.files import write_json_atomic
from train.features.cache import FeatureCache
from train.features.stream import HEARTBEAT_S, POLL_S, StreamDir, StreamPlan

# extract(cache, dataset, indices): features of `indices` (in that order), or with None of this rank's share
Extract = Callable[[FeatureCache, Any, "list[int] | None"], int]
ONE_SHARD = 1 << 62  # a stream shard is flushed once, when complete


class Heartbeat:
    """Rewrites <stream>/producer-rank{r}.json every HEARTBEAT_S seconds from a thread while the block runs."""

    def __init__(self, stream: StreamDir, rank: int, ranks: int):
        self.path = stream.heartbeat_path(rank)
        self.rank, self.ranks = rank, ranks
        self.last_shard: int | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def beat(self, state: str = "running") -> None:
        write_json_atomic(self.path, {"rank": self.rank, "ranks": self.ranks, "pid": os.getpid(),
                                      "host": socket.gethostname(), "time": time.time(), "state": state,
                                      "last_shard": self.last_shard})

    def _run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            self.beat()

    def __enter__(self) -> "Heartbeat":
        self.beat()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()
        self.beat("finished")


def write_shard(stream: StreamDir, plan: StreamPlan, shard: int, meta: dict[str, Any], dataset, extract: Extract,
                rank: int) -> None:
    """Extract shard `shard` into its temporary directory and rename it into place (all or nothing)."""
    tmp = stream.tmp_path(shard, rank)
    shutil.rmtree(tmp, ignore_errors=True)
    cache = FeatureCache(tmp, {**meta, "stream_plan": dataclasses.asdict(plan)}, shard_bytes=ONE_SHARD)
    extract(cache, dataset, plan.samples_of(shard))
    cache.flush()
    try:
        os.rename(tmp, stream.shard_path(shard))
    except OSError:  # another producer of the same rank wrote it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)


def run_producer(stream: StreamDir, dataset, meta: dict[str, Any], extract: Extract, *, rank: int = 0,
                 ranks: int = 1, stop: threading.Event | None = None, log: Callable[[str], None] = print) -> int:
    """Follow the trainer until it is done (or `stop` is set); returns the shards written."""
    started, written, waiting_said = time.time(), 0, False
    for leftover in os.listdir(stream.shards):  # this rank's shards cut off by an earlier crash
        if leftover.startswith(".tmp-") and leftover.endswith(f"-rank{rank}"):
            shutil.rmtree(os.path.join(stream.shards, leftover), ignore_errors=True)
    with Heartbeat(stream, rank, ranks) as heartbeat:
        while stop is None or not stop.is_set():
            progress = stream.progress()
            if progress is None or (progress["done"] and progress["time"] < started):  # no trainer of this run yet
                if not waiting_said:
                    log(f"producer rank {rank}: waiting for the trainer (`draftsmith train RECIPE`, same recipe)")
                    waiting_said = True
                time.sleep(POLL_S)
                continue
            if progress["done"]:
                break
            plan = StreamPlan(**progress["plan"])
            if plan.num_samples != len(dataset):
                raise ValueError(f"the trainer's training set has {plan.num_samples} samples and this producer's "
                                 f"{len(dataset)}: run both with the same recipe and data overrides")
            window = range(progress["shard"], min(progress["end"], plan.num_shards))
            todo = [p for p in window if p % ranks == rank and not os.path.isdir(stream.shard_path(p))]
            if stream.progress() != progress:  # the trainer moved (and may have deleted a shard) while we looked
                continue
            if not todo:
                time.sleep(POLL_S)
                continue
            write_shard(stream, plan, todo[0], meta, dataset, extract, rank)
            heartbeat.last_shard, written = todo[0], written + 1
            heartbeat.beat()
            now = stream.progress()
            if not now["shard"] <= todo[0] < now["end"]:  # the trainer restarted elsewhere meanwhile
                stream.remove(todo[0])
    return written
