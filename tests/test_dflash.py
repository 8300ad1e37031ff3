"""DFlash drafter: the block mask and anchor sampling against cell-by-cell predicates, the training forward and loss
against a naive per-block reference, training == KV-cached block drafting, lossless decoding through the engine (greedy
and the exact T = 1 law), persistence, input errors, and training through the real loop on the debug recipe."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
from conftest import joint_counts, make_tiny_model

from drafters import DRAFTERS, load_drafter
from drafters.base import DraftContext
from drafters.dflash import DFlashConfig, DFlashDrafter
from drafters.dflash.anchors import anchor_candidates, block_attention_mask, sample_anchors
from drafters.dflash.layers import decay_gamma, default_layer_ids
from drafters.layers import KVCache
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel

VOCAB = 256
MASK = 255  # the tiny targets have no tokenizer, so the mask row is named explicitly
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_RECIPE = os.path.join(ROOT, "recipes", "debug", "tiny_dflash.yaml")


def tiny_target(num_layers: int = 4, seed: int = 0) -> TargetModel:
    return TargetModel(make_tiny_model(num_layers=num_layers, seed=seed), name_or_path="tiny-llama")


def make_drafter(target: TargetModel, seed: int = 1, **config) -> DFlashDrafter:
    """Random weights, every parameter (norms included) moved off its init so that a skipped norm shows."""
    torch.manual_seed(seed)
    config = {"layer_ids": (1, 2, 3), "num_layers": 2, "block_size": 4, "num_anchors": 5, "mask_token_id": MASK,
              **config}
    drafter = DFlashDrafter(DFlashConfig(**config), target.target_info()).double()
    if drafter.lm_head is not None:
        counts = torch.randint(0, 50, (VOCAB,), generator=torch.Generator().manual_seed(seed + 1))
        drafter.init_from_data(counts)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return drafter


def make_batch(target: TargetModel, drafter: DFlashDrafter, seq_len: int = 14, seed: int = 3) -> dict:
    """Two rows, the second right-padded; the loss mask is off on a prompt prefix and on a few holes."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, MASK, (2, seq_len), generator=gen)
    attention_mask = torch.ones(2, seq_len, dtype=torch.long)
    attention_mask[1, seq_len - 4:] = 0
    loss_mask = (torch.rand(2, seq_len, generator=gen) < 0.85).long() * attention_mask
    loss_mask[:, :3] = 0
    features = target.features(input_ids, attention_mask, drafter.target_layer_ids())
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "hidden": features.hidden, "final_hidden": features.final_hidden,
            "target_argmax": features.argmax, "sample_index": torch.tensor([7, 3]), "epoch": 0, "seed": 0}


# ---- 1. the block mask and the anchors, cell by cell -----------------------------------------------------------------
def test_block_mask_matches_the_cell_predicate():
    gen = torch.Generator().manual_seed(0)
    batch, seq_len, num_anchors, block = 2, 9, 3, 4
    anchors = torch.randint(0, seq_len, (batch, num_anchors), generator=gen)
    anchor_valid = torch.tensor([[True, True, False], [True, False, True]])
    context_valid = torch.rand(batch, seq_len, generator=gen) < 0.8
    mask = block_attention_mask(anchors, anchor_valid, context_valid, block)
    assert mask.shape == (batch, 1, num_anchors * block, seq_len + num_anchors * block)
    for b in range(batch):
        for q in range(num_anchors * block):
            blk = q // block
            for kv in range(seq_len + num_anchors * block):
                if kv < seq_len:  # context: strictly before the anchor, real, and only for a kept block
                    expected = bool(anchor_valid[b, blk]) and kv < int(anchors[b, blk]) and bool(context_valid[b, kv])
                else:  # block slots: the query's own block, bidirectionally (padding blocks too)
                    expected = (kv - seq_len) // block == blk
                assert bool(mask[b, 0, q, kv]) == expected, (b, q, kv)
    assert bool(mask.any(-1).all())  # no query row is empty


