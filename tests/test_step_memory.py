"""The step-memory model of `draftsmith estimate` (drafters/step_memory.py): every trained kind has one, its parameter
count is the drafters' own, its parts grow linearly in the sequence once chunks are full, checkpointing shrinks the
activations, it predicts the peaks benchmarks/training/long_sequence_memory.py measured
(docs/results/long_sequence_memory.json) within 20%, and for the full-vocabulary kinds the tensors autograd saves."""

from __future__ import annotations

import json
import os

import pytest
from test_long_sequences import FACTORIES, FULL_VOCAB, LENGTH, make_batch, target_info

from benchmarks.training import long_sequence_memory as bench
from drafters import DRAFTERS
from drafters.base import Drafter
from drafters.step_memory import StepShape, activation_values, peak_activation_values, step_peak_bytes, \
    step_peak_parts, step_shape, trained_params
from train.estimate import activation_bytes, saved_tensor_storages

ALL = {**FACTORIES, **FULL_VOCAB}

RESULTS = os.path.join(os.path.dirname(__file__), "..", "docs", "results", "long_sequence_memory.json")


def test_every_trained_kind_declares_its_step():
    trained = {kind for kind, cls in DRAFTERS.items() if cls.forward is not Drafter.forward}
    assert trained == {kind.split("_")[0] for kind in ALL}  # a new trained kind gets a factory above
    assert all(hasattr(DRAFTERS[kind].Config, "step_shape") for kind in trained)


@pytest.mark.parametrize("kind", sorted(ALL))
def test_parameter_count_is_the_drafters(kind):
    drafter = ALL[kind](target_info())
    shape = step_shape(drafter, seq_len=64, batch=1, checkpointing=False)
    counted = StepShape(**{**shape.__dict__, "params": None})
    assert trained_params(counted) == sum(p.numel() for p in drafter.parameters() if p.requires_grad)


def test_parameter_count_counts_the_mtp_draft_vocabulary_head():
    """MTP with draft_vocab_size trains one V_d x D head beside its modules; the full-vocabulary MTP trains none."""
    info = target_info()
    sizes = {}
    for vocab in (None, 40, info.vocab_size):  # a head of every row is trained too
        drafter = DRAFTERS["mtp"](DRAFTERS["mtp"].Config(num_modules=2, draft_vocab_size=vocab), info)
        shape = step_shape(drafter, seq_len=64, batch=1, checkpointing=False)
        counted = trained_params(StepShape(**{**shape.__dict__, "params": None}))
        assert counted == sum(p.numel() for p in drafter.parameters() if p.requires_grad)
        sizes[vocab] = counted
    assert sizes[40] - sizes[None] == 40 * info.hidden_size
    assert sizes[info.vocab_size] - sizes[None] == info.vocab_size * info.hidden_size


def bench_shape(variant: str, length: int, checkpointing: bool = False) -> StepShape:
    kind, fields = bench.VARIANTS[variant]
    return StepShape.for_drafter(kind, bench.drafter_config(kind, fields), hidden=bench.HIDDEN,
                                 heads=bench.HEADS, kv_heads=bench.KV_HEADS, head_dim=bench.HEAD_DIM,
                                 intermediate=bench.MLP, vocab=bench.VOCAB, num_features=None, seq_len=length,
                                 batch=1, checkpointing=checkpointing)


@pytest.mark.parametrize("variant", sorted(bench.VARIANTS))
def test_linear_in_the_sequence_once_chunks_are_full(variant):
    peaks = [step_peak_bytes(bench_shape(variant, length)) for length in (8192, 16384, 24576)]
    assert peaks[2] - peaks[1] == pytest.approx(peaks[1] - peaks[0], rel=1e-6)


@pytest.mark.parametrize("variant", sorted(bench.VARIANTS))
def test_checkpointing_keeps_less(variant):
    plain, checkpointed = bench_shape(variant, 8192), bench_shape(variant, 8192, checkpointing=True)
    assert activation_values(checkpointed) < activation_values(plain) / 2
    assert step_peak_parts(checkpointed)["static"] == step_peak_parts(plain)["static"]


def test_model_predicts_the_measured_peaks_within_20_percent():
    with open(RESULTS) as f:
        measured = json.load(f)["after"]
    checked = 0
    for key, point in measured.items():
        if "measured_bytes" not in point:
            continue
        variant, _, rest = key.partition("@")
        length, checkpointing = int(rest.split("+")[0]), rest.endswith("+checkpointing")
        ratio = step_peak_bytes(bench_shape(variant, length, checkpointing)) / point["measured_bytes"]
        assert 0.8 <= ratio <= 1.2, (key, ratio)
        checked += 1
    assert checked >= 12


# one MTP module over 3 served steps: step k attends to k + 1 blocks of keys (mtp/layers.StepKeys)
SERVED_MTP = {"mtp-served": lambda info: FULL_VOCAB["mtp"](info).__class__(
    FULL_VOCAB["mtp"](info).Config(num_modules=1, reuse=True, num_steps=3), info)}


@pytest.mark.parametrize("kind", sorted(FULL_VOCAB) + sorted(SERVED_MTP))
def test_full_vocab_kinds_count_what_autograd_saves(kind):
    """MTP (DeepSeek-V3's depths and the served steps), Medusa and the assistant: the kept activations plus the
    one-shot loss's logits and per-cell teacher (what the step saves for its backward pass, counted storage by
    storage) within 5% of the model's count."""
    drafter = {**FULL_VOCAB, **SERVED_MTP}[kind](target_info())
    batch = make_batch(drafter, (LENGTH, LENGTH))
    shape = step_shape(drafter, seq_len=LENGTH, batch=2, checkpointing=False)

    def step():
        loss, _ = drafter.loss(drafter(batch), batch)
        loss.backward()

    measured = activation_bytes(saved_tensor_storages(step), drafter)
    logits = shape.batch * shape.seq_len * shape.depths * shape.head_vocab
    assert 4 * (activation_values(shape) + 2 * logits) == pytest.approx(measured, rel=0.05)
    assert peak_activation_values(shape) == activation_values(shape) + 3 * logits  # + the backward's softmax


@pytest.mark.parametrize("variant", sorted(bench.VARIANTS))
def test_repeated_kv_off_the_cpu_costs_memory_and_the_cpu_model_is_unchanged(variant):
    """Off the CPU masked attention repeats K/V to every query head (drafters/layers.expands_kv_heads): block
    drafters hold the repeated K/V of an attention chunk, EAGLE-3 (unpadded at batch 1: no mask) nothing more."""
    cpu = bench_shape(variant, 8192)
    accelerator = StepShape(**{**cpu.__dict__, "kv_expanded": True})
    extra = step_peak_bytes(accelerator) - step_peak_bytes(cpu)
    assert extra == 0 if cpu.step == "ttt" else 0 < extra < step_peak_bytes(cpu) // 10

