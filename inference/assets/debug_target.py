"""Tiny random targets built on the fly for debug recipes and tests: `target.name_or_path: debug:tiny-llama`.

The builder writes an ordinary Hugging Face model directory (config.json, model.safetensors, a byte-level tokenizer
with a ChatML chat template, generation_config.json) into the draftsmith cache, so everything downstream treats it
as any other target directory. Weights are seeded, so the same name always gives the same model; the directory is
written under a temporary name and renamed into place, so concurrent processes (DDP ranks) never see half of it.
"""

from __future__ import annotations

import os

import torch

from drafters.files import replace_directory
from inference.assets import default_cache_dir

DEBUG_PREFIX = "debug:"
DEBUG_TARGET_VERSION = "v2"  # part of the cache directory name: bump when the built model changes
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ids 256..259. <|mask|> is reserved and never produced by text or the chat template, like the <|MASK|> row that
# DFlash checkpoints use as their mask token.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
DEBUG_TARGETS = {
    "tiny-llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=2048, seed=0, logit_scale=8.0),
}


def is_debug_target(name_or_path: str) -> bool:
    return name_or_path.startswith(DEBUG_PREFIX)


def build_tokenizer():
    """A byte-level tokenizer (one token per byte, no merges) plus ChatML special tokens and <|mask|>; 260 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def write_debug_target(name: str, directory: str) -> None:
    """Write the debug target `name` (without the "debug:" prefix) as an HF model directory."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if name not in DEBUG_TARGETS:
        raise ValueError(f"unknown debug target {DEBUG_PREFIX}{name}; choose one of "
                         f"{[DEBUG_PREFIX + known for known in DEBUG_TARGETS]}")
    spec = dict(DEBUG_TARGETS[name])
    seed, logit_scale = spec.pop("seed"), spec.pop("logit_scale")
    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **spec)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    torch.random.set_rng_state(generator_state)
    with torch.no_grad():  # sharper logits than the default init: random targets then write repetitive, learnable text
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(directory)
    generation = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    generation.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _built(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "model.safetensors"))


def resolve_debug_target(name_or_path: str, cache_dir: str | None = None) -> str:
    """"debug:NAME" -> the directory of that tiny target in the cache (built on first use).

    Args:
        name_or_path: "debug:tiny-llama".
        cache_dir: cache root; None means $DRAFTSMITH_CACHE or ~/.cache/draftsmith.
    Returns:
        <cache>/models/debug-NAME-VERSION, an ordinary HF model directory.
    """
    if not is_debug_target(name_or_path):
        raise ValueError(f"{name_or_path!r} is not a debug target name (debug:NAME)")
    name = name_or_path[len(DEBUG_PREFIX):]
    root = cache_dir or default_cache_dir()
    final_dir = os.path.join(root, "models", f"debug-{name}-{DEBUG_TARGET_VERSION}")
    if _built(final_dir):
        return final_dir
    with replace_directory(final_dir, keep=_built) as tmp_dir:  # another process's copy is identical: kept
        write_debug_target(name, tmp_dir)
    return final_dir