def test_anchor_sampling_candidates_determinism_and_uniformity():
    attention_mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1], [0, 1, 1, 0, 1, 1, 1, 1, 0, 0]])
    candidates = anchor_candidates(attention_mask, loss_mask)
    for b in range(2):
        for a in range(10):
            expected = a + 1 < 10 and all(bool(attention_mask[b, p] and loss_mask[b, p]) for p in (a, a + 1))
            assert bool(candidates[b, a]) == expected, (b, a)
    assert candidates[0].nonzero().flatten().tolist() == [2, 3, 6, 7, 8]
    assert candidates[1].nonzero().flatten().tolist() == [1, 4]

    anchors, valid = sample_anchors(attention_mask, loss_mask, 3, seed=5, epoch=2, sample_index=torch.tensor([11, 4]))
    assert valid.tolist() == [[True] * 3, [True, True, False]]  # row 1 has only 2 candidates: all, then padding
    assert anchors[1, :2].tolist() == [1, 4]
    row0 = anchors[0].tolist()
    assert row0 == sorted(set(row0)) and set(row0) <= {2, 3, 6, 7, 8}
    # A pure function of (seed, epoch, sample index): the same draw in another row or batch (resume, process split)
    alone, _ = sample_anchors(attention_mask[:1], loss_mask[:1], 3, seed=5, epoch=2, sample_index=torch.tensor([11]))
    assert alone[0].tolist() == row0
    draws = {tuple(sample_anchors(attention_mask[:1], loss_mask[:1], 3, seed=5, epoch=e,
                                  sample_index=torch.tensor([11]))[0][0].tolist()) for e in range(8)}
    assert len(draws) > 1  # redrawn every epoch
    # Uniform without replacement: each of the 5 candidates is chosen with probability 3/5.
    counts = torch.zeros(10)
    for epoch in range(1000):
        drawn, _ = sample_anchors(attention_mask[:1], loss_mask[:1], 3, seed=1, epoch=epoch)
        counts[drawn[0]] += 1
    assert counts[[0, 1, 4, 5, 9]].sum() == 0
    assert ((counts[[2, 3, 6, 7, 8]] - 600).abs() < 5 * math.sqrt(1000 * 0.6 * 0.4)).all(), counts


def test_default_layer_ids_and_decay_gamma():
    assert default_layer_ids(36) == (2, 10, 18, 26, 34)  # z-lab [1, 9, 17, 25, 33] + 1 (outputs -> inputs)
    assert default_layer_ids(32) == (2, 9, 16, 23, 30)  # Llama-3.1-8B: z-lab [1, 8, 15, 22, 29]
    assert all(0 <= i < 30 for i in default_layer_ids(30))
    assert [decay_gamma(DFlashConfig(block_size=s)) for s in (16, 10, 8, 6)] == [7.0, 5.0, 4.0, 3.0]
    assert decay_gamma(DFlashConfig(block_size=16, loss_decay_gamma=2.5)) == 2.5


