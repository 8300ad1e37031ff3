"""Long sequences in bounded memory (drafters/chunked.py): the chunked attention and losses equal the one-shot ones,
activation checkpointing leaves the gradients unchanged, and the chunked paths never build a [T, T] (or [N, V]-for-
all-rows) tensor, checked on the shapes of every tensor the forward and backward create. The full-vocabulary losses of
MTP, Medusa and the assistant (losses.full_vocab_cross_entropy) run through the same chunks: their one-shot path is
bitwise the whole-tensor computation, and chunked they equal it to fp32 rounding and hold no logits of all rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from drafters import chunked
from drafters.assistant import AssistantConfig, AssistantDrafter
from drafters.base import TargetInfo
from drafters.dflash import DFlashConfig, DFlashDrafter
from drafters.dspark import DSparkConfig, DSparkDrafter
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.losses import full_vocab_cross_entropy, soft_cross_entropy
from drafters.medusa import MedusaConfig, MedusaDrafter
from drafters.mtp import MTPConfig, MTPDrafter
from drafters.peagle import PEagleConfig, PEagleDrafter

HIDDEN, VOCAB, LENGTH = 16, 96, 160  # every width but the vocabulary below LENGTH / 2 (the shape check)


def target_info() -> TargetInfo:
    generator = torch.Generator().manual_seed(0)
    config = {"hidden_size": HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
              "intermediate_size": 24, "num_hidden_layers": 4, "rope_theta": 10000.0, "vocab_size": VOCAB}
    return TargetInfo(name_or_path="synthetic", hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=4,
                      embed_weight=torch.randn(VOCAB, HIDDEN, generator=generator),
                      lm_head_weight=torch.randn(VOCAB, HIDDEN, generator=generator) * 0.3,
                      final_norm_weight=torch.ones(HIDDEN), rms_norm_eps=1e-6, eos_token_ids=(2,), pad_token_id=2,
                      config=config, unused_token_ids=(3,))


FACTORIES = {
    "eagle3": lambda info: Eagle3Drafter(Eagle3Config(layer_ids=(1, 2, 3), num_layers=2, draft_vocab_size=64,
                                                      ttt_steps=3), info),
    "peagle": lambda info: PEagleDrafter(PEagleConfig(layer_ids=(1, 2, 3), num_layers=2, draft_vocab_size=64,
                                                      ttt_steps=3), info),
    "dflash": lambda info: DFlashDrafter(DFlashConfig(layer_ids=(1, 2, 3), num_layers=2, block_size=4,
                                                      num_anchors=24, mask_token_id=3), info),
    "dflash_vocab": lambda info: DFlashDrafter(DFlashConfig(layer_ids=(1, 2), num_layers=1, block_size=4,
                                                            num_anchors=24, mask_token_id=3, draft_vocab_size=48,
                                                            loss_weighting="dpace"), info),
    "dspark": lambda info: DSparkDrafter(DSparkConfig(layer_ids=(1, 2, 3), num_layers=2, block_size=3,
                                                      num_anchors=24, markov_rank=8, mask_token_id=3), info),
    "dspark_rnn": lambda info: DSparkDrafter(DSparkConfig(layer_ids=(1, 2), num_layers=1, block_size=3,
                                                          num_anchors=24, markov_rank=8, mask_token_id=3,
                                                          markov_head_type="rnn"), info),
}

# the kinds whose loss runs through the target's full vocabulary (losses.full_vocab_cross_entropy)
FULL_VOCAB = {
    "mtp": lambda info: MTPDrafter(MTPConfig(num_modules=3), info),
    "medusa": lambda info: MedusaDrafter(MedusaConfig(num_heads=3, num_layers=2, lm_head="copy"), info),
    "assistant": lambda info: AssistantDrafter(AssistantConfig(num_layers=2, hidden_size=12, num_steps=3), info),
}


def make_batch(drafter, lengths=(LENGTH, LENGTH - 37)) -> dict:
    """Right-padded rows of random features (what a feature cache serves), loss on all but the first 5 tokens."""
    generator = torch.Generator().manual_seed(1)
    batch_size, width = len(lengths), max(lengths)
    real = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    loss_mask = real & (torch.arange(width) >= 5)
    return {"input_ids": torch.randint(4, VOCAB, (batch_size, width), generator=generator),
            "attention_mask": real.long(), "loss_mask": loss_mask.long(),
            "target_argmax": torch.randint(4, VOCAB, (batch_size, width), generator=generator),
            "hidden": {i: torch.randn(batch_size, width, HIDDEN, generator=generator)
                              for i in drafter.feature_request().layer_ids},
            "final_hidden": torch.randn(batch_size, width, HIDDEN, generator=generator),
            "target_kv": {i: (torch.randn(batch_size, 2, width, 4, generator=generator),
                              torch.randn(batch_size, 2, width, 4, generator=generator))
                          for i in drafter.feature_request().kv_layers},
            "sample_index": torch.arange(batch_size), "epoch": 0, "seed": 0}


def loss_and_grads(drafter, batch):
    drafter.zero_grad(set_to_none=True)
    loss, metrics = drafter.loss(drafter(batch), batch)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def assert_same(reference, other):
    """fp32: chunking and recomputation change only the order of sums of a few hundred terms, so values agree to
    about 1e-6 relative; 1e-4 of each tensor's largest entry leaves room for cancellation."""
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = reference, other
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-4 * float(grad.abs().max()), msg=name)
    assert metrics_a.keys() == metrics_b.keys()
    for key in metrics_a:  # accuracies from chunked argmaxes: identical unless two logits tie within rounding
        assert float(metrics_b[key]) == pytest.approx(float(metrics_a[key]), rel=1e-4, abs=1e-5), key


