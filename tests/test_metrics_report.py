"""Report record counters on hand-built GenerateOutputs, the k recommendation, and the report files."""

from __future__ import annotations

import json
import os

import pytest
import torch

from inference.engine.generate import GenerateOutput
from inference.evaluation.metrics import (
    annotate_recommendations,
    build_record,
    merge_outputs,
    recommend_num_draft_tokens,
    roofline_keys,
)
from inference.engine.roofline import stream_bandwidth, weight_bytes
from inference.evaluation.report import format_table, write_report

ENV = {"torch": "test"}


def spec_output() -> GenerateOutput:
    """k = 3, two rows: row 0 accepts 3, 1, 0; row 1 accepts 2, 3. Three batched rounds after one prefill."""
    return GenerateOutput(
        tokens=[list(range(8)), list(range(8))],
        accept_lengths=[[3, 1, 0], [2, 3]],
        proposed=[[3, 3, 3], [3, 3]],
        num_draft_tokens=3,
        target_forwards=4, verify_forwards=3,
        time_draft=0.6, time_verify=1.0, time_prefill=0.2, time_other=0.2, time_total=2.0,
    )


def ar_output() -> GenerateOutput:
    """The k = 0 baseline: 16 tokens in 15 decode steps of 0.1 s each, 4 s in all."""
    return GenerateOutput(tokens=[list(range(8)), list(range(8))], accept_lengths=[[], []], proposed=[[], []],
                          num_draft_tokens=0, target_forwards=16, verify_forwards=15, time_verify=1.5,
                          time_prefill=0.2, time_total=4.0)


def record_for(out: GenerateOutput, ar: GenerateOutput | None = None, drafter: str = "d", temperature: float = 0.0):
    return build_record(out, ar=ar, dataset="set", category="all", drafter_name=drafter, temperature=temperature,
                        batch_size=2, num_prompts=2, greedy_exact_match=1.0 if temperature == 0 else None, env=ENV)


def test_counters_agree_with_the_definitions():
    record = record_for(spec_output(), ar_output())
    assert record["rounds"] == 5 and record["accepted"] == 9 and record["proposed"] == 15
    assert record["tau"] == pytest.approx(1 + 9 / 5)
    assert record["acceptance_rate"] == pytest.approx(9 / 15)
    assert record["accept_length_histogram"] == [1, 1, 1, 2]
    assert sum(record["accept_length_histogram"]) == record["rounds"]
    unconditional = record["per_position_acceptance_unconditional"]
    assert unconditional == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert sum(unconditional) == pytest.approx(record["tau"] - 1)
    conditional = record["per_position_acceptance_conditional"]
    assert conditional == pytest.approx([0.8, 0.75, 2 / 3])
    assert record["target_forwards"] == 4 and record["verify_forwards"] == 3
    assert record["new_tokens"] == 16


def test_costs_and_speedups():
    record = record_for(spec_output(), ar_output())
    step = 1.5 / 15
    assert record["tokens_per_s"] == pytest.approx(8.0)
    assert record["tokens_per_s_ar"] == pytest.approx(4.0)
    assert record["speedup"] == pytest.approx(2.0)
    d = 0.6 / 3 / step  # draft seconds per round / AR step
    v = 1.0 / 3 / step
    assert record["draft_cost_per_round"] == pytest.approx(d)
    assert record["draft_cost_ratio"] == pytest.approx(d / 3)
    assert record["verify_cost_ratio"] == pytest.approx(v)
    assert record["theoretical_speedup"] == pytest.approx(2.8 / (d + v))
    assert record["time_s"] == {"draft": 0.6, "verify": 1.0, "prefill": 0.2, "other": 0.2, "total": 2.0}


def test_without_baseline_the_relative_numbers_are_missing():
    record = record_for(spec_output(), None)
    for key in ("tokens_per_s_ar", "speedup", "draft_cost_per_round", "draft_cost_ratio", "verify_cost_ratio",
                "theoretical_speedup"):
        assert record[key] is None
    assert record["tau"] == pytest.approx(2.8)


def test_baseline_record_is_one():
    record = record_for(ar_output(), ar_output(), drafter="none")
    assert record["tau"] == 1.0 and record["rounds"] == 0
    assert record["speedup"] == pytest.approx(1.0) and record["theoretical_speedup"] == pytest.approx(1.0)
    assert record["per_position_acceptance_unconditional"] == [] and record["accept_length_histogram"] == [0]


