"""Streamed features (train/features/stream.py, train/features/stream_producer.py) on the tiny debug target: a producer beside the
trainer gives the offline cache's features bit for bit within the disk window, a crashed and resumed trainer ends
bitwise where an uninterrupted one does, a shard being written is waited for, and a lost producer or a bad
features.stream field is one line.

The producer runs in a thread of the test process (its own TargetModel, the real producer code), except in the
dead-producer test, where it is a real `draftsmith prepare` process that gets killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.test_train import DEBUG_RECIPE, ROOT, reset_accelerate, tiny_overrides, weights, write_chats
from train.config import load_recipe


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A built debug target, a small chat file and its tokenised datasets cache (so producer and trainer threads
    only read it)."""
    from inference.assets.debug_target import resolve_debug_target
    from inference.engine.target import TargetModel
    from train.data.dataset import build_dataset

    root = tmp_path_factory.mktemp("stream")
    target_dir = resolve_debug_target("debug:tiny-llama", cache_dir=str(root / "cache"))
    write_chats(str(root / "chats.jsonl"))
    work = (root, target_dir)
    for size in ("null", "8"):
        recipe = load_recipe(DEBUG_RECIPE, tiny_overrides(work, str(root / "x"), f"data.num_samples={size}"))
        build_dataset(TargetModel.from_pretrained(target_dir).tokenizer, recipe.data)
    return work


def streamed(workdir, out, cache, *extra):
    return tiny_overrides(workdir, str(out), "features.mode=streamed", f"features.cache_dir={cache}",
                          "features.stream.window_shards=2", *extra)


class Producer:
    """train.feature_source.produce in a thread (started after the Accelerator state is reset)."""

    def __init__(self, overrides):
        from train.build import process_state
        from train.feature_source import produce

        self.stop, self.errors, self.written = threading.Event(), [], []
        recipe, state = load_recipe(DEBUG_RECIPE, overrides), process_state()

        def body():
            try:
                self.written.append(produce(recipe, state, stop=self.stop))
            except BaseException as err:  # noqa: BLE001 - re-raised by join in the test's thread
                self.errors.append(err)

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()
        # the trainer is built once the producer is set up: building a drafter draws from torch's global generator
        beat = os.path.join(recipe.features.cache_dir, "stream", "producer-rank0.json")
        while not os.path.exists(beat) and self.thread.is_alive():
            time.sleep(0.01)

    def join(self) -> int:
        self.thread.join(timeout=120)
        if self.errors:
            raise self.errors[0]
        return self.written[0]


class ProducerRanks:
    """Producer ranks 0..ranks-1 (train.features.stream_producer.run_producer, HF extraction), each in a thread with its own
    target, as `accelerate launch -m train.prepare` would run them in processes."""

    def __init__(self, overrides, ranks: int):
        from inference.engine.target import TargetModel
        from train.build import build_drafter, feature_provider
        from train.data.dataset import build_dataset
        from train.features.cache import cache_meta, training_request, write_cache
        from train.features.stream import StreamDir
        from train.features.stream_producer import run_producer

        recipe = load_recipe(DEBUG_RECIPE, overrides)
        self.threads, self.written, self.errors = [], [], []
        for rank in range(ranks):
            target = TargetModel.from_pretrained(recipe.target.name_or_path)
            data = build_dataset(target.tokenizer, recipe.data)
            with torch.random.fork_rng():
                request = build_drafter(recipe, target).feature_request()

            def extract(cache, dataset, indices, target=target, rank=rank):
                return write_cache(target, dataset, cache, batch_size=recipe.train.batch_size, rank=rank,
                                   world_size=ranks, pad_token_id=target.pad_token_id, indices=indices,
                                   progress=False)

            extract(feature_provider(recipe, "eval", target, request, len(data.eval), rank).cache, data.eval, None)
            meta = cache_meta(target.target_info(), training_request(request, "streamed"), torch.float32,
                              len(data.train))

            def body(rank=rank, data=data, meta=meta, extract=extract):
                try:
                    self.written.append(run_producer(StreamDir(recipe.features.cache_dir), data.train, meta, extract,
                                                     rank=rank, ranks=ranks, log=lambda line: None))
                except BaseException as err:  # noqa: BLE001 - re-raised by join in the test's thread
                    self.errors.append(err)

            self.threads.append(threading.Thread(target=body, daemon=True))
            self.threads[-1].start()

    def join(self) -> list[int]:
        for thread in self.threads:
            thread.join(timeout=120)
        if self.errors:
            raise self.errors[0]
        return self.written


