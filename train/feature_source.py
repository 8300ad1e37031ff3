"""Where a recipe's stored features come from: one `FeatureSource` per process, built in one place from the recipe.

`features.extractor` names it: "hf" runs the target's own forward in this process (the whole target, replicated);
"vllm" runs a vLLM engine per data-parallel rank (train/features/vllm_features.py) while this process holds only the target's
embeddings, final norm and lm_head. `draftsmith prepare`'s offline cache (train/prepare.py) and the stream producer
(train/features/stream_producer.py) both ask a source for its target, data, rank and `extract`, and cannot tell which it is;
the cache it writes is the same format either way, so training cannot either.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from accelerate import PartialState

from train.build import build_drafter, feature_meta, feature_provider, load_data, load_target
from train.config import Recipe
from train.features.cache import write_cache
from train.features.stream import StreamDir
from train.features.stream_producer import run_producer
from train.features.vllm_features import vllm_extractor, vllm_head
from train.warm_start import warm_recipe

# (cache, dataset, indices or None for this rank's whole share, progress bar) -> samples written
Extract = Callable[[Any, Any, "list[int] | None", bool], int]


@dataclass(frozen=True)
class FeatureSource:
    """What computes this process's features: `target` (whole, or the head only), the tokenised `data`, the
    drafter's `request`, this process's `rank` among `ranks` writers, and `extract`."""

    name: str  # the recipe's features.extractor
    target: Any  # inference.engine.target.TargetModel
    data: Any  # train.data.dataset.PreparedData
    request: Any  # drafters.base.FeatureRequest
    rank: int
    ranks: int
    writer: Extract

    def extract(self, cache, dataset, indices: list[int] | None = None, *, progress: bool = False) -> int:
        """Compute and store the features `cache` lacks: this rank's share of `dataset` (index % ranks == rank),
        longest first, or `indices` in their order (a streamed shard). Returns the samples written."""
        return self.writer(cache, dataset, indices, progress)

    def splits(self) -> list[tuple[str, Any]]:
        return [("train", self.data.train), ("eval", self.data.eval)]


def feature_source(recipe: Recipe, state: PartialState) -> FeatureSource:
    """The recipe's feature source for this process: the one place features.extractor is read."""
    if recipe.features.extractor == "vllm":
        target, rank, ranks = vllm_head(recipe, state)
        make_writer = vllm_extractor
    else:
        target, rank, ranks = load_target(recipe, state.device, whole=True), state.process_index, state.num_processes
        make_writer = hf_extractor
    data = load_data(recipe, target, state)
    request = build_drafter(warm_recipe(recipe, target.target_info()), target).feature_request()
    writer = make_writer(recipe, state, target, request, [data.train, data.eval], rank, ranks)
    return FeatureSource(recipe.features.extractor, target, data, request, rank, ranks, writer)


def hf_extractor(recipe: Recipe, state: PartialState, target, request, datasets, rank: int, ranks: int) -> Extract:
    """The target's own forward, train.batch_size samples at a time (a streamed shard: the trainer's micro-batches)."""
    def extract(cache, dataset, indices, progress):
        return write_cache(target, dataset, cache, batch_size=recipe.train.batch_size, pad_token_id=target.pad_token_id,
                           rank=rank, world_size=ranks, indices=indices, progress=progress)

    return extract


def produce(recipe, state, stop: threading.Event | None = None) -> int:
    """`draftsmith prepare` for a streamed recipe: this process's eval share, then its shards of the train split
    until the trainer is done (or `stop` is set), from the recipe's feature source. Returns the shards written."""
    source = feature_source(recipe, state)
    eval_cache = feature_provider(recipe, "eval", source.target, source.request, len(source.data.eval),
                                  source.rank).cache
    source.extract(eval_cache, source.data.eval)
    # the meta the trainer checks every shard against
    meta = feature_meta(recipe, source.target, source.request, len(source.data.train))
    stream = StreamDir(recipe.features.cache_dir)
    print(f"producer rank {source.rank} of {source.ranks}: eval features in {eval_cache.directory}; streaming into "
          f"{stream.shards}")
    written = run_producer(stream, source.data.train, meta, source.extract, rank=source.rank, ranks=source.ranks,
                           stop=stop)
    print(f"producer rank {source.rank}: the trainer is done; this rank wrote {written} shards")
    return written
