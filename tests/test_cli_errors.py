"""Every command answers bad input with one line naming the field or file and what to do, exit status 2, no
traceback; `--debug` (anywhere on the command line) or DRAFTSMITH_DEBUG=1 shows the traceback instead.

docs/reliability.md lists the same inputs with the line each gets. The mistakes a new user makes (issue 39: a typo'd
command, a recipe value out of range, a tracker that is not installed, a training run or step given where a drafter
is wanted, a drafter for another target) must each be refused before the target loads: those tests put a tripwire on
`TargetModel.from_pretrained`.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

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
        (["train", RECIPE, f"data.mix=[{{path: {missing}.jsonl}}]"],
         f"draftsmith train: error: data.mix[0].path: data file '{missing}.jsonl' does not exist; write the target's "
         "answers there first (draftsmith prepare RECIPE data.path=PROMPTS data.regenerated_path=FILE data.mix=[] "
         "regenerate.num_conversations=N regenerate.heldout_conversations=0)"),
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
         f"(resume state): pass the run's {tmp_path / 'run' / 'final'}, or turn this step into a drafter with "
         f"`draftsmith export {step} --format native --out DIR`"),
        (["doctor", missing, "--target", "debug:tiny-llama"],
         f"draftsmith doctor: error: {missing}: not a drafter or model directory (no config.json)"),
        (["calibrate", missing, "--target", "debug:tiny-llama", "--prompts", "mt_bench", "--out", str(tmp_path / "c")],
         f"draftsmith calibrate: error: DRAFTER '{missing}': drafter '{missing}' is neither"),
    ]


def test_each_command_answers_bad_input_in_one_line_with_status_2(tmp_path, capsys):
    for argv, expected in bad_inputs(tmp_path):
        assert cli(argv) == 2, argv
        stderr = capsys.readouterr().err.replace("\r", "\n")  # progress bars of model loading may come first
        assert "Traceback" not in stderr, argv
        errors = [line for line in stderr.splitlines() if ": error: " in line]
        assert len(errors) == 1 and errors[0].startswith(expected), (argv, errors)


def assert_one_line(argv: list[str], expected: str, capsys) -> None:
    assert cli(argv) == 2, argv
    stderr = capsys.readouterr().err.replace("\r", "\n")
    assert "Traceback" not in stderr and "usage:" not in stderr, (argv, stderr)
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith(expected), (argv, errors, expected)


@pytest.fixture
def no_target_load(monkeypatch):
    """A tripwire: loading any target fails the test, so a refusal that passes came before the expensive work."""
    from inference.engine.target import TargetModel

    def loaded(*args, **kwargs):
        raise AssertionError("the target was loaded before the bad input was refused")

    monkeypatch.setattr(TargetModel, "from_pretrained", loaded)


def config_only_dir(tmp_path) -> str:
    """A model directory holding the debug target's config.json and nothing else (no weights, no tokenizer)."""
    import shutil

    from inference.assets.debug_target import resolve_debug_target

    (tmp_path / "config_only").mkdir()
    shutil.copy(os.path.join(resolve_debug_target("debug:tiny-llama"), "config.json"), tmp_path / "config_only")
    return str(tmp_path / "config_only")


def missing_tracker() -> str | None:
    """A tracker accelerate knows that is not installed here (None when every one is)."""
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    available = {str(LoggerType(tracker)) for tracker in get_available_trackers()}
    return next((name for name in ("wandb", "aim", "mlflow") if name not in available), None)


