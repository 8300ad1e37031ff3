"""Regenerated data that ships: a gzipped jsonl beside a manifest that says what it holds and lets it be checked.

`draftsmith prepare` regenerates into the plain working file (the path without `.gz`, resumable by id), seeded from
the shipped `.jsonl.gz` when only that exists, so a partial regeneration resumes without redoing a row; then it
packs the working file (`pack`): the gzip (deterministic bytes: no name, mtime 0), the manifest
(<stem>.manifest.json: source, generator and settings, counts, token-length histograms, sha256 of the jsonl, the
tokenizer's fingerprint, the held-out ids) and the held-out slice as a FastChat question file
(<stem>.heldout.jsonl, for `draftsmith eval --prompts` and benchmarks/training/heldout_tau.py).

Training reads the gzip directly; `check` refuses, in one line naming the file and what to do, a file that does not
match its manifest (cut off, edited) or was written by a target with another tokenizer, and `heldout_ids` are
never trained on (train/data/dataset.py drops them from the pool).

Quality: an empty answer ends its conversation (the next turn would not follow from it) and a conversation whose
first prompt exceeds regenerate.max_prompt_tokens holds no answer; both are counted, and the loader drops a record
with no answer. An answer that reached regenerate.max_new_tokens is the target's exact greedy prefix: it is kept and
counted, as the trainer's data.max_length cuts every longer sequence the same way.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
from bisect import bisect_right
from collections import Counter
from typing import Any

from inference.evaluation.chat_template import render_text
from train.data.chat import tokenizer_fingerprint

PACKED_SUFFIX = ".jsonl.gz"
HISTOGRAM_EDGES = (0, 32, 64, 128, 256, 512, 1024, 2048)


def is_packed(path: str) -> bool:
    return path.endswith(PACKED_SUFFIX)


def working_path(path: str) -> str:
    """Where regeneration appends: the plain jsonl beside a packed file (the path itself otherwise)."""
    return path[:-len(".gz")] if is_packed(path) else path


def sidecar(path: str, what: str) -> str:
    """<stem>.<what> beside a data file (stem: the name without .jsonl.gz / .jsonl)."""
    stem = path[:-len(PACKED_SUFFIX)] if is_packed(path) else path.removesuffix(".jsonl")
    return f"{stem}.{what}"


def read_lines(path: str) -> bytes:
    """The jsonl bytes of a data file, decompressed when packed."""
    opener = gzip.open if is_packed(path) else open
    with opener(path, "rb") as f:
        return f.read()


def packed_as_working(path: str) -> bool:
    """The shipped gzip holds exactly the working file's lines (nothing to repack)."""
    work = working_path(path)
    return os.path.exists(path) and os.path.exists(work) and read_lines(path) == read_lines(work)


def unpack_to_working(path: str) -> None:
    """Seed the working file from the shipped gzip (checked first) when the working file does not exist yet."""
    work = working_path(path)
    if is_packed(path) and os.path.exists(path) and not os.path.exists(work):
        check(path)
        with open(work + ".tmp", "wb") as f:
            f.write(read_lines(path))
        os.replace(work + ".tmp", work)


def histogram(values: list[int]) -> dict[str, int]:
    """Counts per bin [edge_i, edge_i+1), the last bin open-ended, keyed "lo-hi" / "lo+"."""
    counts = Counter(bisect_right(HISTOGRAM_EDGES, value) - 1 for value in values)
    names = [f"{lo}-{hi - 1}" for lo, hi in zip(HISTOGRAM_EDGES, HISTOGRAM_EDGES[1:])] + [f"{HISTOGRAM_EDGES[-1]}+"]
    return {name: counts.get(index, 0) for index, name in enumerate(names)}


