"""Write a directory that `draftsmith estimate --config-only` plans from: a large target's config.json in the layout
its release ships (gemma-4-26B-A4B: a vision-language `gemma4` config around the text model's) and, beside it, the
debug targets' byte tokenizer as a stand-in for the model's own (so the disk and token counts are the stand-in's;
every size of the target and the drafter is the config's).

    python benchmarks/training/config_only_target.py gemma-4-26b-a4b /tmp/gemma-4-26b-a4b
    draftsmith estimate recipes/gemma-4-26b-a4b/eagle3.yaml target.name_or_path=/tmp/gemma-4-26b-a4b \\
        data.regenerated_path=null --world-size 8 --gpu-memory-gib 80

gemma-4-26B-A4B's and gemma-4-31B's text configs as public conversions of the releases list them; built, they count
25.23B parameters of which 3.82B are active per token (the release's 25.2B and 3.8B), and 30.70B. DeepSeek-V3's is
transformers' DeepseekV3Config defaults, which are that model's, and so are Qwen3_5MoeTextConfig's Qwen3.6-35B-A3B's
(34.66B built); Qwen3.6-27B's as assumed here (26.90B built); Kimi-K2.5's, Kimi K2's published text config inside a
`kimi_k25` vision-language config (1,026B built; without its int4 quantization_config, so vLLM's weights count bf16);
MiniMax-M3's, transformers' defaults with the layer split assumed below (426.2B built; 428B is the figure quoted
for it).
tests/test_config.py builds the recipes' test shapes from these same fields.
"""

from __future__ import annotations

import argparse
import os
import sys

GEMMA4_26B_A4B_TEXT = dict(
    model_type="gemma4_text", vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
    attention_k_eq_v=True, sliding_window=1024, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
    enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704, hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=0, final_logit_softcapping=30.0, max_position_embeddings=262144,
    tie_word_embeddings=True, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh")

GEMMA4_31B_TEXT = dict(
    GEMMA4_26B_A4B_TEXT, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
    num_key_value_heads=16, num_global_key_value_heads=4, enable_moe_block=False, num_experts=None,
    top_k_experts=None, moe_intermediate_size=None, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10)
GEMMA4_TEXT = {"gemma-4-26b-a4b": GEMMA4_26B_A4B_TEXT, "gemma-4-31b": GEMMA4_31B_TEXT}


QWEN36_27B_TEXT = dict(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}, mtp_num_hidden_layers=1)


# Kimi-K2.5's text model: DeepSeek-V3's architecture (MLA, group-free routing) with 384 experts, 64 heads and a
# 163,840-token vocabulary, as Kimi K2's published config lists it (K2.5 is K2 pretrained further)
KIMI_K25_TEXT = dict(
    model_type="deepseek_v3", vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1, n_routed_experts=384,
    num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1,
    q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    max_position_embeddings=262144, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0})


# MiniMax-M3's text model: transformers' MiniMaxM3VLTextConfig defaults (documented as MiniMaxAI/MiniMax-M3's) with
# its first three layers dense with full attention and the rest MoE with sparse attention (assumed, as public parsers
# of the release's config describe its sparse layers: the MoE ones)
MINIMAX_M3_TEXT = dict(layer_types=["full_attention"] * 3 + ["minimax_m3_sparse"] * 57,
                       mlp_layer_types=["dense"] * 3 + ["sparse"] * 57)


def config_of(name: str):
    if name == "minimax-m3":
        from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig

        config = MiniMaxM3VLConfig(text_config=MINIMAX_M3_TEXT)
        config.architectures = ["MiniMaxM3SparseForConditionalGeneration"]
        return config
    if name == "kimi-k2.5":  # a vision-language `kimi_k25` config around the text model, as released
        from transformers import Kimi_K25Config

        config = Kimi_K25Config(text_config=KIMI_K25_TEXT, tie_word_embeddings=False)
        config.architectures = ["KimiK25ForConditionalGeneration"]
        return config
    if name.startswith("qwen3.6"):  # Qwen3_5MoeTextConfig's defaults are Qwen3.6-35B-A3B's text config
        from transformers import Qwen3_5Config, Qwen3_5MoeConfig

        dense = name == "qwen3.6-27b"
        config = (Qwen3_5Config(text_config=QWEN36_27B_TEXT, tie_word_embeddings=False) if dense else
                  Qwen3_5MoeConfig(text_config={"mtp_num_hidden_layers": 1}, tie_word_embeddings=False))
        config.architectures = ["Qwen3_5ForConditionalGeneration" if dense else "Qwen3_5MoeForConditionalGeneration"]
        return config
    if name in GEMMA4_TEXT:
        from transformers import Gemma4Config

        config = Gemma4Config(text_config=GEMMA4_TEXT[name], tie_word_embeddings=True)
        config.architectures = ["Gemma4ForConditionalGeneration"]
        return config
    from transformers import DeepseekV3Config

    config = DeepseekV3Config()
    config.architectures = ["DeepseekV3ForCausalLM"]
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=[*GEMMA4_TEXT, "qwen3.6-27b", "qwen3.6-35b-a3b", "deepseek-v3", "kimi-k2.5",
                                           "minimax-m3"])
    parser.add_argument("out", help="the directory to write (config.json and the stand-in tokenizer)")
    args = parser.parse_args(argv)
    if os.path.exists(os.path.join(args.out, "config.json")):
        print(f"config_only_target: {args.out} already holds a config.json; give an empty directory", file=sys.stderr)
        return 2
    from inference.assets.debug_target import build_tokenizer

    config_of(args.target).save_pretrained(args.out)
    build_tokenizer().save_pretrained(args.out)
    print(f"wrote {args.out}: {args.target}'s config.json and the byte tokenizer as a stand-in")
    return 0


if __name__ == "__main__":
    sys.exit(main())
