"""EAGLE-3 drafter: TTT against a naive loop reference, TTT against KV-cached chain drafting, vocab mapping,
export/load round trips, input errors, warm starts, and the lossless invariant through the real engine."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from conftest import make_tiny_model
from transformers import LlamaConfig

from drafters import DRAFTERS, load_drafter
from drafters.base import DraftContext
from drafters.eagle3 import Eagle3Config, Eagle3Drafter, detect_format
from drafters.vocab import DraftVocab
from inference.generate import speculative_generate
from inference.target import TargetModel

VOCAB = 256


def tiny_target(num_layers: int = 4, seed: int = 0, dtype=torch.float64, **overrides) -> TargetModel:
    model = make_tiny_model(num_layers=num_layers, seed=seed, dtype=dtype)
    if overrides:
        config = LlamaConfig(**{**model.config.to_dict(), **overrides})
        torch.manual_seed(seed)
        model = type(model)(config).to(dtype).eval()
    return TargetModel(model, name_or_path="tiny-llama")


def make_drafter(target: TargetModel, seed: int = 1, counts_seed: int = 2, **config) -> Eagle3Drafter:
    """A drafter with random (not warm-started) weights and a draft vocab drawn from random counts."""
    torch.manual_seed(seed)
    config = {"draft_vocab_size": 160, "ttt_steps": 3, "init_head_from_target": False, **config}
    drafter = Eagle3Drafter(Eagle3Config(**config), target.target_info()).double()
    counts = torch.randint(0, 50, (VOCAB,), generator=torch.Generator().manual_seed(counts_seed))
    drafter.init_from_data(counts)
    return drafter


def make_batch(target: TargetModel, drafter: Eagle3Drafter, seq_len: int = 11, seed: int = 3) -> dict:
    """Two rows, the second right-padded, a random loss mask; target features from the real tiny target."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (2, seq_len), generator=gen)
    attention_mask = torch.ones(2, seq_len, dtype=torch.long)
    attention_mask[1, seq_len - 3 :] = 0
    loss_mask = (torch.rand(2, seq_len, generator=gen) < 0.8).long() * attention_mask
    features = target.features(input_ids, attention_mask, drafter.target_layer_ids(), return_logits=True)
    return {
        "input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
        "target_hidden": features.hidden, "target_last_hidden": features.last_hidden,
        "target_argmax": features.argmax, "target_logits": features.logits,
    }


