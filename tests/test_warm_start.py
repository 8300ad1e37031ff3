"""train.init_from (train/warm_start.py): a run starts from a trained drafter's weights, in any layout its kind reads,
with the checkpoint's architecture and the recipe's training options; what it cannot start from is refused in one
line before the target loads.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import yaml

from drafters import load_drafter
from tests.test_cli_errors import assert_one_line, no_target_load  # noqa: F401 (no_target_load: the fixture)
from tests.test_train import reset_accelerate, tiny_overrides, workdir  # noqa: F401 (workdir: the module fixture)
from train.build import build_drafter
from train.config import load_recipe
from train.warm_start import check_init_from, load_weights, warm_start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = {  # each debug recipe, one of its TRAINING_OPTIONS set otherwise than the checkpoint was trained with
    "eagle3": "drafter.ttt_steps=1", "dflash": "drafter.loss=soft", "dspark": "drafter.ce_weight=0.5",
    "mtp": "drafter.loss=hard", "medusa": "drafter.step_decay=0.5", "assistant": "drafter.num_steps=1"}


def recipe_of(kind: str, workdir, out: str, *extra: str):
    path = os.path.join(ROOT, "recipes", "debug", f"tiny_{kind}.yaml")
    return load_recipe(path, tiny_overrides(workdir, out, *extra))


@pytest.fixture(scope="module")
def target(workdir):
    from inference.engine.target import TargetModel

    return TargetModel.from_pretrained(workdir[1])


def trained_like(kind: str, workdir, target, directory: str, fmt: str = "native"):
    """A drafter of the debug recipe whose every weight is drawn at random (so no fresh build equals it), saved."""
    drafter = build_drafter(recipe_of(kind, workdir, directory + "_run"), target)
    generator = torch.Generator().manual_seed(1)
    drafter.init_from_data(torch.randint(0, 50, (target.target_info().vocab_size,), generator=generator))
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    drafter.save(directory, fmt)
    return drafter


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_starts_from_its_checkpoint_with_the_recipes_training_options(kind, workdir, target, tmp_path):
    saved = trained_like(kind, workdir, target, str(tmp_path / "ckpt"))
    recipe = recipe_of(kind, workdir, str(tmp_path / "run"), f"train.init_from={tmp_path / 'ckpt'}", KINDS[kind])
    check_init_from(recipe)
    start = warm_start(recipe, target.target_info())
    drafter = build_drafter(start.recipe, target)
    load_weights(drafter, start)
    assert drafter.state_dict().keys() == saved.state_dict().keys()
    assert all(torch.equal(value, saved.state_dict()[name]) for name, value in drafter.state_dict().items())
    option, value = KINDS[kind].removeprefix("drafter.").split("=")
    assert str(getattr(start.recipe.drafter, option)) == value != str(getattr(saved.config, option))
    assert drafter.target_layer_ids() == saved.target_layer_ids()


@pytest.mark.parametrize("kind, fmt", [("eagle3", "speculators"), ("eagle3", "eagle3"), ("dflash", "dflash"),
                                       ("medusa", "medusa")])
def test_a_run_starts_from_an_export_and_its_recipe_records_the_checkpoints_architecture(kind, fmt, workdir, target,
                                                                                         tmp_path):
    from train.build import build_trainer

    trained_like(kind, workdir, target, str(tmp_path / "export"), fmt)
    exported = load_drafter(str(tmp_path / "export"), target.target_info())
    out = tmp_path / "run"
    reset_accelerate()
    overrides = (f"train.init_from={tmp_path / 'export'}", "train.save_every=1")
    trainer = build_trainer(recipe_of(kind, workdir, str(out), *overrides, "train.max_steps=2"))
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert all(torch.equal(value, exported.state_dict()[name]) for name, value in model.state_dict().items())
    recorded = yaml.safe_load((out / "recipe.yaml").read_text())
    assert recorded["train"]["init_from"] == str(tmp_path / "export")
    assert tuple(recorded["drafter"].get("layer_ids", ())) == exported.target_layer_ids()
    final = trainer.fit()
    trainer.accelerator.end_training()
    again = load_drafter(final, target.target_info())  # trained on: its weights moved, its architecture kept
    assert again.state_dict().keys() == exported.state_dict().keys()
    assert any(not torch.equal(value, exported.state_dict()[name]) for name, value in again.state_dict().items())
    reset_accelerate()  # resumed: the architecture its checkpoint recorded, the weights of step 2, the export gone
    shutil.rmtree(tmp_path / "export")
    check_init_from(recipe_of(kind, workdir, str(out), *overrides, "train.resume_from=latest"))
    resumed = build_trainer(recipe_of(kind, workdir, str(out), *overrides, "train.max_steps=3",
                                      "train.resume_from=latest"))
    model = resumed.accelerator.unwrap_model(resumed.model)
    assert resumed.step == 2 and all(torch.equal(value, again.state_dict()[name])
                                     for name, value in model.state_dict().items())
    resumed.accelerator.end_training()


def test_what_a_run_cannot_start_from_is_refused_in_one_line_before_the_target_loads(workdir, target, tmp_path,
                                                                                     capsys, no_target_load):
    trained_like("eagle3", workdir, target, str(tmp_path / "eagle3"))
    trained_like("mtp", workdir, target, str(tmp_path / "mtp"))
    reduced = trained_like("dspark", workdir, target, str(tmp_path / "dspark"))
    reduced.reduce_draft_vocab(torch.arange(target.target_info().vocab_size), 40)  # a frequency-ranked head
    reduced.save(str(tmp_path / "dspark"))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    recipe = os.path.join(ROOT, "recipes", "debug", "tiny_eagle3.yaml")
    mtp = os.path.join(ROOT, "recipes", "debug", "tiny_mtp.yaml")
    train = ["train", recipe, *tiny_overrides(workdir, str(tmp_path / "out"))]
    error = "draftsmith train: error: train.init_from: "
    cases = [
        ([*train, f"train.init_from={tmp_path / 'nosuch'}"], f"{error}'{tmp_path / 'nosuch'}' is not a directory"),
        ([*train, f"train.init_from={tmp_path / 'run'}"],
         f"{error}{tmp_path / 'run'}: not a drafter or model directory (no config.json); it is a training run "
         "without final/ yet"),
        ([*train, f"train.init_from={tmp_path / 'mtp'}"],
         f"{error}{tmp_path / 'mtp'} holds a drafter of kind mtp and the recipe trains eagle3; set drafter.kind: mtp"),
        ([*train, f"train.init_from={tmp_path / 'eagle3'}", "drafter.draft_vocab_size=64", "drafter.num_layers=2"],
         f"{error}the checkpoint at {tmp_path / 'eagle3'} fixes the drafter's architecture and the recipe sets it "
         "otherwise: drafter.num_layers (recipe 2, checkpoint 1), drafter.draft_vocab_size (recipe 64, checkpoint "
         "128); remove those fields from the recipe"),
        ([*train, f"output.dir={tmp_path}", f"train.init_from={tmp_path / 'eagle3'}"],
         f"{error}{tmp_path / 'eagle3'} is inside output.dir, which the run writes"),
        (["train", mtp, *tiny_overrides(workdir, str(tmp_path / "out")), f"train.init_from={tmp_path / 'mtp'}",
          "drafter.init_from_native=true"],
         f"{error[:-2]} and drafter.init_from_native both give the starting weights; keep one"),
        (["train", os.path.join(ROOT, "recipes", "debug", "tiny_dspark.yaml"),
          *tiny_overrides(workdir, str(tmp_path / "out")), f"train.init_from={tmp_path / 'dspark'}"],
         f"{error}{tmp_path / 'dspark'}: drafter.draft_vocab_size: DSpark trains over the target's full vocabulary"),
        (["prepare", recipe, *tiny_overrides(workdir, str(tmp_path / "out")), f"train.init_from={tmp_path / 'mtp'}"],
         f"draftsmith prepare: error: train.init_from: {tmp_path / 'mtp'} holds a drafter of kind mtp"),
        (["estimate", recipe, *tiny_overrides(workdir, str(tmp_path / "out")), f"train.init_from={tmp_path / 'mtp'}"],
         f"draftsmith estimate: error: train.init_from: {tmp_path / 'mtp'} holds a drafter of kind mtp"),
    ]
    for argv, expected in cases:
        assert_one_line(argv, expected, capsys)


def test_estimate_and_prepare_read_the_checkpoints_architecture_without_its_weights(workdir, target, tmp_path,
                                                                                     capsys):
    """A checkpoint of 2 layers over taps [0, 3] where the recipe says 1 layer over auto taps: `estimate
    --config-only` counts its parameters and `prepare`'s features are its taps (warm_recipe, on a meta target)."""
    from inference.engine.target import TargetModel
    from train.cli import main as cli
    from train.warm_start import warm_recipe

    saved = build_drafter(recipe_of("eagle3", workdir, str(tmp_path / "a"), "drafter.num_layers=2",
                                    "drafter.layer_ids=[0,3]"), target)
    saved.save(str(tmp_path / "ckpt"))
    recipe = recipe_of("eagle3", workdir, str(tmp_path / "run"), f"train.init_from={tmp_path / 'ckpt'}")
    meta = TargetModel.from_config(workdir[1]).target_info()
    assert warm_recipe(recipe, meta).drafter.num_layers == 2
    assert build_drafter(warm_recipe(recipe, meta), target).feature_request().layer_ids == (0, 3)
    overrides = tiny_overrides(workdir, str(tmp_path / "run"), f"train.init_from={tmp_path / 'ckpt'}")
    assert cli(["estimate", os.path.join(ROOT, "recipes", "debug", "tiny_eagle3.yaml"), *overrides,
                "--config-only"]) == 0
    trained = sum(p.numel() for p in saved.parameters() if p.requires_grad)
    assert f"{trained:,} trained parameters" in capsys.readouterr().out