def directory_bytes(path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except FileNotFoundError:  # deleted (or renamed with its directory) while counted
                pass
    return total


class DiskWatch:
    """Polls the stream's shard directories from a thread: the most of them and of their bytes seen at once, and
    the largest single shard."""

    def __init__(self, cache):
        from train.features.stream import StreamDir

        self.stream, self.most, self.most_bytes, self.largest = StreamDir(str(cache)), 0, 0, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.is_set():
            sizes = [directory_bytes(os.path.join(self.stream.shards, name)) for name in os.listdir(self.stream.shards)]
            self.most, self.most_bytes = max(self.most, len(sizes)), max(self.most_bytes, sum(sizes))
            self.largest = max([self.largest, *sizes])
            time.sleep(0.001)

    def stop(self):
        self.done.set()
        self.thread.join()


def train(overrides, watch=None):
    """Build and fit; every feature batch the trainer reads is recorded, with the shard directories on disk then."""
    from train.build import build_trainer

    trainer = build_trainer(load_recipe(DEBUG_RECIPE, overrides))
    served, read = [], trainer.train_features.from_cache

    def from_cache(batch, indices):
        features = read(batch, indices)
        served.append((batch, features, None if watch is None else len(os.listdir(watch.stream.shards))))
        return features

    trainer.train_features.from_cache = from_cache
    final = trainer.fit()
    trainer.accelerator.end_training()
    return trainer, final, served


def losses(out):
    return {line["step"]: line["train/loss"] for line in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
            if "train/loss" in line}


def test_streamed_features_equal_offline_bit_for_bit_and_disk_stays_in_the_window(workdir, tmp_path):
    from train import prepare
    from train.features.cache import FeatureCache

    one = ("train.batch_size=1", "train.max_steps=8", "train.log_every=1")  # batch 1: each sample extracted alone
    offline = tiny_overrides(workdir, str(tmp_path / "off"), "features.mode=offline",
                             f"features.cache_dir={tmp_path / 'offline'}", *one)
    reset_accelerate()
    assert prepare.main([DEBUG_RECIPE, *offline]) == 0
    reset_accelerate()
    off, off_final, _ = train(offline)
    cache = tmp_path / "streamed"
    overrides = streamed(workdir, tmp_path / "on", cache, *one)
    reset_accelerate()
    producer, watch = Producer(overrides), DiskWatch(cache)
    on, on_final, served = train(overrides, watch)
    watch.stop()
    assert producer.join() == 8  # one shard per step, every one written, at most two on disk at any time
    assert 1 <= watch.most <= 2 and all(on_disk <= 2 for *_, on_disk in served)
    offline_bytes = directory_bytes(tmp_path / "offline" / "train")
    assert watch.most_bytes <= 2 * watch.largest and 4 * watch.most_bytes < offline_bytes  # 2 samples, not 36
    assert os.listdir(cache / "stream" / "train") == []  # the trainer deleted every shard it read
    reference = FeatureCache(str(tmp_path / "offline" / "train"), off.train_features.cache.meta)
    assert len(served) == 8
    for batch, features, _ in served:
        (index,) = batch["sample_index"].tolist()
        stored = reference.read(index)
        assert torch.equal(features["final_hidden"][0], stored["final_hidden"].float())
        for layer_id, hidden in features["hidden"].items():
            assert torch.equal(hidden[0], stored[f"hidden.{layer_id}"].float())
    assert losses(str(tmp_path / "on")) == losses(str(tmp_path / "off"))
    expected, got = weights(off_final), weights(on_final)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


class Crash(Exception):
    pass


def test_a_crashed_trainer_resumed_from_its_checkpoint_trains_bitwise_the_uninterrupted_run(workdir, tmp_path):
    """The uninterrupted run is fed by two producer ranks, the crashed and resumed one by one (which stays up)."""
    from train.build import build_trainer

    # 8 training samples, global batch 2: 4 steps an epoch, so 7 steps stream two epochs (shards 0..6)
    common = ("data.num_samples=8", "train.max_steps=7", "train.save_every=3", "train.log_every=1")
    reset_accelerate()
    producers = ProducerRanks(streamed(workdir, tmp_path / "full", tmp_path / "c1", *common), ranks=2)
    _, full_final, _ = train(streamed(workdir, tmp_path / "full", tmp_path / "c1", *common))
    assert sorted(producers.join()) == [3, 4]  # shards 0, 2, 4, 6 and 1, 3, 5: two ranks share them
    crashed = streamed(workdir, tmp_path / "crashed", tmp_path / "c2", *common)
    reset_accelerate()
    producer = Producer(crashed)  # stays up across the trainer's crash and restart, as a separate process would
    trainer = build_trainer(load_recipe(DEBUG_RECIPE, crashed))
    at_step = trainer.train_features.at_step

    def crash_at_step_6(step):
        if step == 5:
            raise Crash
        at_step(step)

    trainer.train_features.at_step = crash_at_step_6
    with pytest.raises(Crash):
        trainer.fit()
    trainer.accelerator.end_training()
    assert sorted(os.listdir(tmp_path / "crashed" / "checkpoints")) == ["step_3"]
    reset_accelerate()
    resumed, resumed_final, served = train([*crashed, "train.resume_from=latest"])
    producer.join()
    assert resumed.step == 7 and len(served) == 4  # steps 4..7, not from scratch
    assert resumed.train_features.plan.num_shards == 7 and resumed.derived.steps_per_epoch == 4
    full, again = losses(str(tmp_path / "full")), losses(str(tmp_path / "crashed"))
    assert [again[step] for step in (4, 5, 6, 7)] == [full[step] for step in (4, 5, 6, 7)]
    expected, got = weights(full_final), weights(resumed_final)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_the_trainer_waits_for_a_shard_being_written_and_checks_it(workdir, tmp_path):
    from train.build import build_trainer
    from train.features.stream import StreamPlan
    from train.features.stream_producer import write_shard

    overrides = streamed(workdir, tmp_path / "run", tmp_path / "c")
    reset_accelerate()
    trainer = build_trainer(load_recipe(DEBUG_RECIPE, overrides))
    provider = trainer.train_features
    stream, plan = provider.stream, provider.plan
    partial = stream.tmp_path(0, rank=0)  # what a producer mid-write leaves: a truncated shard, no rename yet
    os.makedirs(partial)
    with open(os.path.join(partial, "rank0-00000.safetensors"), "wb") as f:
        f.write(b"\x00" * 100)

    def extract(cache, dataset, indices):  # the producer's HF extraction of the trainer's micro-batches
        from train.features.cache import write_cache
        return write_cache(trainer.target, dataset, cache, batch_size=2, pad_token_id=trainer.pad_token_id,
                           indices=indices, progress=False)

    polls = []

    def pause():  # the trainer looks again; on its third look the producer finishes shard 0
        polls.append(os.listdir(stream.shards))
        if len(polls) == 3:
            write_shard(stream, plan, 0, provider.meta, trainer.data.train, extract, rank=0)

    provider.pause = pause
    batch = trainer.micro_batches(0)[0]
    assert len(polls) == 3 and provider.current == 0 and polls[0] == [".tmp-000000-rank0"]
    features, online = provider(batch), provider.online(batch)
    assert torch.equal(features["target_argmax"], online["target_argmax"])
    for layer_id, hidden in online["hidden"].items():
        assert torch.equal(features["hidden"][layer_id], hidden)  # the same micro-batch, the same forward
    assert isinstance(plan, StreamPlan) and plan.samples_of(0) == batch["sample_index"].tolist()
    # a complete shard whose bytes changed afterwards is refused by its sha256, naming the file
    write_shard(stream, plan, 1, provider.meta, trainer.data.train, extract, rank=0)
    shard = os.path.join(stream.shard_path(1), "rank0-00000.safetensors")
    data = bytearray(open(shard, "rb").read())
    data[-1] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=f"{shard} fails its sha256 check"):
        provider(trainer.micro_batches(1)[0])
    trainer.accelerator.end_training()


