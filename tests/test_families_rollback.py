"""Rollback == recompute for every family of tests/test_families.py: after verify blocks where the rows of a batch
keep different numbers of tokens (chains) or different branches (trees), each row's cache (the K/V of its valid slots,
full and sliding-window layers alike) and each linear-attention layer's conv and recurrent state equal those of a
fresh prefill of the tokens the row kept, and so do the next logits. Sequences end past Gemma 4's and gpt-oss's
window of 16. float64: the two sides differ only in summation order (batched vs single-row, one-token recurrence vs
the chunked prefill), about 1e-15 relative, so 1e-9 is a tolerance that still catches any wrong token or state; the
logits the engine returns are float32, compared to a few float32 ulps.
"""

from __future__ import annotations

import pytest
import torch
from test_families import FAMILIES, HYBRIDS, family_target
from transformers.cache_utils import LinearAttentionLayer

from drafters.ragged_lm import RaggedLM
from drafters.ragged_state import MECHANISMS
from inference.engine.run import left_pad
from inference.engine.tree.draft import DraftTree
from inference.engine.tree.target import tree_extend

# Parts of some forwards run in float32 whatever the model's dtype: transformers' gated delta rule (its reference
# kernels cast to float32 and keep a float32 recurrent state) and the RMSNorm of gpt-oss and DeepSeek-V3 (computed in
# float32, cast back; Mistral's too). Those families are compared at float32 level, Gemma 4 at float64's.
FLOAT32_INSIDE = {"tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-gpt-oss", "tiny-deepseek-v3", "mistral",
                  "tiny-deepseek-v3.2", "tiny-glm-5",  # and the DSA indexer's scores
                  "tiny-nemotron-h", "tiny-granite-4", "tiny-jamba", "tiny-falcon-h1", "tiny-zamba2",  # Mamba's scans
                  "tiny-lfm2", "tiny-llama4-chunked", "tiny-kimi-linear"}  # and Llama 4's RMSNorm, Kimi's delta rule
FLOAT64 = dict(rtol=1e-9, atol=1e-11)
FLOAT32 = dict(rtol=1e-5, atol=1e-6)
LOGITS_TOLERANCE = dict(rtol=1e-6, atol=1e-6)  # the engine hands logits on in float32 (for float64 families)
PROMPTS = [list(range(30, 50)), list(range(100, 109)), list(range(200, 214))]  # 20, 9, 14 tokens
KEEPS = ([2, 4, 1], [4, 1, 3], [1, 3, 4], [3, 4, 2])  # tokens each row keeps of a 4-token block, per round


def row_state(runner: RaggedLM, row: int) -> list:
    """Per layer: (keys, values) of the row's valid slots, or (conv, recurrent) of a linear-attention layer."""
    valid = runner.slot_mask[row].bool()
    state = []
    for layer in runner.cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            if layer.conv_states[0] is None:  # transformers 5.17's place for a block without a mixer (Nemotron-H)
                continue
            # cloned: the cache updates these in place (a short convolution, LFM2's, has no recurrent state)
            state.append(tuple(s[row].clone() for s in (layer.conv_states[0], layer.recurrent_states[0])
                               if s is not None))
        elif getattr(layer, "keys", None) is not None:
            state.append((layer.keys[row][:, valid], layer.values[row][:, valid]))
            if getattr(layer, "indexer_keys", None) is not None:  # DSA: the indexer's own key cache [B, L, d]
                state.append((layer.indexer_keys[row][valid],))
    return state


def assert_equals_fresh_prefill(target, sequences: list[list[int]], next_tokens: torch.Tensor, name: str) -> None:
    """Row b of target.runner == a new single-row cache built from sequences[b]; and one more token gives the same
    logits. Consumes the target's cache (feeds next_tokens)."""
    runner, tolerance = target.runner, FLOAT32 if name in FLOAT32_INSIDE else FLOAT64
    ours = [row_state(runner, row) for row in range(len(sequences))]
    logits = runner.extend(next_tokens[:, None])[:, -1]
    for row, tokens in enumerate(sequences):
        fresh = RaggedLM(target.model)
        fresh.extend(torch.tensor([tokens]))
        for layer, (mine, theirs) in enumerate(zip(ours[row], row_state(fresh, 0))):
            for a, b in zip(mine, theirs):
                torch.testing.assert_close(a, b, **tolerance, msg=lambda m: f"row {row} layer {layer}: {m}")
        torch.testing.assert_close(logits[row], fresh.extend(next_tokens[row:row + 1, None])[0, -1],
                                   **(FLOAT32 if name in FLOAT32_INSIDE else LOGITS_TOLERANCE))


