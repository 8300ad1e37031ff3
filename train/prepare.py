"""`draftsmith prepare RECIPE [key=value ...]`: regenerate answers with the target, then write the offline cache.

1. When the recipe has a `regenerate:` section, the target answers `regenerate.num_conversations` conversations of
   data.path (a seeded sample) and the results go to data.regenerated_path (train/regenerate.py). It resumes by
   conversation id. Under `accelerate launch` each process answers its share into <path>.rank<r> and the main
   process merges them.
2. When features.mode is offline or hybrid, every process writes the features of its share of the train and eval
   splits into <features.cache_dir>/{train,eval} (train/features.py); an interrupted run resumes from its index.

    draftsmith prepare recipes/smollm2/eagle3_full.yaml
    accelerate launch --config_file recipes/accelerate/8gpu_ddp.yaml -m train.prepare recipes/llama3.1-8b/eagle3.yaml
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from accelerate import PartialState

from train.config import Recipe, recipe_from_argv


def regenerate_data(recipe: Recipe, target, state: PartialState) -> None:
    """Step 1: answer a seeded sample of data.path's conversations with the target into data.regenerated_path."""
    from train.conversations import load_conversations
    from train.regenerate import regenerate

    settings, out_path = recipe.regenerate, recipe.data.regenerated_path
    if not out_path:
        raise ValueError("the regenerate: section needs data.regenerated_path (where the answers are written)")
    conversations, _ = load_conversations(recipe.data.path, recipe.data.format)
    random.Random(settings.seed).shuffle(conversations)
    conversations = conversations[:settings.num_conversations]
    share = conversations[state.process_index::state.num_processes]
    part = out_path if state.num_processes == 1 else f"{out_path}.rank{state.process_index}"
    stats = regenerate(target.model, target.tokenizer, share, part, max_new_tokens=settings.max_new_tokens,
                       temperature=settings.temperature, top_p=settings.top_p, batch_size=settings.batch_size,
                       max_prompt_tokens=settings.max_prompt_tokens, seed=settings.seed + state.process_index,
                       chat_template=recipe.data.chat_template, use_vllm=settings.use_vllm)
    print(f"rank {state.process_index}: regenerated {stats}")
    state.wait_for_everyone()
    if state.num_processes > 1 and state.is_main_process:
        merge_parts(out_path, [f"{out_path}.rank{rank}" for rank in range(state.num_processes)])
    state.wait_for_everyone()


def merge_parts(out_path: str, parts: list[str]) -> None:
    """Append the records of the per-rank files whose id `out_path` does not hold yet."""
    done = set()
    if os.path.exists(out_path):
        with open(out_path, encoding="utf-8") as f:
            done = {json.loads(line)["id"] for line in f if line.strip()}
    with open(out_path, "a", encoding="utf-8") as out:
        for part in parts:
            with open(part, encoding="utf-8") as f:
                for line in f:
                    if line.strip() and json.loads(line)["id"] not in done:
                        out.write(line if line.endswith("\n") else line + "\n")


def write_features(recipe: Recipe, target, state: PartialState) -> None:
    """Step 2: this process's share of the train and eval splits into the offline cache."""
    from train.build import build_drafter, feature_provider, load_data
    from train.features import write_cache

    data = load_data(recipe, target, state)
    request = build_drafter(recipe, target).feature_request()
    pad_token_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    for split, dataset in (("train", data.train), ("eval", data.eval)):
        cache = feature_provider(recipe, split, target, request, len(dataset), state.process_index).cache
        started = time.perf_counter()
        written = write_cache(target, dataset, cache, batch_size=recipe.train.batch_size, pad_token_id=pad_token_id,
                              rank=state.process_index, world_size=state.num_processes,
                              progress=state.is_local_main_process)
        print(f"rank {state.process_index}: {split}: wrote features of {written} samples to {cache.directory} "
              f"in {time.perf_counter() - started:.1f} s")
    state.wait_for_everyone()


def main(argv: list[str] | None = None) -> int:
    recipe = recipe_from_argv("draftsmith prepare", __doc__.split("\n\n")[0], argv)
    from train.build import load_target, process_state

    state = process_state()
    target = load_target(recipe, state.device)
    if recipe.regenerate is not None:
        regenerate_data(recipe, target, state)
    if recipe.features.mode in ("offline", "hybrid"):
        write_features(recipe, target, state)
    elif recipe.regenerate is None:
        print("nothing to prepare: no regenerate: section and features.mode is online")
    return 0


if __name__ == "__main__":
    sys.exit(main())
