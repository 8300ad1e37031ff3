"""Target features for training: online (target forward in the step), offline (a cache on disk), or hybrid.

The drafter batch always carries the same keys, wherever they came from (drafters/base.py), serving the drafter's
FeatureRequest:
    hidden {layer_id: [B, T, D]} float32, final_hidden [B, T, D] float32, target_argmax [B, T] long, and with
    request.top_k_logits = k > 0: top_k (values [B, T, k] float32, ids [B, T, k] long), and with request.kv_layers
    (online only): target_kv {layer: (keys, values) [B, H_kv, T, d]} float32. The names are the engine's
    (drafters/served.py `Served`), so a drafter reads one name in training and in inference.

Offline cache layout, one directory per split (`<features.cache_dir>/train`, `.../eval`):
    meta.json                       format (2), target name, hidden size, number of layers, layer ids, dtype, number
                                    of samples, top-k logits
    rank{r}-{n:05d}.safetensors     shards written by rank r; per sample `s{i}.input_ids` [T] int32,
                                    `s{i}.hidden.{id}` [T, D], `s{i}.final_hidden` [T, D], `s{i}.argmax` [T] int32,
                                    with top-k logits `s{i}.top_k.values` [T, k] and `s{i}.top_k.ids` [T, k] int32
A cache of another format (format 1 named its records h{id}, last, topv, topi) is refused in one line that says
how to rebuild it.
    index-rank{r}.json              per shard: file name, size in bytes, sha256 and the sample indices it holds
Each rank writes only its own shards and index, shard files and indexes are written under temporary names and
renamed into place, so an interrupted `draftsmith prepare` resumes where its index ends. The first time a process
opens a shard it checks the size (a truncated file is named as such without reading it) and then the sha256 (one
sequential read, which also warms the page cache the memory map reads from next); every error names the shard file.
Caches written before the index held sizes and checksums stay readable, unverified, with a warning. A sample's stored
input_ids must equal the batch's, so a cache built from other data is refused instead of silently misaligned.
A full disk while flushing raises DiskFullError naming the shard and features.cache_dir; the index then still lists
only complete shards.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import warnings
from typing import Any, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from drafters.base import FeatureRequest
from drafters.files import disk_full_reported, write_atomic, write_json_atomic
from train.data.dataset import collate
from train.features.placement import release_gathered

CACHE_FORMAT = 2  # 2: records named as the engine serves them (hidden.{id}, final_hidden, top_k.values / .ids)
DEFAULT_SHARD_BYTES = 256 << 20
_REBUILD = "delete this split's cache directory (or choose a new features.cache_dir) and rerun draftsmith prepare"


class FeatureCache:
    """The offline feature cache of one split. Readers see every rank's shards; a writer appends to its own."""

    def __init__(self, directory: str, meta: dict[str, Any], *, rank: int = 0, shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.directory = directory
        self.rank = rank
        self.shard_bytes = shard_bytes
        self.dtype = getattr(torch, meta["dtype"])
        os.makedirs(directory, exist_ok=True)
        self.meta = self._check_meta({"format": CACHE_FORMAT, **meta})
        self.location: dict[int, str] = {}  # sample index -> shard file name
        self.checksums: dict[str, dict[str, Any]] = {}  # shard file name -> its index entry (sha256, bytes)
        self.own_shards: list[dict[str, Any]] = []
        self.buffer: dict[int, dict[str, torch.Tensor]] = {}
        self.buffer_bytes = 0
        self.handles: dict[str, Any] = {}
        self.warned_unverified = False
        self.refresh()

    def _check_meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Write meta.json, or check that an existing one describes the same target, layers and dtype."""
        path = os.path.join(self.directory, "meta.json")
        if not os.path.exists(path):
            write_json_atomic(path, meta)
        with open(path) as f:
            stored = json.load(f)
        if stored.get("format") != CACHE_FORMAT:
            raise ValueError(f"feature cache {self.directory} was written by another draftsmith version (format "
                             f"{stored.get('format')!r}, this one reads {CACHE_FORMAT}); rebuild it: delete the "
                             "directory (or choose a new features.cache_dir) and rerun `draftsmith prepare RECIPE`")
        for key in ("target", "hidden_size", "num_layers", "dtype", "num_samples", "top_k_logits"):
            if stored.get(key) != meta.get(key):
                raise ValueError(f"feature cache {self.directory}: {key} is {stored.get(key)!r} but this run needs "
                                 f"{meta.get(key)!r}; point features.cache_dir elsewhere or delete the cache")
        missing = sorted(set(meta["layer_ids"]) - set(stored["layer_ids"]))
        if missing:
            raise ValueError(f"feature cache {self.directory}: layer ids {missing} were not stored "
                             f"(it has {stored['layer_ids']}); rerun draftsmith prepare into a new features.cache_dir")
        return stored

    def refresh(self) -> None:
        """Re-read every rank's index (after other ranks flushed)."""
        for path in sorted(glob.glob(os.path.join(self.directory, "index-rank*.json"))):
            try:
                with open(path) as f:
                    shards = json.load(f)["shards"]
            except (json.JSONDecodeError, KeyError) as err:
                raise ValueError(f"feature cache index {path} is unreadable ({err}); delete it and the shards it "
                                 "listed, then rerun draftsmith prepare (it recomputes only what is missing)") from None
            if os.path.basename(path) == f"index-rank{self.rank}.json":
                self.own_shards = shards
            for shard in shards:
                self.checksums[shard["file"]] = shard
                self.location.update({index: shard["file"] for index in shard["samples"]})

    def __contains__(self, index: int) -> bool:
        return index in self.location or index in self.buffer

    def __len__(self) -> int:
        return len(self.location) + len(self.buffer)

    def add(self, index: int, input_ids: torch.Tensor, hidden: dict[int, torch.Tensor], last_hidden: torch.Tensor,
            argmax: torch.Tensor, top_k: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Buffer one sample (input_ids [T], hidden {id: [T, D]}, last_hidden [T, D], argmax [T], and top_k
        (values, ids) [T, k] when the cache stores them); flush when full."""
        record = {"input_ids": input_ids.to("cpu", torch.int32), "argmax": argmax.to("cpu", torch.int32),
                  "final_hidden": last_hidden.to("cpu", self.dtype)}
        if self.meta.get("top_k_logits"):
            record.update({"top_k.values": top_k[0].to("cpu", self.dtype), "top_k.ids": top_k[1].to("cpu", torch.int32)})
        record.update({f"hidden.{layer_id}": hidden[layer_id].to("cpu", self.dtype)
                       for layer_id in self.meta["layer_ids"]})
        self.buffer[index] = {key: value.contiguous() for key, value in record.items()}
        self.buffer_bytes += sum(t.numel() * t.element_size() for t in record.values())
        if self.buffer_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the buffered samples as one shard of this rank and publish it in this rank's index."""
        if not self.buffer:
            return
        name = f"rank{self.rank}-{len(self.own_shards):05d}.safetensors"
        tensors = {f"s{index}.{key}": t for index, record in self.buffer.items() for key, t in record.items()}
        payload = safetensors_bytes(tensors)
        path = os.path.join(self.directory, name)
        shard = {"file": name, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
                 "samples": sorted(self.buffer)}
        with disk_full_reported(path, "choose another features.cache_dir"):
            write_atomic(path, payload)
            write_json_atomic(os.path.join(self.directory, f"index-rank{self.rank}.json"),
                              {"shards": self.own_shards + [shard]})
        self.own_shards = self.own_shards + [shard]
        self.checksums[name] = shard
        self.location.update({index: name for index in self.buffer})
        self.handles.pop(name, None)
        self.buffer, self.buffer_bytes = {}, 0

    def _open(self, name: str):
        """The shard's safetensors handle, verified (size, then sha256) the first time this process opens it."""
        if name not in self.handles:
            path = os.path.join(self.directory, name)
            self._verify(path, self.checksums[name])
            try:
                self.handles[name] = safe_open(path, framework="pt")
            except Exception as err:  # safetensors raises its own error types for a malformed header
                raise ValueError(f"feature cache shard {path} is not a readable safetensors file ({err}); "
                                 f"{_REBUILD}") from None
        return self.handles[name]

    def _verify(self, path: str, shard: dict[str, Any]) -> None:
        if not os.path.isfile(path):
            raise ValueError(f"feature cache shard {path} is missing but listed in its index; {_REBUILD}")
        size = os.path.getsize(path)
        if "bytes" in shard and size != shard["bytes"]:
            raise ValueError(f"feature cache shard {path} is truncated or overwritten: {size:,} bytes, the index says "
                             f"{shard['bytes']:,}; {_REBUILD}")
        if "sha256" not in shard:
            if not self.warned_unverified:
                warnings.warn(f"feature cache {self.directory} was written without shard checksums, so it is read "
                              "unverified; rerun draftsmith prepare into a new features.cache_dir to get them")
                self.warned_unverified = True
            return
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
        if digest.hexdigest() != shard["sha256"]:
            raise ValueError(f"feature cache shard {path} fails its sha256 check (corrupt or replaced); {_REBUILD}")

    def read(self, index: int) -> dict[str, torch.Tensor]:
        """One sample: input_ids [T], argmax [T], final_hidden [T, D], hidden.{id} [T, D] (the stored dtype), and
        top_k.values, top_k.ids [T, k] when stored."""
        if index in self.buffer:
            return self.buffer[index]
        if index not in self.location:
            raise ValueError(f"sample {index} is not in the feature cache {self.directory}; run "
                             "`draftsmith prepare RECIPE` first (or use features.mode=hybrid)")
        handle = self._open(self.location[index])
        keys = ["input_ids", "argmax", "final_hidden"] + [f"hidden.{layer_id}" for layer_id in self.meta["layer_ids"]]
        keys += ["top_k.values", "top_k.ids"] if self.meta.get("top_k_logits") else []
        return {key: handle.get_tensor(f"s{index}.{key}") for key in keys}


def cache_meta(target_info, request: FeatureRequest, dtype: torch.dtype, num_samples: int) -> dict[str, Any]:
    """What a cache records about the run that wrote it (checked by every reader)."""
    return {"target": os.path.basename(os.path.normpath(target_info.name_or_path)),
            "hidden_size": target_info.hidden_size, "num_layers": target_info.num_layers,
            "layer_ids": sorted(int(i) for i in request.layer_ids), "dtype": str(dtype).removeprefix("torch."),
            "num_samples": num_samples, "top_k_logits": int(request.top_k_logits)}


def training_request(request: FeatureRequest, mode: str = "online") -> FeatureRequest:
    """The part of a drafter's request that training serves in features.mode `mode`; ValueError for what it cannot.

    The target's KV cache (kv_layers, a KV-sharing assistant) is served online only: stored, it would be
    2 x layers x KV heads x head dim values per token (a Llama-3.1-8B layer: 2,048 bytes per token in bf16, i.e.
    gigabytes per layer for a 1M-token data set and terabytes for all layers), far more than the hidden states.
    """
    if request.kv_layers and mode != "online":
        raise ValueError(f"features.mode={mode}: the drafter reads the target's KV cache of layers "
                         f"{list(request.kv_layers)}, which is served online only (stored it would take gigabytes "
                         "per layer); set features.mode: online")
    return FeatureRequest(layer_ids=tuple(int(i) for i in request.layer_ids), top_k_logits=request.top_k_logits,
                          kv_layers=tuple(int(i) for i in request.kv_layers))


class FeatureProvider:
    """Fills a batch with target features. The drafter never learns which mode produced them.

    Args:
        mode: "online" | "offline" | "hybrid" (| "streamed": train/features/stream.py's subclass, which sets the cache
            of the shard it reads in `at_step`).
        target: the frozen TargetModel (used by online and hybrid).
        request: the drafter's `feature_request()`.
        cache: the split's FeatureCache (offline and hybrid), else None.
    """

    def __init__(self, mode: str, target, request: FeatureRequest, cache: FeatureCache | None = None):
        if mode in ("offline", "hybrid") and cache is None:
            raise ValueError(f"features.mode={mode} needs features.cache_dir")
        self.mode, self.target, self.cache = mode, target, cache
        self.request = training_request(request, mode)
        self.layer_ids = self.request.layer_ids

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """batch: input_ids, attention_mask [B, T] (right padding), sample_index [B]. Returns the feature keys."""
        indices = [int(i) for i in batch["sample_index"]]
        if self.mode == "offline" or (self.mode == "hybrid" and all(i in self.cache for i in indices)):
            return self.from_cache(batch, indices)
        features = self.online(batch)
        if self.mode == "hybrid":
            store_rows(self.cache, batch, features, [row for row, i in enumerate(indices) if i not in self.cache])
        return features

    def online(self, batch: dict[str, Any]) -> dict[str, Any]:
        """One no-grad target forward on the batch (on the target's device). Padding positions are zeroed, as the
        cache pads them, so a drafter sees identical batches in every mode."""
        device = self.target.device
        mask = batch["attention_mask"].to(device)
        top_k = self.request.top_k_logits
        out = self.target.features(batch["input_ids"].to(device), mask, self.layer_ids, return_logits=top_k > 0,
                                   kv_layers=self.request.kv_layers)
        release_gathered(self.target)
        keep = mask.unsqueeze(-1).float()  # [B, T, 1]
        features = {"hidden": {i: out.hidden[i].float() * keep for i in self.layer_ids},
                    "final_hidden": out.final_hidden.float() * keep, "target_argmax": out.argmax.long() * mask}
        if self.request.kv_layers:  # {layer: (keys, values) [B, H_kv, T, d]}, padding slots zeroed
            slot = keep.unsqueeze(1)  # [B, 1, T, 1]
            features["target_kv"] = {i: (k.float() * slot, v.float() * slot) for i, (k, v) in out.kv.items()}
        if top_k:
            values, ids = out.logits.float().topk(top_k, dim=-1)
            features["top_k"] = (values * keep, ids * mask.unsqueeze(-1))
        return features

    def from_cache(self, batch: dict[str, Any], indices: list[int]) -> dict[str, Any]:
        """Read each row from the cache and right-pad to the batch length with zeros."""
        input_ids = batch["input_ids"]
        batch_size, length = input_ids.shape
        hidden_size = self.cache.meta["hidden_size"]
        hidden = {i: torch.zeros(batch_size, length, hidden_size) for i in self.layer_ids}  # [B, T, D]
        last_hidden = torch.zeros(batch_size, length, hidden_size)  # [B, T, D]
        argmax = torch.zeros(batch_size, length, dtype=torch.long)  # [B, T]
        top_k = self.request.top_k_logits
        top_values = torch.zeros(batch_size, length, top_k)  # [B, T, k]
        top_ids = torch.zeros(batch_size, length, top_k, dtype=torch.long)
        for row, index in enumerate(indices):
            record = self.cache.read(index)
            size = record["input_ids"].shape[0]
            if not torch.equal(record["input_ids"].long(), input_ids[row, :size].cpu()) or (
                    size < length and bool(batch["attention_mask"][row, size])):
                raise ValueError(f"feature cache {self.cache.directory}: sample {index} holds other tokens than the "
                                 "dataset gives now (the data changed); rerun draftsmith prepare into a new cache_dir")
            for i in self.layer_ids:
                hidden[i][row, :size] = record[f"hidden.{i}"].float()
            last_hidden[row, :size] = record["final_hidden"].float()
            argmax[row, :size] = record["argmax"].long()
            if top_k:
                top_values[row, :size] = record["top_k.values"][:, :top_k].float()
                top_ids[row, :size] = record["top_k.ids"][:, :top_k].long()
        device = input_ids.device
        features = {"hidden": {i: h.to(device) for i, h in hidden.items()},
                    "final_hidden": last_hidden.to(device), "target_argmax": argmax.to(device)}
        if top_k:
            features["top_k"] = (top_values.to(device), top_ids.to(device))
        return features

    def at_step(self, step: int) -> None:
        """The trainer is about to run optimizer step `step` (the streamed provider waits for its shard)."""

    def close(self) -> None:
        """The run's last step is done (the streamed provider deletes what is left and releases the producers)."""

    def flush(self) -> None:
        if self.cache is not None and self.mode == "hybrid":
            self.cache.flush()

    def refresh(self) -> None:
        if self.cache is not None:
            self.cache.refresh()


def store_rows(cache: FeatureCache, batch: dict[str, Any], features: dict[str, Any], rows: Iterable[int]) -> None:
    """Add batch rows `rows` to the cache, each cut to its real length (right padding)."""
    for row in rows:
        length = int(batch["attention_mask"][row].sum())
        top_k = None
        if "top_k" in features:
            top_k = tuple(part[row, :length] for part in features["top_k"])
        cache.add(int(batch["sample_index"][row]), batch["input_ids"][row, :length],
                  {i: h[row, :length] for i, h in features["hidden"].items()},
                  features["final_hidden"][row, :length], features["target_argmax"][row, :length], top_k)


def sample_lengths(dataset) -> list[int]:
    """Token count of every row, read column-wise in chunks (never the whole token column at once)."""
    lengths: list[int] = []
    for chunk in dataset.select_columns(["input_ids"]).iter(batch_size=4096):
        lengths.extend(len(ids) for ids in chunk["input_ids"])
    return lengths


def samples_to_write(dataset, cache: FeatureCache, rank: int, world_size: int,
                     indices: list[int] | None = None) -> list[int]:
    """What a feature writer still has to compute: this rank's share of `dataset` (index % world_size == rank) not
    in `cache`, longest first (a crash loses little, memory peaks early); or `indices` not in it, in their order."""
    if indices is not None:
        return [i for i in indices if i not in cache]
    lengths = sample_lengths(dataset)
    return sorted((i for i in range(rank, len(dataset), world_size) if i not in cache), key=lambda i: -lengths[i])


def make_batch(dataset, indices: list[int], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Collate dataset rows `indices`: input_ids, attention_mask, loss_mask [B, T] (right padding), sample_index [B]."""
    batch = collate([dataset[i] for i in indices], pad_token_id=pad_token_id)
    batch["sample_index"] = torch.tensor(indices, dtype=torch.long)
    return batch


def write_cache(target, dataset, cache: FeatureCache, *, batch_size: int, pad_token_id: int, rank: int = 0,
                world_size: int = 1, progress: bool = True, indices: list[int] | None = None) -> int:
    """Compute and store the features of this rank's share of `dataset` (index % world_size == rank), skipping samples
    already in the cache, longest first so a crash loses little and memory peaks early. Returns samples written.
    With `indices`, those samples in that order instead, batch_size at a time (a streamed shard: the trainer's
    micro-batches exactly)."""
    from tqdm.auto import tqdm

    todo = samples_to_write(dataset, cache, rank, world_size, indices)
    request = FeatureRequest(layer_ids=tuple(cache.meta["layer_ids"]), top_k_logits=cache.meta.get("top_k_logits", 0))
    provider = FeatureProvider("online", target, request)
    bar = tqdm(total=len(todo), desc=f"features rank {rank}", disable=not progress, unit="sample")
    for start in range(0, len(todo), batch_size):
        chunk = todo[start:start + batch_size]
        batch = make_batch(dataset, chunk, pad_token_id)
        store_rows(cache, batch, provider.online(batch), range(len(chunk)))
        bar.update(len(chunk))
    cache.flush()
    bar.close()
    return len(todo)
