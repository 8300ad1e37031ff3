"""The step-memory model of `draftsmith estimate` (drafters/step_memory.py): its parameter count is the drafters'
own, its parts grow linearly in the sequence once chunks are full, checkpointing shrinks the activations, and it
predicts the peaks benchmarks/training/long_sequence_memory.py measured (docs/results/long_sequence_memory.json) within 20%."""

from __future__ import annotations

import json
import os

import pytest
from test_long_sequences import FACTORIES, target_info

from benchmarks.training import long_sequence_memory as bench
from drafters.step_memory import StepShape, activation_values, step_peak_bytes, step_peak_parts, step_shape, \
    trained_params

RESULTS = os.path.join(os.path.dirname(__file__), "..", "docs", "results", "long_sequence_memory.json")


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_parameter_count_is_the_drafters(kind):
    drafter = FACTORIES[kind](target_info())
    shape = step_shape(drafter, seq_len=64, batch=1, checkpointing=False)
    counted = StepShape(**{**shape.__dict__, "params": None})
    assert trained_params(counted) == sum(p.numel() for p in drafter.parameters() if p.requires_grad)


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

