"""The training loop on a tiny random target (the debug recipe's): exact resume, offline == online features,
cache checksums, NaN stops, target checks, data order across processes, export, and (slow) 2-process DDP == 1 process.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from drafters import DRAFTERS, load_drafter
from train.config import Derived, load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_RECIPE = os.path.join(ROOT, "recipes", "debug", "tiny_eagle3.yaml")
WORDS = ("the cat sat on a mat and then it ran to see what was there near old red house by one tree while "
         "rain fell slowly over quiet hills so we wrote code to count every word twice").split()


def write_chats(path: str, num: int = 40, seed: int = 0) -> None:
    """Seeded OpenAI-format conversations of simple words (one or two turns)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num):
            messages = []
            for _ in range(rng.choice((1, 2))):
                messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 8)))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(8, 20)))})
            f.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A built debug target directory and a small chat file, shared by the module's tests."""
    from inference.assets.debug_target import resolve_debug_target

    root = tmp_path_factory.mktemp("train")
    target_dir = resolve_debug_target("debug:tiny-llama", cache_dir=str(root / "cache"))
    write_chats(str(root / "chats.jsonl"))
    return root, target_dir


def tiny_overrides(workdir, out: str, *extra: str) -> list[str]:
    root, target_dir = workdir
    return [f"target.name_or_path={target_dir}", f"data.path={root / 'chats.jsonl'}", "data.max_length=160",
            "data.num_samples=null", "data.num_eval_samples=4", f"data.cache_dir={root / 'datasets'}",
            f"output.dir={out}", "train.batch_size=2", "train.epochs=null", "train.max_steps=6", "train.log_every=2",
            "train.save_every=null", "train.eval_every=null", "train.keep_last=null", "eval.num_prompts=0",
            "eval.num_batches=1", "schedule.warmup_steps=2", *extra]