def test_a_producer_never_rewrites_a_shard_the_trainer_deletes_while_it_looks(tmp_path):
    """The trainer publishes its new position, then deletes: a producer that read the old position and looks at the
    disk after the deletion must read the position again instead of extracting the deleted shard anew."""
    from train.features.stream import StreamDir, StreamPlan
    from train.features.stream_producer import run_producer

    plan = StreamPlan(num_samples=4, seed=0, global_batch_size=1, steps_per_epoch=4, max_steps=4, steps_per_shard=1)
    extracted = []

    class TrainerFinishesMeanwhile(StreamDir):
        looks = 0

        def progress(self):
            seen = super().progress()
            self.looks += 1
            if self.looks == 1:  # the trainer's close() right after this read: done first, then delete its shard
                self.publish(plan, plan.num_shards, plan.num_shards, done=True)
                self.remove(3)
            return seen

    stream = TrainerFinishesMeanwhile(str(tmp_path))
    os.makedirs(stream.shard_path(3))  # the trainer reads the last shard, the window [3, 5) ends at the plan's end
    stream.publish(plan, 3, 5)
    written = run_producer(stream, list(range(4)), {}, lambda cache, dataset, indices: extracted.append(indices),
                           log=lambda line: None)
    assert (written, extracted, stream.complete()) == (0, [], [])


