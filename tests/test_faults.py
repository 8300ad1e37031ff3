"""Faults a long run meets, injected for real on the debug recipe (a tiny random target, CPU, one process):
SIGTERM (preemption), SIGKILL at a random step and in the middle of a checkpoint write, a full disk, a non-finite
gradient, corrupt or truncated cache shards, and a resume from 1 to 2 processes at the same global batch.

The kills hit real subprocesses (`python -m train`); every resumed run must end with exactly the weights of one
uninterrupted run. docs/reliability.md records what these tests measure.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.test_train import DEBUG_RECIPE, ROOT, reset_accelerate, run, tiny_overrides, weights, write_chats
from train.fit.checkpoint import list_checkpoints

MAX_STEPS = 36  # long enough that each kill at a random step lands at least 8 steps before the run would end
RUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
# The child of test_sigkill_during_a_checkpoint_write: the real entry point, with accelerate's save_state made to
# stop (after writing the weights into the temporary directory, before the rename) at one chosen step, announcing it.
PAUSED_SAVE = """
import sys, time, accelerate
from train.cli import main
real_save_state = accelerate.Accelerator.save_state
def save_state(self, output_dir=None, **kwargs):
    result = real_save_state(self, output_dir, **kwargs)
    if output_dir.endswith(sys.argv[1]):
        open(sys.argv[2], "w").close()
        time.sleep(600)
    return result
accelerate.Accelerator.save_state = save_state
sys.exit(main(["train", *sys.argv[3:]]))
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from inference.assets.debug_target import resolve_debug_target

    root = tmp_path_factory.mktemp("faults")
    target_dir = resolve_debug_target("debug:tiny-llama", cache_dir=str(root / "cache"))
    write_chats(str(root / "chats.jsonl"))
    return root, target_dir


def overrides(workdir, out, *extra: str) -> list[str]:
    """The run every fault test interrupts: MAX_STEPS steps, a checkpoint every 2, every step logged."""
    return tiny_overrides(workdir, str(out), f"train.max_steps={MAX_STEPS}", "train.save_every=2", "train.log_every=1",
                          *extra)


def start(workdir, out, *extra: str, command: list[str] | None = None) -> subprocess.Popen:
    """`python -m train DEBUG_RECIPE ...` in the background, its output in OUT.log (a pipe nobody reads could
    fill up and stall the run)."""
    os.makedirs(out, exist_ok=True)
    log = open(f"{out}.log", "a")
    command = command or [sys.executable, "-m", "train"]
    return subprocess.Popen([*command, DEBUG_RECIPE, *overrides(workdir, out, *extra)], cwd=ROOT, env=RUN_ENV,
                            stdout=log, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, out) -> tuple[int, str]:
    status = process.wait(timeout=600)
    with open(f"{out}.log") as f:
        return status, f.read()


def logged_steps(out) -> list[int]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.endswith("\n")]
    return [line["step"] for line in lines if "train/loss" in line]


def wait_until(condition, process: subprocess.Popen, what: str) -> None:
    """Poll `condition` every 5 ms; fail if the run ends first (the fault would then never be injected)."""
    deadline = time.monotonic() + 600
    while not condition():
        assert process.poll() is None, f"the run ended (status {process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after 600 s"
        time.sleep(0.005)


def resumed_line(out: str, step: int) -> str:
    """What train/build.py prints when it resumes from checkpoint `step` of `out`."""
    return f"resumed from {os.path.join(out, 'checkpoints', f'step_{step}')} at step {step}"


def assert_same_weights(expected_dir: str, got_dir: str) -> None:
    expected, got = weights(expected_dir), weights(got_dir)
    assert expected.keys() == got.keys()
    different = [key for key in expected if not torch.equal(expected[key], got[key])]
    assert not different, f"{len(different)} of {len(expected)} tensors differ from the uninterrupted run: {different}"