# ---- 2. the training forward and the loss == a naive per-block reference ---------------------------------------------
def naive_rope(x: torch.Tensor, position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [d] rotated pairwise (i, i + d/2) by position * inv_freq[i] (inv_freq[i] = theta**(-2i/d), taken from the
    drafter: it is computed in float32, and the reference must not differ by that rounding)."""
    half = x.shape[0] // 2
    out = x.clone()
    for i in range(half):
        angle = position * float(inv_freq[i])
        out[i] = x[i] * math.cos(angle) - x[i + half] * math.sin(angle)
        out[i + half] = x[i + half] * math.cos(angle) + x[i] * math.sin(angle)
    return out


def naive_key_value(drafter, layer, x, position):
    """One key/value per KV head for input x [D] at `position`: k_norm per head, then RoPE; v plain."""
    cfg = drafter.layer_config
    kv_heads, head_dim = cfg["num_key_value_heads"], cfg["head_dim"]
    k = layer.self_attn.k_proj(x).view(kv_heads, head_dim)
    v = layer.self_attn.v_proj(x).view(kv_heads, head_dim)
    inv_freq = drafter.rotary.inv_freq
    k = torch.stack([naive_rope(layer.self_attn.k_norm(k[h]), position, inv_freq) for h in range(kv_heads)])
    return k, v


def naive_block(drafter, batch, b: int, anchor: int) -> torch.Tensor:
    """Pre-norm outputs [S, D] of the block at `anchor` of row b, run alone: [x_a, MASK...] at a..a+S-1, every slot
    sees the context features of real positions j < a (through the layer's k/v projections) and all block slots."""
    cfg = drafter.layer_config
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    size = drafter.config.block_size
    embed = drafter.target_info.embed_weight.double()
    context = [drafter.hidden_norm(drafter.fc(torch.cat([batch["hidden"][i][b, j] for i in drafter.layer_ids])))
               for j in range(anchor) if batch["attention_mask"][b, j]]
    context_positions = [j for j in range(anchor) if batch["attention_mask"][b, j]]
    tokens = [int(batch["input_ids"][b, anchor])] + [drafter.mask_token_id] * (size - 1)
    h = [embed[t] for t in tokens]
    for layer in drafter.layers:
        x = [layer.input_layernorm(hi) for hi in h]
        keys = [naive_key_value(drafter, layer, c, p) for c, p in zip(context, context_positions)]
        keys += [naive_key_value(drafter, layer, x[i], anchor + i) for i in range(size)]
        new_h = []
        for i in range(size):
            q = layer.self_attn.q_proj(x[i]).view(heads, head_dim)
            outputs = []
            for head in range(heads):
                g = head // (heads // kv_heads)
                qh = naive_rope(layer.self_attn.q_norm(q[head]), anchor + i, drafter.rotary.inv_freq)
                scores = torch.stack([qh @ k[g] / math.sqrt(head_dim) for k, _ in keys])
                weights = torch.softmax(scores, dim=0)
                outputs.append(sum(w * v[g] for w, (_, v) in zip(weights, keys)))
            y = h[i] + layer.self_attn.o_proj(torch.cat(outputs))
            new_h.append(y + layer.mlp(layer.post_attention_layernorm(y)))
        h = new_h
    return torch.stack(h)


def naive_logits(drafter, hidden: torch.Tensor) -> torch.Tensor:
    normed = drafter.norm(hidden)
    if drafter.lm_head is not None:
        return drafter.lm_head(normed)
    return normed @ drafter.target_info.lm_head_weight.double().T


def naive_loss(drafter, batch, anchors, anchor_valid):
    """The weighted same-position CE, the per-depth accuracies and counts, and the logits per kept anchor."""
    size = drafter.config.block_size
    gamma = decay_gamma(drafter.config)
    ids, real, lm = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
    seq_len = ids.shape[1]
    draft_ids = drafter.draft_ids()
    total, weight = 0.0, 0.0
    correct, count, all_logits = [0] * (size - 1), [0] * (size - 1), []
    for b in range(ids.shape[0]):
        for a, keep in zip(anchors[b].tolist(), anchor_valid[b].tolist()):
            if not keep:
                continue
            logits = naive_logits(drafter, naive_block(drafter, batch, b, a)[1:])  # slots 1..S-1
            all_logits.append(logits)
            for slot in range(1, size):
                position = a + slot  # same-position label: slot k predicts x_{a+k}
                if position >= seq_len or not (real[b, position] and lm[b, position]):
                    continue
                if drafter.config.label_source == "target":  # the target's greedy token there, given the prefix
                    label = int(batch["target_argmax"][b, position - 1])
                else:
                    label = int(ids[b, position])
                if draft_ids is not None:
                    if label not in draft_ids.tolist():
                        continue
                    label = draft_ids.tolist().index(label)
                w = math.exp(-(slot - 1) / gamma)
                log_q = torch.log_softmax(logits[slot - 1], dim=0)
                if drafter.config.loss == "soft":  # the target's distribution before the label, on the draft vocab
                    head = drafter.target_info.lm_head_weight.double()
                    head = head if draft_ids is None else head[draft_ids]
                    teacher = torch.softmax(head @ batch["final_hidden"][b, position - 1].double(), dim=0)
                    total = total - w * (teacher * log_q).sum()
                else:
                    total = total - w * log_q[label]
                weight += w
                predicted = int(logits[slot - 1].argmax())
                predicted = predicted if draft_ids is None else int(draft_ids[predicted])
                correct[slot - 1] += int(predicted == int(batch["target_argmax"][b, position - 1]))
                count[slot - 1] += 1
    return total / weight, [c / max(n, 1) for c, n in zip(correct, count)], count, torch.stack(all_logits)


@pytest.mark.parametrize("draft_vocab_size,label_source,loss", [(None, "data", "hard"), (160, "data", "hard"),
                                                                  (160, "target", "hard"), (None, "data", "soft"),
                                                                  (160, "data", "soft")])
def test_training_forward_loss_and_gradients_match_naive_reference(draft_vocab_size, label_source, loss):
    target = tiny_target()
    drafter = make_drafter(target, draft_vocab_size=draft_vocab_size, label_source=label_source, loss=loss)
    batch = make_batch(target, drafter)
    anchors, anchor_valid = sample_anchors(batch["attention_mask"], batch["loss_mask"], drafter.config.num_anchors,
                                           sample_index=batch["sample_index"])
    assert bool(anchor_valid[0].all()) and not bool(anchor_valid[1].all())  # row 1 needs padding blocks
    output = drafter(batch)  # forward samples exactly these anchors
    forced = drafter.block_logits(batch, anchors, anchor_valid)
    torch.testing.assert_close(output.logits, forced.logits, rtol=0, atol=0)
    loss, metrics = drafter.loss(output, batch)
    grads = torch.autograd.grad(loss, list(drafter.parameters()))
    ref_loss, ref_acc, ref_count, ref_logits = naive_loss(drafter, batch, anchors, anchor_valid)
    ref_grads = torch.autograd.grad(ref_loss, list(drafter.parameters()))
    torch.testing.assert_close(output.logits, ref_logits, rtol=1e-9, atol=1e-9)
    kept = anchors[anchor_valid]
    assert torch.equal(output.label_position, (kept[:, None] + 1 + torch.arange(3)).clamp(max=13))
    assert output.logits.shape == (int(anchor_valid.sum()), 3, draft_vocab_size or VOCAB)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-10)
    for k in range(3):
        assert metrics[f"positions_{k}"] == ref_count[k] and metrics[f"acc_{k}"] == pytest.approx(ref_acc[k])
    assert min(ref_count) > 0
    for (name, _), grad, ref in zip(drafter.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-7, atol=1e-10, msg=name)


def test_loss_is_normalised_over_processes():
    """Two processes each holding one row, with global_mean's cross-process sum: their mean gradient equals the
    one-process gradient of the whole batch (the loss does not depend on how the data is split)."""
    target = tiny_target()
    drafter = make_drafter(target)
    batch = make_batch(target, drafter)
    full = torch.autograd.grad(drafter.loss(drafter(batch), batch)[0], list(drafter.parameters()))
    halves = [{k: (v[r:r + 1] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()} for r in (0, 1)]
    halves = [{**h, "hidden": {i: t[r:r + 1] for i, t in batch["hidden"].items()}}
              for r, h in enumerate(halves)]
    weights = []
    for half in halves:
        output = drafter(half)
        valid = output.depth_valid.double()
        weights.append((drafter.depth_weights(3, dtype=torch.float64) * valid).sum())
    total_weight = sum(weights)
    grads = []
    for half in halves:
        half = {**half, "sum_over_processes": lambda w: total_weight, "num_processes": 2}
        grads.append(torch.autograd.grad(drafter.loss(drafter(half), half)[0], list(drafter.parameters())))
    for ref, g0, g1 in zip(full, *grads):
        torch.testing.assert_close((g0 + g1) / 2, ref, rtol=1e-9, atol=1e-12)


# ---- 3. training == KV-cached block drafting through begin / propose / commit ----------------------------------------
def row_features(target, drafter, tokens: list[int]) -> dict[int, torch.Tensor]:
    ids = torch.tensor([tokens])
    return {i: h[0] for i, h in target.features(ids, torch.ones_like(ids), drafter.target_layer_ids()).hidden.items()}


def trained_block_argmax(drafter, target, committed: list[int], bonus: int) -> list[int]:
    """block_logits' draft (target ids, slots 1..S-1) for the anchor at the bonus token, on the true sequence."""
    ids = torch.tensor([committed + [bonus]])
    features = target.features(ids, torch.ones_like(ids), drafter.target_layer_ids())
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
             "hidden": features.hidden}
    out = drafter.block_logits(batch, torch.tensor([[len(committed)]]))
    return out.target_ids(out.logits[0].argmax(-1)).tolist()


@pytest.mark.parametrize("draft_vocab_size", [None, 160])
def test_block_drafting_matches_training_forward(draft_vocab_size):
    """Left-padded prompts of different lengths, per-row accept lengths, a finished row, k below and at S-1."""
    target = tiny_target()
    size = 5
    drafter = make_drafter(target, block_size=size, draft_vocab_size=draft_vocab_size)
    committed = [[5, 17, 33, 9, 120, 41, 7], [250, 11, 64, 90]]
    bonus = [77, 18]
    width = max(map(len, committed))
    ids = torch.zeros(2, width, dtype=torch.long)
    valid = torch.zeros(2, width, dtype=torch.bool)
    hidden = {i: torch.zeros(2, width, 64, dtype=torch.float64) for i in drafter.target_layer_ids()}
    for b, row in enumerate(committed):
        ids[b, width - len(row):], valid[b, width - len(row):] = torch.tensor(row), True
        for i, h in row_features(target, drafter, row).items():
            hidden[i][b, width - len(row):] = h
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    drafter.begin(DraftContext(ids, valid, positions, hidden, torch.tensor(bonus)))
    rounds = [(4, [2, 0]), (2, [2, 1]), (4, [0, 4]), (3, [3, None]), (4, [1, None])]  # (k, accepted; None: finished)
    finished_draft = None
    for k, accepts in rounds:
        proposal = drafter.propose(k)
        assert proposal.probs is None and proposal.tokens.shape == (2, k)
        for b in range(2):
            expected = trained_block_argmax(drafter, target, committed[b], bonus[b])[:k]
            if accepts[b] is not None:
                assert proposal.tokens[b].tolist() == expected, (k, accepts, b)
            elif finished_draft is not None:  # a finished row's state no longer moves
                assert proposal.tokens[b].tolist() == finished_draft[:k]
            else:
                finished_draft = trained_block_argmax(drafter, target, committed[b], bonus[b])
        block = torch.cat([torch.tensor(bonus)[:, None], proposal.tokens], dim=1)
        accepted = torch.tensor([a if a is not None else 0 for a in accepts])
        active = torch.tensor([a is not None for a in accepts])
        block_valid = (torch.arange(k + 1)[None] <= accepted[:, None]) & active[:, None]
        block_pos = torch.tensor([len(row) for row in committed])[:, None] + torch.arange(k + 1)
        block_hidden = {i: torch.zeros(2, k + 1, 64, dtype=torch.float64) for i in drafter.target_layer_ids()}
        for b in range(2):
            for i, h in row_features(target, drafter, committed[b] + block[b].tolist()).items():
                block_hidden[i][b] = h[-(k + 1):]
        new_bonus = torch.randint(3, MASK, (2,), generator=torch.Generator().manual_seed(k))
        drafter.commit(accepted, DraftContext(block, block_valid, block_pos, block_hidden, new_bonus))
        for b in range(2):
            if active[b]:
                committed[b] = committed[b] + block[b, : int(accepted[b]) + 1].tolist()
                bonus[b] = int(new_bonus[b])
    # The context caches hold exactly what projecting each row's verified tokens from scratch gives.
    for b in range(2):
        ids = torch.tensor([committed[b]])
        features = target.features(ids, torch.ones_like(ids), drafter.target_layer_ids()).hidden
        context = drafter.hidden_norm(drafter.fc(torch.cat([features[i] for i in drafter.layer_ids], dim=-1)))
        cos, sin = drafter.rotary(torch.arange(len(committed[b]))[None], torch.float64)
        for layer, cache in zip(drafter.layers, drafter._caches):
            k_ref, v_ref = layer.context_kv(context, cos, sin)
            used = cache.valid[b, : int(cache.lengths[b])]
            assert int(used.sum()) == len(committed[b])
            torch.testing.assert_close(cache.keys[b][:, : int(cache.lengths[b])][:, used], k_ref[0], rtol=1e-10,
                                       atol=1e-12)
            torch.testing.assert_close(cache.values[b][:, : int(cache.lengths[b])][:, used], v_ref[0], rtol=1e-10,
                                       atol=1e-12)
    assert all(isinstance(cache, KVCache) for cache in drafter._caches)


# ---- 4. lossless through the real engine -----------------------------------------------------------------------------
@pytest.mark.parametrize("prompts", [[[5, 6, 7, 8]], [[5, 6, 7, 8, 9, 10], [40, 41], [100, 3, 77]]])
def test_greedy_speculative_output_equals_plain_greedy(prompts):
    target = tiny_target()
    drafter = make_drafter(target, block_size=6)
    plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=24)
    for k in (1, 3, 5):
        spec = speculative_generate(target, drafter, prompts, num_draft_tokens=k, max_new_tokens=24)
        assert spec.tokens == plain.tokens, k
    with pytest.raises(ValueError, match="block_size 6"):
        speculative_generate(target, drafter, prompts, num_draft_tokens=6, max_new_tokens=4)