def reset_accelerate() -> None:
    """Each test builds its own Accelerator in this one process."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def run(workdir, out: str, *extra: str):
    from train.build import build_trainer

    reset_accelerate()
    trainer = build_trainer(load_recipe(DEBUG_RECIPE, tiny_overrides(workdir, out, *extra)))
    final_dir = trainer.fit()
    trainer.accelerator.end_training()
    return trainer, final_dir


def weights(directory: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(directory, "model.safetensors"))


def test_debug_target_is_an_ordinary_model_directory(workdir):
    from transformers import AutoTokenizer

    from inference.engine.target import TargetModel

    _, target_dir = workdir
    target = TargetModel.from_pretrained(target_dir)
    info = target.target_info()
    assert (info.hidden_size, info.num_layers, info.vocab_size) == (64, 4, 260)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "héllo"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text == "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_data_order_of_two_processes_equals_one_process_with_accumulation():
    from train.data.dataset import epoch_order, step_indices

    order = epoch_order(40, seed=3, epoch=1)
    assert sorted(order) == list(range(40)) and order != epoch_order(40, seed=3, epoch=2)
    one = Derived(world_size=1, grad_accum=2, global_batch_size=4, steps_per_epoch=10, max_steps=10)
    two = Derived(world_size=2, grad_accum=1, global_batch_size=4, steps_per_epoch=10, max_steps=10)
    for step in range(10):
        single = step_indices(order, step, one, rank=0, batch_size=2)
        assert [step_indices(order, step, two, rank=r, batch_size=2)[0] for r in (0, 1)] == single


def test_resume_is_bitwise_exact_and_export_loads(workdir, tmp_path):
    full, final_dir = run(workdir, str(tmp_path / "full"), "train.save_every=3",
                          "train.phases=[{until_fraction: 0.5, drafter: {ttt_steps: 1}}]")
    assert sorted(os.listdir(tmp_path / "full" / "checkpoints")) == ["step_3", "step_6"]
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_3", resumed_dir / "checkpoints" / "step_3")
    resumed, resumed_final = run(workdir, str(resumed_dir), "train.save_every=3", "train.resume_from=latest",
                                 "train.phases=[{until_fraction: 0.5, drafter: {ttt_steps: 1}}]")
    logged = [json.loads(line)["step"] for line in open(resumed_dir / "metrics.jsonl")]
    assert resumed.step == 6 and min(logged) == 4  # it continued from step 3, it did not start over
    expected, got = weights(final_dir), weights(resumed_final)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    middle = weights(str(resumed_dir / "checkpoints" / "step_3"))
    assert not torch.equal(middle["fc.weight"], expected["fc.weight"])  # steps 4..6 did change the weights
    # the phase changed ttt_steps during training only: the recipe and the export keep the configured value
    assert full.recipe.drafter.ttt_steps == 3 and full.model.config.ttt_steps == 3
    with open(os.path.join(final_dir, "config.json")) as f:
        assert json.load(f)["drafter_config"]["ttt_steps"] == 3
    assert load_recipe(os.path.join(final_dir, "recipe.yaml")).train.max_steps == 6
    assert os.path.isfile(tmp_path / "full" / "checkpoints" / "step_3" / "recipe.yaml")
    drafter = load_drafter(final_dir, full.target.target_info())
    assert type(drafter) is DRAFTERS["eagle3"] and torch.equal(drafter.fc.weight, expected["fc.weight"])
    lines = [json.loads(line) for line in open(tmp_path / "full" / "metrics.jsonl")]
    assert any("train/loss" in line for line in lines) and "eval/sim_accept_length" in lines[-1]
    # `draftsmith export` writes every serving format from the native checkpoint, and each loads back identically
    from train.cli import main as cli

    for fmt in ("speculators", "eagle3", "native"):
        out = tmp_path / f"export_{fmt}"
        assert cli(["export", final_dir, "--format", fmt, "--out", str(out), "--verifier-name", "org/tiny"]) == 0
        again = load_drafter(str(out), full.target.target_info())
        assert torch.equal(again.fc.weight, drafter.fc.weight) and torch.equal(again.d2t, drafter.d2t)
    with open(tmp_path / "export_speculators" / "config.json") as f:
        speculators = json.load(f)
    assert "model_type" not in speculators
    assert speculators["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    # a training checkpoint (resume state) exports too: its drafter rebuilt from its recipe and weights
    for step, reference in (("step_3", middle), ("step_6", expected)):
        out = tmp_path / f"export_{step}"
        assert cli(["export", str(tmp_path / "full" / "checkpoints" / step), "--format", "native", "--out", str(out)]) == 0
        again = load_drafter(str(out), full.target.target_info())
        assert again.config.ttt_steps == 3 and all(torch.equal(again.state_dict()[k], reference[k]) for k in reference)


def test_checkpoint_from_another_target_is_refused(workdir, tmp_path):
    from inference.engine.target import TargetModel
    from tests.conftest import make_tiny_model
    from train.fit.checkpoint import check_target

    trainer, _ = run(workdir, str(tmp_path / "run"), "train.max_steps=2", "train.save_every=2")
    checkpoint = os.path.join(tmp_path, "run", "checkpoints", "step_2")
    check_target(checkpoint, trainer.target.target_info())
    other = TargetModel(make_tiny_model(), name_or_path=trainer.target.name_or_path).target_info()
    with pytest.raises(ValueError, match="another target: target vocab_size is 260 there but 256"):
        check_target(checkpoint, other)


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_checkpoint(workdir, tmp_path):
    out = tmp_path / "nan"
    with pytest.raises(FloatingPointError, match=r"at step 2\b.*step_1"):
        run(workdir, str(out), "optim.lr=1e30", "optim.grad_clip=null", "schedule.kind=constant",
            "schedule.warmup_steps=0", "train.save_every=1")
    assert sorted(os.listdir(out / "checkpoints")) == ["step_1"]
    assert all(torch.isfinite(t).all() for t in weights(str(out / "checkpoints" / "step_1")).values())


def test_offline_cache_equals_online_and_trains_the_same(workdir, tmp_path):
    from train import prepare
    from train.build import build_trainer

    cache = tmp_path / "features"
    offline = tiny_overrides(workdir, str(tmp_path / "off"), "features.mode=offline", f"features.cache_dir={cache}")
    reset_accelerate()
    assert prepare.main([DEBUG_RECIPE, *offline]) == 0
    assert prepare.main([DEBUG_RECIPE, *offline]) == 0  # resumable: a second run finds everything cached
    with open(cache / "train" / "index-rank0.json") as f:
        assert len(json.load(f)["shards"]) == 1
    reset_accelerate()
    trainer = build_trainer(load_recipe(DEBUG_RECIPE, offline))
    for batch in trainer.micro_batches(0) + trainer.micro_batches(1):
        online, cached = trainer.train_features.online(batch), trainer.train_features(batch)
        mask = batch["attention_mask"].bool()
        assert torch.equal(online["target_argmax"][mask], cached["target_argmax"][mask])
        for key in ("final_hidden",):
            torch.testing.assert_close(cached[key][mask], online[key][mask], rtol=1e-5, atol=1e-5)
        for layer_id, hidden in online["hidden"].items():
            torch.testing.assert_close(cached["hidden"][layer_id][mask], hidden[mask], rtol=1e-5, atol=1e-5)
    trainer.accelerator.end_training()
    _, offline_final = run(workdir, str(tmp_path / "off"), "features.mode=offline", f"features.cache_dir={cache}")
    _, online_final = run(workdir, str(tmp_path / "on"))
    expected, got = weights(online_final), weights(offline_final)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)


def test_hybrid_computes_the_first_epoch_and_reads_the_cache_after(workdir, tmp_path):
    small = ("data.num_samples=8", "train.max_steps=6")  # 4 steps per epoch: the second epoch reads the cache
    hybrid, hybrid_final = run(workdir, str(tmp_path / "hybrid"), *small, "features.mode=hybrid",
                               f"features.cache_dir={tmp_path / 'cache'}")
    assert len(hybrid.train_features.cache) == 8 and hybrid.derived.steps_per_epoch == 4
    assert len(hybrid.train_features.cache.buffer) == 0  # flushed at the epoch end
    _, online_final = run(workdir, str(tmp_path / "online"), *small)
    expected, got = weights(online_final), weights(hybrid_final)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)


def test_cache_checksum_and_stale_data_are_detected(workdir, tmp_path):
    from drafters.base import FeatureRequest
    from inference.engine.target import TargetModel
    from train.features.cache import FeatureCache, FeatureProvider, cache_meta

    target = TargetModel.from_pretrained(workdir[1])
    request = FeatureRequest(layer_ids=(1, 3), top_k_logits=4)  # top-k logits are served like hidden states
    meta = cache_meta(target.target_info(), request, torch.float32, num_samples=4)
    cache = FeatureCache(str(tmp_path / "c"), meta)
    hybrid = FeatureProvider("hybrid", target, request, cache)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]), "sample_index": torch.tensor([0, 1]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    first = hybrid(batch)  # computed online, written
    cache.flush()
    again = FeatureProvider("offline", target, request, FeatureCache(str(tmp_path / "c"), meta))(batch)
    assert torch.equal(first["hidden"][3], again["hidden"][3])
    assert first["top_k"][1].shape == (2, 4, 4)
    assert torch.equal(first["top_k"][1], again["top_k"][1])
    torch.testing.assert_close(first["top_k"][0], again["top_k"][0])
    assert torch.equal(first["top_k"][1][..., 0], first["target_argmax"])
    stale = dict(batch, input_ids=torch.tensor([[5, 6, 7, 9], [9, 10, 0, 0]]))
    with pytest.raises(ValueError, match="sample 0 holds other tokens"):
        FeatureProvider("offline", target, request, FeatureCache(str(tmp_path / "c"), meta))(stale)
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    (old_dir / "meta.json").write_text(json.dumps({"format": 1, **meta}))  # records named h{id}, last, topv, topi
    with pytest.raises(ValueError, match=r"written by another draftsmith version \(format 1, this one reads 2\); "
                                         r"rebuild it: .* rerun `draftsmith prepare RECIPE`"):
        FeatureCache(str(old_dir), meta)
    with pytest.raises(ValueError, match="top_k_logits is 4 but this run needs 0"):
        FeatureCache(str(tmp_path / "c"), {**meta, "top_k_logits": 0})
    with pytest.raises(ValueError, match="layer ids \\[2\\] were not stored"):
        FeatureCache(str(tmp_path / "c"), {**meta, "layer_ids": [1, 2, 3]})
    shard = tmp_path / "c" / "rank0-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        FeatureProvider("offline", target, request, FeatureCache(str(tmp_path / "c"), meta))(batch)


def test_prepare_regenerates_answers_that_training_then_reads(workdir, tmp_path):
    from train import prepare
    from train.build import build_trainer

    regenerated = tmp_path / "regenerated.jsonl"
    overrides = tiny_overrides(workdir, str(tmp_path / "run"), f"data.regenerated_path={regenerated}",
                               "regenerate={num_conversations: 12, max_new_tokens: 6, batch_size: 4}")
    reset_accelerate()
    assert prepare.main([DEBUG_RECIPE, *overrides]) == 0
    records = [json.loads(line) for line in open(regenerated)]
    assert len(records) == 12 and all(r["messages"][-1]["role"] == "assistant" for r in records)
    reset_accelerate()
    trainer = build_trainer(load_recipe(DEBUG_RECIPE, overrides))
    assert trainer.data.counts["records"] == 12
    trainer.accelerator.end_training()


def counted_reads(call, monkeypatch, folders: tuple[str, ...]):
    """(call(), [(read, file)]) of each host read of a tensor's value (item, float, int, bool, tolist) made directly
    from a file under one of `folders` while call() runs."""
    reads = []
    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "nonzero", "cpu"):
            original = getattr(torch.Tensor, name)

            def wrapped(self, *args, _original=original, _name=name, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if any(os.path.join(ROOT, folder) in caller for folder in folders):
                    reads.append((_name, os.path.relpath(caller, ROOT)))
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, wrapped)
        return call(), reads


def test_train_metrics_are_read_once_per_log_line_not_per_micro_batch(workdir, tmp_path, monkeypatch):
    """The loop and the shared losses leave every metric on the device: two micro-batches read nothing, the step's
    stop flags (with the agreed clock) are one read, and a log line reads its whole interval in one transfer."""
    from train.build import build_trainer
    from train.fit.loop import LogInterval

    reset_accelerate()
    trainer = build_trainer(load_recipe(DEBUG_RECIPE, tiny_overrides(workdir, str(tmp_path), "train.grad_accum=2")))
    ours = ("train/fit", "drafters/losses.py")
    interval = LogInterval()
    for step in range(2):
        meter, reads = counted_reads(lambda: trainer.train_step(trainer.micro_batches(step)), monkeypatch, ours)
        assert reads == []
        flags, reads = counted_reads(lambda: trainer.stop_flags(meter, preempted=False), monkeypatch, ours)
        assert reads == [("tolist", "train/fit/metrics.py")] and not flags.nonfinite_loss
        interval.add(meter, 1.0)
    (means, steps, _), reads = counted_reads(interval.pop, monkeypatch, ours)
    assert reads == [("tolist", "train/fit/metrics.py")] and steps == 2
    assert {"loss", "acc_0", "sim_accept_length", "data_acc", "grad_norm", "tokens"} <= set(means)
    assert all(isinstance(value, float) and value == value for value in means.values())
    trainer.accelerator.end_training()


def test_recipe_mixed_precision_reaches_the_accelerator_unless_the_launcher_set_one(workdir, tmp_path, monkeypatch):
    from train.build import build_trainer
    from train.fit.launch import PRECISION_ENV

    monkeypatch.delenv(PRECISION_ENV, raising=False)
    trainer, _ = run(workdir, str(tmp_path / "bf16"), "train.mixed_precision=bf16", "train.max_steps=2")
    assert trainer.accelerator.mixed_precision == "bf16"  # CPU autocast in bf16, as a GPU run's default
    train_lines = [line for line in map(json.loads, open(tmp_path / "bf16" / "metrics.jsonl")) if "train/loss" in line]
    assert train_lines[-1]["step"] == 2 and 0.0 < train_lines[-1]["train/loss"] < 100.0
    monkeypatch.setenv(PRECISION_ENV, "no")  # what `accelerate launch --mixed_precision no` sets
    reset_accelerate()
    recipe = load_recipe(DEBUG_RECIPE, tiny_overrides(workdir, str(tmp_path / "no"), "train.mixed_precision=bf16"))
    assert build_trainer(recipe).accelerator.mixed_precision == "no"


def test_estimate_prints_disk_and_time(workdir, tmp_path, capsys):
    from train import estimate

    reset_accelerate()
    assert estimate.main([DEBUG_RECIPE, *tiny_overrides(workdir, str(tmp_path / "est"))]) == 0
    printed = capsys.readouterr().out
    # (2 auto ids (1, 2) + the last hidden state) x 64 x 4 bytes + an int64 argmax per token
    assert "disk: 776 bytes/token" in printed and "tokens/s measured" in printed


@pytest.mark.slow
def test_two_processes_equal_one_process_with_the_same_global_batch(workdir, tmp_path):
    """gloo DDP with 2 processes x batch 2 == 1 process x batch 2 x accumulation 2 (same global batches)."""
    common = tiny_overrides(workdir, "", "train.max_steps=3", "train.log_every=1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # the config file alone selects gloo on CPU
    config = os.path.join(ROOT, "recipes", "accelerate", "cpu_ddp2.yaml")
    two = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
                          "-m", "train", DEBUG_RECIPE, *common, f"output.dir={tmp_path / 'two'}", "train.grad_accum=1"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "world_size=2" in two.stdout + two.stderr
    _, one_final = run(workdir, str(tmp_path / "one"), "train.max_steps=3", "train.grad_accum=2")
    expected, got = weights(one_final), weights(str(tmp_path / "two" / "final"))
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_debug_recipe_trains_evaluates_and_exports(tmp_path):
    """The shipped debug recipe as a user runs it (ShareGPT package data, real speculative-decoding probe)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "train.cli", "train", DEBUG_RECIPE, f"output.dir={tmp_path}"],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert lines[-1]["eval/spec_tau"] >= 1.0 and os.path.isfile(tmp_path / "final" / "model.safetensors")
    # the trained drafter is lossless in the engine: greedy speculative output == plain greedy output
    from inference.assets.debug_target import resolve_debug_target
    from inference.engine.api import speculative_generate
    from inference.engine.target import TargetModel

    target = TargetModel.from_pretrained(resolve_debug_target("debug:tiny-llama"))
    drafter = load_drafter(str(tmp_path / "final"), target.target_info())
    prompts = [target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
               for text in ("Tell me about the sea.", "What is 2 + 2?", "Write a haiku")]
    plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=40)
    for k in (1, 3, 5):
        spec = speculative_generate(target, drafter, prompts, num_draft_tokens=k, max_new_tokens=40)
        assert spec.tokens == plain.tokens


def test_time_annealing_reaches_the_end_of_the_schedule_when_the_budget_stops_the_run(workdir, tmp_path):
    """A budget far below the steps' need: the wall clock drives the schedule, so the lr is annealed and the last
    phase is reached at the step where the budget stops the run (long before max_steps)."""
    trainer, _ = run(workdir, str(tmp_path / "timed"), "train.max_steps=100000", "train.max_time_minutes=0.004",
                     "schedule.anneal_on=time", "schedule.min_lr_ratio=0.1", "schedule.warmup_steps=0")
    assert trainer.step < 100000
    assert trainer.scheduler.get_last_lr()[0] < 0.5 * trainer.recipe.optim.lr  # steps alone would leave ~ lr
    assert trainer.phase_overrides(trainer.step) == trainer.base_config  # past every phase
