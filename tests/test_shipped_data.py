"""Shipped regenerated data (train/data/shipped.py): `draftsmith prepare` packs a .jsonl.gz with its manifest and
held-out questions, resumes from the gzip alone without redoing a row, reproduces it byte for byte (greedy), and
training refuses a file that does not match its manifest or its target's tokenizer, and never sees a held-out id."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from accelerate import PartialState

from inference.evaluation.prompts import load_questions
from train.cli import main as cli
from train.config import load_recipe
from train.data.dataset import build_dataset
from train.data.shipped import check, heldout_ids, histogram, read_lines, unpack_to_working, working_path
from train.regeneration import regenerate_data, regenerate_share, regeneration_model

RECIPE = str(Path(__file__).resolve().parent.parent / "recipes" / "debug" / "tiny_eagle3.yaml")


def _chats(tmp_path) -> str:
    chats = tmp_path / "chats.jsonl"
    rows = []
    for index in range(8):
        turns = [{"role": "user", "content": f"question {index}.{turn} " + "word " * index}
                 for turn in range(1 + index % 3)]
        rows.append({"id": f"c{index}", "messages": [m for turn in turns for m in
                                                       (turn, {"role": "assistant", "content": "old"})]})
    rows.append({"id": "c8", "messages": rows[1]["messages"]})  # a repeated first turn: dropped before answering
    chats.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(chats)


def _recipe(tmp_path, name: str, num_conversations: int, *more: str):
    return load_recipe(RECIPE, [f"data.path={_chats(tmp_path)}", f"data.regenerated_path={tmp_path / name}",
                                f"regenerate.num_conversations={num_conversations}", "regenerate.max_new_tokens=5",
                                "regenerate.batch_size=2", "regenerate.unique_prompts=true",
                                "regenerate.heldout_conversations=2", "data.num_eval_samples=1", *more])


def test_pack_resume_from_the_gzip_alone_and_reproduce(tmp_path):
    state = PartialState(cpu=True)
    whole = _recipe(tmp_path, "whole.jsonl.gz", 8)
    regenerate_data(whole, state)
    manifest = check(whole.data.regenerated_path)
    assert manifest["records"] == 8 and manifest["complete"]  # c8 repeats c1's first turn: not among the 8
    assert "c8" not in {json.loads(line)["id"] for line in read_lines(whole.data.regenerated_path).splitlines()}
    counts = manifest["counts"]
    assert counts["repeated_first_turns"] == 0 and counts["conversations"] == 8
    assert sum(counts["histograms"]["answer_tokens"].values()) == counts["assistant_turns"]
    heldout = [json.loads(line) for line in Path(tmp_path / "whole.heldout.jsonl").read_text().splitlines()]
    assert [q["question_id"] for q in heldout] == manifest["heldout"]["ids"] and len(heldout) == 2

    part = _recipe(tmp_path, "part.jsonl.gz", 3)
    regenerate_data(part, state)
    os.remove(working_path(part.data.regenerated_path))  # what ships: the gzip and its manifest only
    rest = _recipe(tmp_path, "part.jsonl.gz", 8)
    unpack_to_working(rest.data.regenerated_path)
    model, tokenizer = regeneration_model(rest, state)
    assert regenerate_share(rest, model, tokenizer, 0, 1)["conversations"] == 5  # the 3 shipped rows are not redone
    regenerate_data(rest, state)
    assert Path(tmp_path / "part.jsonl.gz").read_bytes() == Path(tmp_path / "whole.jsonl.gz").read_bytes()


def test_a_complete_file_needs_no_engine(tmp_path, capsys):
    """Every sampled conversation written: prepare builds no model, so regenerate.use_vllm needs no vLLM here."""
    state = PartialState(cpu=True)
    regenerate_data(_recipe(tmp_path, "done.jsonl.gz", 4), state)
    packed = Path(tmp_path / "done.jsonl.gz").read_bytes()
    os.remove(working_path(str(tmp_path / "done.jsonl.gz")))
    capsys.readouterr()
    regenerate_data(_recipe(tmp_path, "done.jsonl.gz", 4, "regenerate.use_vllm=true"), state)
    assert "nothing to regenerate" in capsys.readouterr().out
    assert Path(tmp_path / "done.jsonl.gz").read_bytes() == packed


def test_training_refuses_a_file_unlike_its_manifest_and_never_sees_held_out_ids(tmp_path, capsys):
    state = PartialState(cpu=True)
    recipe = _recipe(tmp_path, "data.jsonl.gz", 8)
    regenerate_data(recipe, state)
    _, tokenizer = regeneration_model(recipe, state)
    data = build_dataset(tokenizer, recipe.data)
    held = heldout_ids(recipe.data.regenerated_path)
    assert len(held) == 2 and data.counts["held_out"] == 2
    answered = check(recipe.data.regenerated_path)["counts"]["answered"]
    assert data.counts["records"] == 8 and len(data.train) + len(data.eval) <= answered - 2

    path = recipe.data.regenerated_path
    lines = read_lines(path).splitlines(keepends=True)
    with gzip.open(path, "wb") as f:
        f.writelines(lines[:-1])  # cut off
    with pytest.raises(ValueError, match=r"data\.jsonl\.gz does not match its manifest .*git checkout"):
        build_dataset(tokenizer, recipe.data)
    argv = ["train", RECIPE, *[f"{k}={v}" for k, v in (("data.path", recipe.data.path), ("data.regenerated_path", path))]]
    assert cli(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "does not match its manifest" in errors[0]

    with gzip.open(path, "wb") as f:
        f.writelines(lines)
    manifest_path = tmp_path / "data.manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "tokenizer": "another"}))
    with pytest.raises(ValueError, match="regenerated by a target with another tokenizer"):
        build_dataset(tokenizer, recipe.data)


def test_histogram_bins():
    assert histogram([0, 31, 32, 255, 256, 5000]) == {"0-31": 2, "32-63": 1, "64-127": 0, "128-255": 1,
                                                      "256-511": 1, "512-1023": 0, "1024-2047": 0, "2048+": 1}


def test_the_shipped_math_prompts_are_gsm8k_train_questions_none_of_them_evaluated():
    """recipes/smollm2/data/gsm8k_train_questions.jsonl.gz: 7,473 single non-empty user turns with unique ids (prompts
    for `draftsmith prepare` to answer), none of them a question of an evaluation set that asks GSM8K-style maths."""
    path = Path(__file__).resolve().parents[1] / "recipes" / "smollm2" / "data" / "gsm8k_train_questions.jsonl.gz"
    with gzip.open(path, "rt") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 7473 and len({r["id"] for r in records}) == 7473
    assert all([m["role"] for m in r["messages"]] == ["user"] and r["messages"][0]["content"] for r in records)
    asked = {" ".join(r["messages"][0]["content"].split()) for r in records}
    for name, category in (("gsm8k", None), ("spec_bench", "math_reasoning")):
        _, questions = load_questions(name, categories=[category] if category else None)
        assert questions and not asked & {" ".join(q.turns[0].split()) for q in questions}, name
    assert (path.parent / "gsm8k_train_questions.LICENSE").read_text().startswith("MIT License")
