"""The study's target families through the engine (drafters/ragged_state.py): Qwen3-Next, Qwen3.5 and Qwen3.5-MoE
(gated-DeltaNet hybrids), Gemma 4 (window 16, so every sequence here outgrows it; also with its MoE block and K = V
global layers, and with E2B / E4B's per-layer inputs and KV-shared tail), gpt-oss (sinks, alternating windows, MoE),
DeepSeek-V3 (MLA, MoE), DeepSeek-V3.2 and GLM-5 (MLA whose indexer picks the 8 keys each query reads, under the
attention mask, so holes and tree nodes are masked as keys), and the Mamba hybrids Nemotron-H, Granite 4.0-H (Mamba-2)
and Jamba (Mamba-1), whose states the engine records as gated DeltaNet's, each the `debug:` target built from
transformers' own classes, in float64.

For every family: greedy speculative output == plain greedy through the same engine at batch 1 and 3 (n-gram, a draft
model, tree verification), the T = 1 sampling law (chi-square, as test_contract.py), native MTP where the checkpoint
ships one, transformers' assisted generation where it supports the family, and the one-line refusal of a family the
engine cannot roll back. Rollback == recompute is tests/test_families_rollback.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import joint_counts
from test_contract import exact_joint
from test_tree import assert_chi_square
from transformers import AutoModelForCausalLM

from drafters import DraftModelDrafter, NgramDrafter, load_drafter
from drafters.draft_model import DraftModelConfig
from inference.assets.debug_target import DEBUG_TARGETS, resolve_debug_target
from inference.engine.api import speculative_generate, tree_speculative_generate
from inference.engine.target import TargetModel

HYBRIDS = ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe"]
GEMMA4 = ["tiny-gemma4", "tiny-gemma4-moe", "tiny-gemma4-e"]
DSA = ["tiny-deepseek-v3.2", "tiny-glm-5"]  # MLA with an indexer choosing the keys each query reads
# Mamba layers (a conv and an SSM state) beside attention; Falcon-H1's and Zamba2's layers hold both (`hybrid`);
# LFM2's gated short convolutions (a conv state alone)
RECURRENT = ["tiny-nemotron-h", "tiny-granite-4", "tiny-jamba", "tiny-falcon-h1", "tiny-zamba2", "tiny-lfm2",
             "tiny-kimi-linear"]  # and Kimi Linear's delta attention
FAMILIES = HYBRIDS + GEMMA4 + ["tiny-gpt-oss", "tiny-deepseek-v3", "tiny-llama4-chunked"] + DSA + RECURRENT
# Families whose state machinery another one's tests already run in full (Nemotron-H's Mamba-2 recorder: Granite's is
# the same mixer, Jamba's Mamba-1 differs by a rank-3 state, Zamba2's by where its mixer sits; Qwen3.5's for Kimi
# Linear's delta attention): greedy and rollback tests only, not the T = 1 law and every drafter kind again (the
# suite's 10 minutes on 2 cores)
SAME_MACHINERY = ["tiny-granite-4", "tiny-jamba", "tiny-zamba2", "tiny-kimi-linear"]
EVERY_TEST = [name for name in FAMILIES if name not in SAME_MACHINERY]
MAX_NEW = 24  # with prompts of 7-20 tokens every row ends past Gemma 4's and gpt-oss's window of 16


def load_family_model(name: str, seed: int | None = None, noise: float = 0.0):
    """The debug target `name` in float64 (MoE experts in transformers' eager loop: its grouped matmul has no
    float64 kernel); with `noise`, every weight moved by noise x its tensor's std (a draft model that agrees with
    the target often but not always)."""
    directory = resolve_debug_target("debug:" + name)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, experts_implementation="eager").eval()
    if noise:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.numel() > 1:
                    parameter.add_(noise * parameter.std() * torch.randn(parameter.shape, generator=generator,
                                                                          dtype=parameter.dtype))
    return model


@functools.lru_cache(maxsize=None)
def family_target(name: str) -> TargetModel:
    return TargetModel(load_family_model(name), name_or_path=resolve_debug_target("debug:" + name))


def draft_model(target: TargetModel, name: str) -> DraftModelDrafter:
    """The target with noisy weights: accepts some drafts and rejects others (Gemma 4's is more sensitive)."""
    model = load_family_model(name, seed=11, noise=0.03 if name in GEMMA4 else 0.1)
    return DraftModelDrafter(DraftModelConfig(path=name), target.target_info(), model=model)


def prompts(seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (12, 20, 7)]


@functools.lru_cache(maxsize=None)
def plain_greedy(name: str) -> list[list[int]]:
    """Per prompt, plain greedy (k = 0) at batch 1 through the engine."""
    target = family_target(name)
    return [speculative_generate(target, None, [p], num_draft_tokens=0, max_new_tokens=MAX_NEW,
                                 eos_token_ids=[]).tokens[0] for p in prompts()]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_speculative_equals_plain_greedy(name):
    """Chains (n-gram, draft model) at batch 1 and 3 and trees (draft model, DDTree of 5 nodes) at batch 3 emit
    plain greedy's tokens, with drafts both accepted and rejected in every family."""
    target, plain = family_target(name), plain_greedy(name)
    ngram, drafter = NgramDrafter(NgramDrafter.Config(), target.target_info()), draft_model(target, name)
    accepted = rejected = 0
    for each, batch in ((ngram, 3), (drafter, 1), (drafter, 3)):
        out = speculative_generate(target, each, prompts()[:batch], num_draft_tokens=3, max_new_tokens=MAX_NEW,
                                   eos_token_ids=[])
        assert out.tokens == plain[:batch], (type(each).__name__, batch)
        if each is drafter:
            accepted += sum(map(sum, out.accept_lengths))
            rejected += sum(map(sum, out.proposed)) - sum(map(sum, out.accept_lengths))
    tree = tree_speculative_generate(target, drafter, prompts(), tree_budget=5, max_new_tokens=MAX_NEW,
                                     eos_token_ids=[])
    assert tree.tokens == plain
    assert accepted > 0 and rejected > 0, (accepted, rejected)  # rows accepted different counts: real rollbacks


def assert_sampling_law(name: str, vocab: int, rows: int, prompt: list[int], timed: bool = True) -> None:
    """T = 1 through chains of 2 sampled drafts from a draft model of family `name`, `rows` copies of `prompt`: the
    first three emitted tokens follow the target's joint law (the target cut to a `vocab`-token vocabulary with soft
    logits), and drafts were both accepted and rejected."""
    model = load_family_model(name)
    model.resize_token_embeddings(vocab)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.05)
    target = TargetModel(model, name_or_path=name)
    draft = load_family_model(name, seed=3, noise=0.3)
    draft.resize_token_embeddings(vocab)
    with torch.no_grad():
        draft.get_output_embeddings().weight.copy_(model.get_output_embeddings().weight)
    drafter = DraftModelDrafter(DraftModelConfig(path=name, sample_drafts=True), target.target_info(), model=draft)
    out = speculative_generate(target, drafter, [prompt] * rows, num_draft_tokens=2, max_new_tokens=3,
                               temperature=1.0, seed=0, eos_token_ids=[], timed=timed)
    counts = joint_counts(out.tokens, vocab)
    assert_chi_square(counts, exact_joint(model, prompt, vocab) * rows)
    accepted = sum(map(sum, out.accept_lengths))
    assert 0 < accepted < 2 * sum(map(len, out.accept_lengths))  # drafts were accepted and rejected


