"""DSpark drafter: the loss against a naive per-cell reference (teacher from the target's own logits, contiguous
supervision, exp(-k/4) weights, global normalisation), the heads at training time (teacher-forced, parallel) against
the sequential inference loop, the exact law of a scheduled round (static threshold and prefix scheduler), the T = 1
law through the engine with both schedules, the debug recipe trained, calibrated (`draftsmith calibrate`) and
greedy-exact at batch 1 and 3 with and without scheduling, the export layouts, bad input, and parity with DeepSpec's
and speculators' model classes (marker `peer`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import joint_counts, make_tiny_model

from drafters import DRAFTERS, load_drafter
from drafters.base import DraftContext
from drafters.dflash.anchors import sample_anchors
from drafters.dspark import DSparkConfig, DSparkDrafter
from inference.engine.api import speculative_generate
from inference.engine.costs import CostProfile
from inference.engine.schedule import PrefixScheduler, StaticThreshold
from inference.engine.target import TargetModel
from inference.engine.verify import acceptance_probability, residual_distribution
from inference.evaluation.profile import profile_costs

VOCAB = 256
MASK = 255
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_RECIPE = os.path.join(ROOT, "recipes", "debug", "tiny_dspark.yaml")
HEADS = ["vanilla", "gated", "rnn", "none"]


def tiny_target(num_layers: int = 4, seed: int = 0, vocab: int | None = None) -> TargetModel:
    model = make_tiny_model(num_layers=num_layers, seed=seed)
    if vocab is not None:
        model.resize_token_embeddings(vocab)
        with torch.no_grad():
            model.lm_head.weight.mul_(0.05)  # a soft distribution so that sampling matters
        model.config.eos_token_id = None
    return TargetModel(model, name_or_path="tiny-llama")


def make_drafter(target: TargetModel, seed: int = 1, **config) -> DSparkDrafter:
    """Random weights, every parameter moved off its init (W2 = 0 and unit norms would hide mistakes)."""
    torch.manual_seed(seed)
    head = config.get("markov_head_type", "vanilla")
    config = {"layer_ids": (1, 2, 3), "num_layers": 2, "block_size": 4, "num_anchors": 5, "markov_rank": 8,
              "mask_token_id": target.target_info().vocab_size - 1, "confidence_head_with_markov": head != "none",
              **config}
    drafter = DSparkDrafter(DSparkConfig(**config), target.target_info()).double()
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return drafter.eval()


def make_batch(target: TargetModel, drafter, seq_len: int = 14, seed: int = 3) -> dict:
    """Two rows, the second right-padded; the loss mask is off on a prompt prefix and on a few holes."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, MASK, (2, seq_len), generator=gen)
    attention_mask = torch.ones(2, seq_len, dtype=torch.long)
    attention_mask[1, seq_len - 4:] = 0
    loss_mask = (torch.rand(2, seq_len, generator=gen) < 0.85).long() * attention_mask
    loss_mask[:, :3] = 0
    features = target.features(input_ids, attention_mask, drafter.target_layer_ids(), return_logits=True)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "hidden": features.hidden, "final_hidden": features.final_hidden,
            "target_argmax": features.argmax, "target_logits": features.logits, "sample_index": torch.tensor([7, 3]),
            "epoch": 0, "seed": 0}


