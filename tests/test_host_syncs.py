"""Host reads and device synchronisations per round of the decoding loop, counted without an accelerator.

Each read of a tensor's value on the host (tolist, item, bool, int, float, nonzero) and each clock synchronisation is
a stall on a GPU. The counter wraps those Tensor methods and the clock's `synchronize` for one engine call; two calls
that differ only in their number of rounds (batch 1, no EOS, so every round is alike) give the exact count per round.
At 73a164d a round read the host 11 times at k = 0 and 24 times at k = 3 (this drafter's own reads included) and
synchronised 2 and 6 times; an untimed call now synchronises never.
"""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import make_tiny_model, random_prompts

from drafters import DraftModelDrafter
from drafters.draft_model import DraftModelConfig
from inference.engine import run as run_module
from inference.engine.generate import decode
from inference.engine.policy import FixedWidth
from inference.engine.rounds import ChainRounds
from inference.engine.target import TargetModel

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "nonzero", "cpu")


def counted(call, monkeypatch) -> tuple[collections.Counter, object]:
    counts = collections.Counter()
    with monkeypatch.context() as patch:
        for name in READS:
            original = getattr(torch.Tensor, name)

            def wrapped(self, *args, _original=original, _name=name, **kwargs):
                counts[_name] += 1
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, wrapped)
        synchronize = run_module.synchronize
        patch.setattr(run_module, "synchronize", lambda device: (counts.update(["synchronize"]), synchronize(device)))
        out = call()
    return counts, out


@pytest.fixture(scope="module")
def pair():
    target = TargetModel(make_tiny_model("llama", dtype=torch.float32))
    drafter = DraftModelDrafter(DraftModelConfig(path="tiny"), target.target_info(),
                                model=make_tiny_model("llama", seed=5, num_layers=1, dtype=torch.float32))
    return target, drafter


@pytest.mark.parametrize("k,most_reads,syncs", [(0, 5, 2), (3, 15, 6)])
def test_host_reads_and_synchronisations_per_round(pair, monkeypatch, k, most_reads, syncs):
    target, drafter = pair
    prompt = random_prompts(1, seed=1)
    per_round, outputs = {}, {}
    for timed in (True, False):
        runs = []
        for max_new_tokens in (20, 40):
            counts, out = counted(lambda: decode(target, drafter if k else None, prompt, ChainRounds(), FixedWidth(k),
                                                 max_new_tokens=max_new_tokens, eos_token_ids=[], timed=timed),
                                  monkeypatch)
            runs.append((counts, out.verify_forwards))
            outputs[timed, max_new_tokens] = out.tokens
        (first, rounds_first), (second, rounds_second) = runs
        assert rounds_second > rounds_first
        per_round[timed] = {name: (second[name] - first[name]) / (rounds_second - rounds_first)
                            for name in set(first) | set(second)}
    assert outputs[True, 40] == outputs[False, 40]  # the clock changes no token
    assert per_round[True]["synchronize"] == syncs and per_round[False].get("synchronize", 0) == 0
    reads = {timed: sum(v for name, v in counts.items() if name != "synchronize") for timed, counts in per_round.items()}
    assert reads[True] == reads[False] <= most_reads
    assert per_round[False]["tolist"] == (1 if k == 0 else 4)  # emit's one stacked copy (+ record's, the drafter's)
