"""Adaptive proposal length (inference/engine/adaptive.py) through the real engine, for every registered drafter.

- lossless: greedy output equals plain greedy output; at T = 1 the emitted law is the target's (chi-square);
- a k = 0 round defers the drafter's catch-up: proposals made after a catch-up commit equal the proposals made at the
  same position by a run that committed every round (the contract's catch-up clause, drafters/base.py);
- the controller falls to k = 0 with a useless drafter and rises to the largest k with one that copies the target;
- the width chosen is the argmax of the predicted throughput (brute force over synthetic acceptance and costs).
Costs are synthetic here (never wall-clock): the logic is tested, the measurement lives in docs/benchmarks.md.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import joint_counts, make_tiny_model, random_prompts
from test_contract import KINDS, NUM_DRAFTS, SAMPLING, build, exact_joint, tiny_target

from drafters.draft_model import DraftModelConfig, DraftModelDrafter
from inference.engine.adaptive import AdaptiveK, best_width, expected_gain
from inference.engine.api import speculative_generate
from inference.engine.costs import CostProfile
from inference.engine.policy import WidthPolicy
from inference.engine.target import TargetModel
from inference.evaluation.profile import profile_costs


def chain_costs(max_width: int, draft_step: float = 0.1, verify_slope: float = 0.05) -> CostProfile:
    """A chain drafter's shape in AR steps: d(W) = W * draft_step, v(W) = 1 + W * verify_slope."""
    widths = range(max_width + 1)
    return CostProfile(tuple(draft_step * w for w in widths), tuple(1.0 + verify_slope * w for w in widths))


class Recorder:
    """Passes the engine's calls through to a drafter and records each proposal by the position of its anchor
    (batch 1: the number of tokens of the sequence when it was made)."""

    def __init__(self, drafter):
        self.drafter, self.by_position, self.position = drafter, {}, 0

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def begin(self, context):
        self.position = int(context.valid.sum()) + 1
        self.drafter.begin(context)

    def propose(self, num_tokens):
        proposal = self.drafter.propose(num_tokens)
        self.by_position[self.position] = proposal.tokens[0, :num_tokens].tolist()
        return proposal

    def commit(self, num_accepted, context):
        self.position += int(context.valid.sum())
        self.drafter.commit(num_accepted, context)


class Scripted(WidthPolicy):
    """A fixed sequence of widths (then `rest` forever): exercises catch-up commits at chosen places."""

    adaptive = True

    def __init__(self, widths: list[int], rest: int, max_width: int):
        self.widths, self.rest, self.max_width = widths, rest, max_width

    def start(self, batch):
        self._round = 0

    def choose(self, active):
        self._round += 1
        return self.widths[self._round - 1] if self._round <= len(self.widths) else self.rest


@pytest.mark.parametrize("kind", KINDS)
def test_proposals_after_a_catch_up_equal_those_of_a_run_that_never_skipped(kind):
    target = tiny_target()
    prompt = [[5, 6, 7, 8, 9, 10]]
    every_round, skipping = Recorder(build(kind, target)), Recorder(build(kind, target))
    plain = speculative_generate(target, every_round, prompt, num_draft_tokens=2, max_new_tokens=24,
                                 adaptive=Scripted([], 2, 2))
    skipped = speculative_generate(target, skipping, prompt, num_draft_tokens=2, max_new_tokens=24,
                                   adaptive=Scripted([0, 0, 0, 2, 0, 2, 0, 0], 2, 2))
    assert skipped.tokens == plain.tokens
    assert skipped.chosen[0][:8] == [0, 0, 0, 2, 0, 2, 0, 0]
    common = sorted(set(every_round.by_position) & set(skipping.by_position))
    assert len(common) >= 3, "the two runs must propose at some common positions"
    for position in common:
        assert skipping.by_position[position] == every_round.by_position[position], (kind, position)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prompts", [[[5, 6, 7, 8]], [[5, 6, 7, 8, 9, 10], [40, 41], [100, 3, 77]]])