def small_budgets(monkeypatch):
    monkeypatch.setattr(chunked, "ATTENTION_CHUNK_VALUES", 4000)  # a few query rows / anchors per chunk
    monkeypatch.setattr(chunked, "LOSS_CHUNK_VALUES", 2000)  # a few rows of logits per chunk
    monkeypatch.setattr(chunked, "LOSS_ONE_SHOT_VALUES", 2000)


@pytest.mark.parametrize("kind", sorted(FACTORIES))
@pytest.mark.parametrize("lengths", [(LENGTH,), (LENGTH, LENGTH - 37)], ids=["unpadded", "padded"])
def test_chunked_equals_one_shot(kind, lengths, monkeypatch):
    torch.manual_seed(0)
    drafter = FACTORIES[kind](target_info())
    batch = make_batch(drafter, lengths)
    reference = loss_and_grads(drafter, batch)
    small_budgets(monkeypatch)
    assert_same(reference, loss_and_grads(drafter, batch))


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_activation_checkpointing_keeps_gradients(kind, monkeypatch):
    torch.manual_seed(0)
    drafter = FACTORIES[kind](target_info())
    batch = make_batch(drafter)
    reference = loss_and_grads(drafter, batch)
    drafter.activation_checkpointing = True
    assert_same(reference, loss_and_grads(drafter, batch))
    small_budgets(monkeypatch)  # layer checkpoints around chunk checkpoints
    assert_same(reference, loss_and_grads(drafter, batch))


