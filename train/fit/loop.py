"""The training loop: `train_step` / `evaluate` / `fit` around one Accelerator, for any drafter.

The loop knows the drafter only through the contract in drafters/base.py: `target_layer_ids`, `init_from_data`,
`forward(batch)`, `loss(output, batch)`, `save(dir, "native")`, its `config` dataclass (phases set fields on it by
name) and the inference methods the speculative-decoding probe drives. Only the drafter and its optimizer are
prepared by accelerate; the target is frozen, unwrapped, on the accelerator's device, and features come from
train/features/cache.py (online, offline or hybrid) or train/features/stream.py (streamed).

Data order is a pure function of (seed, epoch, step): each epoch is a seeded permutation cut into global batches of
batch_size x processes x grad_accum sequences; micro-batch m of process r takes slice m * processes + r. So the
checkpointed step fixes the data position, and N processes with accumulation A see the same global batches as one
process with accumulation N x A.

Faults: after every step one all-reduce agrees on why to stop (Trainer.stop_flags). A non-finite loss or gradient
norm raises FloatingPointError naming the step and the last good checkpoint, before any checkpoint holds that step.
SIGTERM (preemption) is caught on every process and turned into a checkpoint at the next step boundary, then
`Preempted`, which the entry point turns into exit status PREEMPTED_EXIT_CODE; `train.resume_from=latest` continues
bitwise.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from drafters.files import disk_full_reported, replace_directory
from train.fit.checkpoint import list_checkpoints, save_checkpoint
from train.config import Derived, Recipe, save_recipe
from train.data.dataset import epoch_order, step_indices
from train.features.cache import FeatureProvider, make_batch
from train.fit.launch import drafter_is_sharded
from train.fit.metrics import (MeanMeter, RunLog, agree_on_step, any_nonfinite, full_norm, mean_of_meters, reduce_mean,
                              speculative_probe)
from train.fit.optim import schedule_position


PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: what schedulers already read as "terminated", see docs/reliability.md


class Preempted(Exception):
    """SIGTERM arrived; the run saved `checkpoint` at `step` and stopped. Entry points exit PREEMPTED_EXIT_CODE."""

    def __init__(self, step: int, checkpoint: str):
        super().__init__(f"preempted (SIGTERM): saved {checkpoint} at step {step}; rerun with "
                         "train.resume_from=latest to continue")
        self.step, self.checkpoint = step, checkpoint


@dataclass(frozen=True)
class StepFlags:
    """Why the run must stop after a step, agreed by all processes (Trainer.stop_flags)."""

    nonfinite_loss: bool
    nonfinite_grad: bool
    out_of_time: bool
    preempted: bool


@dataclass
class RunClock:
    """The run's wall time across resumes: `before` seconds spent by earlier processes (the checkpoint's) plus this
    process's since `start`. `now` is the step boundary's reading, the main process's on every process
    (Trainer.stop_flags): the wall budget, the time-annealed schedule and the checkpoint all go by it, so one step
    boundary sees one time everywhere."""

    before: float = 0.0
    started: float = 0.0
    now: float = 0.0

    def start(self) -> None:
        self.started, self.now = time.perf_counter(), self.before

    def tick(self) -> float:
        self.now = self.before + time.perf_counter() - self.started
        return self.now


@dataclass
class LogInterval:
    """What one train log line averages: the steps' metrics since the last line (each step's meter of its
    micro-batches, still on the device), and how many steps took how long (train steps only: features, forward,
    backward, optimizer; not evaluation or checkpoints)."""

    meters: list[MeanMeter] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.meters)

    def add(self, step: MeanMeter, seconds: float) -> None:
        self.meters.append(step)
        self.seconds += seconds

    def pop(self) -> tuple[dict[str, float], int, float]:
        """(mean over steps of each step's mean metrics, steps, seconds) since the last pop, read from the device in
        one transfer; starts the next interval."""
        meters, seconds = self.meters, self.seconds
        self.meters, self.seconds = [], 0.0
        interval = MeanMeter()
        for means in mean_of_meters(meters):
            interval.add(means)
        return interval.pop(), len(meters), seconds


@contextlib.contextmanager
def sigterm_flag() -> Iterator[threading.Event]:
    """While the block runs, SIGTERM (what SLURM and Kubernetes send on preemption) sets the yielded event instead
    of killing the process; the loop checks it at each step boundary. Outside the main thread (where Python cannot
    install handlers) the event simply never fires. The previous handler is restored on exit."""
    received = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.set())
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class Trainer:
    """Everything one run needs; built by `train.build.build_trainer`. `step` counts optimizer steps taken."""

    recipe: Recipe
    derived: Derived
    accelerator: Accelerator
    target: Any  # inference.engine.target.TargetModel, frozen
    drafter: torch.nn.Module  # prepared (maybe DDP/FSDP-wrapped)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # may follow `clock` (train/fit/optim.py schedule_position)
    clock: RunClock
    data: Any  # train.data.dataset.PreparedData
    train_features: FeatureProvider
    eval_features: FeatureProvider
    eval_prompts: list[list[int]]
    pad_token_id: int
    step: int = 0
    last_eval_step: int = -1
    saved_step: int = -1
    base_config: dict[str, Any] = field(default_factory=dict)
    _orders: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self):
        self.log = RunLog(self.accelerator, self.recipe.output.dir)
        self.model = self.accelerator.unwrap_model(self.drafter)
        keys = {key for phase in self.recipe.train.phases for key in phase.drafter}
        self.base_config = {key: getattr(self.model.config, key) for key in sorted(keys)}

    # ---- data ------------------------------------------------------------------------------------------------
    def micro_batches(self, step: int) -> list[dict[str, Any]]:
        """The batches this process runs for optimizer step `step` (0-based), on the accelerator's device."""
        epoch, position = divmod(step, self.derived.steps_per_epoch)
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(len(self.data.train), self.recipe.train.seed, epoch)}
        slices = step_indices(self._orders[epoch], position, self.derived, self.accelerator.process_index,
                              self.recipe.train.batch_size)
        self.train_features.at_step(step)  # streamed features: wait for the step's shard
        return [self.to_device(make_batch(self.data.train, indices, self.pad_token_id), epoch) for indices in slices]

    def to_device(self, batch: dict[str, Any], epoch: int = 0) -> dict[str, Any]:
        """The batch on the accelerator, plus what a drafter may read besides tensors (drafters/base.py forward):
        the epoch (random anchors are redrawn per epoch from (seed, epoch, sample index), so resume and any
        process count give the same draws) and the cross-process sum for globally normalised losses."""
        batch = {key: value.to(self.accelerator.device) for key, value in batch.items()}
        batch["epoch"] = epoch
        batch["seed"] = self.recipe.train.seed
        if self.accelerator.num_processes > 1:
            batch["sum_over_processes"] = lambda value: self.accelerator.reduce(value.detach().clone(), "sum")
            batch["num_processes"] = self.accelerator.num_processes
        return batch

    # ---- drafter config phases -------------------------------------------------------------------------------
    def schedule_position(self, step: int) -> float:
        """Where the schedule stands at `step` by the run clock's last reading (train/fit/optim.py schedule_position)."""
        return schedule_position(step, self.clock.now, max_steps=self.derived.max_steps, config=self.recipe.schedule,
                                 budget_minutes=self.recipe.train.max_time_minutes)

    def phase_overrides(self, step: int) -> dict[str, Any]:
        """Drafter config values for this step: the first phase whose until_fraction lies beyond it, else base."""
        fraction = self.schedule_position(step) / self.derived.max_steps
        for phase in self.recipe.train.phases:
            if fraction < phase.until_fraction:
                return {**self.base_config, **phase.drafter}
        return dict(self.base_config)

    def set_drafter_config(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            setattr(self.model.config, key, value)

    # ---- one optimizer step ------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[dict[str, Any]]) -> MeanMeter:
        """Forward/backward over the micro-batches, clip, AdamW step. Returns the micro-batches' metrics unread: their
        tensors stay on the device until a log line reads them all at once (a GPU never waits on them per step)."""
        self.drafter.train()
        meter = MeanMeter()
        grad_clip = self.recipe.optim.grad_clip
        for batch in micro_batches:
            with self.accelerator.accumulate(self.drafter):
                batch.update(self.train_features(batch))
                loss, metrics = self.model.loss(self.drafter(batch), batch)
                self.accelerator.backward(loss)
                if self.accelerator.sync_gradients:
                    # the norm is always taken so a non-finite gradient stops the run before any checkpoint holds
                    # its update; without clipping, max_norm=inf scales the gradients by exactly 1.0
                    grad_norm = self.accelerator.clip_grad_norm_(
                        self.drafter.parameters(), grad_clip if grad_clip is not None else math.inf)
                    if grad_norm is not None:  # DeepSpeed clips inside its engine and may return no norm
                        metrics = {**metrics, "grad_norm": full_norm(grad_norm)}
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            meter.add({"loss": loss.detach(), **metrics, "tokens": batch["attention_mask"].sum()})
        return meter

    # ---- evaluation ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss / per-depth accuracy / simulated acceptance (all processes), then real speculative decoding
        on a few prompts (main process). Runs with the recipe's drafter config, whatever the current phase."""
        current = {key: getattr(self.model.config, key) for key in self.base_config}
        self.set_drafter_config(self.base_config)
        self.drafter.eval()
        meter = MeanMeter()
        world, rank, size = self.accelerator.num_processes, self.accelerator.process_index, self.recipe.train.batch_size
        num_batches = len(self.data.eval) // (size * world)
        if self.recipe.eval.num_batches is not None:
            num_batches = min(num_batches, self.recipe.eval.num_batches)
        with torch.random.fork_rng(devices=[]):
            for b in range(num_batches):
                start = (b * world + rank) * size
                batch = self.to_device(make_batch(self.data.eval, list(range(start, start + size)), self.pad_token_id))
                batch.update(self.eval_features(batch))
                loss, metrics = self.model.loss(self.drafter(batch), batch)
                meter.add({"loss": loss.detach(), **metrics})
            self.eval_features.flush()
            results = reduce_mean(self.accelerator, meter.pop())
            if self.eval_prompts and self.accelerator.is_main_process and self.can_probe():
                results.update({f"spec_{key}": value for key, value in speculative_probe(
                    self.target, self.model, self.eval_prompts, num_draft_tokens=self.recipe.eval.num_draft_tokens,
                    max_new_tokens=self.recipe.eval.max_new_tokens).items()})
        self.accelerator.wait_for_everyone()
        self.set_drafter_config(current)
        self.drafter.train()
        return results

    def can_probe(self) -> bool:
        """FSDP and ZeRO-3 shard the drafter's weights across processes, so one process cannot decode with it alone
        (under ZeRO-3 it would wait in an all-gather the others never join); nor with a target that is sharded or
        served elsewhere (target.placement)."""
        sharded = drafter_is_sharded(self.accelerator.distributed_type, self.accelerator.state.deepspeed_plugin)
        return not sharded and self.target.whole

    # ---- checkpoints and export ----------------------------------------------------------------------------------
    def save(self) -> str:
        """A checkpoint at self.step (collective; DiskFullError when the disk fills up, earlier ones intact)."""
        self.train_features.flush()
        state = {"step": self.step, "elapsed_seconds": self.clock.now,
                 "steps_per_epoch": self.derived.steps_per_epoch, "global_batch_size": self.derived.global_batch_size,
                 "seed": self.recipe.train.seed}
        path = save_checkpoint(self.accelerator, self.recipe.output.dir, self.step, recipe=self.recipe,
                               trainer_state=state, target_info=self.model.target_info,
                               keep_last=self.recipe.train.keep_last)
        self.saved_step = self.step
        return path

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's trainer state (after accelerator.load_state)."""
        for key in ("steps_per_epoch", "global_batch_size", "seed"):
            current = {"steps_per_epoch": self.derived.steps_per_epoch,
                       "global_batch_size": self.derived.global_batch_size, "seed": self.recipe.train.seed}[key]
            if state[key] != current:
                raise ValueError(f"cannot resume exactly: the checkpoint has {key}={state[key]} but this run has "
                                 f"{current} (same data, train.seed and global batch are needed)")
        self.step, self.clock.before = state["step"], state["elapsed_seconds"]
        self.saved_step = self.step  # the checkpoint it resumed from holds this step

    def export_final(self) -> str:
        """OUTPUT_DIR/final in the native format (+ recipe.yaml), from the gathered state dict (works under FSDP)."""
        state = self.accelerator.get_state_dict(self.drafter)
        final_dir = os.path.join(self.recipe.output.dir, "final")
        if self.accelerator.is_main_process:
            fresh = type(self.model)(copy.deepcopy(self.recipe.drafter), self.model.target_info)
            fresh.load_state_dict(state, strict=True)
            with disk_full_reported(final_dir, "choose another output.dir"), replace_directory(final_dir) as tmp_dir:
                fresh.save(tmp_dir, "native")
                save_recipe(self.recipe, os.path.join(tmp_dir, "recipe.yaml"))
        self.accelerator.wait_for_everyone()
        return final_dir

    # ---- the run ---------------------------------------------------------------------------------------------------
    def stop_flags(self, step: MeanMeter, preempted: bool) -> StepFlags:
        """This step's stop reasons, the same answer on every process (`agree_on_step`): a process that saw a
        non-finite value, or received SIGTERM, stops all of them at the same step, so none waits forever in a
        collective the others never reach. The run clock takes the main process's reading, so the wall budget and
        the time-annealed schedule and phases (schedule.anneal_on: time) switch at the same step everywhere."""
        device = self.accelerator.device
        local = torch.cat([any_nonfinite(step.values.get("loss", []), device),
                           any_nonfinite(step.values.get("grad_norm", []), device)])
        counts, self.clock.now = agree_on_step(self.accelerator, local, preempted, self.clock.tick())
        budget = self.recipe.train.max_time_minutes
        nonfinite_loss, nonfinite_grad, preempted_anywhere = (count > 0 for count in counts)
        return StepFlags(nonfinite_loss, nonfinite_grad, budget is not None and self.clock.now >= 60.0 * budget,
                         preempted_anywhere)

    def diverged(self, flags: StepFlags) -> FloatingPointError:
        """The error a non-finite loss or gradient norm stops the run with: the step and the last good checkpoint."""
        what = "training loss" if flags.nonfinite_loss else "gradient norm (the loss was finite)"
        last = self.last_checkpoint()
        remedy = (f"resume from it with a lower optim.lr or with optim.grad_clip set (train.resume_from={last})"
                  if last else "no checkpoint was written before it (train.save_every); lower optim.lr or set "
                  "optim.grad_clip")
        return FloatingPointError(f"non-finite {what} at step {self.step}; stopping. The last good checkpoint is "
                                  f"{last or 'none'}: {remedy}")

    def log_interval(self, interval: LogInterval) -> dict[str, float]:
        """Mean train metrics since the last log line, the learning rate, and tokens/s over all processes (time spent
        in train steps only)."""
        metrics, steps, seconds = interval.pop()
        means = reduce_mean(self.accelerator, metrics)
        tokens = means.pop("tokens") * self.derived.grad_accum * self.accelerator.num_processes * steps
        means.update(lr=self.scheduler.get_last_lr()[0], tokens_per_s=tokens / max(seconds, 1e-9),
                     epoch=self.step / self.derived.steps_per_epoch)
        self.log.log(self.step, means, "train")
        return means

    def after_step(self, interval: LogInterval, last_step: bool) -> dict[str, float] | None:
        """Logging, epoch-end cache refresh, checkpoints and evaluation after optimizer step self.step. On the run's
        last step (max_steps, or the wall budget) the log line, the checkpoint (when train.save_every is set) and the
        evaluation come whatever their periods. A run resumed at its last step trained nothing (empty interval):
        only what its checkpoint lacks, the evaluation. Returns the train means when a log line was written."""
        train = self.recipe.train
        trained, logged = interval.steps > 0, None
        if trained and (self.step % train.log_every == 0 or self.step == self.derived.max_steps or last_step):
            logged = self.log_interval(interval)
        if trained and self.step % self.derived.steps_per_epoch == 0:  # hybrid: every rank's shards become readable
            self.train_features.flush()
            self.accelerator.wait_for_everyone()
            self.train_features.refresh()
        if last_step:
            self.set_drafter_config(self.base_config)
        if train.save_every and (self.step % train.save_every == 0 or last_step) and self.saved_step != self.step:
            self.save()
        if train.eval_every and self.step % train.eval_every == 0 or last_step and self.last_eval_step != self.step:
            self.log.log(self.step, self.evaluate(), "eval")
            self.last_eval_step = self.step
        return logged

    def last_checkpoint(self) -> str | None:
        checkpoints = list_checkpoints(self.recipe.output.dir)
        return checkpoints[-1][1] if checkpoints else None

    def fit(self) -> str:
        """Train to max_steps (or the wall budget), evaluate, save, export OUTPUT_DIR/final; return its path.

        Raises Preempted after saving a checkpoint at the step boundary that followed a SIGTERM."""
        max_steps, interval = self.derived.max_steps, LogInterval()
        self.clock.start()
        last_step = self.step >= max_steps  # a run resumed at its end goes straight to its last-step duties
        bar = tqdm(total=max_steps, initial=self.step, disable=not self.accelerator.is_main_process, unit="step")
        with bar, sigterm_flag() as sigterm:  # the bar ends its line even when an error follows
            if last_step:
                self.after_step(interval, last_step=True)
            while not last_step:
                self.set_drafter_config(self.phase_overrides(self.step))  # by the clock all processes agreed on
                step_started = time.perf_counter()
                step = self.train_step(self.micro_batches(self.step))
                self.step += 1
                flags = self.stop_flags(step, sigterm.is_set())  # waits for the device, so the step's time is all in
                interval.add(step, time.perf_counter() - step_started)
                self.scheduler.step()  # after the clock is agreed: a time-annealed schedule reads it
                if flags.nonfinite_loss or flags.nonfinite_grad:
                    raise self.diverged(flags)
                last_step = self.step == max_steps or flags.out_of_time
                logged = self.after_step(interval, last_step and not flags.preempted)
                bar.update(1)
                if logged:
                    bar.set_postfix(loss=f"{logged['loss']:.3f}")
                if flags.preempted:
                    raise Preempted(self.step, self.last_checkpoint() if self.saved_step == self.step else self.save())
                if flags.out_of_time:
                    self.accelerator.print(f"wall budget train.max_time_minutes reached at step {self.step}; stopping")
        self.train_features.close()
        return self.export_final()
