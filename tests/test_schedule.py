"""Confidence-scheduled verification (inference/engine/schedule.py): the static threshold, the prefix scheduler's greedy
admission with early stop, the DSpark paper's appendix counter-example (our rule gives exactly p, a look-ahead
search gives the biased (0.85, 0.15)), the uncalibrated fallback, the verify cost read from the one cost profile, and
`draftsmith eval --schedule` end to end."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import make_tiny_model

from drafters.base import Proposal
from drafters.dspark import DSparkConfig, DSparkDrafter
from inference.engine.costs import CostProfile
from inference.engine.schedule import (
    PrefixScheduler,
    StaticThreshold,
    parse_schedule_specs,
    prefix_schedule,
    prefix_survival,
    scheduled_num_valid,
    threshold_lengths,
)
from inference.engine.target import TargetModel
from inference.engine.verify import acceptance_probability, residual_distribution
from inference.evaluation.profile import profile_costs


def test_threshold_cuts_at_the_first_survival_below():
    survival = torch.tensor([[0.9, 0.6, 0.5, 0.2], [0.4, 0.3, 0.2, 0.1], [1.0, 1.0, 0.99, 0.98]])
    assert threshold_lengths(survival, 0.5).tolist() == [3, 0, 4]
    assert threshold_lengths(survival, 0.0).tolist() == [4, 4, 4]
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    expected = torch.sigmoid(logits / torch.tensor([2.0, 1.0, 0.5])).cumprod(-1)
    torch.testing.assert_close(prefix_survival(logits, torch.tensor([2.0, 1.0, 0.5])), expected.double())
    torch.testing.assert_close(prefix_survival(logits, None), torch.sigmoid(logits).cumprod(-1).double())


def test_scheduler_admits_columns_while_throughput_rises():
    """Two rows, padded engine: column j costs a forward over 2 (1 + j) tokens; hand-computed throughputs."""
    survival = torch.tensor([[0.9, 0.8, 0.1], [0.7, 0.2, 0.0]])
    seconds = {2: 1.0, 4: 1.2, 6: 1.5, 8: 3.0}.__getitem__
    # width 0: 2 / 1.0 = 2.0; width 1: 3.6 / 1.2 = 3.0; width 2: 4.6 / 1.5 = 3.07; width 3: 4.7 / 3.0 -> stop
    assert prefix_schedule(survival, seconds).tolist() == [2, 2]
    seconds = {2: 1.0, 4: 1.2, 6: 1.6, 8: 1.7}.__getitem__  # width 2: 4.6 / 1.6 = 2.875 < 3.0: stops there
    assert prefix_schedule(survival, seconds).tolist() == [1, 1]  # even though width 3 (4.7 / 1.7) would be better
    free = lambda tokens: 1.0  # noqa: E731  verification costs nothing extra: every offered draft is admitted
    assert prefix_schedule(survival, free).tolist() == [3, 2]  # row 1 offers 2 drafts (survival 0 after)
    assert prefix_schedule(torch.zeros(3, 4), free).tolist() == [0, 0, 0]


def test_scheduler_decision_for_column_j_never_reads_later_columns():
    """Whether column j is verified is a function of columns <= j (they depend on drafts < j only): redrawing the
    later columns never changes it. This is the non-anticipation that makes the schedule lossless."""
    gen = torch.Generator().manual_seed(0)
    seconds = lambda tokens: 1.0 + 0.05 * tokens ** 1.3  # noqa: E731
    for _ in range(200):
        survival = torch.rand(3, 5, generator=gen).cumprod(-1)
        width = int(prefix_schedule(survival, seconds).max())
        for j in range(5):
            changed = survival.clone()
            changed[:, j + 1:] = changed[:, j: j + 1] * torch.rand(3, 4 - j, generator=gen).cumprod(-1)
            assert (int(prefix_schedule(changed, seconds).max()) > j) == (width > j)


# ---- the DSpark paper's appendix A counter-example -------------------------------------------------------------------
SPS = {1: 1.0, 2: 0.5, 3: 0.45}  # engine steps per second at 1, 2, 3 verified tokens
P = torch.tensor([0.7, 0.3], dtype=torch.float64)  # the target at the first position
Q = torch.tensor([0.5, 0.5], dtype=torch.float64)  # the draft there
A1 = 0.8  # a_1: the confidence of draft 1, known before it is drawn
C2 = {0: 1.0, 1: 0.0}  # c_2 depends on the drawn x_1 (through its Markov embedding)


def lookahead_lengths(survival: torch.Tensor, step_seconds) -> int:
    """A retrospective search: the length with the best expected throughput over all lengths (one row)."""
    values = [(1 + float(survival[0, :length].sum())) / step_seconds(1 + length) for length in range(3)]
    return max(range(3), key=values.__getitem__)


def first_token_law(lengths_of) -> torch.Tensor:
    """Exact law of the first emitted token: x_1 ~ Q, verified (rejection sampling) when its length is >= 1."""
    law = torch.zeros(2, dtype=torch.float64)
    for x1 in (0, 1):
        survival = torch.tensor([[A1, A1 * C2[x1]]], dtype=torch.float64)
        if lengths_of(survival) == 0:
            law += Q[x1] * P
            continue
        accept = float(acceptance_probability(P, Q, torch.tensor(x1)))
        law[x1] += Q[x1] * accept
        law += Q[x1] * (1 - accept) * residual_distribution(P, Q, torch.tensor(x1))
    return law


def test_appendix_counter_example_early_stop_is_exact_and_lookahead_is_biased():
    cost = CostProfile.from_steps_per_second(SPS).verify_by_tokens
    ours = first_token_law(lambda survival: int(prefix_schedule(survival, cost)[0]))
    torch.testing.assert_close(ours, P, rtol=0, atol=1e-15)  # exactly p = (0.7, 0.3)
    biased = first_token_law(lambda survival: lookahead_lengths(survival, cost))
    torch.testing.assert_close(biased, torch.tensor([0.85, 0.15], dtype=torch.float64), rtol=0, atol=1e-15)


# ---- fallback, cost curve, engine hook, profiling, CLI specs ---------------------------------------------------------
def test_uncalibrated_scheduler_falls_back_to_the_threshold_and_says_so():
    survival = torch.tensor([[0.9, 0.6, 0.4], [0.3, 0.2, 0.1]], dtype=torch.float64)
    scheduler = PrefixScheduler(CostProfile((0.0, 0.0), (1.0, 1.0)), fallback_threshold=0.5)
    with pytest.warns(UserWarning, match="not calibrated.*static threshold 0.5"):
        assert scheduler.lengths(survival, False, 2, 0.0).tolist() == [2, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per scheduler, not every round
        scheduler.lengths(survival, False, 2, 0.0)
        assert scheduler.lengths(survival, True, 2, 0.0).tolist() == [3, 3]  # calibrated: scheduled (free here)


def test_cost_curve_interpolates_and_refuses_non_positive_entries():
    cost = CostProfile((0.0,) * 4, (1.0, 2.0, 2.0, 3.0), num_rows=2)  # forwards over 2, 4, 6, 8 tokens
    assert cost.verify_by_tokens(3) == pytest.approx(1.5) and cost.verify_by_tokens(5) == pytest.approx(2.0)
    assert cost.verify_by_tokens(2) == 1.0 and cost.verify_by_tokens(10) == pytest.approx(4.0)  # extrapolated above
    assert cost.verify_by_tokens(1) == pytest.approx(1.0)  # extrapolated below, never under the cheapest measurement
    assert CostProfile.from_steps_per_second({1: 1.0, 2: 0.5}).verify_by_tokens(2) == pytest.approx(2.0)
    with pytest.raises(ValueError, match=r"verify seconds must be > 0.*\(1, 0\.0\)"):
        CostProfile((0.0, 0.0), (1.0, 0.0))
    with pytest.raises(ValueError, match=r"steps per second must be > 0.*\{2: -1\.0\}"):
        CostProfile.from_steps_per_second({1: 1.0, 2: -1.0})
    with pytest.raises(ValueError, match="every B = 1..N"):
        CostProfile.from_steps_per_second({1: 1.0, 4: 2.0})
    with pytest.raises(ValueError, match="one entry per width"):
        CostProfile((0.0, 0.0), (1.0,))
    with pytest.raises(ValueError, match=r"threshold 1\.5"):
        StaticThreshold(1.5)


def test_engine_hook_respects_offered_drafts_finished_rows_and_drafters_without_confidences():
    tokens = torch.zeros(3, 3, dtype=torch.long)
    logits = torch.full((3, 3), 5.0)  # sigmoid ~ 0.993: everything survives a 0.5 threshold
    proposal = Proposal(tokens=tokens, confidence_logits=logits)
    num_valid = torch.tensor([3, 1, 3])
    active = torch.tensor([True, True, False])
    lengths = scheduled_num_valid(StaticThreshold(0.5), proposal, num_valid, active, 0.0)
    assert lengths.tolist() == [3, 1, 0]
    plain = Proposal(tokens=tokens)  # no confidences: proposed as usual
    assert scheduled_num_valid(StaticThreshold(0.99), plain, num_valid, active, 0.0).tolist() == [3, 1, 3]


def test_profiled_costs_give_the_scheduler_its_verify_cost_by_tokens():
    target = TargetModel(make_tiny_model(num_layers=3), name_or_path="tiny")
    drafter = DSparkDrafter(DSparkConfig(layer_ids=(0, 1, 2), num_layers=1, block_size=3, markov_rank=8,
                                         mask_token_id=255),
                            target.target_info())
    cost = profile_costs(target, drafter, [[5, 6, 7, 8]] * 2, 2, max_new_tokens=3, repeats=1)
    assert cost.num_rows == 2 and cost.max_width == 2 and all(s > 0 for s in cost.verify_seconds)
    for width in range(3):  # the scheduler reads the same measurement by tokens: rows x (width + 1)
        assert cost.verify_by_tokens(2 * (width + 1)) == cost.v(width)
    with pytest.raises(ValueError, match="profile_costs"):
        profile_costs(target, drafter, [], 2)
    with pytest.raises(ValueError, match="no cost profile"):
        PrefixScheduler(None).lengths(torch.ones(1, 2), True, 1, 0.0)


def test_schedule_specs():
    assert parse_schedule_specs("fixed, threshold:0.6,scheduler") == ["fixed", "threshold:0.6", "scheduler"]
    assert parse_schedule_specs("") == ["fixed"]
    for bad in ("threshold", "threshold:2", "threshold:x", "adaptive"):
        with pytest.raises(ValueError, match="--schedule"):
            parse_schedule_specs(bad)


def test_eval_runs_each_schedule_as_its_own_method_and_stays_exact(tmp_path):
    """`draftsmith eval --schedule fixed,threshold:0.5,scheduler` on the debug target with an untrained DSpark."""
    from inference.assets.debug_target import resolve_debug_target
    from inference.evaluation.eval import main

    target_dir = resolve_debug_target("debug:tiny-llama", cache_dir=str(tmp_path / "cache"))
    target = TargetModel.from_pretrained(target_dir)
    torch.manual_seed(0)
    drafter = DSparkDrafter(DSparkConfig(layer_ids=(1, 2, 3), num_layers=1, block_size=3, markov_rank=8),
                            target.target_info())
    drafter.save(str(tmp_path / "dspark"))
    with pytest.warns(UserWarning, match="not calibrated"):  # the uncalibrated drafter: the scheduler says so
        status = main(["--target", target_dir, "--drafter", str(tmp_path / "dspark"), "--prompts", "gsm8k",
                       "--num-prompts", "1", "--max-new-tokens", "8", "--num-draft-tokens", "3",
                       "--schedule", "fixed,threshold:0.5,scheduler", "--out", str(tmp_path / "report.json")])
    assert status == 0
    records = json.loads((tmp_path / "report.json").read_text())
    records = records["records"] if isinstance(records, dict) else records
    names = {r["drafter"] for r in records if r["category"] == "all"}
    assert names == {"none", "dspark:dspark", "dspark:dspark@threshold0.5", "dspark:dspark@scheduler"}
    assert all(r["greedy_exact_match"] == 1.0 for r in records if r["drafter"] != "none")
