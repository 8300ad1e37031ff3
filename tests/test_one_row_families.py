"""MiniMax-M3 and Llama 4 through the engine (drafters/ragged_state.py, slot-anchored layers). MiniMax-M3's
`minimax_m3_sparse` layers' indexer keeps, per query, 2 key blocks of 8 (the nearest always) cut by cache SLOT, so
`debug:tiny-minimax-m3` attends sparsely past 16 tokens, and the engine decodes it exactly where slots are positions:
one row, in chains.

- the tiny target is sparse at these lengths (its logits differ from the same weights reading every block);
- greedy speculative decoding (n-gram, a noisy draft model) == plain greedy through the engine == transformers' own
  generate (its own cache, one token per forward), with drafts accepted and rejected; every drafter kind lossless;
- rollback == recompute: after verify blocks kept in part, the K/V and the indexer's keys equal a fresh prefill's,
  and so do the next logits;
- the T = 1 law, rows decoded one after another, each with its own random streams;
- a batch given to speculative_generate is decoded row by row, as each row alone; a batch forward, padding and a tree
  are refused in one line; eval refuses --batch-size > 1 and --tree-budget before any weight loads (its records name
  a batch size; calibrate's temperatures do not depend on one, so its batches run row by row, and it writes its
  report).
float64 except where the model computes in float32 (its RMSNorm and the indexer's scores), hence FLOAT32 tolerances.
Llama 4 (`debug:tiny-llama4`: chunks of 8 positions, NoPE layers whose query temperature transformers computes from
the cache slot count, stepping every 4 tokens) runs the greedy, every-kind and refusal tests; its chunked attention
in batches and trees, temperature tuning off, is tests/test_families.py's `tiny-llama4-chunked`.
"""

from __future__ import annotations

import pytest
import torch
from test_families import MAX_NEW, assert_sampling_law, draft_model, family_target, plain_greedy, prompts
from test_families_drafters import FACTORIES, build
from test_families_rollback import FLOAT32
from transformers import AutoModelForCausalLM

from drafters import NgramDrafter
from drafters.ragged_lm import RaggedLM
from inference.assets.debug_target import resolve_debug_target
from inference.engine.api import speculative_generate, tree_speculative_generate
from inference.engine.target import TargetModel
from train.cli import main as cli

NAME = "tiny-minimax-m3"  # prompts of 7-20 tokens and MAX_NEW 24: rows end at 31-44 tokens, up to 6 blocks of 8
# and Llama 4, whose NoPE layers' attention temperature reads the cache slot (floor_scale 4: it steps every 4 tokens)
ONE_ROW = [NAME, "tiny-llama4"]
REFUSALS = {NAME: "target family minimax_m3_vl_text decodes one row at a time in chains",
            "tiny-llama4": "target family llama4_text decodes one row at a time in chains"}
REFUSAL = REFUSALS[NAME]


def target(name: str = NAME) -> TargetModel:
    return family_target(name)


def test_the_tiny_target_attends_sparsely():
    """Up to 2 blocks every key is read; past them, dropping blocks changes the logits (the indexer is live)."""
    dense = AutoModelForCausalLM.from_pretrained(resolve_debug_target("debug:" + NAME), dtype=torch.float64,
                                                 experts_implementation="eager", index_topk_blocks=64).eval()
    tokens = torch.tensor([list(range(30, 78))])
    with torch.no_grad():
        sparse_logits, dense_logits = target().model(tokens).logits[0], dense(tokens).logits[0]
    torch.testing.assert_close(sparse_logits[:16], dense_logits[:16], rtol=1e-9, atol=1e-9)
    assert (sparse_logits[24:] - dense_logits[24:]).abs().amax(-1).min() > 1e-3


@pytest.mark.parametrize("name", ONE_ROW)
def test_greedy_speculative_equals_plain_greedy_and_transformers(name):
    reference = [target(name).model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                 for p in prompts()]
    assert plain_greedy(name) == reference
    ngram = NgramDrafter(NgramDrafter.Config(), target(name).target_info())
    drafter = draft_model(target(name), name)
    accepted = rejected = 0
    for prompt, plain in zip(prompts(), plain_greedy(name)):
        for each in (ngram, drafter):
            out = speculative_generate(target(name), each, [prompt], num_draft_tokens=3, max_new_tokens=MAX_NEW,
                                       eos_token_ids=[])
            assert out.tokens == [plain], type(each).__name__
            if each is drafter:
                accepted += sum(out.accept_lengths[0])
                rejected += sum(out.proposed[0]) - sum(out.accept_lengths[0])
    assert accepted > 0 and rejected > 0, (accepted, rejected)


@pytest.mark.parametrize("name", ONE_ROW)
@pytest.mark.parametrize("kind", sorted(FACTORIES) + ["draft_model"])
def test_every_kind_is_lossless_row_by_row(kind, name):
    """Every drafter kind (untrained, as tests/test_families_drafters.py builds them) in chains of 2 over the three
    prompts given as one batch: plain greedy's tokens."""
    family, drafter = build(kind, name)
    out = speculative_generate(family, drafter, prompts(), num_draft_tokens=2, max_new_tokens=MAX_NEW,
                               eos_token_ids=[])
    assert out.tokens == plain_greedy(name)


def cache_state(runner: RaggedLM) -> list[torch.Tensor]:
    """Every attention layer's keys and values, and each sparse layer's indexer keys (one row, no holes)."""
    state = []
    for layer in runner.cache.layers:
        state += [layer.keys, layer.values] + ([layer.idx_keys] if hasattr(layer, "idx_keys") else [])
    return state