@pytest.mark.parametrize("name", EVERY_TEST)
def test_sampling_law_is_the_targets(name):
    """The T = 1 law (assert_sampling_law) on a 6-token vocabulary, 2,000 rows decoded as one batch."""
    assert_sampling_law(name, vocab=6, rows=2000, prompt=[1, 4, 2, 5, 3])


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_native_mtp_greedy_exact(name):
    """`--drafter native-mtp`: the checkpoint's own (random) MTP module drafts 2 tokens per round at batch 3."""
    target = family_target(name)
    drafter = load_drafter("native-mtp", target.target_info()).to(torch.float64)
    out = speculative_generate(target, drafter, prompts(), num_draft_tokens=2, max_new_tokens=MAX_NEW,
                               eos_token_ids=[])
    assert out.tokens == plain_greedy(name)
    assert sum(map(len, out.accept_lengths)) > 0


@pytest.mark.parametrize("name", GEMMA4 + ["tiny-gpt-oss", "tiny-deepseek-v3", "tiny-llama4-chunked", "tiny-lfm2"]
                         + DSA)
def test_output_equals_transformers_assisted_generation(name):
    """transformers' assisted generation with the same draft model and 3 drafts gives our tokens (its candidate
    generator refuses the hybrids: 'assisted generation is not supported with stateful models')."""
    target = family_target(name)
    drafter = draft_model(target, name)
    prompt = prompts()[1]
    ours = speculative_generate(target, drafter, [prompt], num_draft_tokens=3, max_new_tokens=MAX_NEW,
                                eos_token_ids=[])
    reference = target.model.generate(torch.tensor([prompt]), assistant_model=drafter.lm, do_sample=False,
                                      max_new_tokens=MAX_NEW, num_assistant_tokens=3,
                                      num_assistant_tokens_schedule="constant", eos_token_id=None, pad_token_id=0)
    assert ours.tokens[0] == reference[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", [n for n in HYBRIDS + RECURRENT if n != "tiny-lfm2"])  # LFM2's it crops itself
def test_hybrid_without_rollback_is_what_transformers_refuses(name):
    """Why the engine records linear states itself: transformers' own assisted generation refuses these targets."""
    target = family_target(name)
    with pytest.raises(ValueError, match="stateful"):
        target.model.generate(torch.tensor([prompts()[0]]), assistant_model=draft_model(target, name).lm,
                              do_sample=False, max_new_tokens=4)


@pytest.mark.parametrize("name,refused,allowed", [(name, "[0]", "[1, 3]") for name in HYBRIDS] +
                         [("tiny-nemotron-h", "[0, 1]", "[2, 5]"),  # a Mamba-2 and a MoE block
                          ("tiny-granite-4", "[0]", "[1, 3]"), ("tiny-jamba", "[0]", "[1, 3]"),
                          ("tiny-zamba2", "[0]", "[1]"),  # Zamba2's hybrid layer: Mamba-2 after a shared attention
                          ("tiny-lfm2", "[0]", "[1, 3]")])
def test_kv_of_a_layer_without_kv_is_refused_naming_the_allowed_layers(name, refused, allowed):
    from drafters.assistant import AssistantConfig, AssistantDrafter

    target = family_target(name)
    drafter = AssistantDrafter(AssistantConfig(num_layers=2, kv_layers=(0, 1)), target.target_info())
    with pytest.raises(ValueError) as refusal:
        target.check_request(drafter.feature_request())
    message = str(refusal.value)
    assert message.startswith(f"drafter.kv_layers: target layers {refused} of ") and "\n" not in message
    assert message.endswith(f"(no K/V to read); choose among its attention layers {allowed}")


def tiny_deepseek_v4(**fields):
    """DeepSeek-V4: compressed attention (`heavily_compressed_attention` layers) the engine does not roll back."""
    from transformers import AutoConfig

    return AutoConfig.for_model("deepseek_v4", hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                                num_attention_heads=4, head_dim=16, q_lora_rank=16, num_experts_per_tok=1,
                                n_routed_experts=2, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
                                index_topk=4, sliding_window=8, bos_token_id=None, **fields)


def test_unsupported_family_is_refused_in_one_line():
    """DeepSeek-V4's compressed-attention layers have a cache the engine cannot roll back per row: TargetModel refuses
    the family at once, naming it, the layer type and what is missing (not a traceback mid-generation)."""
    model = AutoModelForCausalLM.from_config(tiny_deepseek_v4(vocab_size=64, eos_token_id=0))
    with pytest.raises(ValueError) as error:
        TargetModel(model)
    message = str(error.value)
    assert "\n" not in message and "deepseek_v4" in message and "'heavily_compressed_attention'" in message
    assert "missing" in message


@torch.no_grad()
@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_assistant_past_four_windows_drafts_as_transformers_and_is_greedy_exact(name, tmp_path):
    """A Gemma-4-layout assistant (transformers' Gemma4AssistantForCausalLM, random, imported through its
    `gemma4_assistant` reader) over the target's sliding (window 16) and global K/V after 70 tokens: its draft
    logits equal transformers' assistant driven as its candidate generator drives it, and greedy output over
    sequences past 4 windows == plain greedy at batch 3. tiny-gemma4-moe's global layers cache one KV head whose
    values are its keys (attention_k_eq_v, as gemma-4-26B-A4B)."""
    pytest.importorskip("transformers.models.gemma4_assistant", reason="transformers without Gemma 4 assistants")
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    from drafters.base import DraftContext

    target = family_target(name)
    config = target.model.config
    global_kv = {key: DEBUG_TARGETS[name]["config"][key] for key in ("attention_k_eq_v", "num_global_key_value_heads")
                 if key in DEBUG_TARGETS[name]["config"]}
    text = Gemma4TextConfig(**global_kv, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            vocab_size=config.vocab_size, layer_types=["sliding_attention", "full_attention"],
                            sliding_window=config.sliding_window, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                            max_position_embeddings=2048, pad_token_id=config.pad_token_id,
                            eos_token_id=config.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    helper = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64))
    with torch.no_grad():  # off the unit-norm, zero-scalar start
        for parameter in helper.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    helper.save_pretrained(str(tmp_path / "assistant"))
    helper = helper.double().eval()
    drafter = load_drafter(str(tmp_path / "assistant"), target.target_info()).to(torch.float64).eval()

    length = 70
    prompt = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(5))
    _, served = target.prefill(prompt, torch.ones_like(prompt), drafter.feature_request())
    next_token = torch.tensor([50])
    drafter.begin(DraftContext(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.arange(length)[None],
                               next_tokens=next_token, **served.context()))
    drafts, logits, _ = drafter.draft_logits(3)
    out = target.model(input_ids=prompt, output_hidden_states=True, return_shared_kv_states=True)
    shared = dict(out.shared_kv_states)
    token, hidden = next_token[:, None], out.hidden_states[-1][:, -1:]
    for step in range(3):
        embeds = torch.cat([target.model.get_input_embeddings()(token), hidden], dim=-1)
        reference = helper(inputs_embeds=embeds, attention_mask=torch.ones(1, length, dtype=torch.long),
                           position_ids=torch.tensor([[length]]), shared_kv_states=shared, use_cache=False)
        # Gemma 4's RMSNorm computes in float32 even for float64 inputs, hence the tolerance
        torch.testing.assert_close(logits[:, step], reference.logits[:, 0], rtol=0, atol=1e-5)
        token, hidden = reference.logits.argmax(-1), reference.last_hidden_state
        assert int(token) == int(drafts[0, step])

    max_new = 4 * config.sliding_window  # rows end at 71-84 tokens
    plain = speculative_generate(target, None, prompts(), num_draft_tokens=0, max_new_tokens=max_new,
                                 eos_token_ids=[])
    chain = speculative_generate(target, drafter, prompts(), num_draft_tokens=3, max_new_tokens=max_new,
                                 eos_token_ids=[])
    assert chain.tokens == plain.tokens


