"""inference/evaluation/settings.py: the settings eval, calibrate and doctor share, and `--dtype auto`."""

import dataclasses

import pytest
import torch

from inference.evaluation.eval import build_parser, parse_settings
from inference.evaluation.settings import EvalSettings, check_at_least, numbers, split


def test_dtype_auto_is_float32_on_a_cpu_and_bfloat16_on_an_accelerator():
    auto = EvalSettings(target="t")
    assert auto.torch_dtype("cpu") == torch.float32
    assert auto.torch_dtype("cuda") == torch.bfloat16  # a device name only; nothing is allocated there
    assert EvalSettings(target="t", dtype="float16").torch_dtype("cpu") == torch.float16


def test_eval_parses_its_flags_once_into_frozen_settings(tmp_path):
    args = build_parser().parse_args(["--target", "t", "--drafter", "a, b,a", "--num-draft-tokens", "auto,3",
                                      "--temperature", "0,1", "--batch-size", "1,4", "--tree-budget", "4",
                                      "--out", str(tmp_path / "r.json")])
    settings = parse_settings(args)
    assert settings.drafter == ("a", "b") and settings.num_draft_tokens == ("auto", 3)
    assert settings.temperature == (0.0, 1.0) and settings.batch_size == (1, 4) and settings.tree_budget == (4,)
    assert settings.dtype == "auto" and args.drafter == "a, b,a"  # the namespace is left as parsed
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.seed = 1


def test_list_and_bound_errors_name_the_flag():
    assert split(" x,,y ,x") == ("x", "y")
    with pytest.raises(ValueError, match="--batch-size: values must be >= 0"):
        numbers("1,-2", "--batch-size", int)
    with pytest.raises(ValueError, match="--temperature: expected comma-separated float"):
        numbers("a", "--temperature", float)
    with pytest.raises(ValueError, match="--threads must be >= 1, got 0"):
        check_at_least(("--num-prompts", None, 1), ("--threads", 0, 1))
