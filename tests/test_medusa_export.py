"""Medusa's vLLM layout (drafters/medusa/export.py, readers.py): written and read back as the same drafter for every
head choice; the file, computed the way vLLM's MedusaModel computes it (written out below from its documented
reading), drafts what our engine drafts; FasterDecoding's releases are read; and `draftsmith doctor` names what vLLM
would misread (biases without medusa_fc_bias, a release without hidden_size, a stored head of another target).
vLLM serving the export is tests/test_serve_check.py (vLLM environment)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from drafters import load_drafter
from drafters.medusa import MedusaConfig, MedusaDrafter
from drafters.medusa.export import export_checks
from inference.engine.target import TargetModel
from tests.test_doctor import PROMPTS, TARGET, overfit
from train.doctor import main as doctor_main
from train.export import main as export_main


@pytest.fixture(scope="module")
def target():
    return TargetModel.from_pretrained(TARGET)


def trained_looking(target, **config) -> MedusaDrafter:
    """Heads away from the identity start, biases included, so that every tensor of the file matters."""
    torch.manual_seed(0)
    drafter = MedusaDrafter(MedusaConfig(**{"num_heads": 3, **config}), target.target_info())
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    return drafter


def vllm_drafts(directory: str, hidden: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """vLLM 0.32's Medusa on `hidden` [B, D] from the files alone: blocks x + SiLU(W x (+ b only with
    medusa_fc_bias)), then original_lm_head's one head or head h's own; argmax of the first num_tokens heads."""
    with open(f"{directory}/config.json") as f:
        config = json.load(f)
    weights = load_file(f"{directory}/model.safetensors")
    drafts = []
    for h in range(num_tokens):
        x = hidden.double()
        for layer in range(config["num_hidden_layers"]):
            bias = weights[f"blocks.{h}.layers.{layer}.bias"].double() if config.get("medusa_fc_bias") else 0
            x = x + F.silu(x @ weights[f"blocks.{h}.layers.{layer}.weight"].double().T + bias)
        head = weights["lm_head.weight"] if config.get("original_lm_head") else weights[f"lm_heads.{h}.weight"]
        drafts.append((x @ head.double().T).argmax(-1))
    return torch.stack(drafts, dim=1)


@pytest.mark.parametrize("lm_head,num_layers", [("target", 1), ("copy", 2), ("new", 0)])
def test_export_reads_back_as_the_same_drafter_and_drafts_as_vllm_computes_it(target, tmp_path, lm_head, num_layers):
    drafter = trained_looking(target, lm_head=lm_head, num_layers=num_layers).double()
    drafter.save(str(tmp_path / "medusa"), "medusa")
    with open(tmp_path / "medusa" / "config.json") as f:
        config = json.load(f)
    assert (config["model_type"], config["num_heads"], config["num_hidden_layers"], config["medusa_fc_bias"],
            config["original_lm_head"]) == ("medusa", 3, num_layers, True, lm_head == "target")
    loaded = load_drafter(str(tmp_path / "medusa"), target.target_info())
    assert loaded.config == drafter.config
    mine, theirs = drafter.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k].double()) for k in mine)
    hidden = 3 * torch.randn(16, target.target_info().hidden_size, dtype=torch.float64)
    ours = drafter.head_logits(hidden).argmax(-1)
    assert torch.equal(vllm_drafts(str(tmp_path / "medusa"), hidden, 3), ours)
    assert [row.status for row in export_checks(str(tmp_path / "medusa"), target.target_info())] == ["pass"] * (
        6 if lm_head == "target" else 5)


def fasterdecoding_release(drafter: MedusaDrafter, directory) -> None:
    """The FasterDecoding repository's layout of `drafter` (own heads): medusa_num_heads / medusa_num_layers, no
    model_type or widths, tensors medusa_heads.{h}.{l}.linear.* and medusa_heads.{h}.{num_layers}.weight."""
    directory.mkdir()
    num_layers = drafter.config.num_layers
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": drafter.config.num_heads,
                                                       "medusa_num_layers": num_layers,
                                                       "base_model_name_or_path": "tiny"}))
    tensors = {}
    for name, tensor in drafter.state_dict().items():
        h, rest = name.removeprefix("heads.").split(".", 1)
        rest = rest.replace("blocks.", "") if rest.startswith("blocks.") else f"{num_layers}.weight"
        tensors[f"medusa_heads.{h}.{rest}"] = tensor.contiguous()
    save_file(tensors, str(directory / "medusa_lm_head.safetensors"))


def test_a_fasterdecoding_release_is_read_and_doctor_says_vllm_needs_its_width(target, tmp_path):
    drafter = trained_looking(target, lm_head="copy", num_layers=1)
    fasterdecoding_release(drafter, tmp_path / "release")
    loaded = load_drafter(str(tmp_path / "release"), target.target_info())
    assert (loaded.config.num_heads, loaded.config.num_layers, loaded.config.lm_head) == (3, 1, "copy")
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values()))
    rows = {row.name: row for row in export_checks(str(tmp_path / "release"), target.target_info())}
    assert rows["reader draftsmith"].status == "pass"
    assert rows["reader vllm"].status == "fail" and "hidden_size 4096 (its default" in rows["reader vllm"].detail \
        and "set hidden_size: 64" in rows["reader vllm"].detail


def edited(directory, tmp_path, name, config=None, tensors=None):
    out = tmp_path / name
    out.mkdir()
    header = json.loads((directory / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**header, **(config or {})}))
    weights = load_file(str(directory / "model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(out / "model.safetensors"))
    return out


def test_doctor_names_what_vllm_would_misread_and_what_we_do_not_read(target, tmp_path):
    info = target.target_info()
    trained_looking(target, lm_head="target").save(str(tmp_path / "good"), "medusa")
    good = tmp_path / "good"

    def rows(directory):
        return {row.name: row for row in export_checks(str(directory), info)}

    no_flag = rows(edited(good, tmp_path, "no_flag", {"medusa_fc_bias": False}))
    assert no_flag["reader draftsmith"].status == "pass" and no_flag["reader vllm"].status == "fail"
    assert "drops the file's" in no_flag["reader vllm"].detail
    zero = rows(edited(good, tmp_path, "zero_bias", {"medusa_fc_bias": False},
                       lambda w: {k: torch.zeros_like(v) if k.endswith(".bias") else v for k, v in w.items()}))
    assert zero["reader vllm"].status == "pass"  # zero biases: vLLM computes the same without them
    other = rows(edited(good, tmp_path, "other_head", tensors=lambda w: {**w, "lm_head.weight": -w["lm_head.weight"]}))
    assert other["head"].status == "fail" and "not this target's lm_head" in other["head"].detail
    no_head = rows(edited(good, tmp_path, "no_head", {"original_lm_head": False}))
    assert no_head["heads"].status == "fail" and no_head["reader vllm"].status == "fail"
    truncated = rows(edited(good, tmp_path, "token_map", {"truncated_vocab_size": 128},
                            lambda w: {**w, "token_map": torch.arange(128)}))
    assert truncated["reader draftsmith"].status == "fail" and "truncated_vocab_size 128" in \
        truncated["reader draftsmith"].detail
    with pytest.raises(ValueError, match="neither a Medusa block nor a head"):
        load_drafter(str(edited(good, tmp_path, "stray",
                                tensors=lambda w: {**w, "extra.weight": w["lm_head.weight"].clone()})), info)


def test_export_and_doctor_commands_take_the_format(tmp_path, capsys, target):
    torch.manual_seed(0)
    drafter = overfit(target, MedusaDrafter(MedusaConfig(num_heads=3), target.target_info()), steps=120)
    drafter.save(str(tmp_path / "native"), "native")
    assert export_main([str(tmp_path / "native"), "--format", "medusa", "--out", str(tmp_path / "out"),
                        "--target", TARGET]) == 0
    code = doctor_main([str(tmp_path / "out"), "--target", TARGET, "--prompts", PROMPTS, "--max-new-tokens", "48"])
    out = capsys.readouterr().out
    assert code == 0 and "reader vllm" in out and "0 failed" in out, out


def test_a_file_missing_one_heads_block_is_refused_naming_the_tensor(target, tmp_path):
    trained_looking(target, lm_head="copy").save(str(tmp_path / "good"), "medusa")
    broken = edited(tmp_path / "good", tmp_path, "broken",
                    tensors=lambda w: {k: v for k, v in w.items() if k != "blocks.1.layers.0.weight"})
    with pytest.raises(ValueError, match=r"the tensors lack blocks\.1\.layers\.0\.weight$"):
        load_drafter(str(broken), target.target_info())
    rows = {row.name: row for row in export_checks(str(broken), target.target_info())}
    assert rows["heads"].status == rows["reader draftsmith"].status == rows["reader vllm"].status == "fail"


def test_a_release_for_another_width_is_refused_naming_the_tensor(target, tmp_path, capsys):
    """FasterDecoding's config gives no width, so the tensors are checked against the target's when the drafter loads
    (as every export that records no target: drafters.check_drafter_spec): one error line from eval, no traceback."""
    from inference.evaluation.eval import main as eval_main

    release, width, vocab = tmp_path / "release", 2 * target.target_info().hidden_size, target.target_info().vocab_size
    release.mkdir()
    (release / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    save_file({name: torch.zeros(shape) for h in range(2) for name, shape in (
        (f"medusa_heads.{h}.0.linear.weight", (width, width)), (f"medusa_heads.{h}.0.linear.bias", (width,)),
        (f"medusa_heads.{h}.1.weight", (vocab, width)))}, str(release / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=rf"0\.0\.linear\.(weight|bias) is \[{width}"):
        load_drafter(str(release), target.target_info())
    code = eval_main(["--target", TARGET, "--drafter", str(release), "--prompts", PROMPTS, "--num-prompts", "1",
                      "--max-new-tokens", "4", "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert code == 2 and len(errors) == 1 and errors[0].startswith("draftsmith eval: error:") and \
        "the target's widths make it" in errors[0], err