# ---- 1. the loss == a naive per-cell reference -----------------------------------------------------------------------
def naive_loss(drafter: DSparkDrafter, batch, anchors, anchor_valid, output):
    """Cell by cell: label x_{a+k+1}; supervised while every label so far is inside the sequence and a loss token;
    p_t from the target's OWN logits at a + k; 0.1 CE + 0.9 L1 + BCE(confidence, 1 - L1/2), weight exp(-k/4)."""
    ids, real, lm = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
    seq_len, size = ids.shape[1], drafter.config.block_size
    total, weight, cells = 0.0, 0.0, []
    n = 0
    for b in range(ids.shape[0]):
        for a, keep in zip(anchors[b].tolist(), anchor_valid[b].tolist()):
            if not keep:
                continue
            for k in range(size):
                position = a + k + 1
                if position >= seq_len or not (real[b, position] and lm[b, position]):
                    break  # contiguous from the front
                logits = output.logits[n, k]
                p_draft = torch.softmax(logits, dim=0)
                p_target = torch.softmax(batch["target_logits"][b, position - 1].double(), dim=0)
                log_q = torch.log_softmax(logits, dim=0)
                ce = -(p_target * log_q).sum() if drafter.config.loss == "soft" else -log_q[ids[b, position]]
                l1 = (p_draft - p_target).abs().sum()
                cell = 0.1 * ce + 0.9 * l1
                if drafter.confidence_head is not None:
                    head = drafter.confidence_head.proj
                    features = output.hidden[n, k]
                    if drafter.config.confidence_head_with_markov:
                        features = torch.cat([features, drafter.markov_head.markov_w1.weight[ids[b, position - 1]]])
                    z = features @ head.weight[0] + head.bias[0]
                    c = (1 - l1 / 2).clamp(0, 1).detach()
                    cell = cell - (c * F.logsigmoid(z) + (1 - c) * F.logsigmoid(-z))
                w = math.exp(-k / 4.0)
                total, weight = total + w * cell, weight + w
                cells.append((n, k))
            n += 1
    return total / weight, cells


