"""Tokenizers built offline for tests: a small byte-level BPE with three hand-written chat templates.

The BPE is trained on a few sentences so that tokens span several characters (as real ones do) and every string
round-trips through encode/decode. Special tokens cover ChatML, Llama-3 and Qwen3 markers; <think> / </think> are
added as non-special tokens, as in Qwen3.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]
THINK_TOKENS = ["<think>", "</think>"]

# SmolLM2-135M-Instruct's template: ChatML with a default system prompt when the conversation has none.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Llama-3.1 style: BOS, role headers, trimmed contents, <|eot_id|>, and an injected date block in the system turn.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\n' + system"
    " + '<|eot_id|>' }}"
    "{% for message in rest %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# Qwen3 style: ChatML, and an empty think block injected into assistant turns after the last user turn and into
# the generation prompt when thinking is off.
QWEN3_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% if loop.index0 > ns.last_user %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}")

TEMPLATES = {"chatml": CHATML_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "qwen3": QWEN3_TEMPLATE}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "qwen3": "<|im_end|>"}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Hello! How can I help you today?",
    "You are a helpful assistant.", "What is the capital of France? Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n", "Sure, here is a short answer: 42.", "user assistant system",
]


def build_tokenizer(template: str | None = "chatml", vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A fast byte-level BPE tokenizer, len() about `vocab_size` + 9, with the named template (None = none)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIAL_TOKENS, show_progress=False)
    backend.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                        eos_token="<|im_end|>" if template != "llama3" else "<|eot_id|>",
                                        pad_token="<|endoftext|>")
    tokenizer.add_tokens(THINK_TOKENS)
    tokenizer.chat_template = TEMPLATES[template] if template else None
    return tokenizer