def test_short_proposals_count_rounds_and_condition_on_offered_positions():
    """An n-gram miss proposes nothing: the round counts for tau, but no position was offered."""
    out = GenerateOutput(tokens=[[1, 2, 3, 4, 5]], accept_lengths=[[0, 2, 1]], proposed=[[0, 2, 3]],
                         num_draft_tokens=3, target_forwards=4, verify_forwards=3, time_total=1.0)
    record = record_for(out)
    assert record["tau"] == pytest.approx(1 + 3 / 3)
    assert record["acceptance_rate"] == pytest.approx(3 / 5)
    assert record["per_position_acceptance_unconditional"] == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert sum(record["per_position_acceptance_unconditional"]) == pytest.approx(record["tau"] - 1)
    # position 1 offered twice (both accepted), position 2 offered twice (once accepted), position 3 never
    assert record["per_position_acceptance_conditional"] == [1.0, 0.5, None]


def test_inconsistent_counters_are_rejected():
    bad = GenerateOutput(tokens=[[1]], accept_lengths=[[2]], proposed=[[1]], num_draft_tokens=3)
    with pytest.raises(ValueError, match="2 accepted of 1 proposed"):
        record_for(bad)


def test_merge_sums_counters_and_concatenates_rows():
    merged = merge_outputs([spec_output(), spec_output()])
    assert len(merged.tokens) == 4 and merged.verify_forwards == 6 and merged.time_total == pytest.approx(4.0)
    assert record_for(merged)["tau"] == pytest.approx(2.8)
    with pytest.raises(ValueError, match="different num_draft_tokens"):
        merge_outputs([spec_output(), ar_output()])


def test_recommendation_picks_the_best_k():
    p = [0.9, 0.8, 0.5, 0.2]
    # a chain drafter, d(k) = 0.1 k, v = 1.2 everywhere: 1.46, 1.93, 2.133, 2.125 -> k = 3
    chain = {k: 0.1 * k for k in range(1, 5)}
    assert recommend_num_draft_tokens(p, chain, {4: 1.2}) == 3
    # v interpolated between k = 1 (1.0) and k = 4 (1.6): 1.73, 1.93, 1.88, 1.70 -> k = 2
    assert recommend_num_draft_tokens(p, chain, {1: 1.0, 4: 1.6}) == 2
    # a drafter as slow as the target never pays off -> do not speculate
    assert recommend_num_draft_tokens(p, {k: 1.0 * k for k in range(1, 5)}, {4: 1.2}) == 0
    # a block drafter pays one forward for every k: d flat at 0.3 -> 1.27, 1.73, 2.07, 2.2 -> k = 4 ...
    assert recommend_num_draft_tokens(p, {1: 0.3, 4: 0.3}, {4: 1.2}) == 4
    # ... unless it cannot draft that many in one round
    assert recommend_num_draft_tokens(p, {1: 0.3, 4: 0.3}, {4: 1.2}, max_draft_tokens=3) == 3


def test_annotate_recommendations_names_its_basis():
    ar = ar_output()
    records = [record_for(ar, ar, drafter="none"), record_for(spec_output(), ar)]
    annotate_recommendations(records)
    assert records[0]["recommended_num_draft_tokens"] is None
    assert isinstance(records[1]["recommended_num_draft_tokens"], int)
    assert "only at k=3" in records[1]["recommendation_basis"]


def sweep_records() -> list[dict]:
    ar = ar_output()
    records = [record_for(ar, ar, drafter="none")]
    for k in (1, 3):
        out = spec_output() if k == 3 else GenerateOutput(
            tokens=[list(range(8))], accept_lengths=[[1, 0, 1, 1]], proposed=[[1, 1, 1, 1]], num_draft_tokens=1,
            target_forwards=5, verify_forwards=4, time_draft=0.1, time_verify=0.8, time_total=1.5)
        records.append(record_for(out, ar))
    annotate_recommendations(records)
    return records