def test_sampling_law_at_temperature_one():
    """T = 1: the joint law of the first three emitted tokens equals the target's (chi-square over 6^3 cells)."""
    vocab, rows = 6, 4000
    model = make_tiny_model("llama", seed=0, num_layers=4)
    model.resize_token_embeddings(vocab)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.05)  # a soft distribution so that sampling matters
    model.config.eos_token_id = None
    target = TargetModel(model)
    torch.manual_seed(2)
    drafter = DFlashDrafter(DFlashConfig(layer_ids=(1, 3), num_layers=1, block_size=3, mask_token_id=5),
                            target.target_info()).double()
    prompt = [1, 4, 2]
    out = speculative_generate(target, drafter, [prompt] * rows, num_draft_tokens=2, max_new_tokens=3,
                               temperature=1.0, seed=0, eos_token_ids=[])
    assert sum(sum(a) for a in out.accept_lengths) > 0.05 * rows  # drafts were accepted, not only rejected
    counts = joint_counts(out.tokens, vocab)
    seqs = torch.tensor([[a, b] for a in range(vocab) for b in range(vocab)])
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)).logits,
                              -1)
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


# ---- 5. persistence, bad input, meta device --------------------------------------------------------------------------
def expected_names(num_layers: int, reduced: bool) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
        names |= {f"layers.{i}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                                 "k_norm")}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return names | ({"lm_head.weight", "d2t", "t2d"} if reduced else set())


@pytest.mark.parametrize("draft_vocab_size", [None, 160])
def test_native_save_load_round_trip(tmp_path, draft_vocab_size):
    target = tiny_target()
    drafter = make_drafter(target, draft_vocab_size=draft_vocab_size).float()
    assert set(drafter.state_dict()) == expected_names(2, draft_vocab_size is not None)
    batch = make_batch(target, drafter)
    drafter.save(str(tmp_path))
    header = json.loads((tmp_path / "config.json").read_text())
    assert header["draftsmith_kind"] == "dflash" and DFlashDrafter.detect_format(header) == "native"
    assert header["drafter_config"]["mask_token_id"] == MASK and header["target_layer_ids"] == [1, 2, 3]
    loaded = load_drafter(str(tmp_path), target.target_info())
    assert isinstance(loaded, DFlashDrafter) and loaded.layer_ids == (1, 2, 3) and loaded.mask_token_id == MASK
    torch.testing.assert_close(loaded(batch).logits, drafter(batch).logits, rtol=0, atol=0)
    if draft_vocab_size:
        assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    assert DFlashDrafter.detect_format({"architectures": ["LlamaForCausalLM"]}) is None


def test_mask_token_default_and_layer_config():
    target = tiny_target()
    info = dataclasses.replace(target.target_info(), unused_token_ids=(253, 254))
    drafter = DFlashDrafter(DFlashConfig(layer_ids=(0, 3), num_layers=1), info)
    assert drafter.mask_token_id == 253 and drafter.config.mask_token_id == 253
    assert drafter.max_draft_tokens() == 15 and drafter.target_layer_ids() == (0, 3)
    assert drafter.feature_request().layer_ids == (0, 3)
    cfg = drafter.layer_config
    assert cfg["model_type"] == "qwen3" and cfg["num_hidden_layers"] == 1
    shape = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    assert shape == (64, 4, 2, 16)
    theta = torch.tensor(cfg["rope_theta"], dtype=torch.float64)
    torch.testing.assert_close(drafter.rotary.inv_freq, theta ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16),
                               rtol=1e-6, atol=0)  # what naive_rope reads
    assert bool((drafter.norm.weight == 1).all())  # the final norm starts at ones (see the model docstring)
    assert not any(p is info.embed_weight or p is info.lm_head_weight for p in drafter.parameters())
    allowed = DFlashDrafter(DFlashConfig(layer_ids=(1,), mask_token_id=40, allow_text_mask_token=True), info)
    assert allowed.mask_token_id == 40


