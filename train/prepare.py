"""`draftsmith prepare RECIPE [key=value ...]`: regenerate answers with the target, then write the offline cache.

1. When the recipe has a `regenerate:` section, the target answers `regenerate.num_conversations` conversations of
   data.path (a seeded sample) and the results go to data.regenerated_path (train/regeneration.py). It resumes by
   conversation id. Under `accelerate launch` each process answers its share into <path>.rank<r> and the main
   process merges them. `regenerate.use_vllm: true` answers with a vLLM engine per process instead of HF generate
   (same prompts, sampling settings and resumable output).
2. When features.mode is offline or hybrid, every process writes the features of its share of the train and eval
   splits into <features.cache_dir>/{train,eval} (train/features/cache.py); an interrupted run resumes from its index.
   features.extractor: vllm computes them in a vLLM engine per rank instead (train/features/vllm_features.py).
3. When features.mode is streamed, every process is a producer that runs beside `draftsmith train` and writes the
   train split's shards just ahead of it (train/features/stream_producer.py), until the trainer is done.

    draftsmith prepare recipes/smollm2/eagle3_full.yaml
    accelerate launch --config_file recipes/accelerate/8gpu_ddp.yaml -m train.prepare recipes/llama3.1-8b/eagle3.yaml
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

from accelerate import PartialState

from drafters.files import check_writable_dir
from train.build import feature_provider, process_state
from train.config import Recipe, recipe_from_argv, recipe_parser
from train.feature_source import feature_source, produce
from train.features.vllm_features import require_vllm
from train.regeneration import VLLM_MISSING, regenerate_data
from train.warm_start import check_init_from


def write_features(recipe: Recipe, state: PartialState) -> None:
    """Step 2: this process's share of the train and eval splits into the offline cache, from the recipe's feature
    source (the target's forward here, or a vLLM engine per rank: train/feature_source.py)."""
    source = feature_source(recipe, state)
    for split, dataset in source.splits():
        cache = feature_provider(recipe, split, source.target, source.request, len(dataset), source.rank).cache
        started = time.perf_counter()
        written = source.extract(cache, dataset, progress=state.is_local_main_process)
        print(f"rank {source.rank}: {split}: wrote {source.name} features of {written} samples to {cache.directory} "
              f"in {time.perf_counter() - started:.1f} s")
    state.wait_for_everyone()


def build_parser():
    return recipe_parser("draftsmith prepare", __doc__.split("\n\n")[0])


def check_before_loading(recipe: Recipe) -> None:
    """What prepare would refuse only after loading the target or reading the data: a feature cache it cannot
    write, a regenerate: section with nowhere (or nowhere writable) to write its answers, and regenerate.use_vllm
    where vLLM is not installed (looked up, not imported: importing it is slow), and a train.init_from holding no
    drafter of the recipe's kind (its layer ids decide the features)."""
    check_init_from(recipe)
    if recipe.features.mode != "online" and recipe.features.cache_dir:
        check_writable_dir(recipe.features.cache_dir, "features.cache_dir")
    if recipe.regenerate is None:
        return
    if not recipe.data.regenerated_path:
        raise ValueError("the regenerate: section needs data.regenerated_path (where the answers are written)")
    check_writable_dir(os.path.dirname(os.path.abspath(recipe.data.regenerated_path)), "data.regenerated_path")
    if recipe.regenerate.use_vllm and importlib.util.find_spec("vllm") is None:
        raise ValueError(VLLM_MISSING)


def main(argv: list[str] | None = None) -> int:
    recipe = recipe_from_argv("draftsmith prepare", __doc__.split("\n\n")[0], argv)
    check_before_loading(recipe)
    state = process_state(recipe)  # the recipe's collective timeout (train.dist_timeout_minutes)
    if recipe.features.extractor == "vllm" and recipe.features.mode != "online":
        require_vllm()  # before any regeneration, so a missing vLLM costs nothing
    if recipe.regenerate is not None:
        regenerate_data(recipe, state)
    if recipe.features.mode == "streamed":
        produce(recipe, state)
    elif recipe.features.mode in ("offline", "hybrid"):
        write_features(recipe, state)
    elif recipe.regenerate is None:
        print("nothing to prepare: no regenerate: section and features.mode is online")
    return 0


if __name__ == "__main__":
    sys.exit(main())
