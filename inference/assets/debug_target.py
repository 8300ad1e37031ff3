"""Tiny random targets built on the fly for debug recipes and tests: `target.name_or_path: debug:tiny-llama`.

The builder writes an ordinary Hugging Face model directory (config.json, model.safetensors, a byte-level tokenizer
with a ChatML chat template, generation_config.json) into the draftsmith cache, so everything downstream treats it
as any other target directory. Weights are seeded, so the same name always gives the same model; the directory is
written under a temporary name and renamed into place, so concurrent processes (DDP ranks) never see half of it.

One target per family the study's models belong to, each built from transformers' own config and model classes
(hidden 64, 3-7 layers, the 260-token vocabulary): Llama; Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (hybrids: gated-DeltaNet
layers with a conv and a recurrent state, and gated full attention); Gemma 4 (sliding window 16 beside global
layers, so any test sequence outgrows the window); gpt-oss (attention sinks, alternating windows, MoE); DeepSeek-V3
(MLA and MoE); and beyond the study DeepSeek-V3.2 / GLM-5 (DSA), MiniMax-M3, the Mamba hybrids Nemotron-H,
Granite 4.0-H, Jamba, Falcon-H1 and Zamba2, Kimi Linear, LFM2's short convolutions and Llama 4's chunked attention.
The Qwen ones also carry one randomly initialised native MTP module in their checkpoint, in the names vLLM's
Qwen3-Next / Qwen3.5 MTP loaders read (`mtp.fc`, `mtp.pre_fc_norm_{embedding,hidden}`, `mtp.layers.0.*` = a
full-attention decoder layer of the family, `mtp.norm`; config `mtp_num_hidden_layers: 1`), so `--drafter native-mtp`
runs on them.
"""

from __future__ import annotations

import os
import shutil

import torch

from drafters.files import replace_directory
from inference.assets import default_cache_dir

