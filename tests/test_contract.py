"""The drafter contract, tested once for every registered drafter (drafters/base.py; docs/ARCHITECTURE.md).

A new drafter is done when this file passes for it: add a tiny factory to FACTORIES (the test below fails for a
registered kind without one). What is checked, per kind:
- it builds on the meta device; its feature request fits the target; max_draft_tokens is honoured by propose;
- trainable kinds: the loss is finite and gradients reach the drafter's parameters only;
- trainable kinds: proposals made through begin / propose / commit equal what `forward` predicts on the same
  ground-truth sequence (left padding, rows accepting different numbers of drafts, a finished row). Lossless output
  alone cannot catch a broken `commit`: a drafter fed the wrong context still loses nothing, it only drafts worse;
- greedy speculative output equals plain greedy output at batch 1 and 3;
- at temperature 1 the whole loop emits exactly the target's law (chi-square on a 6-token vocabulary);
- save -> load gives identical proposals (and identical training logits for trainable kinds).
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from conftest import joint_counts, make_tiny_model

from drafters import DRAFTERS, load_drafter
from drafters.assistant import AssistantConfig, AssistantDrafter
from drafters.base import DraftContext, Drafter, TargetInfo
from drafters.dflash import DFlashConfig, DFlashDrafter
from drafters.draft_model import DraftModelConfig, DraftModelDrafter
from drafters.dspark import DSparkConfig, DSparkDrafter
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.medusa import MedusaConfig, MedusaDrafter
from drafters.mtp import MTPConfig, MTPDrafter
from drafters.ngram import NgramConfig, NgramDrafter
from drafters.peagle import PEagleConfig, PEagleDrafter
from inference.engine.api import speculative_generate
from inference.engine.rounds import commit_context, roll_back
from inference.engine.target import TargetModel
from train.features.cache import FeatureProvider

NUM_DRAFTS = 3  # proposal length used throughout; every factory below can draft at least this many


def _draft_lm(info: TargetInfo, seed: int = 1):
    model = make_tiny_model("llama", seed=seed, num_layers=1)
    if info.vocab_size != model.config.vocab_size:
        model.resize_token_embeddings(info.vocab_size)
    return model.to(info.embed_weight.dtype)


# kind -> factory(target_info) building a small, untrained drafter for the tiny targets below (hidden 64, 4 layers).
FACTORIES: dict[str, Callable[[TargetInfo], Drafter]] = {
    # two query-only layers over the K/V of target layers 1 and 3, trained for NUM_DRAFTS steps
    "assistant": lambda info: AssistantDrafter(AssistantConfig(num_layers=2, kv_layers=(1, 3), num_steps=NUM_DRAFTS),
                                               info),
    "eagle3": lambda info: Eagle3Drafter(Eagle3Config(layer_ids=(1, 2, 4), num_layers=2,
                                                      draft_vocab_size=info.vocab_size, ttt_steps=NUM_DRAFTS,
                                                      init_head_from_target=False), info),
    "draft_model": lambda info: DraftModelDrafter(DraftModelConfig(path="tiny"), info, model=_draft_lm(info)),
    "ngram": lambda info: NgramDrafter(NgramConfig(), info),
    # EAGLE-3's layers drafting in one forward; the tiny targets have no tokenizer, so the last row is the mask token
    "peagle": lambda info: PEagleDrafter(PEagleConfig(layer_ids=(1, 2, 4), num_layers=2,
                                                      draft_vocab_size=info.vocab_size, ttt_steps=NUM_DRAFTS,
                                                      init_head_from_target=False, mask_token_id=info.vocab_size - 1),
                                         info),
    "mtp": lambda info: MTPDrafter(MTPConfig(num_modules=NUM_DRAFTS), info),
    "medusa": lambda info: MedusaDrafter(MedusaConfig(num_heads=NUM_DRAFTS), info),
    # blocks of NUM_DRAFTS + 1; enough anchors that the training forward covers every position; the tiny targets
    # have no tokenizer, so their last row is named as the mask token
    "dflash": lambda info: DFlashDrafter(DFlashConfig(layer_ids=(1, 2, 3), num_layers=2, block_size=NUM_DRAFTS + 1,
                                                      num_anchors=64, mask_token_id=info.vocab_size - 1), info),
    # the DFlash backbone with the anchor slot drafting: blocks of NUM_DRAFTS give NUM_DRAFTS drafts
    "dspark": lambda info: DSparkDrafter(DSparkConfig(layer_ids=(1, 2, 3), num_layers=2, block_size=NUM_DRAFTS,
                                                      num_anchors=64, markov_rank=16,
                                                      mask_token_id=info.vocab_size - 1), info),
}
SAMPLING = {  # the factory variant that samples its drafts, for kinds that can
    "assistant": lambda info: AssistantDrafter(AssistantConfig(num_layers=1, sample_drafts=True), info),
    # DSpark samples at the engine's temperature (DraftContext.temperature) with its exact Markov-corrected q
    "dspark": lambda info: DSparkDrafter(DSparkConfig(layer_ids=(1, 2, 3), num_layers=1, block_size=NUM_DRAFTS,
                                                      markov_rank=16, mask_token_id=info.vocab_size - 1), info),
    "mtp": lambda info: MTPDrafter(MTPConfig(num_modules=1, reuse=True, sample_drafts=True), info),
    "medusa": lambda info: MedusaDrafter(MedusaConfig(num_heads=NUM_DRAFTS, sample_drafts=True), info),
    "eagle3": lambda info: Eagle3Drafter(Eagle3Config(layer_ids=(1, 2, 4), draft_vocab_size=info.vocab_size,
                                                      ttt_steps=NUM_DRAFTS, sample_drafts=True), info),
    "peagle": lambda info: PEagleDrafter(PEagleConfig(layer_ids=(1, 2, 4), draft_vocab_size=info.vocab_size,
                                                      ttt_steps=NUM_DRAFTS, sample_drafts=True,
                                                      mask_token_id=info.vocab_size - 1), info),
    "draft_model": lambda info: DraftModelDrafter(DraftModelConfig(path="tiny", sample_drafts=True), info,
                                                  model=_draft_lm(info)),
}
KINDS = sorted(DRAFTERS)


def trainable(drafter: Drafter) -> bool:
    return type(drafter).forward is not Drafter.forward


def tiny_target(vocab_size: int | None = None, seed: int = 0, dtype=torch.float64, backend=None) -> TargetModel:
    model = make_tiny_model("llama", seed=seed, num_layers=4, dtype=dtype)
    if vocab_size is not None:
        model.resize_token_embeddings(vocab_size)
        with torch.no_grad():
            model.lm_head.weight.mul_(0.05)  # a soft distribution, so that sampling matters
        model.config.eos_token_id = None
    return TargetModel(model, name_or_path="tiny-llama", backend=backend)


def build(kind: str, target: TargetModel, seed: int = 1, sampling: bool = False) -> Drafter:
    torch.manual_seed(seed)
    factory = (SAMPLING if sampling else FACTORIES)[kind]
    drafter = factory(target.target_info()).to(target.target_info().embed_weight.dtype)
    with torch.no_grad():  # some drafters start with zeroed or identity parts; perturb so that nothing is trivial
        for parameter in drafter.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    return drafter.eval()


def training_batch(target, drafter, sequences: list[list[int]]) -> dict:
    """Right-padded batch over `sequences`, every real token in the loss, features as training serves them."""
    width = max(map(len, sequences))
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(sequences):
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        attention_mask[row, : len(tokens)] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": attention_mask.clone(),
             "sample_index": torch.arange(len(sequences)), "epoch": 0, "seed": 0}
    batch.update(FeatureProvider("online", target, drafter.feature_request()).online(batch))
    return batch


def test_every_registered_drafter_has_a_factory():
    assert set(FACTORIES) == set(DRAFTERS), "add a tiny factory for the new drafter kind to FACTORIES"


@pytest.mark.parametrize("kind", KINDS)
def test_builds_on_meta_device_and_states_its_needs(kind):
    target = tiny_target()
    info = target.target_info()
    drafter = build(kind, target)
    target.check_request(drafter.feature_request())  # raises when it asks for what the target lacks
    assert tuple(drafter.feature_request().layer_ids) == tuple(drafter.target_layer_ids())
    limit = drafter.max_draft_tokens()
    assert limit is None or limit >= NUM_DRAFTS
    if not trainable(drafter):
        pytest.skip(f"{kind} wraps a model or none; nothing of its own to build on the meta device")
    with torch.device("meta"):
        meta = FACTORIES[kind](info)
    assert all(p.is_meta for p in meta.parameters())
    assert {n: p.shape for n, p in meta.named_parameters()} == {n: p.shape for n, p in drafter.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
def test_loss_is_finite_and_gradients_reach_only_the_drafter(kind):
    target = tiny_target()
    drafter = build(kind, target).train()
    if not trainable(drafter):
        pytest.skip(f"{kind} is not trainable")
    batch = training_batch(target, drafter, [[5, 9, 31, 77, 8, 120, 64, 3, 200, 41, 17, 99],
                                             [250, 11, 64, 90, 3, 45, 6, 230]])
    output = drafter(batch)
    loss, metrics = drafter.loss(output, batch)
    assert torch.isfinite(loss) and loss.requires_grad
    assert {"sim_accept_length", "acc_0", "loss_0", "positions_0", "data_acc"} <= set(metrics)
    # where the data is the target's greedy text, agreement with the data token is agreement with the target
    greedy = dict(batch, input_ids=torch.cat([batch["input_ids"][:, :1], batch["target_argmax"][:, :-1]], dim=1))
    _, on_greedy = drafter.loss(drafter(greedy), greedy)
    depths = [k for k in range(NUM_DRAFTS + 8) if f"acc_{k}" in on_greedy]
    right = sum(on_greedy[f"acc_{k}"] * on_greedy[f"positions_{k}"] for k in depths)
    assert on_greedy["data_acc"] == pytest.approx(float(right / sum(on_greedy[f"positions_{k}"] for k in depths)),
                                                  abs=1e-6)  # metrics are 0-dim tensors; approx takes numbers
    loss.backward()
    grads = [p.grad for p in drafter.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads)
    info = target.target_info()
    assert info.embed_weight.grad is None and info.lm_head_weight.grad is None
    assert all(p.grad is None for p in target.model.parameters())
    valid = output.depth_valid
    assert output.logits.shape[:2] == valid.shape == output.label_position.shape
    assert output.batch_index.shape == (valid.shape[0],)
    # every cell, valid or not, names a position inside the sequence (losses.output_metrics indexes with it)
    assert int(output.label_position.min()) >= 1 and int(output.label_position.max()) < batch["input_ids"].shape[1]
    assert bool((output.label_position[valid] < batch["attention_mask"].sum(1)[output.batch_index[:, None]
                                                                                .expand_as(valid)][valid]).all())


# ---- proposals through the stateful proposer == the training forward ---------------------------------------------
def decode_with_forced_accepts(target, drafter, prompts, schedules, seed=0):
    """Drive begin / propose / commit as the engine does (its rollback and commit context, inference/engine/rounds.py),
    but with the accept count of every round forced by `schedules[row][round]` (None = the row has finished).
    Returns per row the final sequence and, per round the row took part in, (anchor position, proposed tokens,
    accepted count)."""
    gen = torch.Generator().manual_seed(seed)
    request = drafter.feature_request()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = torch.tensor(prompt), 1
    _, served = target.prefill(ids, mask, request)
    bonus = torch.randint(3, 250, (len(prompts),), generator=gen)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    drafter.begin(DraftContext(ids, mask.bool(), positions, next_tokens=bonus, **served.context()))
    sequences = [list(p) for p in prompts]
    rounds = [[] for _ in prompts]
    for step in range(len(schedules[0])):
        proposal = drafter.propose(NUM_DRAFTS)
        accepted = torch.tensor([a if a is not None else 0 for a in (s[step] for s in schedules)])
        active = torch.tensor([s[step] is not None for s in schedules])
        block = torch.cat([bonus[:, None], proposal.tokens], dim=1)
        mark = target.mark()
        _, served = target.extend(block, request)
        served = roll_back(target, mark, accepted, active, request, served)
        new_bonus = torch.randint(3, 250, (len(prompts),), generator=gen)
        for row in range(len(prompts)):
            if active[row]:
                rounds[row].append((len(sequences[row]), proposal.tokens[row].tolist(), int(accepted[row])))
                sequences[row] += block[row, : int(accepted[row]) + 1].tolist()
        bonus = torch.where(active, new_bonus, bonus)
        drafter.commit(accepted, commit_context(target, block, accepted, active, next_tokens=bonus, **served.context()))
    for row in range(len(prompts)):  # the last bonus, then room for the deepest prediction of the last round
        sequences[row] += [int(bonus[row])] + torch.randint(3, 250, (NUM_DRAFTS + 1,), generator=gen).tolist()
    return sequences, rounds


@pytest.mark.parametrize("kind", KINDS)
def test_proposals_equal_the_training_forward(kind):
    target = tiny_target()
    drafter = build(kind, target)
    if not trainable(drafter):
        pytest.skip(f"{kind} has no training forward to agree with")
    assert_proposals_are_training_predictions(target, drafter)


def assert_proposals_are_training_predictions(target, drafter):
    """Decode with forced accept counts, then the training forward over the decoded sequences: wherever a round's
    drafts up to step k were accepted, its step-k prediction is the proposal; returns the training output."""
    prompts = [[5, 17, 33, 9, 120, 41, 7], [250, 11, 64, 90, 3]]
    schedules = [[2, NUM_DRAFTS, 0, 1], [0, 1, NUM_DRAFTS, None]]  # row 1 finishes before the last round
    with torch.no_grad():
        sequences, rounds = decode_with_forced_accepts(target, drafter, prompts, schedules)
        batch = training_batch(target, drafter, sequences)
        output = drafter(batch)
    cells = {}
    for n in range(output.logits.shape[0]):
        for k in range(output.logits.shape[1]):
            anchor = int(output.label_position[n, k]) - 1 - k
            cells[(int(output.batch_index[n]), anchor, k)] = output.logits[n, k]
    checked = 0
    for row, row_rounds in enumerate(rounds):
        for anchor, proposed, accepted in row_rounds:
            # Depths up to the first rejected one read only ground truth (the accepted drafts), so they must agree.
            for k in range(min(accepted + 1, NUM_DRAFTS)):
                logits = cells.get((row, anchor, k))
                assert logits is not None, f"forward has no prediction for row {row}, anchor {anchor}, depth {k}"
                predicted = int(output.target_ids(logits.argmax()))
                assert predicted == proposed[k], (row, anchor, k)
                checked += 1
    assert checked >= 12
    return output, batch


# ---- lossless through the real engine ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prompts", [[[5, 6, 7, 8]], [[5, 6, 7, 8, 9, 10], [40, 41], [100, 3, 77]]])
# the model's own forward; the CPU backend's lean forward (float64: no fast linears); and float32 on the fast path,
# the drafter served on it too
@pytest.mark.parametrize("decode", ["hf", "lean", "served"])
def test_greedy_speculative_output_equals_plain_greedy(kind, prompts, decode, cpu_backend):
    served = decode == "served"
    target = tiny_target(dtype=torch.float32 if served else torch.float64,
                         backend=None if decode == "hf" else cpu_backend)
    assert target.decode == ("lean" if served else decode)
    drafter = build(kind, target)
    if served:
        drafter = target.serve(drafter)
        assert not any(type(module) is torch.nn.Linear for module in drafter.modules())
    plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=20)
    spec = speculative_generate(target, drafter, prompts, num_draft_tokens=NUM_DRAFTS, max_new_tokens=20)
    assert spec.tokens == plain.tokens


def exact_joint(model, prompt: list[int], vocab: int) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) of the target at temperature 1, [vocab ** 3]."""
    seqs = torch.tensor([[a, b] for a in range(vocab) for b in range(vocab)])
    with torch.no_grad():
        logits = model(input_ids=torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)).logits
    probs = torch.softmax(logits.double(), -1)
    start = len(prompt) - 1
    p1 = probs[0, start]
    p2 = probs[:, start + 1].reshape(vocab, vocab, vocab)[:, 0]
    p3 = probs[:, start + 2].reshape(vocab, vocab, vocab)
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten()