def test_report_files_are_written_and_parse(tmp_path):
    records = sweep_records()
    out = str(tmp_path / "sub" / "report.json")
    written = write_report(records, out)
    with open(out) as f:
        assert json.load(f)["records"] == json.loads(json.dumps(records))
    table = (tmp_path / "sub" / "report.md").read_text()
    assert table == format_table(records)
    rows = [line for line in table.splitlines() if line.startswith("| set")]
    assert len(rows) == len(records)
    assert "| - |" in rows[0]  # the baseline has no draft cost
    pngs = sorted(os.path.basename(path) for path in written if path.endswith(".png"))
    assert pngs == ["report_acceptance_set.png", "report_speedup_set.png"]
    for name in pngs:
        assert (tmp_path / "sub" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_single_k_writes_no_speedup_plot(tmp_path):
    records = [record_for(spec_output(), ar_output())]
    written = write_report(records, str(tmp_path / "r.json"))
    assert [os.path.basename(path) for path in written] == ["r.json", "r.md", "r_acceptance_set.png"]


def test_recommendation_and_prediction_are_the_argmax_over_synthetic_profiles():
    """With a cost profile at every k, the recommended k is the argmax of the predicted speedup (k = 0 = 1.0), and a
    useless drafter gets k = 0."""
    from inference.evaluation.metrics import predicted_speedup

    generator = torch.Generator().manual_seed(1)
    for _ in range(100):
        k_max = int(torch.randint(1, 9, (1,), generator=generator))
        p = sorted(torch.rand(k_max, generator=generator).tolist(), reverse=True)
        d = {k: 0.3 * float(torch.rand(1, generator=generator)) * k for k in range(1, k_max + 1)}
        v = {k: 1.0 + 0.2 * k * float(torch.rand(1, generator=generator)) for k in range(1, k_max + 1)}
        predictions = [1.0] + [predicted_speedup(p, d, v, k) for k in range(1, k_max + 1)]
        best = recommend_num_draft_tokens(p, d, v)
        assert predictions[best] == max(predictions)
        assert recommend_num_draft_tokens([0.0] * k_max, d, v) == 0


def test_roofline_keys_are_weight_bytes_over_measured_seconds():
    roofline = {"target_path": "fast-cpu-linear", "weight_bytes": 10**9, "stream_gb_per_s": 20.0}
    profile = {"verify_seconds": [0.1, 0.125, 0.2]}
    record = build_record(spec_output(), ar=ar_output(), dataset="set", category="all", drafter_name="d",
                          temperature=0.0, batch_size=2, num_prompts=2, greedy_exact_match=1.0, env=ENV,
                          roofline=roofline, cost_profile=profile)
    achieved = record["achieved_gb_per_s"]
    assert achieved["ar"] == pytest.approx(1.0 / 0.1)  # 1 GB per 1.5 s / 15 decode steps
    assert achieved["verify"] == pytest.approx(1.0 / (1.0 / 3))  # 1 GB per 1.0 s / 3 verify rounds
    assert achieved["verify_by_width"] == pytest.approx([10.0, 8.0, 5.0])
    assert record["stream_gb_per_s"] == 20.0 and record["target_path"] == "fast-cpu-linear"
    assert record["cost_profile"] is profile
    baseline = record_for(ar_output(), ar_output())
    assert baseline["achieved_gb_per_s"]["ar"] is None and baseline["target_path"] is None  # no roofline given
    assert roofline_keys(roofline, 0.1, 0.1)["achieved_gb_per_s"] == {"ar": 10.0, "verify": 10.0,
                                                                     "verify_by_width": None}
    assert "roofline: target path fast-cpu-linear" in format_table([record])
    assert "50% of the 20.0 GB/s" in format_table([record])


def test_weight_bytes_count_tied_weights_once_and_skip_an_untied_input_embedding():
    from conftest import make_tiny_model

    model = make_tiny_model("llama")  # untied, float64: the input embedding is read a row per token, not in full
    embed = model.model.embed_tokens.weight
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(model) == every - embed.numel() * 8
    model.lm_head.weight = embed
    assert weight_bytes(model) == sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(model) == every - embed.numel() * 8  # the head is the embedding now, counted once
    assert stream_bandwidth(nbytes=1 << 20, repeats=1) > 0


def test_tau_interval_is_a_bootstrap_over_questions():
    """Questions that all read the same tau give a zero-width interval at that tau; the interval holds the pooled tau
    and stays inside the range of the questions' own taus; it narrows as questions are added; it is seeded (the same
    report each run); under two questions there is none."""
    from inference.evaluation.intervals import tau_interval

    assert tau_interval([(10, 5), (20, 10), (4, 2)]) == [1.5, 1.5]
    per_question = [(10, 2), (10, 9), (8, 1), (12, 10), (10, 5)]
    low, high = tau_interval(per_question)
    pooled = 1 + sum(a for _, a in per_question) / sum(r for r, _ in per_question)
    assert 1 + 1 / 8 <= low < pooled < high <= 1 + 10 / 12
    assert tau_interval(per_question) == [low, high]
    wide = high - low
    low4, high4 = tau_interval(per_question * 4)
    assert high4 - low4 < wide
    assert tau_interval([(10, 5)]) is None and tau_interval([(10, 5), (0, 0)]) is None


def test_question_counts_follow_the_rows_of_each_call():
    from inference.engine.run import GenerateOutput
    from inference.evaluation.intervals import merge_counts, question_counts

    first = GenerateOutput([[1], [2]], [[1, 2], [0]], [[3, 3], [3]], 3)  # rows answer questions 4 and 7
    second = GenerateOutput([[1]], [[3, 3, 0]], [[3, 3, 3]], 3)  # question 4's second turn
    assert question_counts(first, [4, 7]) == {4: [2, 3], 7: [1, 0]}
    assert merge_counts([question_counts(first, [4, 7]), question_counts(second, [4])]) == {4: [5, 9], 7: [1, 0]}


def test_the_paired_difference_interval_cancels_what_the_questions_share():
    """Two drafters on the same questions whose per-question taus differ by about the same amount: the paired
    interval of the difference holds it and is narrower than either tau's own interval; identical drafters give
    [0, 0]; lists of other lengths give none."""
    from inference.evaluation.intervals import tau_difference_interval, tau_interval

    base = [(40, 4), (40, 30), (40, 10), (40, 24), (40, 16), (40, 36), (40, 2), (40, 20)]
    better = [(rounds, accepted + 4) for rounds, accepted in base]  # +0.1 tau on every question
    low, high = tau_difference_interval(better, base)
    assert low <= 0.1 + 1e-12 and high >= 0.1 - 1e-12 and high - low < 1e-9  # a constant shift: no spread at all
    own_low, own_high = tau_interval(base)
    noisy = [(r, a + (6 if i % 2 else 2)) for i, (r, a) in enumerate(base)]
    low, high = tau_difference_interval(noisy, base)
    assert 0.05 - 1e-12 <= low < high <= 0.15 + 1e-12 and high - low < own_high - own_low
    assert tau_difference_interval(base, base) == [0.0, 0.0]
    assert tau_difference_interval(base, base[:-1]) is None


def test_paired_tau_differences_pair_questions_by_index_within_each_k():
    """Each drafter against the first of its dataset, T, B and k, question by question (by index, whatever the
    order the records list them in); the baseline and single-drafter groups take no part; the report prints it."""
    from inference.evaluation.intervals import paired_tau_differences

    def record(drafter, k, per_question, dataset="set", category="all"):
        return {"dataset": dataset, "category": category, "drafter": drafter, "temperature": 0.0, "batch_size": 1,
                "num_draft_tokens": k, "tau_per_question": per_question}

    base = [[0, 10, 2], [1, 10, 9], [2, 8, 1], [5, 12, 10]]
    other = [[5, 12, 11], [2, 8, 2], [1, 10, 10], [0, 10, 3]]  # one more accepted draft on every question
    records = [{**record("none", 0, None)}, record("a", 3, base), record("b", 3, other), record("b", 1, other),
               record("a", 3, base, category="math"), record("a", 3, base, dataset="other set")]
    rows = paired_tau_differences(records)
    assert [(r["dataset"], r["num_draft_tokens"], r["drafter"], r["base"], r["questions"]) for r in rows] == [
        ("set", 3, "b", "a", 4)]
    assert rows[0]["difference"] == pytest.approx(4 / 40)
    low, high = rows[0]["ci95"]
    assert 0 < low <= 4 / 40 <= high  # every question gained: the paired interval excludes 0
    assert paired_tau_differences(records, category="math") == []
    table = format_table(records)
    assert "| set | 0 | 3 | 1 | b | a | +0.10 |" in table
    assert "paired" not in format_table(records[:2])
    # two checkpoints of one name (two runs' final/) are told apart by their place in the --drafter list
    same_name = [record("a", 3, base), record("a", 3, other)]
    (row,) = paired_tau_differences(same_name)
    assert (row["drafter"], row["base"], row["difference"]) == ("a #2", "a #1", pytest.approx(4 / 40))