def test_a_producer_that_falls_behind_or_never_starts_is_named(workdir, tmp_path):
    from train.build import build_trainer
    from train.features.stream import ProducerError
    from train.features.stream_producer import Heartbeat

    overrides = streamed(workdir, tmp_path / "run", tmp_path / "c", "features.stream.timeout_s=0.2")
    reset_accelerate()
    trainer = build_trainer(load_recipe(DEBUG_RECIPE, overrides))
    with pytest.raises(ProducerError, match=r"^no stream producer has started for .* \(the trainer waits for shard "
                                            r"0 \(steps 1-1\)\); start one with `draftsmith prepare RECIPE`"):
        trainer.micro_batches(0)
    with Heartbeat(trainer.train_features.stream, rank=0, ranks=1):  # alive, but it writes no shard
        with pytest.raises(ProducerError, match=r"^stream producer rank 0 of 1 \(pid \d+ on .*; last shard written: "
                                                r"None\) runs but shard 0 .* falls behind"):
            trainer.micro_batches(0)
    trainer.accelerator.end_training()


def test_a_dead_producer_stops_training_with_one_line_and_status_2(workdir, tmp_path, capsys):
    from train.cli import main as cli

    overrides = streamed(workdir, tmp_path / "run", tmp_path / "c", "train.max_steps=30")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    producer = subprocess.Popen([sys.executable, "-m", "train.cli", "prepare", DEBUG_RECIPE, *overrides], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shard_1 = os.path.join(tmp_path, "c", "stream", "train", "000001")

    def kill_after_shard_1():
        while not os.path.isdir(shard_1) and producer.poll() is None:
            time.sleep(0.005)
        producer.kill()
        producer.wait()

    killer = threading.Thread(target=kill_after_shard_1, daemon=True)
    killer.start()
    reset_accelerate()
    assert cli(["train", DEBUG_RECIPE, *overrides]) == 2
    killer.join()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    err = [err.strip().splitlines()[-1].split("\r")[-1]]  # after the progress bar's line
    assert err[0].startswith(f"draftsmith train: error: stream producer rank 0 of 1 (pid {producer.pid} on ")
    assert "; last shard written: " in err[0] and "is gone (its process exited) while the trainer waits for shard" \
        in err[0] and err[0].endswith("it continues at the trainer's position")


@pytest.mark.slow
def test_two_trainer_processes_read_the_stream_of_two_producer_ranks(workdir, tmp_path):
    """gloo DDP, 2 processes x batch 1, fed by 2 producer ranks == 1 process x batch 1 x accumulation 2 offline
    (the same global batches; each sample extracted alone in both, so the features are bitwise equal)."""
    from train import prepare

    common = ("train.batch_size=1", "train.max_steps=4", "train.log_every=1")
    cache = tmp_path / "streamed"
    overrides = streamed(workdir, tmp_path / "two", cache, *common, "train.grad_accum=1")
    producers = ProducerRanks(overrides, ranks=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    config = os.path.join(ROOT, "recipes", "accelerate", "cpu_ddp2.yaml")
    two = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "-m", "train",
                          DEBUG_RECIPE, *overrides], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "world_size=2" in two.stdout + two.stderr and sorted(producers.join()) == [2, 2]
    offline = tiny_overrides(workdir, str(tmp_path / "one"), "features.mode=offline",
                             f"features.cache_dir={tmp_path / 'offline'}", *common, "train.grad_accum=2")
    reset_accelerate()
    assert prepare.main([DEBUG_RECIPE, *offline]) == 0
    reset_accelerate()
    _, one_final, _ = train(offline)
    expected, got = weights(one_final), weights(str(tmp_path / "two" / "final"))
    for key in expected:  # DDP averages the two processes' gradients: equal up to the order of that sum
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)
    assert os.listdir(cache / "stream" / "train") == []


@pytest.mark.parametrize("field, line", [
    ("features.stream.window_shards=0", "features.stream.window_shards must be >= 1, got 0"),
    ("features.stream.steps_per_shard=-1", "features.stream.steps_per_shard must be >= 1, got -1"),
    ("features.stream.timeout_s=0", "features.stream.timeout_s must be > 0 seconds, got 0.0"),
    ("features.stream.window=3", "unknown config key(s) features.stream.window; allowed: ['steps_per_shard', "
                                 "'timeout_s', 'window_shards']"),
    ("features.cache_dir=null", "features.cache_dir must be set for features.mode=streamed"),
])
def test_bad_stream_fields_are_one_line_naming_the_key(field, line, capsys):
    from train.cli import main as cli

    for command in ("train", "prepare"):
        assert cli([command, DEBUG_RECIPE, "features.mode=streamed", "features.cache_dir=/tmp/unused", field]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"draftsmith {command}: error: {line}"] or (len(err) == 1 and err[0].startswith(
            f"draftsmith {command}: error: {line}")), err
