"""A frequency-ranked head after training (DraftHead.reduce_draft_vocab, `draftsmith export --draft-vocab-size`):
the kept tokens are the most frequent of the drafter's vocabulary, their rows (and so their logits) are unchanged,
the reduced drafter saves, loads, and decodes losslessly; bad requests are refused in one line before the target loads.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from drafters import DRAFTERS, load_drafter
from tests.test_train import reset_accelerate, tiny_overrides, workdir  # noqa: F401 (workdir: the module fixture)
from train.config import load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def target():
    from inference.assets.debug_target import resolve_debug_target
    from inference.engine.target import TargetModel

    return TargetModel.from_pretrained(resolve_debug_target("debug:tiny-llama"))


def most_frequent_first(counts: torch.Tensor, kept: torch.Tensor, among: torch.Tensor) -> bool:
    """Every kept id is at least as frequent as every id of `among` left out."""
    dropped = among[~torch.isin(among, kept)]
    return dropped.numel() == 0 or bool(counts[kept].min() >= counts[dropped].max())


def decodes_as_plain_greedy(target, drafter) -> bool:
    """Two chat prompts, 24 tokens, k = 3: the drafter's greedy output equals plain greedy's."""
    from inference.engine.api import speculative_generate

    prompts = [target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
               for text in ("the cat sat on", "rain fell over the quiet hills")]
    plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=24)
    return speculative_generate(target, drafter, prompts, num_draft_tokens=3, max_new_tokens=24).tokens == plain.tokens


@pytest.mark.parametrize("kind, config", [("dflash", {"block_size": 4}), ("mtp", {}),
                                          ("eagle3", {"draft_vocab_size": 128})])
def test_reduced_head_keeps_the_most_frequent_rows_and_their_logits(target, tmp_path, kind, config):
    info = target.target_info()
    torch.manual_seed(0)
    drafter = DRAFTERS[kind](DRAFTERS[kind].Config(**config), info)
    counts = torch.randint(0, 50, (info.vocab_size,))
    if drafter.lm_head is not None:  # a trained head of its own: a distinct one, so its rows are its, not the target's
        drafter.pick_draft_vocab(torch.randint(0, 50, (info.vocab_size,)))
        torch.nn.init.normal_(drafter.lm_head.weight)
    before = drafter.draft_ids()
    among = torch.arange(info.vocab_size) if before is None else before
    rows = info.lm_head_weight if before is None else drafter.lm_head.weight.detach().clone()
    drafter.reduce_draft_vocab(counts, 40)

    kept = drafter.draft_ids()
    assert kept.numel() == 40 and drafter.config.draft_vocab_size == 40 and bool(torch.isin(kept, among).all())
    assert most_frequent_first(counts, kept, among)
    assert torch.equal(drafter.t2d.nonzero().flatten(), kept)
    positions = torch.searchsorted(among, kept)  # each kept token's row in the head before
    assert torch.equal(drafter.lm_head.weight, rows.index_select(0, positions))
    drafter.save(str(tmp_path / "reduced"), "native")
    again = load_drafter(str(tmp_path / "reduced"), info)
    assert again.config.draft_vocab_size == 40 and torch.equal(again.draft_ids(), kept)
    assert all(torch.equal(again.state_dict()[name], value) for name, value in drafter.state_dict().items())
    with pytest.raises(ValueError, match="draft vocabulary size 40 must be in"):
        drafter.reduce_draft_vocab(counts, 40)  # no smaller than what it drafts over now


def test_dspark_reduced_head_keeps_its_logits_draws_kept_tokens_and_decodes_losslessly(target, tmp_path):
    """DSpark's logit of a kept token is U + B: the target's head row and W2's row, both kept; W1 keeps every row."""
    info = target.target_info()
    torch.manual_seed(0)
    full = DRAFTERS["dspark"](DRAFTERS["dspark"].Config(block_size=4, markov_rank=8), info)
    torch.nn.init.normal_(full.markov_head.markov_w2.weight)  # a trained W2 (it starts at zero)
    counts = torch.randint(0, 50, (info.vocab_size,))
    reduced = copy.deepcopy(full)
    reduced.reduce_draft_vocab(counts, 40)
    kept = reduced.draft_ids()
    assert most_frequent_first(counts, kept, torch.arange(info.vocab_size))
    assert torch.equal(reduced.lm_head.weight, info.lm_head_weight.index_select(0, kept))
    assert torch.equal(reduced.markov_head.markov_w2.weight, full.markov_head.markov_w2.weight.index_select(0, kept))
    assert torch.equal(reduced.markov_head.markov_w1.weight, full.markov_head.markov_w1.weight)

    hidden = full.norm(torch.randn(3, 4, info.hidden_size))
    previous = torch.randint(0, info.vocab_size, (3, 4))
    with torch.no_grad():  # fp32 matmuls over a subset of rows: equal up to the kernel's summation order
        torch.testing.assert_close(reduced.teacher_forced_logits(hidden, previous),
                                   full.teacher_forced_logits(hidden, previous).index_select(-1, kept))
        greedy = reduced.draw_block(hidden, previous[:, 0])
        before = torch.cat([previous[:, :1], greedy.tokens[:, :-1]], dim=1)  # what each slot drew after
        best = full.teacher_forced_logits(hidden, before).index_select(-1, kept).argmax(dim=-1)
        sampled = reduced.draw_block(hidden, previous[:, 0], temperature=1.0,
                                     generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy.tokens, kept[best])  # each slot's draw: the best kept token, in target ids
    assert bool(torch.isin(sampled.tokens, kept).all())
    outside = ~torch.isin(torch.arange(info.vocab_size), kept)
    assert bool((sampled.probs[..., outside] == 0).all()) and bool(torch.isinf(greedy.log_probs[..., outside]).all())
    torch.testing.assert_close(sampled.probs.sum(-1), torch.ones(3, 4))

    reduced.save(str(tmp_path / "reduced"), "native")
    again = load_drafter(str(tmp_path / "reduced"), info)
    assert again.config.draft_vocab_size == 40 and torch.equal(again.draft_ids(), kept)
    assert all(torch.equal(again.state_dict()[name], value) for name, value in reduced.state_dict().items())
    assert decodes_as_plain_greedy(target, again)
    with pytest.raises(ValueError, match="^drafter.draft_vocab_size: DSpark trains over the target's full vocab"):
        again.init_from_data(counts)
    with pytest.raises(ValueError, match="^drafter.draft_vocab_size: DSpark trains over the target's full vocab"):
        load_recipe(os.path.join(ROOT, "recipes", "debug", "tiny_dspark.yaml"), ["drafter.draft_vocab_size=48"])
    with pytest.raises(ValueError, match="--format deepspec: its readers take a DSpark drafter over the full"):
        again.save(str(tmp_path / "deepspec"), "deepspec")