DEBUG_PREFIX = "debug:"
DEBUG_TARGET_VERSION = "v3"  # part of the cache directory name: bump when the built model changes
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ids 256..259. <|mask|> is reserved and never produced by text or the chat template, like the <|MASK|> row that
# DFlash checkpoints use as their mask token.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
_ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_conv_kernel_dim=4, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# name -> model_type, config fields, seed, logit scale, whether a native MTP module ships in the checkpoint.
DEBUG_TARGETS = {
    "tiny-llama": dict(model_type="llama", seed=0, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, intermediate_size=128, num_hidden_layers=4)),
    "tiny-qwen3-next": dict(model_type="qwen3_next", seed=1, logit_scale=8.0, mtp=True, config=dict(
        _ATTENTION, **_LINEAR, **_QWEN_MOE, intermediate_size=128, num_hidden_layers=4)),
    "tiny-qwen3.5": dict(model_type="qwen3_5_text", seed=2, logit_scale=8.0, mtp=True, config=dict(
        _ATTENTION, **_LINEAR, intermediate_size=128, num_hidden_layers=4)),
    "tiny-qwen3.5-moe": dict(model_type="qwen3_5_moe_text", seed=3, logit_scale=8.0, mtp=True, config=dict(
        _ATTENTION, **_LINEAR, **_QWEN_MOE, num_hidden_layers=4)),
    "tiny-gemma4": dict(model_type="gemma4_text", seed=4, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, intermediate_size=128, num_hidden_layers=4, head_dim=16, global_head_dim=32, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=30.0)),
    # gemma-4-26B-A4B's shape: a dense MLP beside a routed MoE block in every layer, and global layers whose values
    # are their keys (attention_k_eq_v: no v_proj) with fewer KV heads of a wider head dim.
    "tiny-gemma4-moe": dict(model_type="gemma4_text", seed=7, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, intermediate_size=64, num_hidden_layers=4, head_dim=16, global_head_dim=32, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=30.0,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32, attention_k_eq_v=True,
        num_global_key_value_heads=1)),
    # gemma-4-E2B / E4B's shape: per-layer inputs (a second embedding table feeding every layer) and a tail of layers
    # that reuse the K/V of the last layer of their type before it (num_kv_shared_layers), so they cache nothing.
    "tiny-gemma4-e": dict(model_type="gemma4_text", seed=8, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, intermediate_size=128, num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=260, num_kv_shared_layers=2, final_logit_softcapping=30.0)),
    "tiny-gpt-oss": dict(model_type="gpt_oss", seed=5, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, intermediate_size=64, num_hidden_layers=4, head_dim=16, sliding_window=16, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=131072)),  # = its YaRN factor x original length, as gpt-oss ships
    # the routing keys the releases' config.json states (transformers routes so regardless and writes neither; vLLM
    # reads their absence as softmax routing: train/serve_check.routing)
    "tiny-deepseek-v3": dict(model_type="deepseek_v3", seed=6, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, num_key_value_heads=4, intermediate_size=128, num_hidden_layers=3, moe_intermediate_size=32,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, scoring_func="sigmoid", topk_method="noaux_tc")),
    # DeepSeek-V3.2's and GLM-5's sparse attention (DSA): MLA whose indexer (16 heads, so scores rarely tie at zero)
    # keeps the top 8 keys per query by score, under the attention mask
    **{name: dict(model_type=kind, seed=seed, logit_scale=8.0, mtp=False, pad_row=True, config=dict(
        _ATTENTION, num_key_value_heads=4, intermediate_size=128, num_hidden_layers=3, moe_intermediate_size=32,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, index_n_heads=16, index_head_dim=16, index_topk=8, scoring_func="sigmoid",
        topk_method="noaux_tc"))
       for name, kind, seed in (("tiny-deepseek-v3.2", "deepseek_v32", 10), ("tiny-glm-5", "glm_moe_dsa", 11))},
    # Nemotron-H's shape (Nemotron 3 Nano / Super): one mixer per block, Mamba-2 (a conv and an SSM state), routed
    # MoE, attention without RoPE or a dense MLP
    "tiny-nemotron-h": dict(model_type="nemotron_h", seed=12, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, head_dim=16, intermediate_size=128, num_hidden_layers=7, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1,
        layer_types=["linear_attention", "moe", "full_attention", "linear_attention", "mlp", "full_attention",
                     "linear_attention"])),
    # Granite 4.0-H's shape: Mamba-2 layers and attention layers (no RoPE), each with a routed MoE and a shared MLP
    "tiny-granite-4": dict(model_type="granitemoehybrid", seed=13, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, intermediate_size=32, num_hidden_layers=4, layer_types=["mamba", "attention"] * 2,
        mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64)),
    # Jamba's shape: Mamba-1 layers (a conv state and a per-channel SSM state) beside attention, MoE every other layer
    "tiny-jamba": dict(model_type="jamba", seed=14, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, intermediate_size=128, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2)),
    # Falcon-H1's shape: every layer runs attention and a Mamba-2 mixer side by side (`hybrid`: K/V and two states)
    "tiny-falcon-h1": dict(model_type="falcon_h1", seed=15, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, intermediate_size=128, num_hidden_layers=4, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=8)),
    # Zamba2's shape: Mamba-2 layers, and hybrid ones where a shared attention block feeds the layer's Mamba-2
    "tiny-zamba2": dict(model_type="zamba2", seed=16, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, intermediate_size=128, num_hidden_layers=4, mamba_d_state=16, mamba_headdim=16, n_mamba_heads=8,
        mamba_ngroups=1, chunk_size=8, num_mem_blocks=1,
        layers_block_type=["mamba", "hybrid", "mamba", "mamba"])),
    # LFM2's shape: gated short convolutions (a conv state alone) beside attention
    "tiny-lfm2": dict(model_type="lfm2", seed=17, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, intermediate_size=128, num_hidden_layers=4, conv_L_cache=3, block_ff_dim=128,
        block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention"] * 2)),
    # Llama 4's shape: chunked attention (chunks of 8 positions: every test sequence crosses them) with RoPE, full
    # attention without it (NoPE) every other layer, whose query temperature steps every floor_scale tokens of the
    # cache (decoded one row at a time), MoE every other layer; and the same with the temperature tuning off
    **{name: dict(model_type="llama4_text", seed=18, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, head_dim=16, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4,
        num_local_experts=2, num_experts_per_tok=1, attention_chunk_size=8, no_rope_layer_interval=2,
        interleave_moe_layer_step=2, floor_scale=4, attn_temperature_tuning=tuned))
       for name, tuned in (("tiny-llama4", True), ("tiny-llama4-chunked", False))},
    # Kimi Linear's shape: Kimi delta attention (a conv state over q, k, v and a recurrent one) beside MLA, dense then
    # routed MoE MLPs
    "tiny-kimi-linear": dict(model_type="kimi_linear", seed=19, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, num_key_value_heads=4, intermediate_size=128, num_hidden_layers=4, moe_intermediate_size=32,
        kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, num_experts_per_tok=2,
        num_local_experts=4, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"] * 2, mlp_layer_types=["dense"] + ["sparse"] * 3)),
    # MiniMax-M3's shape: sparse layers whose indexer keeps 2 key blocks of 8 per query (the nearest one always), so
    # sequences past 24 tokens attend sparsely; dense then routed MoE MLPs.
    "tiny-minimax-m3": dict(model_type="minimax_m3_vl_text", seed=9, logit_scale=8.0, mtp=False, config=dict(
        _ATTENTION, intermediate_size=32, num_hidden_layers=4, head_dim=16, dense_intermediate_size=128,
        shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, rotary_dim=8, index_n_heads=2,
        index_head_dim=16, index_block_size=8, index_topk_blocks=2, index_local_blocks=1,
        layer_types=["full_attention", "minimax_m3_sparse"] * 2, mlp_layer_types=["dense"] + ["sparse"] * 3)),
}
MTP_LAYER = "full_attention"  # the layer type of a Qwen MTP module's decoder layer


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