@pytest.mark.parametrize("name", FAMILIES)
def test_debug_targets_resolve_by_name_with_native_mtp_in_the_qwen_layout(name):
    """Every debug name resolves through resolve_target (train, prepare, eval, export, doctor and calibrate all go
    through it) to a directory transformers loads; the Qwen ones hold one MTP module where vLLM's Qwen3-Next / Qwen3.5
    MTP loaders look (mtp.fc, mtp.pre_fc_norm_*, mtp.layers.0.* with its input_layernorm, mtp.norm)."""
    import json
    import os

    from drafters.mtp.export import checkpoint_index, find_native
    from inference.assets.store import resolve_target

    directory = resolve_target("debug:" + name)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    assert config["vocab_size"] == 260 and config["hidden_size"] == 64
    names = set(checkpoint_index(directory))
    if name in HYBRIDS:
        assert config["mtp_num_hidden_layers"] == 1
        assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                "mtp.norm.weight", "mtp.layers.0.input_layernorm.weight"} <= names
        assert any(n.startswith("mtp.layers.0.self_attn.") for n in names)  # a full-attention layer
        assert find_native(directory, config["num_hidden_layers"], config["model_type"]).num_modules == 1
    else:
        assert not any(n.startswith("mtp.") for n in names)


def test_an_indexed_family_whose_indexer_was_not_read_is_refused():
    """DSA's `indexed_attention` is decoded for DeepSeek-V3.2 and GLM-5, whose indexer picks keys under the attention
    mask; another family with layers of that name (AXK2) may anchor them otherwise (MiniMax-M3's anchor to slots), so
    it is refused in one line naming the families that decode."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("axk2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=16,
                                  n_routed_experts=2, num_experts_per_tok=1, q_lora_rank=16, kv_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_n_heads=2,
                                  index_head_dim=16, index_topk=4, bos_token_id=None, eos_token_id=0)
    assert set(config.layer_types) == {"indexed_attention"}
    with pytest.raises(ValueError) as error:
        TargetModel(AutoModelForCausalLM.from_config(config))
    message = str(error.value)
    assert "\n" not in message and message.startswith("target family axk2: layer types ['indexed_attention']")
    assert "the DSA ones of deepseek_v32, glm_moe_dsa only" in message


def test_eval_refuses_an_unsupported_family_in_one_line_exit_2(tmp_path, capsys):
    from inference.assets.debug_target import build_tokenizer
    from train.cli import main as cli

    tokenizer = build_tokenizer()
    AutoModelForCausalLM.from_config(tiny_deepseek_v4(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)).save_pretrained(str(tmp_path / "dsv4"))
    tokenizer.save_pretrained(str(tmp_path / "dsv4"))
    argv = ["eval", "--target", str(tmp_path / "dsv4"), "--drafter", "ngram", "--prompts", "mt_bench",
            "--num-prompts", "1", "--max-new-tokens", "4", "--num-draft-tokens", "1", "--out",
            str(tmp_path / "report.json")]
    assert cli(argv) == 2
    stderr = capsys.readouterr().err.replace("\r", "\n")
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert "Traceback" not in stderr and len(errors) == 1
    assert "target family deepseek_v4: layer types ['heavily_compressed_attention'] are not supported" in errors[0]