# ---- (a) TTT == a naive step-by-step reference -----------------------------------------------------------------
def naive_rope(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """x [d] rotated pairwise (i, i + d/2) by position * theta**(-2i/d)."""
    half = x.shape[0] // 2
    out = x.clone()
    for i in range(half):
        angle = position * theta ** (-2.0 * i / x.shape[0])
        out[i] = x[i] * math.cos(angle) - x[i + half] * math.sin(angle)
        out[i + half] = x[i + half] * math.cos(angle) + x[i] * math.sin(angle)
    return out


def naive_layer(drafter, layer, embed, hidden, position, own_keys, visible_keys):
    """One draft layer on one position with explicit per-head attention over visible_keys + its own key."""
    cfg = drafter.layer_config
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta = cfg["rope_theta"]
    if layer.first:
        normed = layer.hidden_norm(hidden)
        attn_in = torch.cat([layer.input_layernorm(embed), normed])
        residual = normed if drafter.config.norm_before_residual else hidden
    else:
        attn_in, residual = layer.input_layernorm(hidden), hidden
    q = layer.self_attn.q_proj(attn_in).view(heads, head_dim)
    k = layer.self_attn.k_proj(attn_in).view(kv_heads, head_dim)
    v = layer.self_attn.v_proj(attn_in).view(kv_heads, head_dim)
    k = torch.stack([naive_rope(k[h], position, theta) for h in range(kv_heads)])
    own_keys.append((k, v))
    keys = visible_keys + [(k, v)]
    outputs = []
    for h in range(heads):
        g = h // (heads // kv_heads)
        qh = naive_rope(q[h], position, theta)
        scores = torch.stack([qh @ key[g] / math.sqrt(head_dim) for key, _ in keys])
        weights = torch.softmax(scores, dim=0)
        outputs.append(sum(w * value[g] for w, (_, value) in zip(weights, keys)))
    x = residual + layer.self_attn.o_proj(torch.cat(outputs))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def naive_ttt(drafter, batch, steps):
    """out[(b, step, t)] = pre-norm output, computed cell by cell with the TTT visibility rule spelled out:
    step-0 keys at real pairs s <= t (and t itself), plus the keys of steps 1..step at the same t."""
    ids, real = batch["input_ids"], batch["attention_mask"].bool()
    embed = drafter.target_info.embed_weight.double()
    seq_len = ids.shape[1]
    out = {}
    for b in range(ids.shape[0]):
        keys = {}  # (layer, step, t) -> (k, v)
        for step in range(steps):
            for t in range(seq_len - 1):
                token = int(ids[b, t + 1 + step]) if t + 1 + step < seq_len else 0
                hidden = out[(b, step - 1, t)] if step else drafter.fc(
                    torch.cat([batch["target_hidden"][i][b, t] for i in drafter.layer_ids]))
                for index, layer in enumerate(drafter.layers):
                    visible = [keys[(index, 0, s)] for s in range(t) if real[b, s] and real[b, s + 1]]
                    if step:
                        visible += [keys[(index, 0, t)]] + [keys[(index, j, t)] for j in range(1, step)]
                    own = []
                    hidden = naive_layer(drafter, layer, embed[token], hidden, t + step, own, visible)
                    keys[(index, step, t)] = own[0]
                out[(b, step, t)] = hidden
    return out


def naive_loss(drafter, batch, steps):
    """The TTT loss from the naive outputs and the target's full-vocab logits restricted to the draft vocab."""
    out = naive_ttt(drafter, batch, steps)
    draft_ids = drafter.draft_ids()
    ids, real, lm = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
    total, count, correct = [0.0] * steps, [0] * steps, [0] * steps
    for b in range(ids.shape[0]):
        for s in range(1, ids.shape[1] - 1):
            argmax = int(batch["target_argmax"][b, s])
            if not (lm[b, s + 1] and real[b, s + 1] and drafter.t2d[argmax]):
                continue
            teacher = torch.softmax(batch["target_logits"][b, s, draft_ids], dim=0)
            for step in range(steps):
                if s - 1 - step < 0:
                    continue
                logits = drafter.lm_head(drafter.norm(out[(b, step, s - 1 - step)]))
                total[step] = total[step] - (teacher * torch.log_softmax(logits, dim=0)).sum()
                count[step] += 1
                correct[step] += int(draft_ids[logits.argmax()] == argmax)
    means = [total[k] / max(count[k], 1) for k in range(steps)]
    loss = sum(drafter.config.step_decay**k * means[k] for k in range(steps))
    return loss, [c / max(n, 1) for c, n in zip(correct, count)], count


@pytest.mark.parametrize("num_layers,norm_before_residual", [(1, False), (2, True)])
def test_ttt_loss_and_gradients_match_naive_reference(num_layers, norm_before_residual):
    target = tiny_target()
    drafter = make_drafter(target, num_layers=num_layers, norm_before_residual=norm_before_residual)
    batch = make_batch(target, drafter)
    loss, metrics = drafter.loss(drafter(batch), batch)
    grads = torch.autograd.grad(loss, list(drafter.parameters()))
    ref_loss, ref_acc, ref_count = naive_loss(drafter, batch, drafter.config.ttt_steps)
    ref_grads = torch.autograd.grad(ref_loss, list(drafter.parameters()))
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-9)
    assert min(ref_count) > 0 and ref_count[0] > ref_count[-1]
    for k in range(drafter.config.ttt_steps):
        assert metrics[f"acc_{k}"] == pytest.approx(ref_acc[k]) and metrics[f"positions_{k}"] == ref_count[k]
    # Gradients equal too, so the fed-back hidden state carries gradient across steps as in the reference.
    for (name, _), grad, ref in zip(drafter.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-7, atol=1e-10, msg=name)


def test_ttt_steps_can_change_between_forwards():
    target = tiny_target()
    drafter = make_drafter(target, ttt_steps=4)
    batch = make_batch(target, drafter)
    out4 = drafter(batch)
    drafter.config.ttt_steps = 1
    out1 = drafter(batch)
    assert out4.logits.shape[1] == 4 and out1.logits.shape[1] == 1
    torch.testing.assert_close(out1.logits[:, 0], out4.logits[:, 0])
    _, metrics = drafter.loss(out1, batch)
    assert "acc_0" in metrics and "acc_1" not in metrics
    assert metrics["sim_accept_length"] == pytest.approx(1 + metrics["acc_0"])