def test_chain_rollback_equals_recompute():
    """Verify blocks of 4 kept in part (every count from 0 to 4) across block boundaries: the cache, the indexer's
    keys included, is a fresh prefill's of the kept tokens, and the next logits are the same."""
    runner = RaggedLM(target().model)
    sequence = list(range(30, 50))
    runner.extend(torch.tensor([sequence]))
    generator = torch.Generator().manual_seed(0)
    for keep in (2, 4, 0, 1, 3, 4, 1):
        block = torch.randint(0, 256, (1, 4), generator=generator)
        mark = runner.mark()
        runner.extend(block)
        runner.keep_after(mark, torch.tensor([keep]))
        sequence += block[0, :keep].tolist()
    fresh = RaggedLM(target().model)
    fresh.extend(torch.tensor([sequence]))
    ours, theirs = cache_state(runner), cache_state(fresh)
    assert len(ours) == len(theirs) == 4 * 2 + 2 and ours[0].shape[2] == len(sequence) == 35
    for index, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, **FLOAT32, msg=lambda m: f"tensor {index}: {m}")
    torch.testing.assert_close(runner.extend(torch.tensor([[7]]))[0, -1], fresh.extend(torch.tensor([[7]]))[0, -1],
                               **FLOAT32)


def test_a_batch_is_decoded_row_by_row_as_each_row_alone():
    ngram = NgramDrafter(NgramDrafter.Config(), target().target_info())
    out = speculative_generate(target(), ngram, prompts(), num_draft_tokens=3, max_new_tokens=MAX_NEW,
                               eos_token_ids=[])
    alone = [speculative_generate(target(), ngram, [p], num_draft_tokens=3, max_new_tokens=MAX_NEW,
                                  eos_token_ids=[]) for p in prompts()]
    assert out.tokens == plain_greedy(NAME)
    assert out.accept_lengths == [a.accept_lengths[0] for a in alone]
    assert out.target_forwards == sum(a.target_forwards for a in alone)
    assert out.row_seconds == sorted(out.row_seconds) and out.row_seconds[-1] <= out.time_total


def test_sampling_law_row_by_row():
    """The T = 1 law (test_families.assert_sampling_law) over 400 rows decoded one after another, each its own random
    streams (a 3-token vocabulary: 27 joint cells, about 15 rows expected in each)."""
    assert_sampling_law(NAME, vocab=3, rows=400, prompt=[1, 2, 2, 0, 2], timed=False)


@pytest.mark.parametrize("name", ONE_ROW)
def test_a_batch_forward_padding_and_trees_are_refused_in_one_line(name):
    runner = RaggedLM(target(name).model)
    for input_ids, valid in ((torch.tensor([[5, 6, 7], [8, 9, 10]]), None),
                             (torch.tensor([[0, 6, 7]]), torch.tensor([[False, True, True]]))):
        with pytest.raises(ValueError) as error:
            runner.extend(input_ids, valid)
        assert str(error.value).startswith(REFUSALS[name]) and "\n" not in str(error.value)
    ngram = NgramDrafter(NgramDrafter.Config(), target(name).target_info())
    with pytest.raises(ValueError, match=REFUSALS[name] + r".*a tree's nodes"):
        tree_speculative_generate(target(name), ngram, prompts()[:1], tree_budget=4, max_new_tokens=8, eos_token_ids=[])


@pytest.mark.parametrize("argv,flag", [
    (["eval", "--drafter", "ngram", "--batch-size", "1,2"], "--batch-size 2"),
    (["eval", "--drafter", "ngram", "--tree-budget", "4"], "--tree-budget 4"),
])
def test_eval_refuses_a_batch_or_a_tree_before_a_weight_loads(argv, flag, monkeypatch, capsys, tmp_path):
    import inference.engine.target

    def no_weights(*args, **kwargs):
        raise AssertionError("a weight was loaded")

    monkeypatch.setattr(inference.engine.target, "load_model", no_weights)
    status = cli(argv + ["--target", "debug:" + NAME, "--num-prompts", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert status == 2 and "Traceback" not in err and len(errors) == 1, err
    assert f"error: {flag}: {REFUSAL}" in errors[0]


def test_eval_decodes_it_at_batch_1(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert cli(["eval", "--target", "debug:" + NAME, "--drafter", "ngram", "--num-prompts", "1", "--max-new-tokens",
                "24", "--num-draft-tokens", "3", "--out", str(out)]) == 0
    assert "ngram" in capsys.readouterr().out and out.exists()


def test_calibrate_runs_its_batches_row_by_row(tmp_path):
    """`draftsmith calibrate` (its default --batch-size 4) on an untrained DSpark drafter for the target: the rounds it
    fits temperatures on come from rows decoded one after another, and it writes its report."""
    import json

    from drafters.dspark import DSparkConfig, DSparkDrafter

    info = target().target_info()
    torch.manual_seed(1)
    drafter = DSparkDrafter(DSparkConfig(layer_ids="auto", num_layers=1, block_size=2, intermediate_size=128,
                                         markov_rank=8, mask_token_id=info.vocab_size - 1), info)
    drafter.save(str(tmp_path / "dspark"))
    out = tmp_path / "calibration"
    assert cli(["calibrate", str(tmp_path / "dspark"), "--target", "debug:" + NAME, "--prompts", "mt_bench,gsm8k",
                "--num-prompts", "12", "--max-new-tokens", "32", "--out", str(out)]) == 0
    report = json.loads((out / "calibration.json").read_text())
    assert len(report["positions"]) == 2 and len(report["temperatures"]) == 2