def test_bad_input_names_the_field(tmp_path):
    target = tiny_target()
    info = target.target_info()
    unused = dataclasses.replace(info, unused_token_ids=(253, 254))
    cases = [
        (DFlashConfig(layer_ids=(1,), block_size=1, mask_token_id=MASK), info, r"drafter\.block_size"),
        (DFlashConfig(layer_ids=(1, 4), mask_token_id=MASK), info, r"drafter\.layer_ids.*\[0, 3\]"),
        (DFlashConfig(layer_ids=(-1, 2), mask_token_id=MASK), info, r"drafter\.layer_ids"),
        (DFlashConfig(layer_ids=(1,)), info, r"drafter\.mask_token_id"),
        (DFlashConfig(layer_ids=(1,), mask_token_id=40), unused, r"drafter\.mask_token_id 40.*253, 254"),
        (DFlashConfig(layer_ids=(1,), mask_token_id=VOCAB), info, r"drafter\.mask_token_id"),
        (DFlashConfig(layer_ids=(1,), mask_token_id=MASK, draft_vocab_size=VOCAB + 1), info,
         r"drafter\.draft_vocab_size"),
        (DFlashConfig(layer_ids=(1,), mask_token_id=MASK, num_key_value_heads=3), info,
         r"drafter\.num_key_value_heads"),
        (DFlashConfig(layer_ids=(1,), mask_token_id=MASK, loss_decay_gamma=0.0), info, r"drafter\.loss_decay_gamma"),
    ]
    for config, target_info, message in cases:
        with pytest.raises(ValueError, match=message):
            DFlashDrafter(config, target_info)
    # auto on a target too small for 5 distinct ids: its own ids 1..N-1, spread
    assert DFlashDrafter(DFlashConfig(mask_token_id=MASK), info).layer_ids == (1, 2, 3)
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="before begin"):
        drafter.propose(2)
    (tmp_path / "keep.txt").write_text("kept")
    with pytest.raises(ValueError, match="cannot export format 'gguf'.*native"):
        drafter.save(str(tmp_path), "gguf")
    assert os.listdir(tmp_path) == ["keep.txt"]  # nothing written, nothing lost