def describe(records: list[dict[str, Any]], sources: dict[str, dict[str, Any]], tokenizer: Any, settings,
             template: str | None = None, template_kwargs: dict | None = None) -> dict[str, Any]:
    """The manifest's counts and token histograms of regenerated `records`, against the `sources` they answer
    (id -> source conversation): why each conversation stopped, answers at the cap, repeats."""
    answer_tokens, conversation_tokens, stops = [], [], Counter()
    firsts, answers = Counter(), Counter()
    for record in records:
        asked = [m["content"] for m in record["messages"] if m["role"] == "user"]
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        firsts[asked[0] if asked else None] += 1
        answers.update(replies)
        lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in replies]
        answer_tokens += lengths
        stops["answers_at_max_new_tokens"] += sum(n >= settings.max_new_tokens - 1 for n in lengths)
        if replies:
            conversation_tokens.append(len(tokenizer(render_text(tokenizer, record["messages"], template,
                                                                 template_kwargs=template_kwargs),
                                                     add_special_tokens=False)["input_ids"]))
        source_turns = [m["content"] for m in sources[record["id"]]["messages"] if m["role"] == "user"]
        if len(replies) == len(source_turns):
            stops["all_turns_answered"] += 1
            continue
        chat = record["messages"]  # [system], then user / assistant pairs, then an unanswered first turn if any
        last = max((i for i, m in enumerate(chat) if m["role"] == "assistant"), default=None)
        history = chat[:last + 1] if last is not None else [m for m in chat if m["role"] == "system"]
        next_prompt = history + [{"role": "user", "content": source_turns[len(replies)]}]
        prompt_length = len(tokenizer(render_text(tokenizer, next_prompt, template, add_generation_prompt=True,
                                                  template_kwargs=template_kwargs),
                                      add_special_tokens=False)["input_ids"])
        reason = "prompt_over_max_prompt_tokens" if prompt_length > settings.max_prompt_tokens else "empty_answer"
        stops[("unanswered_" if not replies else "stopped_") + reason] += 1
    return {
        "conversations": len(records),
        "answered": sum(1 for r in records if any(m["role"] == "assistant" for m in r["messages"])),
        "multi_turn": sum(1 for r in records if sum(m["role"] == "assistant" for m in r["messages"]) > 1),
        "assistant_turns": len(answer_tokens),
        "answer_tokens": sum(answer_tokens),
        "conversation_tokens": sum(conversation_tokens),
        "stops": dict(sorted(stops.items())),
        "repeated_first_turns": sum(n - 1 for n in firsts.values() if n > 1),
        "repeated_answers": sum(n - 1 for n in answers.values() if n > 1),
        "histograms": {"answer_tokens": histogram(answer_tokens),
                       "conversation_tokens": histogram(conversation_tokens)},
    }


def pack(path: str, records_meta: dict[str, Any], tokenizer: Any, counts: dict[str, Any], heldout_size: int) -> dict:
    """Write the gzip of the working file, its held-out question file and its manifest; returns the manifest."""
    data = read_lines(working_path(path))
    records = [json.loads(line) for line in data.splitlines() if line.strip()]
    answered = [r for r in records if any(m["role"] == "assistant" for m in r["messages"])]
    heldout = answered[:heldout_size]  # the first answered in regeneration order: there as soon as they are done
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as f:
        f.write(data)
    _write_atomic(path, buffer.getvalue())
    questions = "".join(json.dumps({"question_id": r["id"], "category": "sharegpt_heldout",
                                    "turns": [m["content"] for m in r["messages"] if m["role"] == "user"]},
                                   ensure_ascii=False) + "\n" for r in heldout)
    _write_atomic(sidecar(path, "heldout.jsonl"), questions.encode())
    manifest = {**records_meta, "file": os.path.basename(path), "records": len(records),
                "sha256": hashlib.sha256(data).hexdigest(), "tokenizer": tokenizer_fingerprint(tokenizer),
                "counts": counts, "heldout": {"size": len(heldout), "questions": os.path.basename(
                    sidecar(path, "heldout.jsonl")), "ids": [r["id"] for r in heldout]}}
    _write_atomic(sidecar(path, "manifest.json"), (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode())
    return manifest


def _write_atomic(path: str, payload: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(payload)
    os.replace(path + ".tmp", path)


def manifest_of(path: str) -> dict[str, Any] | None:
    """The manifest beside a data file, or None when it has none (a plain jsonl of one's own)."""
    where = sidecar(path, "manifest.json")
    if not os.path.exists(where):
        return None
    with open(where, encoding="utf-8") as f:
        return json.load(f)


def check(path: str, tokenizer: Any | None = None) -> dict[str, Any] | None:
    """The manifest of `path` after checking the file against it (sha256, records) and, given a tokenizer, that the
    target's tokenizer is the one that wrote it; a ValueError naming the file and what to do otherwise."""
    manifest = manifest_of(path)
    if manifest is None:
        return None
    data = read_lines(path) if os.path.exists(path) else b""
    records = sum(1 for line in data.splitlines() if line.strip())
    if hashlib.sha256(data).hexdigest() != manifest["sha256"] or records != manifest["records"]:
        raise ValueError(f"{path} does not match its manifest {os.path.basename(sidecar(path, 'manifest.json'))} "
                         f"({records} records, the manifest says {manifest['records']}; sha256 differs): it was cut "
                         "off or edited; restore it (git checkout) or regenerate it with draftsmith prepare RECIPE")
    if tokenizer is not None and tokenizer_fingerprint(tokenizer) != manifest["tokenizer"]:
        writer = manifest.get("generator", {}).get("target", "?")
        raise ValueError(f"{path} was regenerated by a target with another tokenizer ({writer}); point "
                         "data.regenerated_path at data of this target, or regenerate it with draftsmith prepare RECIPE")
    return manifest


def heldout_ids(path: str) -> set[str]:
    """Conversation ids the manifest holds out (never trained on); empty without a manifest."""
    manifest = manifest_of(path)
    return set(manifest["heldout"]["ids"]) if manifest else set()