class Shapes(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.shapes.append((str(func), tuple(value.shape)))
        return out


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_chunked_paths_build_no_quadratic_tensor(kind, monkeypatch):
    """With small budgets, no tensor of the step has two dimensions of sequence size (a [T, T] mask or scores, or a
    [T, T + A*S] block mask), nor the logits of all rows (N x V_d values), in the forward or the backward."""
    small_budgets(monkeypatch)
    torch.manual_seed(0)
    drafter = FACTORIES[kind](target_info())
    batch = make_batch(drafter)
    output = drafter(batch)
    num_rows, depths = output.depth_valid.shape
    with Shapes() as recorded:
        loss, _ = drafter.loss(drafter(batch), batch)
        loss.backward()
    long_dims = [(op, shape) for op, shape in recorded.shapes if sum(d >= LENGTH // 2 for d in shape) >= 2]
    assert not long_dims, long_dims[:5]
    vocab = min(p.shape[0] for n, p in drafter.named_parameters() if n == "lm_head.weight") if kind in (
        "eagle3", "dflash_vocab") else VOCAB
    all_logits = [(op, shape) for op, shape in recorded.shapes
                  if shape and shape[-1] == vocab and torch.Size(shape).numel() >= num_rows * vocab]
    assert not all_logits, all_logits[:5]


def test_one_shot_paths_do_build_them():
    """The check above can fail: the default budgets run the one-shot paths, whose [T, T] mask it sees."""
    torch.manual_seed(0)
    drafter = FACTORIES["eagle3"](target_info())
    batch = make_batch(drafter)
    with Shapes() as recorded:
        loss, _ = drafter.loss(drafter(batch), batch)
        loss.backward()
    assert any(sum(d >= LENGTH // 2 for d in shape) >= 2 for _, shape in recorded.shapes)


@pytest.mark.parametrize("kind", ["eagle3", "dflash_vocab", "dspark", *sorted(FULL_VOCAB)])
def test_head_keeps_the_forwards_autocast(kind):
    """The loss runs the head after the forward (a chunk at a time); it computes in the dtype the forward's mixed
    precision would have given it, as when the head ran inside the forward."""
    drafter = {**FACTORIES, **FULL_VOCAB}[kind](target_info())
    batch = make_batch(drafter)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = drafter(batch)
    assert mixed.logits_of(slice(0, 2)).dtype == torch.bfloat16
    assert drafter(batch).logits_of(slice(0, 2)).dtype == torch.float32


def full_vocab_drafter(kind: str, loss: str):
    torch.manual_seed(0)
    drafter = FULL_VOCAB[kind](target_info())
    drafter.config = dataclasses.replace(drafter.config, loss=loss)
    with torch.no_grad():  # fresh Medusa blocks are zero and MTP's eh_proj half the identity: make every part count
        for parameter in drafter.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return drafter


@pytest.mark.parametrize("loss", ["soft", "hard"])
@pytest.mark.parametrize("kind", sorted(FULL_VOCAB))
def test_full_vocab_loss_chunked_equals_one_shot(kind, loss, monkeypatch):
    drafter = full_vocab_drafter(kind, loss)
    batch = make_batch(drafter)
    reference = loss_and_grads(drafter, batch)
    small_budgets(monkeypatch)
    assert_same(reference, loss_and_grads(drafter, batch))


@pytest.mark.parametrize("kind", sorted(FULL_VOCAB))
def test_full_vocab_one_shot_loss_is_the_whole_tensor_loss(kind):
    """Within the one-shot limit the chunked seam adds nothing: the cell losses are bitwise the soft cross-entropy of
    the whole [N, K, V] logits against the teacher rows gathered per cell, and the argmax is theirs."""
    drafter = full_vocab_drafter(kind, "soft")
    batch = make_batch(drafter)
    output = drafter(batch)
    head = drafter._target_tensor("lm_head_weight")
    cell_loss, predicted = full_vocab_cross_entropy(output, batch, head, soft=True)
    rows = output.batch_index.unsqueeze(1).expand_as(output.label_position)
    cells, cell_of = torch.unique(rows * LENGTH + output.label_position - 1, return_inverse=True)
    teacher = torch.softmax(F.linear(batch["final_hidden"][cells // LENGTH, cells % LENGTH], head), dim=-1)
    assert torch.equal(cell_loss, soft_cross_entropy(output.logits, teacher[cell_of]))
    assert torch.equal(predicted, output.logits.argmax(dim=-1))


@pytest.mark.parametrize("kind", sorted(FULL_VOCAB))
def test_full_vocab_chunked_loss_holds_no_logits_of_all_rows(kind, monkeypatch):
    """With small budgets no tensor of the loss's forward or backward holds N x V values (logits, teacher or their
    gradient of every row); the chain drafters' own attention keeps its [T, T] mask (they are not chunked there)."""
    small_budgets(monkeypatch)
    drafter = full_vocab_drafter(kind, "soft")
    batch = make_batch(drafter)
    output = drafter(batch)
    with Shapes() as recorded:
        loss, _ = drafter.loss(output, batch)
        loss.backward()
    all_logits = [(op, shape) for op, shape in recorded.shapes
                  if shape and shape[-1] == VOCAB and torch.Size(shape).numel() >= output.num_rows * VOCAB]
    assert not all_logits, all_logits[:5]
    assert any(shape and shape[-1] == VOCAB for _, shape in recorded.shapes)  # the check saw the chunks' logits