def test_builds_on_the_meta_device():
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    with torch.device("meta"):
        embed = torch.empty(151936, 4096)
        info = dataclasses.replace(tiny_target().target_info(), hidden_size=4096, vocab_size=151936, num_layers=36,
                                   embed_weight=embed, lm_head_weight=embed, final_norm_weight=torch.empty(4096),
                                   config=config.to_dict(), weights={})
        drafter = DFlashDrafter(DFlashConfig(mask_token_id=151669), info)
    assert drafter.layer_ids == (2, 10, 18, 26, 34) and drafter.fc.weight.is_meta
    assert drafter.fc.weight.shape == (4096, 5 * 4096) and len(drafter.layers) == 5
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (4096, 4096)
    assert drafter.layers[0].self_attn.k_proj.weight.shape == (1024, 4096)
    assert drafter.layers[0].self_attn.k_norm.weight.shape == (128,)
    assert drafter.layers[0].mlp.gate_proj.weight.shape == (12288, 4096)


# ---- 6. training: one batch overfits; the debug recipe through the real loop -----------------------------------------
def test_overfitting_one_batch_raises_accuracy():
    target = tiny_target()
    drafter = make_drafter(target, num_layers=1, num_anchors=8)
    batch = make_batch(target, drafter, seq_len=20)
    batch["target_argmax"] = batch["input_ids"].roll(-1, dims=1)  # accuracy against the labels themselves
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    first = None
    for _ in range(40):
        loss, metrics = drafter.loss(drafter(batch), batch)
        first = first or metrics
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert metrics["loss_0"] < first["loss_0"] - 1.0 and metrics["acc_0"] > first["acc_0"] + 0.5
    info = target.target_info()
    assert info.embed_weight.grad is None and info.lm_head_weight.grad is None