@pytest.mark.parametrize("head,loss", [(head, "hard") for head in HEADS] + [("vanilla", "soft")])
def test_loss_and_gradients_match_naive_reference(head, loss):
    target = tiny_target()
    drafter = make_drafter(target, markov_head_type=head, enable_confidence_head=head != "gated", loss=loss)
    batch = make_batch(target, drafter)
    anchors, anchor_valid = sample_anchors(batch["attention_mask"], batch["loss_mask"], drafter.config.num_anchors,
                                           sample_index=batch["sample_index"])
    output = drafter(batch)
    kept = anchors[anchor_valid]
    assert torch.equal(output.label_position, (kept[:, None] + 1 + torch.arange(4)).clamp(max=13))
    loss, metrics = drafter.loss(output, batch)
    ref_loss, cells = naive_loss(drafter, batch, anchors, anchor_valid, output)
    assert sorted(cells) == [tuple(c) for c in output.depth_valid.nonzero().tolist()]
    assert not bool(output.depth_valid.all()) and min(n for n, _ in cells) == 0  # holes cut blocks short
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-10)
    params = [p for p in drafter.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    ref_grads = torch.autograd.grad(ref_loss, params, allow_unused=True)
    for (name, _), grad, ref in zip(drafter.named_parameters(), grads, ref_grads):
        if ref is None:
            assert grad is None or not bool(grad.any()), name
        else:
            torch.testing.assert_close(grad, ref, rtol=1e-7, atol=1e-10, msg=name)
    assert {"acc_0", "loss_3", "sim_accept_length", "ce", "l1", "accept_rate"} <= set(metrics)


def test_loss_is_normalised_over_processes():
    """Two processes each holding one row, with global_mean's cross-process sum: their mean gradient equals the
    one-process gradient of the whole batch."""
    target = tiny_target()
    drafter = make_drafter(target)
    batch = make_batch(target, drafter)
    full = torch.autograd.grad(drafter.loss(drafter(batch), batch)[0], list(drafter.parameters()))
    halves = []
    for r in (0, 1):
        half = {k: (v[r:r + 1] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        half["hidden"] = {i: t[r:r + 1] for i, t in batch["hidden"].items()}
        halves.append(half)
    weights = []
    for half in halves:
        output = drafter(half)
        depth = output.depth_valid.nonzero()[:, 1].double()
        weights.append(torch.exp(-depth / 4.0).sum())
    total = sum(weights)
    grads = [torch.autograd.grad(drafter.loss(drafter(h), {**h, "sum_over_processes": lambda w: total,
                                                           "num_processes": 2})[0], list(drafter.parameters()))
             for h in halves]
    for ref, g0, g1 in zip(full, *grads):
        torch.testing.assert_close((g0 + g1) / 2, ref, rtol=1e-9, atol=1e-12)


# ---- 2. the heads at training time == the sequential inference loop --------------------------------------------------
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_teacher_forced_heads_equal_the_sequential_loop(head):
    """Propose at T = 1 (sampled drafts, their q and confidences), then put the drafts into the training sequence
    after the anchor: the teacher-forced, parallel training forward must give the same q and confidences."""
    target = tiny_target()
    drafter = make_drafter(target, markov_head_type=head, block_size=5)
    committed = [[5, 17, 33, 9, 120, 41, 7], [250, 11, 64, 90]]
    anchors = [77, 18]
    width = max(map(len, committed))
    ids = torch.zeros(2, width, dtype=torch.long)
    valid = torch.zeros(2, width, dtype=torch.bool)
    for b, row in enumerate(committed):
        ids[b, width - len(row):], valid[b, width - len(row):] = torch.tensor(row), True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    _, served = target.prefill(ids, valid.long(), drafter.feature_request())
    generator = torch.Generator().manual_seed(0)
    drafter.begin(DraftContext(ids, valid, positions, next_tokens=torch.tensor(anchors), generator=generator,
                               temperature=1.0, **served.context()))
    proposal = drafter.propose(5)
    assert proposal.probs.shape == (2, 5, VOCAB) and proposal.confidence_logits.shape == (2, 5)
    for b in range(2):
        sequence = committed[b] + [anchors[b]] + proposal.tokens[b].tolist()
        batch = {"input_ids": torch.tensor([sequence]), "attention_mask": torch.ones(1, len(sequence)),
                 "loss_mask": torch.ones(1, len(sequence))}
        batch["hidden"] = target.features(batch["input_ids"], batch["attention_mask"],
                                                 drafter.target_layer_ids()).hidden
        output = drafter.block_outputs(batch, torch.tensor([[len(committed[b])]]))
        torch.testing.assert_close(torch.softmax(output.logits[0], dim=-1), proposal.probs[b], rtol=1e-9, atol=1e-12)
        previous = batch["input_ids"][0, output.label_position[0] - 1]
        torch.testing.assert_close(drafter.confidence_logits(output.hidden[0], previous),
                                   proposal.confidence_logits[b], rtol=1e-9, atol=1e-10)


# ---- 3. exact laws with scheduling -----------------------------------------------------------------------------------
def exact_round_law(p1, p2, q0, q1, lengths_of):
    """The law of the first two emitted tokens [V, V] after a round of two drafts, enumerated exactly.

    p1 [V]: target at the round's first position; p2 [V, V]: target after each first token; q0 [V] and q1 [V, V]
    (indexed by x0): the draft's laws; lengths_of(x0) -> drafts verified (0, 1, 2). A round that emits only its first
    token leaves the second to the next round, whose first token is drawn from p2 (the first-token part of this
    same law, checked by the t1 marginal)."""
    law = torch.zeros_like(p2)
    for x0 in range(p1.numel()):
        w = float(q0[x0])
        length = lengths_of(x0)
        if length == 0:
            law += w * p1[:, None] * p2
            continue
        accept0 = float(acceptance_probability(p1, q0, torch.tensor(x0)))
        law += w * (1 - accept0) * residual_distribution(p1, q0, torch.tensor(x0))[:, None] * p2
        if length == 1:
            law[x0] += w * accept0 * p2[x0]
            continue
        for x1 in range(p1.numel()):
            w1 = w * accept0 * float(q1[x0, x1])
            accept1 = float(acceptance_probability(p2[x0], q1[x0], torch.tensor(x1)))
            law[x0, x1] += w1 * accept1
            law[x0] += w1 * (1 - accept1) * residual_distribution(p2[x0], q1[x0], torch.tensor(x1))
    return law


def test_scheduled_round_is_exactly_lossless():
    """One DSpark round of two sampled drafts on a 6-token vocabulary, its verification length chosen from the real
    confidences by the static threshold and by the prefix scheduler (tuned so that the choice depends on the first
    draft): the exact law of the first two emitted tokens is the target's."""
    vocab = 6
    target = tiny_target(vocab=vocab)
    drafter = make_drafter(target, markov_head_type="gated", block_size=2, num_layers=1)
    prompt = torch.tensor([[1, 4, 2, 5, 3]])
    _, served = target.prefill(prompt, torch.ones_like(prompt), drafter.feature_request())
    drafter.begin(DraftContext(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.arange(5)[None],
                               next_tokens=torch.tensor([2]), temperature=1.0,
                               generator=torch.Generator().manual_seed(0), **served.context()))
    captured = {}
    draw = drafter.draw_block
    drafter.draw_block = lambda hidden, anchor, *rest: captured.update(hidden=hidden) or draw(hidden, anchor, *rest)
    drafter.propose(2)
    hidden = captured["hidden"][0]  # [2, D] post-norm
    previous = torch.tensor([[2, x0] for x0 in range(vocab)])
    with torch.no_grad():
        logits = drafter.teacher_forced_logits(hidden.expand(vocab, -1, -1), previous)  # [V (x0), 2, V]
        confidence = torch.sigmoid(drafter.confidence_logits(hidden.expand(vocab, -1, -1), previous))  # [V, 2]
    q0, q1 = torch.softmax(logits[0, 0], -1), torch.softmax(logits[:, 1], -1)
    with torch.no_grad():
        sequences = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        probs = torch.softmax(target.model(input_ids=sequences).logits.double(), dim=-1)
    p1, p2 = probs[0, -2], probs[:, -1]
    survival = torch.stack([confidence[:, 0], confidence[:, 0] * confidence[:, 1]], dim=1)  # a_0, a_1(x0)
    cut = float(survival[:, 1].median())
    threshold = StaticThreshold(cut)
    c0 = float(confidence[0, 0])
    step_2 = 1 + c0 / 2  # admits draft 0; draft 1 only where a_1(x0) beats the median
    cost = CostProfile((0.0,) * 3, (1.0, step_2, step_2 * (1 + c0 + cut) / (1 + c0)))
    scheduler = PrefixScheduler(cost)
    for schedule in (threshold, scheduler):
        lengths = [int(schedule.lengths(survival[x0:x0 + 1], True, 1, 0.0)) for x0 in range(vocab)]
        assert set(lengths) == {1, 2}, (schedule, lengths)  # the decision depends on the first draft
        law = exact_round_law(p1, p2, q0, q1, lambda x0: lengths[x0])
        torch.testing.assert_close(law, p1[:, None] * p2, rtol=0, atol=1e-12)


@pytest.mark.parametrize("schedule", ["threshold", "scheduler"])
def test_sampling_law_through_the_engine_with_schedules(schedule):
    """T = 1 through speculative_generate with a schedule (calibrated temperatures set, so the scheduler really
    schedules): the joint law of the first three emitted tokens is the target's (chi-square over 6^3 cells)."""
    vocab, rows = 6, 3000
    target = tiny_target(vocab=vocab)
    drafter = make_drafter(target, markov_head_type="rnn", block_size=3, num_layers=1)
    drafter.set_confidence_temperatures([1.5, 0.8, 1.0])
    if schedule == "threshold":
        chosen = StaticThreshold(0.3)
    else:
        chosen = PrefixScheduler(CostProfile((0.0,) * 4, (1.0, 1.25, 1.7, 2.3), num_rows=rows))
    prompt = [1, 4, 2, 5, 3]
    out = speculative_generate(target, drafter, [prompt] * rows, num_draft_tokens=3, max_new_tokens=3,
                               temperature=1.0, seed=0, eos_token_ids=[], schedule=chosen)
    proposed = [n for row in out.proposed for n in row]
    assert 0 < sum(proposed) < 3 * len(proposed)  # truncated, but not to nothing
    counts = joint_counts(out.tokens, vocab)
    seqs = torch.tensor([[a, b] for a in range(vocab) for b in range(vocab)])
    with torch.no_grad():
        logits = target.model(input_ids=torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)).logits
    probs = torch.softmax(logits.double(), -1)
    start = len(prompt) - 1
    p1 = probs[0, start]
    p2 = probs[:, start + 1].reshape(vocab, vocab, vocab)[:, 0]
    p3 = probs[:, start + 2].reshape(vocab, vocab, vocab)
    expected = (p1[:, None, None] * p2[:, :, None] * p3).flatten() * rows
    keep = expected >= 5
    chi2 = (((counts - expected) ** 2) / expected)[keep].sum()
    chi2 += (counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(float(expected[~keep].sum()), 1e-9)
    dof = int(keep.sum())
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (float(chi2), dof)


# ---- 4. the debug recipe: trained, calibrated, lossless with and without scheduling ----------------------------------
@pytest.fixture(scope="module")
def debug_run(tmp_path_factory):
    """The debug recipe trained for a few steps through the real loop, then `draftsmith calibrate` on it."""
    from accelerate.state import AcceleratorState, GradientState

    from inference.assets.debug_target import resolve_debug_target
    from train.build import build_trainer
    from train.config import load_recipe

    tmp_path = tmp_path_factory.mktemp("dspark_debug")
    target_dir = resolve_debug_target("debug:tiny-llama", cache_dir=str(tmp_path / "cache"))
    chats = tmp_path / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(12):
            words = " ".join(["the cat sat on a mat", "and then it ran", "to see the old red house"][j % 3]
                             for j in range(i, i + 4))
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"tell me {i}"},
                                                             {"role": "assistant", "content": words}]}) + "\n")
    overrides = [f"target.name_or_path={target_dir}", f"data.path={chats}", "data.max_length=96",
                 "data.num_samples=null", "data.num_eval_samples=2", f"data.cache_dir={tmp_path / 'datasets'}",
                 f"output.dir={tmp_path / 'run'}", "train.batch_size=2", "train.epochs=null", "train.max_steps=6",
                 "train.log_every=3", "train.save_every=null", "train.eval_every=null", "train.keep_last=null",
                 "eval.num_prompts=1", "eval.max_new_tokens=8", "eval.num_batches=1", "schedule.warmup_steps=1"]
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    trainer = build_trainer(load_recipe(DEBUG_RECIPE, overrides))
    assert trainer.model.mask_token_id == 259
    final_dir = trainer.fit()
    trainer.accelerator.end_training()
    return trainer.target, final_dir, target_dir, tmp_path