def test_recipe_and_command_line_mistakes_answer_before_the_target_loads(tmp_path, capsys, no_target_load):
    train = ["train", RECIPE, f"output.dir={tmp_path / 'run'}"]
    cases = [
        (["trian"], "draftsmith: error: unknown command 'trian'; did you mean 'train'?"),
        (["train"], "draftsmith train: error: the following arguments are required: recipe (draftsmith train --help"),
        (["prepare"], "draftsmith prepare: error: the following arguments are required: recipe ("),
        ([*train, "train.batch_size=-1"], "draftsmith train: error: train.batch_size must be >= 1, got -1"),
        ([*train, "train.epochs=0"], "draftsmith train: error: train.epochs must be > 0, got 0"),
        ([*train, "data.max_length=1"], "draftsmith train: error: data.max_length must be >= 2 (tokens), got 1"),
        (["estimate", RECIPE, f"target.name_or_path={config_only_dir(tmp_path)}"],
         f"draftsmith estimate: error: target {tmp_path / 'config_only'}: no tokenizer could be read there"),
        (["train", RECIPE, f"output.dir={os.devnull}/run"],
         f"draftsmith train: error: output.dir: {os.devnull}/run cannot be created: {os.devnull} is a file"),
        (["train", RECIPE, f"output.dir={os.devnull}"],
         f"draftsmith train: error: output.dir: {os.devnull} is a file, not a directory"),
        (["prepare", RECIPE, "features.mode=offline", f"features.cache_dir={os.devnull}/features"],
         f"draftsmith prepare: error: features.cache_dir: {os.devnull}/features cannot be created: {os.devnull} is "),
        ([*train, "train.grad_accum=0"], "draftsmith train: error: train.grad_accum must be >= 1, got 0"),
        ([*train, "train.log_every=0"], "draftsmith train: error: train.log_every must be >= 1, got 0"),
        ([*train, "train.keep_last=0"], "draftsmith train: error: train.keep_last must be >= 1 (null keeps every"),
        ([*train, "optim.grad_clip=0"], "draftsmith train: error: optim.grad_clip must be > 0 (null: no clipping)"),
        ([*train, "optim.lr=-1"], "draftsmith train: error: optim.lr must be >= 0, got -1"),
        ([*train, "schedule.min_lr_ratio=2"], "draftsmith train: error: schedule.min_lr_ratio must be in [0, 1]"),
        ([*train, "eval.max_new_tokens=0"], "draftsmith train: error: eval.max_new_tokens must be >= 1, got 0"),
        ([*train, "regenerate.top_p=0"], "draftsmith train: error: regenerate.top_p must be in (0, 1], got 0"),
        ([*train, "logging.trackers=[nosuch]"], "draftsmith train: error: logging.trackers: 'nosuch' is not a tracker"),
        ([*train, f"train.resume_from={tmp_path / 'nosuch'}"],
         f"draftsmith train: error: train.resume_from: '{tmp_path / 'nosuch'}' is not a checkpoint directory"),
        ([*train, "eval.prompts=nosuch"], "draftsmith train: error: prompt set 'nosuch' is neither a builtin"),
        (["estimate", RECIPE, "train.batch_size=0", "--no-probe"],
         "draftsmith estimate: error: train.batch_size must be >= 1, got 0"),
        (["eval", "--target", "debug:tiny-llama", "--dtype", "fp16"],
         "draftsmith eval: error: argument --dtype: invalid choice: 'fp16' (choose from"),
        (["eval", "--target", "debug:tiny-llama", "--out", "/dev/null/report.json"],
         "draftsmith eval: error: --out: cannot create the folder of /dev/null/report.json"),
        (["assets", "--cache-dir", os.devnull], f"draftsmith assets: error: --cache-dir: {os.devnull} is a file"),
        (["assets", "--draft-model-layers", "0"], "draftsmith assets: error: --draft-model-layers must be >= 1, got 0"),
        (["assets", "--bogus"], "draftsmith assets: error: unrecognized arguments: --bogus"),
    ]
    tracker = missing_tracker()
    if tracker is not None:  # accelerate would drop it without a word
        cases.append(([*train, f"logging.trackers=[{tracker}]"],
                      f"draftsmith train: error: logging.trackers: {tracker} is not installed here; pip install "))
    if importlib.util.find_spec("vllm") is None:
        cases.append((["prepare", RECIPE, "regenerate.use_vllm=true", f"data.regenerated_path={tmp_path / 'r.jsonl'}"],
                      "draftsmith prepare: error: regenerate.use_vllm is true but vllm is not importable here"))
    for argv, expected in cases:
        assert_one_line(argv, expected, capsys)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A native EAGLE-3 checkpoint in a run directory's final/, trained for the debug target as found in a Hub cache
    snapshot (models--org--tiny/snapshots/rev), a step directory beside it, and a real HF target of other sizes."""
    from drafters import DRAFTERS
    from inference.assets.store import resolve_target
    from inference.engine.target import TargetModel
    from tests.conftest import make_tiny_model

    root = tmp_path_factory.mktemp("cli")
    snapshot = root / "hub" / "models--org--tiny" / "snapshots" / "rev"
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(resolve_target("debug:tiny-llama"), target_is_directory=True)
    info = TargetModel.from_pretrained(str(snapshot)).target_info()
    drafter = DRAFTERS["eagle3"](DRAFTERS["eagle3"].Config(draft_vocab_size=128), info)
    drafter.save(str(root / "run" / "final"), "native")
    (root / "run" / "checkpoints" / "step_2").mkdir(parents=True)
    other = make_tiny_model(dtype=torch.float32)  # vocabulary 256, not the debug target's 260
    other.save_pretrained(root / "other")
    return root


def test_a_run_or_a_drafter_for_another_target_is_refused_before_the_target_loads(trained, capsys, no_target_load):
    run, final, step = trained / "run", trained / "run" / "final", trained / "run" / "checkpoints" / "step_2"
    other, out = str(trained / "other"), str(trained / "out")
    eval_ = ["eval", "--target", "debug:tiny-llama", "--out", str(trained / "eval" / "r.json"), "--drafter"]
    with open(final / "config.json") as f:
        trained_for = json.load(f)["target"]["name_or_path"]
    another = (f"trained for target {trained_for} (hidden_size 64, vocab_size 260), not {other} (hidden_size 64, "
               f"vocab_size 256); use it with that target, or train a drafter for {other}")
    cases = [
        ([*eval_, str(run)], f"draftsmith eval: error: --drafter '{run}': {run}: not a drafter or model directory "
                             f"(no config.json); it is a training run: pass its {final}"),
        ([*eval_, str(step)], f"draftsmith eval: error: --drafter '{step}': {step}: not a drafter or model directory "
                              f"(no config.json); it is a training checkpoint (resume state): pass the run's {final}, "
                              f"or turn this step into a drafter with `draftsmith export {step} --format native"),
        ([*eval_, str(trained / "nosuch")], f"draftsmith eval: error: --drafter '{trained / 'nosuch'}': drafter "),
        (["eval", "--target", other, "--drafter", f"ngram,{final}"],
         f"draftsmith eval: error: --drafter '{final}': {final}: {another}"),
        (["doctor", str(final), "--target", other], f"draftsmith doctor: error: DRAFTER '{final}': {final}: {another}"),
        (["calibrate", str(run), "--target", "debug:tiny-llama", "--out", str(trained / "cal")],
         f"draftsmith calibrate: error: DRAFTER '{run}': {run}: not a drafter or model directory (no config.json); "
         f"it is a training run: pass its {final}"),
        (["export", str(run), "--format", "native", "--out", out],
         f"draftsmith export: error: {run}: not a drafter checkpoint (no config.json); it is a training run: pass "
         f"its {final}"),
        (["export", str(final), "--format", "dflash", "--out", out],
         f"draftsmith export: error: --format 'dflash': {final} holds drafter kind eagle3, which writes native, "),
        (["export", str(final), "--format", "native", "--out", out, "--target", other],
         f"draftsmith export: error: {final}: {another}"),
        (["export", str(final), "--format", "native", "--out", os.devnull],
         f"draftsmith export: error: --out: {os.devnull} is a file; pass a directory"),
        (["export", str(final), "--format", "native", "--out", str(run)],
         f"draftsmith export: error: --out: {run} holds the checkpoint being exported"),
        (["export", str(final), "--format", "native", "--out", str(trained / "hub")],
         f"draftsmith export: error: --out: {trained / 'hub'} is a directory with other files"),
        (["export", str(final), "--format", "native", "--out", f"{os.devnull}/out"],
         f"draftsmith export: error: --out: {os.devnull}/out cannot be created: {os.devnull} is a file"),
        (["calibrate", str(final), "--target", "debug:tiny-llama", "--out", str(trained / "cal")],
         f"draftsmith calibrate: error: DRAFTER '{final}': not a drafter with a confidence head (DSpark)"),
    ]
    for argv, expected in cases:
        assert_one_line(argv, expected, capsys)


def test_speculators_export_names_the_hub_id_of_a_hub_target(trained, capsys):
    """The verifier vLLM serves is the Hub id the target came from, not the training machine's local path."""
    out = trained / "speculators"
    assert cli(["export", str(trained / "run" / "final"), "--format", "speculators", "--out", str(out)]) == 0
    with open(out / "config.json") as f:
        assert json.load(f)["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    assert "warning" not in capsys.readouterr().err
    named = trained / "speculators_named"
    assert cli(["export", str(trained / "run" / "final"), "--format", "speculators", "--out", str(named),
                "--verifier-name", "org/served"]) == 0
    with open(named / "config.json") as f:
        assert json.load(f)["speculators_config"]["verifier"]["name_or_path"] == "org/served"


def test_hub_ids_are_read_from_names_and_cache_paths(tmp_path):
    from inference.assets.store import SMOLLM2_NAME, hub_name

    assert hub_name("smollm2-135m-instruct") == hub_name("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert hub_name("huggingfacetb/smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_name("/cache/hub/models--meta-llama--Llama-3.1-8B/snapshots/0e9e3/") == "meta-llama/Llama-3.1-8B"
    assert hub_name("/data/models/Llama-3.1-8B") is None
    converted = tmp_path / "models" / SMOLLM2_NAME
    converted.mkdir(parents=True)
    assert hub_name(str(converted)) is None  # no completion marker: not our conversion
    (converted / "draftsmith_complete.json").write_text("{}")
    assert hub_name(str(converted)) == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_every_bounded_recipe_field_exists():
    """A renamed field would otherwise leave its bound unchecked without a word."""
    import dataclasses

    from train.config import Recipe, RegenerateConfig
    from train.recipe_checks import NUMBER_BOUNDS

    sections = {f.name: f.type for f in dataclasses.fields(Recipe)}
    for dotted, _, _ in NUMBER_BOUNDS:
        section, name = dotted.split(".")
        owner = RegenerateConfig if section == "regenerate" else sections[section]
        owner = getattr(sys.modules["train.config"], owner) if isinstance(owner, str) else owner
        assert name in {f.name for f in dataclasses.fields(owner)}, dotted


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
