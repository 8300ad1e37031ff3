"""Every command answers bad input with one line naming the field or file and what to do, exit status 2, no
traceback; `--debug` (anywhere on the command line) or DRAFTSMITH_DEBUG=1 shows the traceback instead.

docs/reliability.md lists the same inputs with the line each gets.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from train.cli import describe, main as cli, run_reporting_errors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "debug", "tiny_eagle3.yaml")
MEDUSA = os.path.join(ROOT, "recipes", "debug", "tiny_medusa.yaml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def bad_inputs(tmp_path) -> list[tuple[list[str], str]]:
    """(argv, the start of the one error line it must get)."""
    (tmp_path / "broken.yaml").write_text("target: [\n")
    (tmp_path / "empty").mkdir()
    step = tmp_path / "run" / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    missing = str(tmp_path / "nosuch")
    return [
        (["train", RECIPE, "nosuch.key=1"], "draftsmith train: error: unknown config key(s) nosuch; allowed: ["),
        (["train", RECIPE, "optim.lr=abc"], "draftsmith train: error: optim.lr: expected float, got 'abc'"),
        (["train", RECIPE, "drafter.kind=nosuch"],
         "draftsmith train: error: drafter.kind: 'nosuch' is not a registered drafter; choose one of ["),
        (["train", RECIPE, "noequals"],
         "draftsmith train: error: override 'noequals' is not of the form key.path=value"),
        (["train", f"{missing}.yaml"],
         f"draftsmith train: error: {missing}.yaml: no such file or directory; check the path"),
        (["train", str(tmp_path / "broken.yaml")],
         "draftsmith train: error: not valid YAML: while parsing a flow node expected the node content, but found "
         f"'<stream end>' in \"{tmp_path / 'broken.yaml'}\", line 2, column 1; fix the recipe there"),
        (["train", RECIPE, f"target.name_or_path={missing}"],
         f"draftsmith train: error: target '{missing}' is neither a known name"),
        (["prepare", RECIPE, "nosuch=1"], "draftsmith prepare: error: unknown config key(s) nosuch"),
        (["estimate", RECIPE, "train.batch_size=abc"],
         "draftsmith estimate: error: train.batch_size: expected int, got 'abc'"),
        (["train", RECIPE, "train.activation_checkpointing=maybe"],
         "draftsmith train: error: train.activation_checkpointing: expected a bool, got 'maybe'"),
        (["estimate", MEDUSA, "train.activation_checkpointing=true", "--no-probe"],
         "draftsmith estimate: error: train.activation_checkpointing: drafter kind 'medusa' does not checkpoint"),
        (["export", str(tmp_path / "empty"), "--format", "native", "--out", str(tmp_path / "out")],
         f"draftsmith export: error: {tmp_path / 'empty'}: not a drafter checkpoint (no config.json)"),
        (["export", str(step), "--format", "native", "--out", str(tmp_path / "out")],
         f"draftsmith export: error: {step}: not a drafter checkpoint (no config.json); it is a training checkpoint "
         f"(resume state): export the run's {tmp_path / 'run' / 'final'} instead"),
        (["doctor", missing, "--target", "debug:tiny-llama"],
         f"draftsmith doctor: error: {missing}: not a drafter or model directory (no config.json)"),
        (["calibrate", missing, "--target", "debug:tiny-llama", "--prompts", "mt_bench", "--out", str(tmp_path / "c")],
         f"draftsmith calibrate: error: drafter '{missing}' is neither"),
    ]


def test_each_command_answers_bad_input_in_one_line_with_status_2(tmp_path, capsys):
    for argv, expected in bad_inputs(tmp_path):
        assert cli(argv) == 2, argv
        stderr = capsys.readouterr().err.replace("\r", "\n")  # progress bars of model loading may come first
        assert "Traceback" not in stderr, argv
        errors = [line for line in stderr.splitlines() if ": error: " in line]
        assert len(errors) == 1 and errors[0].startswith(expected), (argv, errors)


def test_debug_flag_or_environment_shows_the_traceback(monkeypatch):
    argv = ["train", RECIPE, "nosuch.key=1"]
    for debug_argv in ([*argv, "--debug"], ["--debug", *argv]):
        with pytest.raises(ValueError, match="unknown config key"):
            cli(debug_argv)
    monkeypatch.setenv("DRAFTSMITH_DEBUG", "1")
    with pytest.raises(ValueError, match="unknown config key"):
        cli(argv)


def test_a_bug_is_not_dressed_as_a_user_error():
    def broken(argv):
        raise RuntimeError("an internal invariant broke")

    with pytest.raises(RuntimeError):
        run_reporting_errors("draftsmith train", broken, [])


def test_os_errors_lead_with_the_file_and_say_what_to_do():
    full = OSError(errno.ENOSPC, "No space left on device", "/data/run/metrics.jsonl")
    assert describe(full) == ("/data/run/metrics.jsonl: no space left on device; free space there or choose another "
                              "output directory")
    denied = PermissionError(errno.EACCES, "Permission denied", "/data/run")
    assert describe(denied) == "/data/run: permission denied; check the path (and its permissions)"
    assert describe(FileNotFoundError("prompt file x.jsonl not found")) == "prompt file x.jsonl not found"


def test_the_accelerate_entry_point_prints_one_line():
    """As `accelerate launch -m train` starts it: `python -m train` (its own copy of the error handling)."""
    plain = subprocess.run([sys.executable, "-m", "train", RECIPE, "nosuch.key=1"], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 2 and plain.stdout == ""
    assert plain.stderr.splitlines() == [plain.stderr.strip()]
    assert plain.stderr.startswith("train: error: unknown config key(s) nosuch; allowed: [")