def test_debug_recipe_calibrates_and_stays_lossless_with_and_without_scheduling(debug_run):
    from inference.evaluation import calibrate

    target, final_dir, target_dir, tmp_path = debug_run
    drafter = load_drafter(final_dir, target.target_info())
    assert type(drafter) is DRAFTERS["dspark"] and drafter.config.confidence_temperatures == ()
    out_dir = tmp_path / "calibration"
    status = calibrate.main([final_dir, "--target", target_dir, "--prompts", "mt_bench,gsm8k", "--num-prompts", "12",
                             "--max-new-tokens", "32", "--batch-size", "12", "--out", str(out_dir)])
    assert status == 0
    report = json.loads((out_dir / "calibration.json").read_text())
    assert (out_dir / "reliability.png").stat().st_size > 0
    assert len(report["positions"]) == drafter.config.block_size
    for entry in report["positions"]:
        assert {"ece_before", "ece_after", "auroc", "brier", "temperature"} <= set(entry)
        assert entry["ece_after"] <= entry["ece_before"] + 1e-12
    calibrated = load_drafter(final_dir, target.target_info())
    assert list(calibrated.config.confidence_temperatures) == report["temperatures"]

    k = calibrated.max_draft_tokens()
    cost = profile_costs(target, calibrated, [[40, 41, 42, 43]] * 3, k, max_new_tokens=4, repeats=1)
    truncated = set()
    for prompts in ([[40, 41, 42, 43]], [[40, 41, 42, 43], [50, 51], [60, 61, 62]]):
        plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=16)
        for schedule in (None, StaticThreshold(0.5), PrefixScheduler(cost)):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # calibrated: the scheduler does not fall back
                spec = speculative_generate(target, calibrated, prompts, num_draft_tokens=k, max_new_tokens=16,
                                            schedule=schedule)
            assert spec.tokens == plain.tokens, (len(prompts), schedule)
            proposed = [n for row in spec.proposed for n in row]
            if sum(proposed) < k * len(proposed):
                truncated.add(type(schedule).__name__)
    assert "StaticThreshold" in truncated  # proposals really were cut (the scheduler's cuts depend on the machine)


