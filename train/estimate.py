"""`draftsmith estimate RECIPE [key=value ...]`: the disk and time an offline feature cache will take.

Disk: per token, (number of hidden ids + 1) x D values in the cache dtype (the requested hidden states plus the
final-norm hidden state) plus 8 bytes (the target argmax and the token id, int32), plus k values and k int32 ids
when the drafter asks for top-k logits, summed over the train and eval splits. Time: the target's feature throughput
measured on a few real batches of the recipe's data, on this machine, after one warm-up batch.

    draftsmith estimate recipes/smollm2/eagle3_full.yaml
"""

from __future__ import annotations

import sys
import time

import torch

from train.config import recipe_from_argv

NUM_TIMED_BATCHES = 2


def cache_bytes_per_token(num_hidden: int, hidden_size: int, dtype: torch.dtype, top_k: int = 0) -> int:
    """(num_hidden + 1) hidden vectors of hidden_size values, + int32 argmax + int32 token id, + top-k values/ids."""
    size = torch.empty((), dtype=dtype).element_size()
    return (num_hidden + 1) * hidden_size * size + 8 + top_k * (size + 4)


def measure_throughput(target, dataset, request, batch_size: int, pad_token_id: int) -> float:
    """Feature tokens per second of the target on the first batches of `dataset` (one warm-up batch untimed)."""
    from inference.target import synchronize
    from train.features import FeatureProvider, make_batch

    provider = FeatureProvider("online", target, request)
    num_batches = min(NUM_TIMED_BATCHES + 1, max(1, len(dataset) // batch_size))
    tokens, seconds = 0, 0.0
    for b in range(num_batches):
        indices = [i % len(dataset) for i in range(b * batch_size, (b + 1) * batch_size)]
        batch = make_batch(dataset, indices, pad_token_id)
        synchronize(target.device)
        started = time.perf_counter()
        provider.online(batch)
        synchronize(target.device)
        if b > 0 or num_batches == 1:
            tokens += int(batch["attention_mask"].sum())
            seconds += time.perf_counter() - started
    return tokens / max(seconds, 1e-9)


def human_seconds(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def human_bytes(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num < 1024 or unit == "TiB":
            return f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} TiB"


def main(argv: list[str] | None = None) -> int:
    recipe = recipe_from_argv("draftsmith estimate", __doc__.split("\n\n")[0], argv)
    from train.build import build_drafter, load_data, load_target, process_state
    from train.features import sample_lengths

    state = process_state()
    target = load_target(recipe, state.device)
    data = load_data(recipe, target, state)
    request = build_drafter(recipe, target).feature_request()
    layer_ids = request.layer_ids
    dtype = target.model.dtype if recipe.features.dtype == "auto" else getattr(torch, recipe.features.dtype)
    info = target.target_info()
    lengths = {split: sum(sample_lengths(dataset)) for split, dataset in (("train", data.train), ("eval", data.eval))}
    total_tokens = sum(lengths.values())
    per_token = cache_bytes_per_token(len(layer_ids), info.hidden_size, dtype, request.top_k_logits)
    pad_token_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    rate = measure_throughput(target, data.train, request, recipe.train.batch_size, pad_token_id)
    seconds = total_tokens / rate
    print(f"target {info.name_or_path}: D={info.hidden_size}, layer ids {list(layer_ids)} + final norm, "
          f"cache dtype {str(dtype).removeprefix('torch.')}")
    print(f"data: {len(data.train)} train + {len(data.eval)} eval samples, {lengths['train']:,} + "
          f"{lengths['eval']:,} = {total_tokens:,} tokens")
    print(f"disk: {per_token:,} bytes/token x {total_tokens:,} tokens = {human_bytes(per_token * total_tokens)}")
    print(f"time: {rate:,.0f} tokens/s measured on {state.device} (batch {recipe.train.batch_size}) -> "
          f"{human_seconds(seconds)} on one process, {human_seconds(seconds / state.num_processes)} with "
          f"{state.num_processes} process(es)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