# ---- (b) TTT == KV-cached chain drafting through begin / propose / commit ------------------------------------------
def row_features(target, drafter, tokens: list[int]) -> dict[int, torch.Tensor]:
    """{id: [len, D]} target features of one unpadded row."""
    ids = torch.tensor([tokens])
    features = target.features(ids, torch.ones_like(ids), drafter.target_layer_ids())
    return {i: h[0] for i, h in features.hidden.items()}


def ttt_chain(drafter, target, committed: list[int], next_token: int, drafts: list[int]) -> torch.Tensor:
    """TTT logits [K, V_d] at the last committed position, reading the ground truth committed + next + drafts."""
    steps = len(drafts)
    tokens = committed + [next_token] + drafts[:-1] + [3]  # one spare token so the deepest step has a target slot
    ids = torch.tensor([tokens])
    features = target.features(ids, torch.ones_like(ids), drafter.target_layer_ids())
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
             "target_hidden": features.hidden, "target_last_hidden": features.last_hidden,
             "target_argmax": torch.full_like(ids, int(drafter.draft_ids()[0]))}
    out = drafter(batch)
    last = len(committed) - 1  # depth k reads it from target position last + 1 + k
    rows = [int((out.extras["target_position"] == last + 1 + k).nonzero()) for k in range(steps)]
    return torch.stack([out.logits[rows[k], k] for k in range(steps)])


@pytest.mark.parametrize("sample_drafts", [False, True])
def test_chain_drafting_matches_ttt(sample_drafts):
    """Left-padded prompts of different lengths, per-row accept lengths (holes), a finished row, 2 draft layers."""
    torch.manual_seed(5)
    target = tiny_target()
    steps = 4
    drafter = make_drafter(target, num_layers=2, ttt_steps=steps, sample_drafts=sample_drafts)
    committed = [[5, 17, 33, 9, 120, 41, 7], [250, 11, 64, 90, 3]]
    next_tokens = [77, 18]
    width = max(map(len, committed))
    ids = torch.zeros(2, width, dtype=torch.long)
    valid = torch.zeros(2, width, dtype=torch.bool)
    hidden = {i: torch.zeros(2, width, 64, dtype=torch.float64) for i in drafter.target_layer_ids()}
    for b, row in enumerate(committed):
        ids[b, width - len(row):], valid[b, width - len(row):] = torch.tensor(row), True
        for i, h in row_features(target, drafter, row).items():
            hidden[i][b, width - len(row):] = h
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    drafter.begin(DraftContext(ids, valid, positions, hidden, torch.tensor(next_tokens)))
    accepts = [[2, 0], [steps, 1], [1, None]]  # None: the row has finished
    for round_accepts in accepts:
        proposal = drafter.propose(steps)
        for b in range(2):
            if round_accepts[b] is None:
                continue
            drafts = proposal.tokens[b].tolist()
            logits = ttt_chain(drafter, target, committed[b], next_tokens[b], drafts)
            assert drafter.draft_ids()[logits.argmax(-1)].tolist() == drafts or sample_drafts
            if sample_drafts:
                torch.testing.assert_close(proposal.probs[b][:, drafter.draft_ids()], torch.softmax(logits, -1))
                assert torch.allclose(proposal.probs[b].sum(-1), torch.ones(steps, dtype=torch.float64))
        block = torch.cat([torch.tensor(next_tokens)[:, None], proposal.tokens], dim=1)
        accepted = torch.tensor([a if a is not None else 0 for a in round_accepts])
        active = torch.tensor([a is not None for a in round_accepts])
        block_valid = (torch.arange(steps + 1)[None] <= accepted[:, None]) & active[:, None]
        block_pos = torch.tensor([len(row) for row in committed])[:, None] + torch.arange(steps + 1)
        block_hidden = {i: torch.zeros(2, steps + 1, 64, dtype=torch.float64) for i in drafter.target_layer_ids()}
        for b in range(2):
            for i, h in row_features(target, drafter, committed[b] + block[b].tolist()).items():
                block_hidden[i][b] = h[-(steps + 1):]
        new_next = torch.randint(3, VOCAB, (2,))
        drafter.commit(accepted, DraftContext(block, block_valid, block_pos, block_hidden, new_next))
        for b in range(2):
            if active[b]:
                committed[b] = committed[b] + block[b, : int(accepted[b]) + 1].tolist()
                next_tokens[b] = int(new_next[b])