def test_debug_recipe_trains_through_the_loop_and_stays_lossless(tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    from inference.assets.debug_target import resolve_debug_target
    from train.build import build_trainer
    from train.config import load_recipe

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
                 f"output.dir={tmp_path / 'run'}", "train.batch_size=2", "train.epochs=null", "train.max_steps=4",
                 "train.log_every=2", "train.save_every=null", "train.eval_every=null", "train.keep_last=null",
                 "eval.num_prompts=1", "eval.max_new_tokens=8", "eval.num_batches=1", "schedule.warmup_steps=1"]
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    trainer = build_trainer(load_recipe(DEBUG_RECIPE, overrides))
    assert trainer.model.mask_token_id == 259  # the debug tokenizer's reserved <|mask|> row, found by default
    final_dir = trainer.fit()
    trainer.accelerator.end_training()
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert any(math.isfinite(line.get("train/loss", math.nan)) for line in lines)
    drafter = load_drafter(final_dir, trainer.target.target_info())
    assert type(drafter) is DRAFTERS["dflash"] and drafter.config.block_size == trainer.model.config.block_size
    prompts = [[40, 41, 42, 43], [50, 51]]
    plain = speculative_generate(trainer.target, None, prompts, num_draft_tokens=0, max_new_tokens=16)
    spec = speculative_generate(trainer.target, drafter, prompts, num_draft_tokens=drafter.max_draft_tokens(),
                                max_new_tokens=16)
    assert spec.tokens == plain.tokens