@pytest.mark.parametrize("kind,verification", [(kind, "token") for kind in KINDS]
                         + [("eagle3", "block"), ("dflash", "block"), ("ngram", "block")])
def test_sampling_law_is_the_targets(kind, verification):
    """T = 1: the joint law of the first three emitted tokens equals the target's, with the drafter's own q where
    it samples and one-hot q where it drafts deterministically, verified token by token and (a sampling chain
    drafter, a block drafter, a deterministic one) as a block."""
    vocab, rows = 6, 4000
    target = tiny_target(vocab_size=vocab)
    drafter = build(kind, target, sampling=kind in SAMPLING)
    prompt = [1, 4, 2, 5, 3]
    out = speculative_generate(target, drafter, [prompt] * rows, num_draft_tokens=2, max_new_tokens=3,
                               temperature=1.0, seed=0, eos_token_ids=[], verification=verification)
    counts = joint_counts(out.tokens, vocab)
    expected = exact_joint(target.model, prompt, vocab) * rows
    keep = expected >= 5
    chi2 = (((counts - expected) ** 2) / expected)[keep].sum()
    chi2 += (counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(float(expected[~keep].sum()), 1e-9)
    dof = int(keep.sum())
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (float(chi2), dof)  # about 4 sigma of the chi-square law
    assert sum(map(sum, out.accept_lengths)) > 0 or kind == "ngram"  # the drafter took part


# ---- persistence -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_save_load_gives_identical_proposals_and_logits(kind, tmp_path):
    target = tiny_target(dtype=torch.float32)  # the dtype a loaded drafter has, so logits compare exactly
    drafter = build(kind, target)
    try:
        drafter.save(str(tmp_path / "native"), "native")
    except ValueError as err:
        if trainable(drafter):
            raise
        pytest.skip(f"{kind}: {err}")
    loaded = load_drafter(str(tmp_path / "native"), target.target_info())
    assert loaded.kind == drafter.kind
    loaded = loaded.to(target.target_info().embed_weight.dtype).eval()
    prompt = torch.tensor([[5, 17, 33, 9, 120, 41, 7, 5, 17]])
    mask = torch.ones_like(prompt)
    proposals = []
    for candidate in (drafter, loaded):
        _, served = target.prefill(prompt, mask, candidate.feature_request())
        candidate.begin(DraftContext(prompt, mask.bool(), torch.arange(prompt.shape[1])[None],
                                     next_tokens=torch.tensor([33]), **served.context()))
        proposals.append(candidate.propose(NUM_DRAFTS))
    assert torch.equal(proposals[0].tokens, proposals[1].tokens)
    if trainable(drafter):
        batch = training_batch(target, drafter, [[5, 9, 31, 77, 8, 120, 64, 3, 200, 41]])
        with torch.no_grad():
            torch.testing.assert_close(loaded(batch).logits, drafter(batch).logits, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_persistence_dispatch_names_the_formats(kind, tmp_path):
    """drafters/base.py's save / load / detect_format serve every kind that does not write its own: a native header
    of the kind is "native", a format it does not write is refused naming every format it does (native first, then
    its export module's layouts), and a foreign config.json is refused naming the kind."""
    cls = DRAFTERS[kind]
    if cls.save is not Drafter.save:
        pytest.skip(f"{kind} writes its own format (a wrapped model or none)")
    exports = cls.export_module.EXPORT_FORMATS if cls.export_module else ()
    assert cls.formats() == ("native",) + tuple(exports)
    assert cls.detect_format({"draftsmith_kind": kind}) == "native"
    assert cls.detect_format({"architectures": ["LlamaForCausalLM"]}) is None
    drafter = build(kind, tiny_target())
    with pytest.raises(ValueError, match=f"{kind} cannot export format 'gguf'; it writes: {', '.join(cls.formats())}$"):
        drafter.save(str(tmp_path / "gguf"), "gguf")
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match=f"not a checkpoint of drafter kind '{kind}'"):
        cls.load(str(tmp_path), tiny_target().target_info())


@pytest.mark.parametrize("kind", KINDS)
def test_propose_refuses_more_than_max_draft_tokens(kind):
    target = tiny_target()
    drafter = build(kind, target)
    limit = drafter.max_draft_tokens()
    if limit is None:
        pytest.skip(f"{kind} has no proposal-length limit")
    prompt = torch.tensor([[5, 17, 33, 9]])
    _, served = target.prefill(prompt, torch.ones_like(prompt), drafter.feature_request())
    drafter.begin(DraftContext(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.arange(4)[None],
                               next_tokens=torch.tensor([7]), **served.context()))
    assert drafter.propose(limit).tokens.shape == (1, limit)
    with pytest.raises(ValueError, match=str(limit)):
        drafter.propose(limit + 1)


# ---- dropping finished rows (drafters/base.py keep_rows) ---------------------------------------------------------
class _ProposalLog:
    """Passes the engine's calls through to a drafter and keeps each round's proposal tokens [B_running, k]."""

    def __init__(self, drafter: Drafter):
        self.drafter, self.rounds = drafter, []

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, num_tokens):
        proposal = self.drafter.propose(num_tokens)
        self.rounds.append(proposal.tokens[:, :num_tokens].clone())
        return proposal


