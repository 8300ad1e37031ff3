"""`auto` against every fixed k without timing: width policies replayed (benchmarks/engine/replay.py) on recorded
greedy continuations of a real target with a measured cost profile, and on the same continuations under a GPU-like
profile.

tests/data/ngram_traces_smollm2.json holds SmolLM2-135M-Instruct's greedy continuations of 16 MT-Bench first turns
and the n-gram drafter's profile on a CPU where a verify of 2 tokens costs 1.64 AR steps. The n-gram drafter's
acceptance comes in runs (copied text) and it proposes nothing on a miss: the case where a running acceptance
estimate with ever rarer explorations settles on plain decoding and never comes back. A replay is the engine's
exact round sequence at batch 1 for this drafter, so the comparison is deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.engine.replay import Replay, replay
from drafters.ngram import NgramConfig, NgramDrafter
from inference.engine.adaptive import AdaptiveK
from inference.engine.costs import CostProfile
from inference.engine.policy import FixedWidth

DATA = json.loads((Path(__file__).parent / "data" / "ngram_traces_smollm2.json").read_text())
CPU = CostProfile(tuple(DATA["d"]), tuple(DATA["v"]))
GPU = CostProfile((0.0,) + (0.01,) * 8, tuple(1.0 + 0.03 * w for w in range(9)))  # verify nearly free at small W


def workload(policy, costs) -> Replay:
    """Every recorded request through one policy object (one AdaptiveK serves a workload, as in draftsmith eval)."""
    result = Replay()
    for trace in DATA["traces"]:
        replay(policy, NgramDrafter(NgramConfig(), None), trace["prompt"], trace["continuation"], costs, result)
    return result


@pytest.mark.parametrize("costs", [CPU, GPU], ids=["cpu", "gpu"])
def test_auto_is_within_3_percent_of_the_best_fixed_k_for_the_ngram_drafter(costs):
    fixed = {k: workload(FixedWidth(k), costs).speedup for k in range(1, 9)}
    auto = workload(AdaptiveK(costs), costs)
    best = max(fixed, key=fixed.get)
    assert auto.speedup >= 0.97 * fixed[best], (auto.speedup, fixed)
    assert sum(w > 0 for w in auto.chosen) > len(auto.chosen) / 4  # it drafts: not plain decoding in disguise


def test_without_regimes_and_the_exploration_cap_auto_settles_on_plain_decoding():
    """What the two changes fix: one running estimate for both regimes and explorations that double to every 256
    rounds end at k = 0 for good on this workload (about 1.0x where the best fixed k gives 1.2x)."""
    old = workload(AdaptiveK(CPU, regimes=False, explore_share=0.0), CPU)
    best = max(workload(FixedWidth(k), CPU).speedup for k in (4, 5))
    assert old.speedup < 0.85 * best and old.chosen[-1000:].count(0) > 990


def test_replay_counts_what_the_engine_would_emit():
    """Every continuation token is emitted once, by a draft or by the target; a round emits accepted + 1 tokens
    (the last one may stop short at the end of the continuation)."""
    trace = DATA["traces"][0]
    result = replay(FixedWidth(3), NgramDrafter(NgramConfig(), None), trace["prompt"], trace["continuation"], CPU)
    assert result.tokens == len(trace["continuation"])
    assert sum(a + 1 for a in result.accepted) in (len(trace["continuation"]) - 1, len(trace["continuation"]))
    assert all(0 <= a <= p <= 3 for a, p in zip(result.accepted, result.proposed))
    assert result.ar_seconds == pytest.approx(CPU.v(0) * (len(trace["continuation"]) - 1))