def test_export_reduces_a_trained_dflash_head_and_it_decodes_losslessly(workdir, tmp_path, capsys):  # noqa: F811
    from inference.engine.target import TargetModel
    from train.build import build_trainer
    from train.cli import main as cli
    from train.data.dataset import build_dataset
    from train.data.vocab import count_tokens

    reset_accelerate()
    recipe = load_recipe(os.path.join(ROOT, "recipes", "debug", "tiny_dflash.yaml"),
                         tiny_overrides(workdir, str(tmp_path / "run"), "train.max_steps=4"))
    trainer = build_trainer(recipe)
    final = trainer.fit()
    trainer.accelerator.end_training()
    out = tmp_path / "fr"
    assert cli(["export", final, "--format", "native", "--draft-vocab-size", "48", "--out", str(out)]) == 0

    target = TargetModel.from_pretrained(workdir[1])
    info = target.target_info()
    full, reduced = load_drafter(final, info), load_drafter(str(out), info)
    counts = count_tokens(build_dataset(target.tokenizer, recipe.data).train, info.vocab_size)
    kept = reduced.draft_ids()
    assert full.lm_head is None and kept.numel() == 48 and most_frequent_first(counts, kept, torch.arange(260))
    assert torch.equal(reduced.lm_head.weight, info.lm_head_weight.index_select(0, kept))
    assert torch.equal(reduced.fc.weight, full.fc.weight)
    assert decodes_as_plain_greedy(target, reduced)
    assert cli(["export", str(out), "--format", "dflash", "--out", str(tmp_path / "zlab")]) == 0
    assert torch.equal(load_drafter(str(tmp_path / "zlab"), info).draft_ids(), kept)

    capsys.readouterr()
    medusa, dspark = tmp_path / "medusa", tmp_path / "dspark"
    DRAFTERS["medusa"](DRAFTERS["medusa"].Config(), info).save(str(medusa), "native")
    DRAFTERS["dspark"](DRAFTERS["dspark"].Config(block_size=4, draft_vocab_size=48), info).save(str(dspark), "native")
    native = ["--format", "native"]
    for argv, line in (
            ([final, *native, "--draft-vocab-size", "260"], f"--draft-vocab-size 260: must be in [1, 259], below the "
                                                            f"260 tokens {final} drafts over now"),
            ([str(out), *native, "--draft-vocab-size", "48"], "--draft-vocab-size 48: must be in [1, 47]"),
            ([str(tmp_path / "zlab"), *native, "--draft-vocab-size", "8", "--target", workdir[1]],
             f"--draft-vocab-size: {tmp_path / 'zlab'} has no recipe.yaml naming the data"),
            ([str(medusa), *native, "--draft-vocab-size", "8"], f"--draft-vocab-size: {medusa} holds drafter kind "
                                                                "medusa, whose head cannot be reduced"),
            ([str(dspark), "--format", "deepspec", "--target", workdir[1]],
             "--format deepspec: its readers take a dspark drafter over the full vocabulary, and this one has a "
             "reduced draft vocabulary; write it with --format native")):
        assert cli(["export", *argv, "--out", str(tmp_path / "refused")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"draftsmith export: error: {line}") and err.count("\n") == 1, err
