"""The assistant-only loss mask of a conversation rendered with the chat template.

`tokenize_conversation` renders a conversation with the target tokenizer's chat template and marks which tokens the
drafter is trained on: the content of every assistant turn plus the special token that closes it (<|im_end|>,
<|eot_id|>, ...). Everything the template writes by itself is masked out: system prompts (also a default one the
template injects), user turns, role headers such as "<|im_start|>assistant\\n", and injected text such as Qwen3's
empty "<think>\\n\\n</think>\\n\\n".

How the spans are found: the conversation is rendered a second time with every message content replaced by a unique
placeholder (both renderings through inference/evaluation/chat_template.render_text, with the recipe's template
options). The text between placeholders is what the template adds around each message (the "glue"); the glue is
then located in the real rendering in order, so a message's content is exactly the text between its own glue and the
next, however short or repetitive it is. Tokens are assigned to spans by the tokenizer's character offsets, so the
mask is right whatever the tokenizer merges.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal, Mapping

from inference.evaluation.chat_template import render_text

Truncation = Literal["truncate", "drop"]
_PLACEHOLDER = "\ue000{}\ue001"  # private-use code points: never in real text, passed through unchanged by jinja
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")


def assistant_spans(tokenizer: Any, messages: list[dict[str, str]], text: str, chat_template: str | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[tuple[int, int]]:
    """Character spans of `text` (the rendering of `messages`) that carry the loss.

    Returns:
        [(start, end)] one span per assistant turn: its content as rendered plus the special end-of-turn token
        that directly follows it, if any.
    """
    placeholders = [dict(message, content=_PLACEHOLDER.format(i)) for i, message in enumerate(messages)]
    skeleton = render_text(tokenizer, placeholders, chat_template, template_kwargs=template_kwargs)
    found = [(int(m.group(1)), m.start(), m.end()) for m in _PLACEHOLDER_RE.finditer(skeleton)]
    if [index for index, _, _ in found] != list(range(len(messages))):
        raise ValueError("the chat template drops, repeats or reorders message contents; cannot locate assistant "
                         "turns (set data.chat_template to a template that writes each message once, in order)")
    ends = [0] + [end for _, _, end in found]
    glues = [skeleton[ends[i]:start] for i, (_, start, _) in enumerate(found)] + [skeleton[ends[-1]:]]
    end_tokens = _special_tokens(tokenizer)
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        start = _find(text, glues[index], cursor) + len(glues[index])
        if not glues[index + 1] and index + 1 < len(messages):
            raise ValueError("the chat template writes two messages with nothing between them; cannot tell where "
                             "one ends (set data.chat_template)")
        end = start + len(message["content"])
        if text[start:end] != message["content"] or not text.startswith(glues[index + 1], end):
            # The template changed the content (trim, ...): its end is where the next glue starts.
            end = _find(text, glues[index + 1], start) if glues[index + 1] else len(text)
        cursor = end
        if message["role"] != "assistant":
            continue
        closing = next((token for token in end_tokens if text.startswith(token, end)), "")
        spans.append((start, end + len(closing)))
    return spans


def _find(text: str, glue: str, start: int) -> int:
    position = text.find(glue, start)
    if position < 0:
        raise ValueError("the chat template writes text that depends on message contents in a way that hides the "
                         f"turn boundaries (could not find {glue[:40]!r}); set data.chat_template")
    return position


def _special_tokens(tokenizer: Any) -> list[str]:
    """Special (added) token strings, longest first so that a prefix never shadows a longer token."""
    tokens = {token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values() if token.special}
    tokens |= set(getattr(tokenizer, "all_special_tokens", []))
    return sorted((t for t in tokens if t), key=len, reverse=True)


def mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span, else 0; both lists sorted by position (one sweep).

    Offsets are widened back to the previous token's end first: tokenizers that trim offsets report a whitespace
    token as zero-width ("\n\n" -> (30, 30)) and SentencePiece leaves out the space a "▁word" token stands for.
    """
    mask, span_index, previous_end = [], 0, 0
    for start, end in offsets:
        start, previous_end = min(start, previous_end), max(previous_end, end)
        while span_index < len(spans) and spans[span_index][1] <= start:
            span_index += 1
        inside = span_index < len(spans) and end > start and spans[span_index][0] < end
        mask.append(int(inside))
    return mask


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, str]], max_length: int,
                          chat_template: str | None = None, truncation: Truncation = "truncate",
                          template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Token ids and the assistant-only loss mask of one conversation.

    Args:
        tokenizer: a fast HF tokenizer (character offsets are needed) with a chat template, or `chat_template`.
        messages: [{"role": "system"|"user"|"assistant", "content": str}].
        max_length: the longest sequence kept, in tokens.
        chat_template: jinja template overriding the tokenizer's own.
        truncation: "truncate" keeps the first `max_length` tokens; "drop" returns None for a longer conversation.
        template_kwargs: template options (enable_thinking, ...), passed to both renderings.
    Returns:
        {"input_ids": [T] ints, "loss_mask": [T] ints in {0, 1}, "truncated": bool}, or None when dropped.
        A conversation without an assistant turn gets an all-zero loss mask.
    """
    if truncation not in ("truncate", "drop"):
        raise ValueError(f"truncation must be 'truncate' or 'drop', got {truncation!r}")
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    text = render_text(tokenizer, messages, chat_template, template_kwargs=template_kwargs)
    spans = assistant_spans(tokenizer, messages, text, chat_template, template_kwargs)
    try:
        # One token past max_length is enough to know that the conversation is too long (if the tokenizer
        # truncates on the right, which is what we keep).
        limit = {"truncation": True, "max_length": max_length + 1} if tokenizer.truncation_side == "right" else {}
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, **limit)
    except NotImplementedError:
        raise ValueError("the loss mask needs a fast tokenizer (character offsets); "
                         f"{type(tokenizer).__name__} has none") from None
    input_ids = list(encoding["input_ids"])
    loss_mask = mask_from_spans(encoding["offset_mapping"], spans)
    truncated = len(input_ids) > max_length
    if truncated and truncation == "drop":
        return None
    return {"input_ids": input_ids[:max_length], "loss_mask": loss_mask[:max_length], "truncated": truncated}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A stable hash of everything in a tokenizer that changes token ids (its full serialised state)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(state.encode()).hexdigest()[:32]