def debug_config(name: str, tokenizer, num_layers: int | None = None):
    """The transformers config of debug target `name` (optionally with another number of layers)."""
    from transformers import AutoConfig

    if name not in DEBUG_TARGETS:
        raise ValueError(f"unknown debug target {DEBUG_PREFIX}{name}; choose one of "
                         f"{[DEBUG_PREFIX + known for known in DEBUG_TARGETS]}")
    spec = DEBUG_TARGETS[name]
    fields = dict(spec["config"])
    if num_layers is not None:  # a deeper donor for the MTP module: layer N is a full-attention layer
        types = fields.get("layer_types")
        if types is not None:
            fields["layer_types"] = (list(types) + [MTP_LAYER] * num_layers)[:num_layers]
        fields["num_hidden_layers"] = num_layers
    if spec["mtp"]:
        fields["mtp_num_hidden_layers"] = 1
    return AutoConfig.for_model(spec["model_type"], vocab_size=len(tokenizer), tie_word_embeddings=False,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                bos_token_id=None, **fields)


def _seeded_model(config, seed: int, logit_scale: float, pad_row: bool = False):
    """pad_row: the pad token's embedding drawn like the others (transformers' init zeroes it; a trained model's is
    not zero, and DSA's indexer reads a zero hidden state as a tie of every key, which topk breaks by slot)."""
    from transformers import AutoModelForCausalLM

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # sharper logits than the default init: random targets then write repetitive, learnable text
        model.get_output_embeddings().weight.mul_(logit_scale)
        embeddings = model.get_input_embeddings().weight
        if pad_row:
            embeddings[config.pad_token_id] = torch.randn(embeddings.shape[1]) * embeddings.std()
    torch.random.set_rng_state(generator_state)
    return model


def _mtp_tensors(name: str, tokenizer, directory: str) -> dict[str, torch.Tensor]:
    """A model one layer deeper, seeded like the target, saved by transformers in the checkpoint's own names: its
    first N layers, embedding, norm and head are the target, its layer N (full attention) is the MTP module's
    decoder layer. Returns every tensor of the checkpoint: the target's under their names, the module's under mtp.*"""
    from safetensors.torch import load_file

    spec = DEBUG_TARGETS[name]
    num_layers = spec["config"]["num_hidden_layers"]
    donor = _seeded_model(debug_config(name, tokenizer, num_layers + 1), spec["seed"], spec["logit_scale"])
    donor_dir = os.path.join(directory, ".donor")
    donor.save_pretrained(donor_dir)
    stored = load_file(os.path.join(donor_dir, "model.safetensors"))
    shutil.rmtree(donor_dir)
    layer = f"model.layers.{num_layers}."
    tensors = {key: t for key, t in stored.items() if not key.startswith(layer)}
    tensors.update({"mtp.layers.0." + key.removeprefix(layer): t for key, t in stored.items() if key.startswith(layer)})
    hidden = donor.config.hidden_size
    generator = torch.Generator().manual_seed(spec["seed"] + 1000)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):  # Qwen norms scale by 1 + w
        tensors[f"mtp.{norm}.weight"] = 0.1 * torch.randn(hidden, generator=generator)
    tensors["mtp.fc.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=generator)
    return tensors


def write_debug_target(name: str, directory: str) -> None:
    """Write the debug target `name` (without the "debug:" prefix) as an HF model directory."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    tokenizer = build_tokenizer()
    config = debug_config(name, tokenizer)
    spec = DEBUG_TARGETS[name]
    if spec["mtp"]:
        os.makedirs(directory, exist_ok=True)
        tensors = _mtp_tensors(name, tokenizer, directory)
        config.save_pretrained(directory)
        save_file({key: t.contiguous() for key, t in tensors.items()}, os.path.join(directory, "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        _seeded_model(config, spec["seed"], spec["logit_scale"], spec.get("pad_row", False)).save_pretrained(directory)
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