@pytest.fixture(scope="module")
def uninterrupted(workdir, tmp_path_factory):
    """The final weights of the run without faults, trained by the same entry point in the same environment."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    status, log = finish(start(workdir, str(out)), str(out))
    assert status == 0, log[-3000:]
    return str(out / "final")


def kill_during_checkpoint_write(workdir, out: str, paused: str) -> None:
    """SIGKILL while step_4 is half written (weights in .tmp_step_4, not yet renamed): step_2 stays the latest."""
    process = start(workdir, out, command=[sys.executable, "-c", PAUSED_SAVE, ".tmp_step_4", paused])
    wait_until(lambda: os.path.exists(paused), process, "the write of checkpoint 4")
    process.kill()
    assert finish(process, out)[0] == -signal.SIGKILL
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == [".tmp_step_4", "step_2"]
    assert [step for step, _ in list_checkpoints(out)] == [2]  # the half-written one is never "latest"


def preempt_at_a_random_step(workdir, out: str, resumed_at: int) -> int:
    """Resume, send SIGTERM after a random step: the run saves the step during which it arrived and exits 143."""
    process = start(workdir, out, "train.resume_from=latest")
    arrive_after = random.randrange(resumed_at + 2, MAX_STEPS // 2)
    wait_until(lambda: logged_steps(out)[-1:] >= [arrive_after], process, f"step {arrive_after}")
    sent_after = logged_steps(out)[-1]
    process.send_signal(signal.SIGTERM)
    status, log = finish(process, out)
    assert status == 143 and resumed_line(out, resumed_at) in log, log[-3000:]
    saved = list_checkpoints(out)[-1][0]
    # no step trained after the signal goes unsaved: the checkpoint is the last step logged, the one it arrived in
    assert saved > sent_after and logged_steps(out)[-1] == saved, (sent_after, saved, logged_steps(out))
    assert f"preempted (SIGTERM): saved {os.path.join(out, 'checkpoints', f'step_{saved}')} at step {saved}" in log
    assert ".tmp_step_4" not in os.listdir(os.path.join(out, "checkpoints"))  # cleaned by the next save
    return saved


def kill_at_a_random_step(workdir, out: str, resumed_at: int) -> int:
    """Resume, SIGKILL at a random step after a checkpoint this run wrote; return the latest checkpoint."""
    process = start(workdir, out, "train.resume_from=latest")
    kill_after = random.randrange(resumed_at + 3, MAX_STEPS - 8)
    wait_until(lambda: logged_steps(out)[-1:] >= [kill_after] and list_checkpoints(out)[-1][0] > resumed_at,
               process, f"step {kill_after}")
    process.kill()
    status, log = finish(process, out)
    assert status == -signal.SIGKILL and resumed_line(out, resumed_at) in log, log[-3000:]
    print(f"SIGKILL after step {logged_steps(out)[-1]}, latest checkpoint step {list_checkpoints(out)[-1][0]}")
    return list_checkpoints(out)[-1][0]


@pytest.mark.slow
def test_a_run_killed_mid_save_preempted_and_killed_again_ends_bitwise_equal(workdir, tmp_path, uninterrupted):
    """One run meets three faults in turn, each followed by `train.resume_from=latest`: SIGKILL in the middle of
    a checkpoint write, SIGTERM at a random step, SIGKILL at a random step. Its final weights are exactly those of
    the uninterrupted run."""
    out = str(tmp_path / "run")
    kill_during_checkpoint_write(workdir, out, str(tmp_path / "save_paused"))
    preempted = preempt_at_a_random_step(workdir, out, resumed_at=2)
    latest = kill_at_a_random_step(workdir, out, resumed_at=preempted)
    status, log = finish(start(workdir, out, "train.resume_from=latest"), out)
    assert status == 0 and resumed_line(out, latest) in log, log[-3000:]
    assert_same_weights(uninterrupted, os.path.join(out, "final"))


def test_full_disk_during_a_checkpoint_is_one_line_and_the_last_checkpoint_resumes(workdir, tmp_path, monkeypatch,
                                                                                  capsys):
    """accelerate's file writer raises ENOSPC for checkpoint 4: `draftsmith train` prints one line naming the
    checkpoint, output.dir and the intact step_2, exits 2, leaves no partial directory; resuming from step_2 without
    the fault ends bitwise equal to a run that never met it."""
    import accelerate.checkpointing
    from train.cli import main as cli

    real_save = accelerate.checkpointing.save

    def save(obj, path, *args, **kwargs):
        if ".tmp_step_4" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    out = tmp_path / "run"
    common = [DEBUG_RECIPE, *tiny_overrides(workdir, str(out), "train.max_steps=6", "train.save_every=2")]
    monkeypatch.setattr(accelerate.checkpointing, "save", save)
    reset_accelerate()
    assert cli(["train", *common]) == 2
    stderr = capsys.readouterr().err.replace("\r", "\n")  # tqdm's bar shares lines with what follows it
    error = [line for line in stderr.splitlines() if line.startswith("draftsmith train: error")]
    step_4, step_2 = out / "checkpoints" / "step_4", out / "checkpoints" / "step_2"
    assert error == [f"draftsmith train: error: no space left on device writing {step_4}: free space there or "
                     f"choose another output.dir (the last checkpoint, {step_2}, is intact)"]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_2"]
    monkeypatch.setattr(accelerate.checkpointing, "save", real_save)
    _, resumed_final = run(workdir, str(out), "train.max_steps=6", "train.save_every=2", "train.resume_from=latest")
    _, expected_final = run(workdir, str(tmp_path / "clean"), "train.max_steps=6", "train.save_every=2")
    assert_same_weights(expected_final, resumed_final)


def test_full_disk_while_flushing_the_feature_cache_names_the_shard(workdir, tmp_path, monkeypatch):
    import drafters.files
    from drafters.base import FeatureRequest
    from drafters.files import DiskFullError
    from inference.engine.target import TargetModel
    from train.features.cache import FeatureCache, FeatureProvider, cache_meta

    target = TargetModel.from_pretrained(workdir[1])
    request = FeatureRequest(layer_ids=(1, 3))
    meta = cache_meta(target.target_info(), request, torch.float32, num_samples=4)
    cache = FeatureCache(str(tmp_path / "c"), meta)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "sample_index": torch.tensor([0]),
             "attention_mask": torch.tensor([[1, 1, 1, 1]])}
    FeatureProvider("hybrid", target, request, cache)(batch)

    class FullDisk:
        def __init__(self, path, mode):
            self.file = open(path, mode)

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(drafters.files, "open", FullDisk, raising=False)
    with pytest.raises(DiskFullError) as caught:
        cache.flush()
    shard = tmp_path / "c" / "rank0-00000.safetensors"
    assert str(caught.value) == (f"no space left on device writing {shard}: free space there or choose another "
                                 "features.cache_dir")
    assert sorted(os.listdir(tmp_path / "c")) == ["meta.json"]  # no partial shard, no index naming one
    monkeypatch.undo()
    cache.flush()  # the samples are still buffered: with space again, nothing was lost
    assert 0 in FeatureCache(str(tmp_path / "c"), meta).location


def test_non_finite_gradient_stops_before_a_checkpoint_holds_it(workdir, tmp_path):
    """A finite loss with an infinite gradient (injected through a real backward hook at step 3): the run stops at
    step 3 naming the gradient and the last good checkpoint; no checkpoint holds the poisoned update."""
    from train.build import build_trainer
    from train.config import load_recipe

    out = tmp_path / "run"
    reset_accelerate()
    trainer = build_trainer(load_recipe(DEBUG_RECIPE, tiny_overrides(workdir, str(out), "train.save_every=1")))
    parameter = trainer.model.fc.weight
    parameter.register_hook(lambda grad: grad * float("inf") if trainer.step == 2 else grad)
    with pytest.raises(FloatingPointError) as caught:
        trainer.fit()
    step_2 = out / "checkpoints" / "step_2"
    assert str(caught.value) == (f"non-finite gradient norm (the loss was finite) at step 3; stopping. The last good "
                                 f"checkpoint is {step_2}: resume from it with a lower optim.lr or with "
                                 f"optim.grad_clip set (train.resume_from={step_2})")
    assert [step for step, _ in list_checkpoints(str(out))] == [1, 2]
    assert all(torch.isfinite(t).all() for t in weights(str(step_2)).values())


def make_cache(workdir, directory: str):
    """A one-shard cache of two samples; returns (target, request, meta, batch)."""
    from drafters.base import FeatureRequest
    from inference.engine.target import TargetModel
    from train.features.cache import FeatureCache, FeatureProvider, cache_meta

    target = TargetModel.from_pretrained(workdir[1])
    request = FeatureRequest(layer_ids=(1, 3))
    meta = cache_meta(target.target_info(), request, torch.float32, num_samples=2)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]), "sample_index": torch.tensor([0, 1]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    cache = FeatureCache(directory, meta)
    FeatureProvider("hybrid", target, request, cache)(batch)
    cache.flush()
    return target, request, meta, batch


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_a_damaged_cache_shard_is_named(workdir, tmp_path, damage):
    from train.features.cache import FeatureCache, FeatureProvider

    target, request, meta, batch = make_cache(workdir, str(tmp_path / "c"))
    shard = tmp_path / "c" / "rank0-00000.safetensors"
    data = shard.read_bytes()
    expected = {"flip": f"feature cache shard {shard} fails its sha256 check",
                "truncate": f"feature cache shard {shard} is truncated or overwritten: {len(data) - 100:,} bytes, "
                            f"the index says {len(data):,}",
                "missing": f"feature cache shard {shard} is missing but listed in its index"}[damage]
    if damage == "flip":
        position = random.randrange(len(data))
        shard.write_bytes(data[:position] + bytes([data[position] ^ 0x01]) + data[position + 1:])
    elif damage == "truncate":
        shard.write_bytes(data[:-100])
    else:
        shard.unlink()
    with pytest.raises(ValueError) as caught:
        FeatureProvider("offline", target, request, FeatureCache(str(tmp_path / "c"), meta))(batch)
    assert str(caught.value).startswith(expected)


def test_a_cache_without_checksums_stays_readable_with_a_warning(workdir, tmp_path):
    from train.features.cache import FeatureCache, FeatureProvider

    target, request, meta, batch = make_cache(workdir, str(tmp_path / "c"))
    expected = FeatureProvider("offline", target, request, FeatureCache(str(tmp_path / "c"), meta))(batch)
    index = tmp_path / "c" / "index-rank0.json"
    shards = json.loads(index.read_text())["shards"]
    index.write_text(json.dumps({"shards": [{"file": s["file"], "samples": s["samples"]} for s in shards]}))
    with pytest.warns(UserWarning, match="written without shard checksums, so it is read unverified"):
        got = FeatureProvider("offline", target, request, FeatureCache(str(tmp_path / "c"), meta))(batch)
    assert torch.equal(got["hidden"][3], expected["hidden"][3])
    index.write_text('{"shards": [')
    with pytest.raises(ValueError, match=f"feature cache index {index} is unreadable"):
        FeatureCache(str(tmp_path / "c"), meta)


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_on_two_processes_with_the_same_data_order(workdir, tmp_path):
    """Global batch 4: one process accumulates 2 micro-batches of 2, two processes (gloo) take one each. The
    2-process run resumed from the 1-process step-3 checkpoint trains the same samples at steps 4-6 (its per-step
    losses equal the 1-process run's to float tolerance) and ends within tolerance of it. Bitwise equality is not
    promised (DDP's all-reduce may sum in another order than accumulation); the printed line says what it was."""
    common = ["train.global_batch_size=4", "train.grad_accum=null", "train.save_every=3", "train.log_every=1"]
    _, one_final = run(workdir, str(tmp_path / "one"), *common)
    resumed = tmp_path / "two"
    shutil.copytree(tmp_path / "one" / "checkpoints" / "step_3", resumed / "checkpoints" / "step_3")
    env = {**RUN_ENV, "ACCELERATE_USE_CPU": "1"}
    two = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "-m", "train", DEBUG_RECIPE, *tiny_overrides(workdir, str(resumed), *common),
                          "train.resume_from=latest"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "world_size=2" in two.stdout + two.stderr and "at step 3" in two.stdout + two.stderr
    losses = {}
    for name in ("one", "two"):
        with open(tmp_path / name / "metrics.jsonl") as f:
            losses[name] = {line["step"]: line["train/loss"] for line in map(json.loads, f) if "train/loss" in line}
    assert sorted(losses["two"]) == [4, 5, 6]
    for step in (4, 5, 6):
        assert losses["two"][step] == pytest.approx(losses["one"][step], rel=1e-5)
    expected, got = weights(one_final), weights(str(resumed / "final"))
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)
    equal = sum(torch.equal(got[key], expected[key]) for key in expected)
    worst = max(float((got[key].double() - expected[key].double()).abs().max()) for key in expected)
    worst_loss = max(abs(losses["two"][s] / losses["one"][s] - 1) for s in (4, 5, 6))
    print(f"1 -> 2 processes: {equal} of {len(expected)} tensors bitwise equal, max |difference| {worst:.3g}, "
          f"largest relative loss difference at steps 4-6 {worst_loss:.3g}")