def test_calibrate_refuses_too_few_rounds_and_drafters_without_confidences(debug_run, tmp_path):
    from inference.evaluation import calibrate

    target, final_dir, target_dir, _ = debug_run
    with pytest.raises(ValueError, match=r"at least 200 verification rounds.*--num-prompts"):
        calibrate.main([final_dir, "--target", target_dir, "--prompts", "gsm8k", "--num-prompts", "1",
                        "--max-new-tokens", "8", "--out", str(tmp_path / "few")])
    with pytest.raises(ValueError, match="confidence head"):
        calibrate.main(["ngram", "--target", target_dir, "--prompts", "gsm8k", "--num-prompts", "1",
                        "--out", str(tmp_path / "ngram")])


# ---- 5. export layouts, persistence, bad input -----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["native", "speculators", "deepspec"])
def test_exports_load_back_with_identical_logits_and_temperatures(tmp_path, fmt):
    target = tiny_target()
    drafter = make_drafter(target, markov_head_type="rnn").float()
    target32 = TargetModel(make_tiny_model(num_layers=4, dtype=torch.float32), name_or_path="tiny-llama")
    batch = make_batch(target32, drafter)
    drafter.save(str(tmp_path), fmt)
    header = json.loads((tmp_path / "config.json").read_text())
    if fmt == "speculators":
        assert header["speculators_model_type"] == "dspark" and header["sample_from_anchor"] is True
        assert header["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
        assert header["aux_hidden_state_layer_ids"] == [1, 2, 3] and header["markov_head_type"] == "rnn"
        assert header["markov_rank"] == 8 and header["confidence_head_with_markov"] is True
    if fmt == "deepspec":
        assert header["architectures"] == ["Qwen3DSparkModel"] and header["target_layer_ids"] == [0, 1, 2]
        assert header["block_size"] == 4 and header["num_target_layers"] == 4 and header["enable_confidence_head"]
    DSparkDrafter.export_module.store_confidence_temperatures(str(tmp_path), [1.0, 2.0, 0.5, 3.0])
    loaded = load_drafter(str(tmp_path), target32.target_info())
    assert isinstance(loaded, DSparkDrafter) and loaded.config.confidence_temperatures == (1.0, 2.0, 0.5, 3.0)
    assert loaded.config.markov_head_type == "rnn" and loaded.layer_ids == (1, 2, 3)
    with torch.no_grad():
        mine, theirs = drafter(batch), loaded(batch)
    torch.testing.assert_close(theirs.logits, mine.logits, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["speculators", "deepspec"])
def test_doctor_checks_pass_a_good_export_and_name_the_broken_field(tmp_path, fmt):
    """`draftsmith doctor`'s format checks (drafters/dspark/readers.py, the backbone's from drafters/dflash/checks.py):
    every check of a fresh export passes (the tiny target has no tokenizer, so the mask row is only reported); ids
    shifted by one in the file's own convention, a head the fields disown and a missing mask token each fail."""
    target = TargetModel(make_tiny_model(num_layers=4, dtype=torch.float32), name_or_path="tiny-llama")
    make_drafter(target, markov_head_type="gated").float().save(str(tmp_path / "good"), fmt)

    def checks(directory):
        rows = DSparkDrafter.export_module.export_checks(str(directory), target.target_info())
        return {row.name: row for row in rows}

    good = checks(tmp_path / "good")
    assert {name: row.status for name, row in good.items()} == {
        "layout": "pass", "fields": "pass", "layer ids": "pass", "mask token": "info", "sizes": "pass",
        "block": "pass", "heads": "pass", "reader draftsmith": "pass"}, good
    ids_field = "aux_hidden_state_layer_ids" if fmt == "speculators" else "target_layer_ids"
    config = json.loads((tmp_path / "good" / "config.json").read_text())
    config[ids_field] = [i + 1 for i in config[ids_field]]
    config["markov_rank"] = 0
    del config["mask_token_id"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    shutil.copy(tmp_path / "good" / "model.safetensors", tmp_path / "bad" / "model.safetensors")
    bad = checks(tmp_path / "bad")
    assert bad["layer ids"].status == "fail" and f"{ids_field} {config[ids_field]}" in bad["layer ids"].detail
    assert bad["heads"].status == "fail" and "markov_head.markov_w1.weight" in bad["heads"].detail
    assert bad["fields"].status == "fail" and "mask_token_id" in bad["fields"].detail
    assert bad["mask token"].status == "fail" and bad["reader draftsmith"].status == "fail"


def test_bad_input_names_the_field():
    target = tiny_target()
    info = target.target_info()
    base = {"layer_ids": (1,), "mask_token_id": MASK}
    cases = [
        ({"markov_rank": 0}, r"drafter\.markov_rank 0 must be >= 1"),
        ({"markov_head_type": "none"}, r"drafter\.confidence_head_with_markov.*markov_head_type is none"),
        ({"markov_head_type": "lstm"}, r"drafter\.markov_head_type"),
        ({"block_size": 0}, r"drafter\.block_size"),
        ({"l1_weight": -1.0}, r"drafter\.l1_weight"),
        ({"confidence_temperatures": (1.0, 2.0)}, r"drafter\.confidence_temperatures"),
        ({"layer_ids": (1, 4)}, r"drafter\.layer_ids"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            DSparkDrafter(DSparkConfig(**{**base, **changes}), info)
    drafter = DSparkDrafter(DSparkConfig(**base, markov_head_type="none", confidence_head_with_markov=False), info)
    assert drafter.markov_head is None and drafter.confidence_head.proj.in_features == 64
    assert drafter.max_draft_tokens() == 7
    with pytest.raises(ValueError, match="before begin"):
        drafter.propose(2)
    with pytest.raises(ValueError, match="cannot export format 'gguf'"):
        drafter.save("unused", "gguf")


def test_builds_on_the_meta_device_with_deepspec_settings():
    """recipes/qwen3-8b/dspark.yaml's shapes: block 7, 5 layers, rank 256 over Qwen3's 151,936 rows."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    with torch.device("meta"):
        embed = torch.empty(151936, 4096)
        info = dataclasses.replace(tiny_target().target_info(), hidden_size=4096, vocab_size=151936, num_layers=36,
                                   embed_weight=embed, lm_head_weight=embed, final_norm_weight=torch.empty(4096),
                                   config=config.to_dict(), weights={})
        drafter = DSparkDrafter(DSparkConfig(mask_token_id=151669), info)
    assert drafter.layer_ids == (2, 10, 18, 26, 34) and drafter.max_draft_tokens() == 7
    assert drafter.markov_head.markov_w1.weight.shape == (151936, 256)
    assert drafter.markov_head.markov_w2.weight.shape == (151936, 256)
    assert drafter.confidence_head.proj.weight.shape == (1, 4096 + 256)


# ---- 6. peers: DeepSpec's and speculators' model classes on our exports (marker `peer`) ----------------------------
DEEPSPEC_REASON = ("DeepSpec is not importable: put a checkout of deepseek-ai/DeepSpec on PYTHONPATH (its model "
                   "classes import with this venv's torch / transformers)")
SPECULATORS_REASON = "speculators not installed: pip install --no-deps speculators==0.9.0 (+ loguru, ...)"
PEER_ANCHORS = (2, 6, 9)


def our_block(drafter, batch, anchors=PEER_ANCHORS):
    """(logits [A, S, V], confidence logits [A, S]) at the given anchors of row 0."""
    with torch.no_grad():
        out = drafter.block_outputs(batch, torch.tensor([list(anchors)]))
        previous = batch["input_ids"][0, out.label_position - 1]
        return out.logits, drafter.confidence_logits(out.hidden, previous)


@pytest.mark.peer
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_deepspec_model_reproduces_our_logits_and_confidences(tmp_path, head):
    pytest.importorskip("deepspec.modeling.dspark.qwen3", reason=DEEPSPEC_REASON)
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
    from transformers import DynamicCache

    target = TargetModel(make_tiny_model("qwen3", num_layers=4, dtype=torch.float32), name_or_path="tiny-qwen3")
    drafter = make_drafter(target, markov_head_type=head).float()
    drafter.save(str(tmp_path), "deepspec")
    model = Qwen3DSparkModel.from_pretrained(str(tmp_path), attn_implementation="sdpa").float().eval()
    ids = torch.randint(3, MASK, (1, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        states = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
             "hidden": {i: states[i] for i in drafter.layer_ids}}
    logits, confidences = our_block(drafter, batch)
    size = model.block_size
    for n, anchor in enumerate(PEER_ANCHORS):
        context = torch.cat([states[0 if t == -1 else t + 1][:, :anchor] for t in model.target_layer_ids], dim=-1)
        block = torch.full((1, size), model.mask_token_id)
        block[0, 0] = ids[0, anchor]
        with torch.no_grad():
            hidden = model._forward_backbone(target_hidden_states=context, noise_embedding=model.embed_tokens(block),
                                             position_ids=torch.arange(anchor + size)[None], attention_mask=None,
                                             past_key_values=DynamicCache(), use_cache=True, is_causal=False)
            previous = ids[:, anchor: anchor + size]
            base = model.compute_logits(hidden)[:, None]  # [1, 1 block, S, V]: its block-shaped API
            peer = model.markov_head.apply_block_logits(base, token_ids=previous[:, None],
                                                        hidden_states=hidden[:, None])[:, 0]
            peer_confidence = model.predict_confidence_step(hidden, prev_token_ids=previous)
        assert float((peer[0] - logits[n]).abs().max()) < 1e-4
        assert float((peer_confidence[0] - confidences[n]).abs().max()) < 1e-4


@pytest.mark.peer
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_speculators_model_reproduces_our_logits_and_confidences(tmp_path, head):
    pytest.importorskip("speculators.models.dspark", reason=SPECULATORS_REASON)
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    model = make_tiny_model("qwen3", num_layers=4, dtype=torch.float32)
    model.save_pretrained(str(tmp_path / "verifier"))  # speculators reloads embed / lm_head from the verifier path
    target = TargetModel(model, name_or_path=str(tmp_path / "verifier"))
    drafter = make_drafter(target, markov_head_type=head).float()
    drafter.save(str(tmp_path / "export"), "speculators")
    config = DSparkSpeculatorConfig.from_pretrained(str(tmp_path / "export"))
    config.transformer_layer_config._attn_implementation = "eager"
    peer = DSparkDraftModel.from_pretrained(str(tmp_path / "export"), config=config).float().eval()
    ids = torch.randint(3, MASK, (1, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        states = target.model(input_ids=ids, output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in peer.target_layer_ids], dim=-1)
        ones = torch.ones_like(ids)
        hidden, logits, _, _, slots = peer._backbone_forward(features, ids, ones, states[-1], torch.zeros_like(ids),
                                                             max_anchors=ids.shape[1])
        size = peer.block_size
        anchors = slots.view(-1, size)[: ids.shape[1] - size, 0].tolist()
        blocks = ids[0, slots].view(-1, size)[: len(anchors)]
        hidden = hidden.view(-1, size, hidden.shape[-1])[: len(anchors)]
        embedding = peer.markov_head.prev_embeddings(blocks)
        logits = logits.view(-1, size, logits.shape[-1])[: len(anchors)]
        logits = logits + peer.markov_head.block_bias(prev_token_ids=blocks, hidden_states=hidden, prev_emb=embedding)
        confidence = peer.confidence_head(torch.cat([hidden, embedding], dim=-1))
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones,
             "hidden": {i: states[i] for i in drafter.layer_ids}}
    ours, our_confidence = our_block(drafter, batch, anchors)
    assert float((logits - ours).abs().max()) < 1e-4
    assert float((confidence - our_confidence).abs().max()) < 1e-4