@pytest.mark.parametrize("kind", KINDS)
def test_dropping_finished_rows_changes_nothing(kind):
    """Rows that finish leave the batch (target cache and drafter state, keep_rows): the outputs, the acceptance and
    every proposal of the running rows equal those of a run that keeps finished rows to the end."""
    target = tiny_target()
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41], [100, 3, 77]]
    plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=24, eos_token_ids=[])
    eos = [plain.tokens[0][5]]  # row 0 ends early; the others at their own time
    runs = {}
    for drop in (False, True):
        log = _ProposalLog(build(kind, target))
        out = speculative_generate(target, log, prompts, num_draft_tokens=NUM_DRAFTS, max_new_tokens=24,
                                   eos_token_ids=eos, drop_finished_rows=drop)
        runs[drop] = (out, log.rounds)
    (kept, kept_rounds), (dropped, dropped_rounds) = runs[False], runs[True]
    assert build(kind, target).drops_rows(), f"{kind}: declare row_state or override keep_rows"
    assert len({len(row) for row in kept.tokens}) > 1, "the test needs rows that finish at different times"
    assert dropped.tokens == kept.tokens == speculative_generate(target, None, prompts, num_draft_tokens=0,
                                                                 max_new_tokens=24, eos_token_ids=eos).tokens
    assert dropped.accept_lengths == kept.accept_lengths and dropped.proposed == kept.proposed
    for round_index, (full, running) in enumerate(zip(kept_rounds, dropped_rounds)):
        alive = [row for row in range(len(prompts)) if len(kept.accept_lengths[row]) > round_index]
        assert torch.equal(running, full[alive]), (kind, round_index)