def prefilled(name: str):
    target = family_target(name)
    input_ids, mask = left_pad(PROMPTS, 0)
    target.prefill(input_ids, mask)
    return target, [list(p) for p in PROMPTS]


def verify_and_keep(target, sequences: list[list[int]]) -> None:
    """Four verify blocks of 4 random tokens; row b keeps KEEPS[i][b] of block i, appended to sequences[b]."""
    generator = torch.Generator().manual_seed(0)
    for keep in KEEPS:
        block = torch.randint(0, 256, (3, 4), generator=generator)
        mark = target.mark()
        target.extend(block)
        target.keep_after(mark, torch.tensor(keep))
        for row, kept in enumerate(keep):
            sequences[row] += block[row, :kept].tolist()


@pytest.mark.parametrize("name", FAMILIES)
def test_chain_rollback_equals_recompute(name):
    """Four verify blocks of 4 tokens; rows keep 1-4 of each (holes in the batched cache, none in a state)."""
    target, sequences = prefilled(name)
    verify_and_keep(target, sequences)
    assert min(map(len, sequences)) > 16  # past the sliding window
    assert_equals_fresh_prefill(target, sequences, torch.tensor([7, 8, 9]), name)


@pytest.mark.parametrize("name", FAMILIES)
def test_tree_rollback_equals_recompute(name):
    """A chain round, then a 6-node tree in which the rows accept different branches (and row 2 only the root)."""
    target, sequences = prefilled(name)
    mark = target.mark()
    target.extend(torch.tensor([[1, 2, 3]] * 3))
    target.keep_after(mark, torch.tensor([3, 1, 2]))
    for row, kept in enumerate([3, 1, 2]):
        sequences[row] += [1, 2, 3][:kept]
    #        0 (root)
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]] * 3)
    tokens = torch.tensor([[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36]])
    tree = DraftTree(tokens=tokens, parents=parents, depth=torch.tensor([[0, 1, 1, 2, 2, 2]] * 3),
                     valid=torch.ones(3, 6, dtype=torch.bool))
    path = torch.tensor([[0, 1, 4], [0, 2, 5], [0, -1, -1]])
    keep = torch.tensor([3, 3, 1])
    mark = target.mark()
    tree_extend(target, tree)
    target.keep_path(mark, path, keep)
    for row in range(3):
        sequences[row] += [int(tree.tokens[row, node]) for node in path[row, : int(keep[row])]]
    assert_equals_fresh_prefill(target, sequences, torch.tensor([7, 8, 9]), name)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_both_linear_mechanisms_give_the_recomputed_state(mechanism):
    """The measured alternative (re-run of the accepted prefix from a saved state) rolls back as exactly as the
    default per-position snapshots, including blocks with slots fed as invalid (a no-op for a row's state)."""
    target = family_target(HYBRIDS[1])
    for recorder in target.runner.family.recorders.values():
        recorder.mechanism = mechanism
    try:
        target, sequences = prefilled(HYBRIDS[1])
        block = torch.tensor([[5, 6, 7, 8]] * 3)
        valid = torch.tensor([[True, True, False, True], [True, True, True, True], [True, False, True, True]])
        mark = target.mark()
        target.extend(block, valid=valid)
        target.keep_after(mark, torch.tensor([3, 2, 1]))  # valid tokens kept per row
        sequences[0] += [5, 6, 8]
        sequences[1] += [5, 6]
        sequences[2] += [5]
        assert_equals_fresh_prefill(target, sequences, torch.tensor([7, 8, 9]), HYBRIDS[1])
    finally:
        for recorder in target.runner.family.recorders.values():
            recorder.mechanism = "snapshot"


def test_mistral_rollback_past_its_window_equals_recompute():
    """Mistral-style configs (no layer_types, one sliding_window for every layer; its forward takes one mask, not one
    per layer type) with a window of 8, so the prompts already outgrow it."""
    from transformers import MistralConfig, MistralForCausalLM

    from inference.engine.target import TargetModel

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=8, max_position_embeddings=512)).double().eval()
    target = TargetModel(model)
    input_ids, mask = left_pad(PROMPTS, 0)
    target.prefill(input_ids, mask)
    sequences = [list(p) for p in PROMPTS]
    verify_and_keep(target, sequences)
    assert_equals_fresh_prefill(target, sequences, torch.tensor([7, 8, 9]), "mistral")
