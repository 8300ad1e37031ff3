"""`draftsmith eval` end to end on a tiny random target directory, and its input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY
from inference.evaluation.eval import main
from offline_tokenizers import build_tokenizer

DATA = Path(__file__).parent / "data"
RECORD_KEYS = {
    "dataset", "category", "drafter", "temperature", "num_draft_tokens", "batch_size", "num_prompts", "new_tokens",
    "rounds", "tau", "acceptance_rate", "per_position_acceptance_conditional",
    "per_position_acceptance_unconditional", "accept_length_histogram", "target_forwards", "time_s",
    "tokens_per_s", "tokens_per_s_ar", "speedup", "draft_cost_ratio", "verify_cost_ratio", "theoretical_speedup",
    "greedy_exact_match", "recommended_num_draft_tokens", "recommendation_basis", "env",
}


def save_tiny_llama(directory: Path, tokenizer, *, seed: int, num_layers: int, vocab_size: int | None = None):
    """A seeded random Llama saved as an HF directory (sharpened head: repetitive text, no fp32 near-ties)."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, "num_hidden_layers": num_layers, "vocab_size": vocab_size or len(tokenizer),
                            "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
                            "pad_token_id": tokenizer.pad_token_id})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_cli")
    tokenizer = build_tokenizer("chatml")
    save_tiny_llama(root / "target", tokenizer, seed=0, num_layers=2)
    save_tiny_llama(root / "draft", tokenizer, seed=0, num_layers=1)
    save_tiny_llama(root / "bad_draft", tokenizer, seed=1, num_layers=1, vocab_size=len(tokenizer) - 7)
    save_tiny_llama(root / "no_template", build_tokenizer(None), seed=0, num_layers=2)
    # a native drafter checkpoint header written for a target with another hidden size
    (root / "other_target_ckpt").mkdir()
    header = {"draftsmith_kind": "ngram", "drafter_config": {},
              "target": {"hidden_size": TINY["hidden_size"] // 2, "vocab_size": len(tokenizer)}}
    (root / "other_target_ckpt" / "config.json").write_text(json.dumps(header))
    return root


def run_eval(dirs, tmp_path, *extra: str, drafter: str = "ngram") -> int:
    argv = ["--target", str(dirs / "target"), "--drafter", drafter, "--prompts", str(DATA / "questions_small.jsonl"),
            "--max-new-tokens", "12", "--out", str(tmp_path / "report.json"), *extra]
    return main(argv)


def test_greedy_eval_matches_plain_greedy_and_writes_the_report(dirs, tmp_path, capsys):
    drafters = f"ngram,{dirs / 'draft'}"
    rc = run_eval(dirs, tmp_path, "--num-prompts", "4", "--num-draft-tokens", "2,3", "--batch-size", "2",
                  "--outputs", str(tmp_path / "outputs.jsonl"), "--threads", "1", drafter=drafters)
    assert rc == 0
    records = json.loads((tmp_path / "report.json").read_text())["records"]
    categories = {record["category"] for record in records}
    assert "all" in categories and len(categories) >= 3
    # per category: the baseline, then 2 drafters x 2 k
    assert len(records) == 5 * len(categories)
    for record in records:
        assert RECORD_KEYS <= set(record)
        if record["num_draft_tokens"] == 0:
            assert record["drafter"] == "none" and record["speedup"] == pytest.approx(1.0)
            continue
        assert record["greedy_exact_match"] == 1.0, record["drafter"]
        assert sum(record["accept_length_histogram"]) == record["rounds"]
        assert record["tau"] == pytest.approx(1 + sum(record["per_position_acceptance_unconditional"]))
        assert record["recommended_num_draft_tokens"] is not None
        # per question, by question index: the counts add up to the record's, the questions are its category's
        per_question = record["tau_per_question"]
        assert [q for q, _, _ in per_question] == sorted({q for q, _, _ in per_question})
        assert len(per_question) == record["num_prompts"]
        assert [sum(row[i] for row in per_question) for i in (1, 2)] == [record["rounds"], record["accepted"]]
    drafter_names = {record["drafter"] for record in records}
    assert drafter_names == {"none", "ngram", "draft_model:draft"}
    # the draft model is an unrelated random 1-layer LM: it is rarely accepted, but the output stays lossless
    table, roofline, caption, paired = (tmp_path / "report.md").read_text().split("\n\n")
    assert table.count("\n") == len(records) + 1  # header, rule, one row per record
    # the draft model against the n-gram drafter (the first named) at each k, paired over the 4 questions
    assert caption.startswith("tau against the first drafter, paired")
    rows = [line.split(" | ") for line in paired.strip().splitlines()[2:]]
    assert [(row[2], row[4], row[5], row[-1]) for row in rows] == [
        ("2", "draft_model:draft", "ngram", "4 |"), ("3", "draft_model:draft", "ngram", "4 |")]
    assert roofline.startswith("roofline: target path fast-cpu-linear")  # a float32 target runs the fast path
    assert all(record["target_path"] == "fast-cpu-linear" and record["achieved_gb_per_s"]["ar"] > 0
               and record["stream_gb_per_s"] > 0 for record in records)
    # the draft model's steps run the fast path's kernels too (TargetModel.serve); the n-gram drafter has no linears
    assert {r["drafter"]: r["drafter_path"] for r in records if r["drafter"] != "none"} == {
        "ngram": "hf", "draft_model:draft": "fast-cpu-linear"}
    kernels = records[0]["target_kernels"]  # what the fast path chose on this machine, per shape and row count
    assert kernels["threads"] >= 1 and kernels["cpu"] and kernels["shapes"]
    assert all(len(shape["plan"]) == 17 and shape["timings_ms"] for shape in kernels["shapes"].values())
    assert (tmp_path / "report_acceptance_questions_small.png").is_file()
    assert (tmp_path / "report_speedup_questions_small.png").is_file()
    lines = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    num_turns = sum(record["num_sequences"] for record in records if record["category"] == "all"
                    and record["drafter"] == "none")
    assert len(lines) == num_turns * 5  # baseline + 4 methods
    assert {"question_id", "turn", "token_ids", "text"} <= set(lines[0])
    assert 1 in {line["turn"] for line in lines}  # the second turn ran after the first
    assert "| dataset |" in capsys.readouterr().out


@pytest.mark.parametrize("verification", ["token", "block"])
def test_sampling_eval_runs_without_exact_match(dirs, tmp_path, verification):
    rc = run_eval(dirs, tmp_path, "--num-prompts", "2", "--num-draft-tokens", "2", "--temperature", "0.8",
                  "--top-k", "20", "--categories", "math,coding", "--verification", verification)
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert {record["category"] for record in report["records"]} == {"all", "math", "coding"}
    assert all(record["greedy_exact_match"] is None for record in report["records"])
    assert report["config"].get("verification", "token") == verification


@pytest.mark.parametrize("extra, drafter, message", [
    (("--num-draft-tokens", "2,-1"), "ngram", "--num-draft-tokens: values must be >= 0"),
    (("--temperature", "-0.5"), "ngram", "--temperature: values must be >= 0"),
    (("--top-p", "0"), "ngram", "--top-p must be in (0, 1]"),
    (("--verification", "block", "--tree-budget", "4"), "ngram", "--verification block: block verification tests a"),
    ((), "BAD_DRAFT", "vocab_size"),
    ((), "OTHER_TARGET", "(hidden_size 32, vocab_size 322), not "),
    ((), "missing_dir", "missing_dir"),
    (("--categories", "poetry"), "ngram", "no question in categories"),
])
def test_bad_input_is_named(dirs, tmp_path, capsys, extra, drafter, message):
    drafter = {"BAD_DRAFT": str(dirs / "bad_draft"), "OTHER_TARGET": str(dirs / "other_target_ckpt"),
               "missing_dir": str(tmp_path / "missing_dir")}.get(drafter, drafter)
    assert run_eval(dirs, tmp_path, *extra, drafter=drafter) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


def test_bad_prompt_file_names_the_line(dirs, tmp_path, capsys):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text('{"question_id": 1, "category": "a", "turns": ["hi"]}\n{"question_id": 2, "turns": 3}\n')
    rc = main(["--target", str(dirs / "target"), "--prompts", str(prompts), "--out", str(tmp_path / "r.json")])
    assert rc == 2
    assert f"{prompts}:2" in capsys.readouterr().err
    rc = main(["--target", str(dirs / "target"), "--prompts", str(tmp_path / "nope.jsonl")])
    assert rc == 2 and "nope.jsonl" in capsys.readouterr().err


def test_missing_chat_template_is_an_error_unless_disabled(dirs, tmp_path, capsys):
    argv = ["--target", str(dirs / "no_template"), "--prompts", str(DATA / "questions_small.jsonl"),
            "--num-prompts", "1", "--max-new-tokens", "4", "--num-draft-tokens", "2", "--out", str(tmp_path / "r.json")]
    assert main(argv) == 2
    assert "no chat template" in capsys.readouterr().err
    assert main(argv + ["--no-chat-template"]) == 0


def test_k_beyond_a_block_drafter_is_refused_naming_the_limit(dirs, tmp_path, capsys):
    """A DFlash checkpoint with block 4 drafts at most 3 tokens: --num-draft-tokens 5 is an input error."""
    from drafters.dflash import DFlashDrafter
    from drafters.dflash.config import DFlashConfig
    from inference.engine.target import TargetModel

    target = TargetModel.from_pretrained(str(dirs / "target"))
    info = target.target_info()
    config = DFlashConfig(layer_ids=(0, 1), num_layers=1, block_size=4, num_anchors=8,
                          mask_token_id=info.vocab_size - 1, allow_text_mask_token=True)
    DFlashDrafter(config, info).save(str(tmp_path / "dflash"), "native")
    rc = run_eval(dirs, tmp_path, "--num-draft-tokens", "2,5", drafter=str(tmp_path / "dflash"))
    err = capsys.readouterr().err
    assert rc == 2 and "--num-draft-tokens 5" in err and "at most 3" in err and "0..3" in err, err
    assert run_eval(dirs, tmp_path, "--num-prompts", "2", "--num-draft-tokens", "3",
                    drafter=str(tmp_path / "dflash")) == 0


def test_auto_and_fixed_k_in_one_run_with_a_load_sweep(dirs, tmp_path):
    """`auto` beside fixed k and two batch sizes: greedy output unchanged, the auto record says "auto" with the
    histogram of the widths it chose, every record carries the profiled costs and a predicted speedup, and the load
    plot is written."""
    rc = run_eval(dirs, tmp_path, "--num-prompts", "3", "--num-draft-tokens", "auto,2", "--batch-size", "1,2",
                  drafter=str(dirs / "draft"))
    assert rc == 0
    records = json.loads((tmp_path / "report.json").read_text())["records"]
    auto = [r for r in records if r["num_draft_tokens"] == "auto"]
    assert {r["batch_size"] for r in auto} == {1, 2}
    for record in auto:
        assert record["greedy_exact_match"] == 1.0
        histogram = record["num_draft_tokens_histogram"]
        assert len(histogram) == record["adaptive_max_draft_tokens"] + 1 and sum(histogram) == record["rounds"]
    for record in records:
        if record["num_draft_tokens"] != 0:
            assert len(record["cost_profile"]["v"]) == record["cost_profile"]["d"].__len__() >= 3
            assert record["predicted_speedup"] is not None
    assert (tmp_path / "report_load_questions_small.png").is_file()


def test_append_refuses_a_report_of_another_configuration(dirs, tmp_path, capsys):
    assert run_eval(dirs, tmp_path, "--num-prompts", "1", "--num-draft-tokens", "2") == 0
    assert run_eval(dirs, tmp_path, "--num-prompts", "1", "--num-draft-tokens", "3", "--append") == 0
    records = json.loads((tmp_path / "report.json").read_text())["records"]
    assert {r["num_draft_tokens"] for r in records} == {0, 2, 3}
    # another question count appends too: each record says how many questions it covers
    assert run_eval(dirs, tmp_path, "--num-prompts", "2", "--num-draft-tokens", "1", "--append") == 0
    records = json.loads((tmp_path / "report.json").read_text())["records"]
    assert {r["num_prompts"] for r in records if r["num_draft_tokens"] == 1 and r["category"] == "all"} == {2}
    assert {r["num_prompts"] for r in records if r["num_draft_tokens"] == 3 and r["category"] == "all"} == {1}
    capsys.readouterr()
    rc = run_eval(dirs, tmp_path, "--num-prompts", "1", "--num-draft-tokens", "2", "--append", "--seed", "5")
    err = capsys.readouterr().err
    assert rc == 2 and "--append" in err and "seed" in err and len(err.strip().splitlines()) == 1, err


def test_tree_budgets_run_beside_chains_and_a_budget_below_one_is_refused(dirs, tmp_path, capsys):
    """--tree-budget adds a "<drafter>@tree" method per budget (DDTree for a DFlash block drafter): greedy output
    unchanged, records carry tree_budget and the chain k of equal verify budget, and no chain recommendation."""
    from drafters.dflash import DFlashDrafter
    from drafters.dflash.config import DFlashConfig
    from inference.engine.target import TargetModel

    info = TargetModel.from_pretrained(str(dirs / "target")).target_info()
    config = DFlashConfig(layer_ids=(0, 1), num_layers=1, block_size=4, num_anchors=8,
                          mask_token_id=info.vocab_size - 1, allow_text_mask_token=True)
    DFlashDrafter(config, info).save(str(tmp_path / "dflash"), "native")
    rc = run_eval(dirs, tmp_path, "--num-prompts", "2", "--num-draft-tokens", "2", "--tree-budget", "1,3,6",
                  drafter=str(tmp_path / "dflash"))
    assert rc == 0
    records = [r for r in json.loads((tmp_path / "report.json").read_text())["records"] if r["category"] == "all"]
    trees = {r["tree_budget"]: r for r in records if r.get("tree_budget") is not None}
    assert sorted(trees) == [3, 6]  # budget 1 is plain autoregression: the baseline already runs it
    for budget, record in trees.items():
        assert record["drafter"].endswith("@tree") and record["num_draft_tokens"] == budget - 1
        assert record["greedy_exact_match"] == 1.0 and record["recommended_num_draft_tokens"] is None
    capsys.readouterr()
    assert run_eval(dirs, tmp_path, "--tree-budget", "4,0", drafter=str(tmp_path / "dflash")) == 2
    err = capsys.readouterr().err
    assert "--tree-budget" in err and ">= 1" in err and len(err.strip().splitlines()) == 1, err
