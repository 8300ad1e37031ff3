"""Shared fixtures: tiny seeded random targets (hidden 64, 2 layers, vocab 256), offline and single-threaded."""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM)

torch.set_num_threads(1)

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0,
)
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 64}),
    # MLA and routed experts after a dense first layer
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, {
        "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 16, "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1}),
}


def make_tiny_model(arch: str = "llama", seed: int = 0, num_layers: int = 2, dtype=torch.float64):
    """A seeded random causal LM. float64 by default so that a k-token verify forward and k one-token forwards pick
    the same argmax (fp32 near-ties would make exact-match tests flaky without saying anything about the engine)."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, "num_hidden_layers": num_layers, **extra})
    config._experts_implementation = "eager"  # MoE: transformers' per-expert loop, which float64 runs
    model = model_cls(config).to(dtype).eval()
    # Sharper logits than the default init so that random models produce repetitive, partly predictable text.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(params=["llama"])
def tiny_target(request):
    from inference.engine.target import TargetModel

    return TargetModel(make_tiny_model(request.param), name_or_path=f"tiny-{request.param}")


def edit_config(directory, change) -> None:
    """Apply `change` (a function of the dict) to directory/config.json in place."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    change(config)
    with open(path, "w") as f:
        json.dump(config, f)


def served_target(directory, model_cls, config, **config_json) -> str:
    """A tiny random model saved for a server to load (tests/test_serve_check.py, tests/test_vllm_features.py): the
    debug target's byte tokenizer (vocabulary 260), weights seeded, a sharpened head, and `config_json` written into
    config.json over what save_pretrained writes there."""
    from inference.assets.store import resolve_target

    source = resolve_target("debug:tiny-llama")
    os.makedirs(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(os.path.join(source, name), directory)
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(directory)
    edit_config(directory, lambda saved: saved.update(config_json))
    return str(directory)


def random_prompts(num: int, seed: int = 0, min_len: int = 3, max_len: int = 12, vocab: int = 256):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def joint_counts(token_rows, vocab: int) -> torch.Tensor:
    """Counts [vocab ** 3] (float64) of the first three tokens of each row, indexed t0 * V^2 + t1 * V + t2: the
    empirical joint law that the sampling-law tests compare with the target's exact one."""
    counts = torch.zeros(vocab ** 3, dtype=torch.float64)
    for tokens in token_rows:
        counts[tokens[0] * vocab * vocab + tokens[1] * vocab + tokens[2]] += 1
    return counts


@pytest.fixture(scope="session", autouse=True)
def session_kernel_cache(tmp_path_factory):
    """The default kernel-timing directory (what a command's CpuBackend() reads and writes) is this session's own:
    a test that runs a command never touches the user's ~/.cache/draftsmith/kernels."""
    from inference.engine.cpu import kernels

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "CACHE_DIR", str(tmp_path_factory.mktemp("default_kernels")))
        yield


@pytest.fixture(scope="session")
def cpu_backend(tmp_path_factory):
    """The CPU backend (inference/engine/cpu/) with its kernel timings kept in this session's own directory: a test
    never reads or writes the user's cache, so what it runs does not depend on an earlier run."""
    from inference.engine.cpu import CpuBackend

    return CpuBackend(cache_dir=str(tmp_path_factory.mktemp("kernels")))
