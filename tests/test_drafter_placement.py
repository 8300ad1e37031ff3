"""A drafter read from disk is served on the target's device in the target's dtype (TargetModel.serve), the engine
refuses one left elsewhere in one line, eval records say where each drafter ran, and "lossless" in bf16 means every
divergence from plain greedy is a near-tie of the target's logits (inference/evaluation/lossless.py).

A bf16 target on the CPU stands in for an accelerator's: the cast, and what rounding does to greedy decoding, are the
same; the meta device is a real second device, so a drafter there is one on another device than the target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from test_contract import FACTORIES, training_batch

from drafters import load_drafter
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel
from inference.evaluation.eval import RunResult
from inference.evaluation.eval import main as eval_main
from inference.evaluation.lossless import (NEAR_TIE_ULPS, divergence_gap, divergence_gaps, first_divergence,
                                           is_near_tie, summarize, tie_gap_ulps)
from inference.evaluation.metrics import acceptance_counts

TARGET = "debug:tiny-llama"  # hidden 64, 4 layers: the size FACTORIES builds for
QUESTIONS = str(Path(__file__).parent / "data" / "questions_small.jsonl")
TRAINED_KINDS = ("assistant", "dflash", "dspark", "eagle3", "medusa", "mtp")
K = 3
NEW_TOKENS = 32
BF16_EPS = torch.finfo(torch.bfloat16).eps


@pytest.fixture(scope="module")
def targets():
    return {dtype: TargetModel.from_pretrained(TARGET, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (n,), generator=generator).tolist() for n in (5, 9, 7, 12, 6, 8, 10, 4)]


@pytest.fixture(scope="module")
def shared(targets, prompts):
    """The prompts whose greedy answer the bf16 target shares with the float32 one (bf16 rounding moves the others
    off it at a near-tie of the target's own): acceptance is comparable across the dtypes only there."""
    answers = {dtype: greedy(target, None, prompts).tokens for dtype, target in targets.items()}
    rows = [row for row, (a, b) in enumerate(zip(*answers.values())) if a == b]
    assert len(rows) >= len(prompts) // 2
    return [prompts[row] for row in rows]


@pytest.fixture(scope="module")
def checkpoints(targets, shared, tmp_path_factory):
    """Every trained kind overfitted (a second or two each) on the target's greedy answers to the `shared` prompts,
    so that its acceptance there is high and a drafter broken by its cast would show; saved in the native format."""
    root = tmp_path_factory.mktemp("placement")
    target = targets[torch.float32]
    sequences = [prompt + answer for prompt, answer in zip(shared, greedy(target, None, shared).tokens)]
    for kind in TRAINED_KINDS:
        torch.manual_seed(0)
        drafter = FACTORIES[kind](target.target_info())
        batch = training_batch(target, drafter, sequences)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
        for step in range(60):
            loss, _ = drafter.loss(drafter({**batch, "epoch": step}), batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        drafter.save(str(root / kind))
    return root


def greedy(target, drafter, prompts):
    return speculative_generate(target, drafter, prompts, num_draft_tokens=K if drafter else 0,
                                max_new_tokens=NEW_TOKENS, eos_token_ids=[])


# ---- the near-tie test itself, analytically --------------------------------------------------------------------------
def test_the_tie_gap_is_measured_in_ulps_of_the_logit_scale():
    logits = torch.tensor([10.0, 10.0 - 3 * BF16_EPS * 10.0, 0.0, -2.0], dtype=torch.float64)
    assert tie_gap_ulps(logits, (0, 1), torch.bfloat16) == pytest.approx(3.0)
    assert tie_gap_ulps(logits, (1, 0), torch.bfloat16) == pytest.approx(3.0)  # the order of the pair is irrelevant
    assert tie_gap_ulps(logits, (0,), torch.bfloat16) == 0.0
    assert is_near_tie(logits, (0, 1), torch.bfloat16)
    assert tie_gap_ulps(logits, (0, 2), torch.bfloat16) == pytest.approx(1 / BF16_EPS)  # the whole scale: 128 ulps
    assert not is_near_tie(logits, (0, 2), torch.bfloat16)
    # the scale is the largest magnitude, negative logits included: 2 ulps of 5
    negative = torch.tensor([-1.0, -1.0 - 2 * BF16_EPS * 5.0, -5.0], dtype=torch.float64)
    assert tie_gap_ulps(negative, (0, 1), torch.bfloat16) == pytest.approx(2.0)
    # the same gap is a tie in bf16 and far from one in float32, whose eps is 2^16 times finer
    assert is_near_tie(logits, (0, 1), torch.bfloat16) and not is_near_tie(logits, (0, 1), torch.float32)
    edge = torch.tensor([1.0, 1.0 - NEAR_TIE_ULPS * BF16_EPS, 1.0 - 1.01 * NEAR_TIE_ULPS * BF16_EPS],
                        dtype=torch.float64)
    assert is_near_tie(edge, (0, 1), torch.bfloat16) and not is_near_tie(edge, (0, 2), torch.bfloat16)


def test_first_divergence_and_the_summary():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert summarize([]) == {"divergences": 0, "divergences_all_near_ties": True, "divergence_max_gap_ulps": None,
                             "near_tie_ulps": NEAR_TIE_ULPS}
    assert summarize([0.5, 9.0]) == {"divergences": 2, "divergences_all_near_ties": False,
                                     "divergence_max_gap_ulps": 9.0, "near_tie_ulps": NEAR_TIE_ULPS}
    stopped = summarize([1.0, float("inf")])  # an output that stopped where the other went on: never a tie
    assert not stopped["divergences_all_near_ties"] and stopped["divergence_max_gap_ulps"] is None


def test_a_divergence_that_is_no_tie_is_reported_as_one(targets, prompts):
    """The recompute on the real target: a continuation that takes the target's second choice where its top two
    logits are far apart is flagged; the target's own greedy continuation has no divergence; in an eval's runs a
    question counts once, at its first parting (its next turn follows another history)."""
    target, prompt = targets[torch.bfloat16], prompts[0]
    plain = greedy(target, None, [prompt]).tokens[0]
    assert divergence_gap(target, prompt, plain, list(plain)) is None

    def logits_after(position):  # as divergence_gap computes them: one forward, the last position's logits
        with torch.no_grad():
            ids = torch.tensor([prompt + plain[:position]])
            return target.model(input_ids=ids, logits_to_keep=1).logits[0, -1].double()

    top_two = [logits_after(position).topk(2).values for position in range(len(plain))]
    position = max(range(len(plain)), key=lambda i: float(top_two[i][0] - top_two[i][1]))  # the clearest choice
    logits = logits_after(position)
    second = int(logits.topk(2).indices[1])
    wrong = plain[:position] + [second] + plain[position + 1:]
    expected = float(logits.max() - logits[second]) / (BF16_EPS * float(logits.abs().max()))
    assert divergence_gap(target, prompt, plain, wrong) == pytest.approx(expected)
    assert expected > NEAR_TIE_ULPS

    other = greedy(target, None, prompts[1:2]).tokens[0]
    baseline = RunResult(tokens={(0, 0): plain, (1, 0): other, (0, 1): [7, 8]},
                         prompts={(0, 0): prompt, (1, 0): prompts[1], (0, 1): prompt + plain + [9]})
    run = RunResult(tokens={(0, 0): wrong, (1, 0): other, (0, 1): [7, 9]},
                    prompts={(0, 0): prompt, (1, 0): prompts[1], (0, 1): prompt + wrong + [9]})
    gaps = divergence_gaps(target, run, baseline)
    assert gaps == {(0, 0): pytest.approx(expected)}
    assert summarize(list(gaps.values()))["divergences_all_near_ties"] is False


# ---- placement -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", TRAINED_KINDS)
def test_a_drafter_from_disk_runs_in_the_targets_dtype_and_stays_lossless_up_to_ties(kind, targets, prompts,
                                                                                     shared, checkpoints):
    fp32, bf16 = targets[torch.float32], targets[torch.bfloat16]
    as_read = load_drafter(str(checkpoints / kind), bf16.target_info())  # built on the CPU in float32
    assert {p.dtype for p in as_read.parameters()} == {torch.float32}
    read_buffers = {name: buffer.dtype for name, buffer in as_read.named_buffers()}
    reference = {name: p.detach().clone() for name, p in as_read.named_parameters()}
    served = bf16.serve(as_read)
    assert served is as_read and not served.training
    parameters = dict(served.named_parameters())
    assert {p.dtype for p in parameters.values()} == {torch.bfloat16}
    assert all(torch.equal(parameters[name], value.to(torch.bfloat16)) for name, value in reference.items())
    # buffers keep their dtype (d2t long, t2d bool, a rotary inv_freq float32), as transformers loads a bf16 model
    assert {name: buffer.dtype for name, buffer in served.named_buffers()} == read_buffers

    accepted, rounds = {}, {}
    for name, target in (("float32", fp32), ("bfloat16", bf16)):
        drafter = target.serve(load_drafter(str(checkpoints / kind), target.target_info()))
        plain, spec = greedy(target, None, prompts), greedy(target, drafter, prompts)
        gaps = [divergence_gap(target, p, a, b) for p, a, b in zip(prompts, plain.tokens, spec.tokens)]
        gaps = [gap for gap in gaps if gap is not None]
        if name == "float32":
            assert not gaps and spec.tokens == plain.tokens  # exact where the dtype is float32
        else:
            assert summarize(gaps)["divergences_all_near_ties"], gaps
        on_shared = greedy(target, drafter, shared)
        accepted[name] = [sum(row) for row in on_shared.accept_lengths]
        rounds[name] = acceptance_counts(on_shared)["rounds"]
    # tau on the shared prompts: the drafts accepted per row agree up to what the drafter's own bf16 near-ties can
    # move (one flip of its argmax costs or gains at most the k drafts of one round)
    assert all(abs(a - b) <= K for a, b in zip(accepted["float32"], accepted["bfloat16"])), accepted
    tau = {name: 1 + sum(accepted[name]) / rounds[name] for name in accepted}
    assert tau["float32"] > 2.0, f"{kind}: the overfitted drafter should accept most of its drafts ({tau})"


def test_the_engine_refuses_a_drafter_on_another_device_in_one_line(targets, prompts):
    target = targets[torch.float32]
    with torch.device("meta"):
        drafter = FACTORIES["eagle3"](target.target_info())
    with pytest.raises(ValueError, match=r"drafter 'eagle3': its parameters are on meta but the target is on cpu"):
        greedy(target, drafter, prompts[:1])
    # no parameters, nothing to place: the n-gram lookup runs against any target
    assert greedy(target, FACTORIES["ngram"](target.target_info()), prompts[:1]).tokens


def test_the_lean_forward_is_neither_built_nor_probed_off_the_cpu(cpu_backend):
    target = TargetModel(make_tiny_model("llama", dtype=torch.float32).to("meta"), backend=cpu_backend)
    assert target.decode == "hf" and target.path == "hf" and "target is on meta" in target.lean_refused
    assert TargetModel(make_tiny_model("llama", dtype=torch.float64), backend=cpu_backend).decode == "lean"


# ---- eval ----------------------------------------------------------------------------------------------------------
def test_eval_records_where_each_drafter_ran_and_whether_it_parted_only_at_ties(checkpoints, tmp_path):
    drafters = ",".join(["ngram"] + [str(checkpoints / kind) for kind in TRAINED_KINDS])
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype / "report.json"
        argv = ["--target", TARGET, "--drafter", drafters, "--prompts", QUESTIONS, "--num-prompts", "2",
                "--max-new-tokens", "12", "--num-draft-tokens", str(K), "--dtype", dtype, "--threads", "1",
                "--target-path", "hf", "--out", str(out)]
        assert eval_main(argv) == 0
        records = json.loads(out.read_text())["records"]
        assert {r["drafter"].split(":")[0] for r in records} == {"none", "ngram", *TRAINED_KINDS}
        for record in records:
            assert record["env"]["device"] == "cpu" and record["env"]["dtype"] == dtype
            if record["drafter"] in ("none", "ngram"):  # no drafter, or one without weights
                assert record["drafter_device"] is None and record["drafter_dtype"] is None
            else:
                assert record["drafter_device"] == "cpu" and record["drafter_dtype"] == dtype
            if record["drafter"] == "none":
                assert record["divergences"] is None and record["divergences_all_near_ties"] is None
                continue
            assert record["divergences_all_near_ties"] is True, record
            if dtype == "float32":
                assert record["greedy_exact_match"] == 1.0 and record["divergences"] == 0
            # a question whose first answer parted asks its second turn after another history: one divergence
            mismatches = round((1 - record["greedy_exact_match"]) * record["num_sequences"])
            assert (record["divergences"] > 0) == (mismatches > 0) and record["divergences"] <= mismatches