def test_adaptive_greedy_equals_plain_greedy(kind, prompts):
    target = tiny_target()
    drafter = build(kind, target)
    plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=24)
    adaptive = AdaptiveK(chain_costs(NUM_DRAFTS), explore_after=2)
    out = speculative_generate(target, drafter, prompts, num_draft_tokens=NUM_DRAFTS, max_new_tokens=24,
                               adaptive=adaptive)
    assert out.tokens == plain.tokens and out.adaptive
    widths = {w for row in out.chosen for w in row}
    assert len(widths) >= 2, widths  # the width changed during the run (0 too for drafters whose drafts fail)


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_adaptive_sampling_law_is_the_targets(kind):
    """T = 1 with widths chosen at run time (0, 1 or 2 per round): the law of three emitted tokens is the target's."""
    vocab, rows = 6, 4000
    target = tiny_target(vocab_size=vocab)
    drafter = build(kind, target, sampling=kind in SAMPLING)
    prompt = [1, 4, 2, 5, 3]
    adaptive = AdaptiveK(chain_costs(2, draft_step=0.05, verify_slope=0.3))
    out = speculative_generate(target, drafter, [prompt] * rows, num_draft_tokens=2, max_new_tokens=3,
                               temperature=1.0, seed=0, eos_token_ids=[], adaptive=adaptive)
    counts = joint_counts(out.tokens, vocab)
    expected = exact_joint(target.model, prompt, vocab) * rows
    keep = expected >= 5
    chi2 = (((counts - expected) ** 2) / expected)[keep].sum()
    chi2 += (counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(float(expected[~keep].sum()), 1e-9)
    dof = int(keep.sum())
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (float(chi2), dof)
    assert {w for row in out.chosen for w in row} >= {1}, "some round must have proposed"


def _draft_model(target: TargetModel, model) -> DraftModelDrafter:
    return DraftModelDrafter(DraftModelConfig(path="tiny"), target.target_info(), model=model)


@pytest.mark.parametrize("share", [0.0, 0.02])
def test_falls_to_zero_with_a_useless_drafter_and_explores_rarely(share):
    """Explorations get rarer until a failed one costs `explore_share` of the AR time since the last (0: they keep
    doubling to max_explore_after)."""
    target = TargetModel(make_tiny_model("llama"))
    useless = _draft_model(target, make_tiny_model("llama", seed=11, num_layers=1))
    costs = chain_costs(6)
    adaptive = AdaptiveK(costs, explore_after=8, max_explore_after=64, explore_share=share)
    out = speculative_generate(target, useless, random_prompts(1, seed=3), num_draft_tokens=6, max_new_tokens=120,
                               eos_token_ids=[], adaptive=adaptive)
    widths = out.chosen[0]
    assert sum(out.accept_lengths[0]) <= 2, "the test needs a drafter whose drafts are rejected"
    explorations = [i for i, w in enumerate(widths) if w > 0 and i >= 10]
    gaps = [b - a for a, b in zip(explorations, explorations[1:])]
    assert all(w == 1 for i, w in enumerate(widths) if i in explorations)  # exploration is one draft
    assert gaps == sorted(gaps), gaps  # and ever rarer, up to the cap
    failed = costs.d(1) + costs.v(1) - costs.v(0)  # what an exploration that is rejected costs, in AR steps
    cap = 64 if share == 0 else min(64, max(8, -(-failed // (share * costs.v(0)))))
    assert adaptive.max_explore_after == cap and max(gaps) <= cap
    if share == 0:
        assert widths[-40:].count(0) >= 38  # after the first rounds: plain AR, with at most a rare exploration
    else:  # cheap explorations (0.15 AR steps) reach the cap at once: every 8 rounds, 1.9% of the AR time
        assert set(gaps) == {cap} and failed / cap <= share * costs.v(0)


def test_rises_to_the_largest_k_with_a_drafter_that_copies_the_target():
    model = make_tiny_model("llama")
    target = TargetModel(model)
    copy_drafter = _draft_model(target, copy.deepcopy(model))
    out = speculative_generate(target, copy_drafter, random_prompts(2, seed=2), num_draft_tokens=6,
                               max_new_tokens=80, eos_token_ids=[], adaptive=AdaptiveK(chain_costs(6)))
    for row in out.chosen:
        assert row[-4:] == [6, 6, 6, 6], row
    assert all(a == p for row_a, row_p in zip(out.accept_lengths, out.proposed) for a, p in zip(row_a, row_p))


def test_choice_is_the_argmax_of_predicted_throughput():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        max_width = int(torch.randint(1, 8, (1,), generator=generator))
        alpha = torch.rand(3, max_width, generator=generator, dtype=torch.float64)
        draft = torch.rand(max_width + 1, generator=generator, dtype=torch.float64) * 0.5
        verify = 1.0 + torch.rand(max_width + 1, generator=generator, dtype=torch.float64)
        draft[0] = 0.0
        seconds = draft + verify
        brute = []
        for width in range(max_width + 1):
            gain = sum(1.0 + sum(float(alpha[r, :j].prod()) for j in range(1, width + 1)) for r in range(3))
            brute.append(gain / float(seconds[width]))
        chosen = best_width(expected_gain(alpha).sum(0), seconds)
        assert brute[chosen] == pytest.approx(max(brute), rel=1e-12)


def test_useless_acceptance_chooses_zero_and_certain_acceptance_the_largest_k():
    costs = chain_costs(5).round_seconds()
    assert best_width(expected_gain(torch.zeros(2, 5, dtype=torch.float64)).sum(0), costs) == 0
    assert best_width(expected_gain(torch.ones(2, 5, dtype=torch.float64)).sum(0), costs) == 5


def test_estimates_follow_observations():
    adaptive = AdaptiveK(chain_costs(3), prior=0.5, prior_weight=2.0, decay=1.0, regimes=False)
    adaptive.start(2)
    for _ in range(6):
        adaptive.observe([3, 3], [3, 0])  # row 0 accepts everything, row 1 rejects the first draft
    alpha = adaptive.acceptance()
    first, second = 7 / 8, (6 + 2 * 7 / 8) / 8
    assert alpha[0].tolist() == pytest.approx([first, second, (6 + 2 * second) / 8])
    assert alpha[1, 0].item() == pytest.approx(1 / 8)
    assert alpha[1, 1].item() == pytest.approx(1 / 8)  # never offered: the prior is the position before


def test_a_round_that_accepted_everything_reads_the_estimates_of_runs():
    """Two regimes per row: after a round that accepted every draft it proposed (a run of copied text, for the
    n-gram drafter) the next round reads counts kept for such rounds only, after any other round the rest."""
    adaptive = AdaptiveK(chain_costs(3), prior=0.5, prior_weight=2.0, decay=1.0)
    adaptive.start(1)
    for _ in range(4):
        adaptive.observe([3], [0])  # rejections, outside runs
    adaptive.observe([3], [3])  # the fifth round, outside a run too, accepts everything: a run starts
    assert adaptive.acceptance()[0, 0].item() == pytest.approx(0.5)  # nothing seen inside runs yet: the prior
    adaptive.observe([3], [3])
    assert adaptive.acceptance()[0, 0].item() == pytest.approx(2 / 3)
    adaptive.observe([3], [1])  # the run ends: back to the counts outside runs (1 of 5 survived position 1)
    assert adaptive.acceptance()[0, 0].item() == pytest.approx(2 / 7)


@pytest.mark.parametrize("draft_step", [0.0, 0.1])
def test_an_exploration_the_drafter_answered_with_nothing_is_retried_when_that_costs_nothing(draft_step):
    """An n-gram miss proposes nothing: the round costs the drafter's seconds only (its verify is an AR step), so
    when those are negligible the policy asks again next round instead of backing off as if it had looked."""
    adaptive = AdaptiveK(chain_costs(3, draft_step=draft_step, verify_slope=0.5), explore_after=4, max_explore_after=64)
    adaptive.start(1)
    active = torch.ones(1, dtype=torch.bool)
    widths = []
    for _ in range(12):
        adaptive.observe([1], [0])
    for _ in range(40):
        widths.append(adaptive.choose(active))
        adaptive.observe([0], [0])  # the drafter never finds anything to propose
    if draft_step == 0.0:
        assert widths[:3] == [0, 0, 0] and set(widths[3:]) == {1}  # asked every round from the first exploration on
    else:
        explorations = [i for i, w in enumerate(widths) if w > 0]
        gaps = [b - a for a, b in zip(explorations, explorations[1:])]
        assert len(explorations) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # backs off as before


@pytest.mark.parametrize("bad", [dict(prior=1.5), dict(decay=0.0), dict(explore_after=0), dict(explore_share=1.0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="adaptive k"):
        AdaptiveK(chain_costs(2), **bad)


def test_cost_curves_need_one_entry_per_width():
    with pytest.raises(ValueError, match="cost curves"):
        CostProfile((0.0, 0.1), (1.0,))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        target = TargetModel(make_tiny_model("llama"))
        speculative_generate(target, _draft_model(target, make_tiny_model("llama", seed=1, num_layers=1)),
                             random_prompts(1), num_draft_tokens=4, max_new_tokens=4,
                             adaptive=AdaptiveK(chain_costs(2)))


def test_widths_sweep_is_monotone_in_cost():
    """Cheaper verification never makes the controller choose a shorter proposal (same acceptance)."""
    alpha = torch.full((1, 6), 0.7, dtype=torch.float64)
    gain = expected_gain(alpha).sum(0)
    widths = [best_width(gain, chain_costs(6, verify_slope=slope).round_seconds())
              for slope in (0.5, 0.2, 0.1, 0.05, 0.0)]
    assert widths == sorted(widths) and widths[-1] > widths[0]


def test_a_second_generation_starts_from_what_the_first_learnt():
    """One AdaptiveK over successive requests: after a request with a useless drafter, the next one starts at k = 0
    (its rows inherit the pooled counts) instead of paying again for learning it."""
    target = TargetModel(make_tiny_model("llama"))
    useless = _draft_model(target, make_tiny_model("llama", seed=11, num_layers=1))
    adaptive = AdaptiveK(chain_costs(6))
    first = speculative_generate(target, useless, random_prompts(1, seed=3), num_draft_tokens=6, max_new_tokens=40,
                                 eos_token_ids=[], adaptive=adaptive)
    second = speculative_generate(target, useless, random_prompts(2, seed=4), num_draft_tokens=6, max_new_tokens=40,
                                  eos_token_ids=[], adaptive=adaptive)
    assert first.chosen[0][0] > 0  # the prior is optimistic
    assert all(row[:4] == [0, 0, 0, 0] for row in second.chosen), second.chosen
    assert sum(w > 0 for row in second.chosen for w in row) < sum(w > 0 for w in first.chosen[0])


def test_the_verify_cost_of_width_w_is_profiled_on_full_blocks_whatever_the_drafter_proposes():
    """An n-gram drafter that finds nothing proposes nothing, so the fixed-W runs verify one token per round; v(W)
    must still be the cost of verifying W + 1 tokens (priced at what the runs happened to verify, wide rounds looked
    free and auto chose them)."""
    from drafters.ngram import NgramConfig, NgramDrafter

    target = TargetModel(make_tiny_model("llama"))
    widths = []
    extend = target.extend
    target.extend = lambda block, *args, **kwargs: widths.append(block.shape[1]) or extend(block, *args, **kwargs)
    ngram = NgramDrafter(NgramConfig(min_ngram=4), target.target_info())  # no 4-gram repeats in 7 random tokens
    costs = profile_costs(target, ngram, [list(range(10, 17))], 3, max_new_tokens=2, repeats=1)
    assert costs.max_width == 3
    assert widths.count(4) == 2 and widths.count(3) == 2 and widths.count(2) == 2  # once per pass, warm-up included
    assert set(widths) - {2, 3, 4} == {1, 7}  # the engine runs themselves: prefills of 7 and verifies of 1 token


def test_profiled_costs_never_fall_with_the_width():
    target = TargetModel(make_tiny_model("llama"))
    drafter = _draft_model(target, make_tiny_model("llama", seed=1, num_layers=1))
    costs = profile_costs(target, drafter, random_prompts(2, seed=5), 3, max_new_tokens=4, repeats=1)
    assert costs.max_width == 3 and costs.draft_seconds[0] == 0.0
    for curve in (costs.draft_seconds, costs.verify_seconds):
        assert list(curve) == sorted(curve)


def test_an_auto_or_scheduler_method_runs_only_once_built_over_a_profile():
    """eval profiles first, then builds the methods that decide from costs (Method.profiled): one that was never
    profiled is refused in one line instead of running unscheduled; its warm-up stand-in is the largest k."""
    from inference.engine.schedule import PrefixScheduler
    from inference.evaluation.methods import Method, generate

    target = TargetModel(make_tiny_model("llama"))
    drafter = _draft_model(target, make_tiny_model("llama", seed=1, num_layers=1))
    prompts = random_prompts(1, seed=6)
    for method in (Method("auto", drafter, 3, auto=True), Method("sched", drafter, 3, PrefixScheduler(None))):
        with pytest.raises(ValueError, match="decides from the drafter's costs: build it with Method.profiled"):
            generate(target, method, prompts, max_new_tokens=4)
        warm = method.unprofiled()
        assert (warm.auto, warm.schedule, warm.adaptive) == (False, None, None)
        assert generate(target, warm, prompts, max_new_tokens=4, eos_token_ids=[]).chosen[0] == [3, 3, 3]
    auto = Method("auto", drafter, 3, auto=True).profiled(chain_costs(3))
    assert isinstance(auto.adaptive, AdaptiveK) and auto.adaptive.max_width == 3
    out = generate(target, auto, prompts, max_new_tokens=8, eos_token_ids=[])
    assert out.adaptive and out.tokens == speculative_generate(target, None, prompts, num_draft_tokens=0,
                                                               max_new_tokens=8, eos_token_ids=[]).tokens
    scheduled = Method("sched", drafter, 3, PrefixScheduler(None)).profiled(chain_costs(3))
    assert scheduled.schedule.cost == chain_costs(3)
    fixed = Method("k", drafter, 3)
    assert fixed.profiled(chain_costs(3)) is fixed
