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
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel

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
        "hidden": features.hidden, "final_hidden": features.final_hidden,
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
                    torch.cat([batch["hidden"][i][b, t] for i in drafter.layer_ids]))
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
            if drafter.config.loss == "hard":  # the target's argmax on the draft vocab, one-hot
                teacher = torch.nn.functional.one_hot(teacher.argmax(), len(draft_ids)).to(teacher.dtype)
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


@pytest.mark.parametrize("num_layers,norm_before_residual,loss", [(1, False, "soft"), (2, True, "soft"),
                                                                   (1, False, "hard")])
def test_ttt_loss_and_gradients_match_naive_reference(num_layers, norm_before_residual, loss):
    target = tiny_target()
    drafter = make_drafter(target, num_layers=num_layers, norm_before_residual=norm_before_residual, loss=loss)
    batch = make_batch(target, drafter)
    loss, metrics = drafter.loss(drafter(batch), batch)
    grads = torch.autograd.grad(loss, list(drafter.parameters()))
    ref_loss, ref_acc, ref_count = naive_loss(drafter, batch, drafter.config.ttt_steps)
    ref_grads = torch.autograd.grad(ref_loss, list(drafter.parameters()))
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-9)
    assert min(ref_count) > 0 and ref_count[0] > ref_count[-1]
    for k in range(drafter.config.ttt_steps):
        assert metrics[f"acc_{k}"] == pytest.approx(ref_acc[k]) and metrics[f"positions_{k}"] == ref_count[k]
    # Gradients equal too, so the fed-back hidden state carries gradient across steps as in the reference. A one-hot
    # teacher's gradient (q - onehot) does not cancel as a soft one's does: the float64 rounding of the batched and
    # the naive forwards (summed in other orders) reaches ~3e-10 there, so its atol is 1e-9.
    atol = 1e-10 if loss == "soft" else 1e-9
    for (name, _), grad, ref in zip(drafter.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-7, atol=atol, msg=name)


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
             "hidden": features.hidden, "final_hidden": features.final_hidden,
             "target_argmax": torch.full_like(ids, int(drafter.draft_ids()[0]))}
    out = drafter(batch)
    last = len(committed) - 1  # depth k reads it from target position last + 1 + k
    rows = [int((out.label_position[:, 0] == last + 2 + k).nonzero()) for k in range(steps)]
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
                torch.testing.assert_close(proposal.probs[b][:, drafter.draft_ids()], torch.softmax(logits, -1).float())
                torch.testing.assert_close(proposal.probs[b].sum(-1), torch.ones(steps))
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


# ---- (c) draft vocab mapping -------------------------------------------------------------------------------------
def test_draft_vocab_from_counts_and_round_trip():
    counts = torch.tensor([5, 0, 9, 5, 1, 9, 0, 2])
    vocab = DraftVocab.from_counts(counts, 4)
    assert vocab.draft_ids.tolist() == [0, 2, 3, 5]  # 9, 9, then the tie 5/5 both fit
    assert DraftVocab.from_counts(counts, 3).draft_ids.tolist() == [0, 2, 5]  # tie 5/5 goes to the smaller id
    assert DraftVocab.from_counts(torch.zeros(8), 3).draft_ids.tolist() == [0, 1, 2]
    assert vocab.d2t.dtype == torch.int64 and vocab.d2t.tolist() == [0, 1, 1, 2]
    assert vocab.t2d.tolist() == [True, False, True, True, False, True, False, False]
    draft = torch.arange(4)
    assert torch.equal(vocab.to_draft(vocab.draft_ids[draft]), draft)
    assert torch.equal(vocab.draft_ids[draft], draft + vocab.d2t)  # target id = draft id + d2t[draft id]
    assert vocab.to_draft(torch.tensor([[1, 5], [7, 0]])).tolist() == [[-1, 3], [-1, 0]]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DraftVocab.from_counts(counts, 9)
    with pytest.raises(ValueError, match="increasing"):
        DraftVocab(torch.tensor([3, 1]), 8)


def test_init_from_data_installs_vocab_and_proposals_are_target_ids():
    target = tiny_target()
    counts = torch.zeros(VOCAB)
    counts[200:] = 1.0  # the top 56 are ids 200..255; ties among the rest go to the smallest ids
    drafter = Eagle3Drafter(Eagle3Config(draft_vocab_size=64, ttt_steps=2), target.target_info())
    drafter.init_from_data(counts)
    assert drafter.draft_ids().tolist() == list(range(8)) + list(range(200, 256))
    assert int(drafter.t2d.sum()) == 64 and drafter.d2t.dtype == torch.int64
    assert torch.equal(drafter.draft_ids(), DraftVocab.from_counts(counts, 64).draft_ids)
    out = speculative_generate(target, drafter, [[5, 6, 7]], num_draft_tokens=3, max_new_tokens=6)
    assert out.accept_lengths[0]  # proposals ran; every proposed token was a draft-vocab target id
    prompt = torch.tensor([[5, 6, 7]])
    features = target.features(prompt, torch.ones_like(prompt), drafter.target_layer_ids())
    drafter.begin(DraftContext(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.arange(3)[None],
                               features.hidden, torch.tensor([9])))
    assert bool(drafter.t2d[drafter.propose(4).tokens].all())


# ---- (d) export -> load ------------------------------------------------------------------------------------------
def trained_looking_drafter(target, **config) -> Eagle3Drafter:
    drafter = make_drafter(target, **{"num_layers": 2, **config})
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return drafter.float()  # the dtype a loaded drafter has, so logits compare exactly


@pytest.mark.parametrize("fmt", ["native", "speculators", "eagle3", "sglang"])
def test_export_load_round_trip(tmp_path, fmt):
    target = tiny_target()
    drafter = trained_looking_drafter(target, **({"num_layers": 1, "layer_ids": (1, 2, 3)} if fmt == "sglang" else {}))
    batch = make_batch(target, drafter)
    drafter.save(str(tmp_path), fmt)
    loaded = load_drafter(str(tmp_path), target.target_info())  # the registry routes by detect_format
    assert isinstance(loaded, Eagle3Drafter) and loaded.layer_ids == drafter.layer_ids
    torch.testing.assert_close(loaded(batch).logits, drafter(batch).logits, rtol=0, atol=0)
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    with open(tmp_path / "config.json") as f:
        assert detect_format(json.load(f)) == fmt


def test_speculators_export_layout(tmp_path):
    from safetensors import safe_open

    target = tiny_target()
    target.model.config.architectures = ["LlamaForCausalLM"]  # as a from_pretrained model has it
    drafter = trained_looking_drafter(target)
    drafter.save(str(tmp_path), "speculators")
    config = json.loads((tmp_path / "config.json").read_text())
    assert "model_type" not in config
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["norm_before_residual"] is False and config["draft_vocab_size"] == 160
    # The default (2, N//2, N-3) = (2, 2, 1) for N=4, sorted and de-duplicated as vLLM captures it.
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2] and config["target_hidden_size"] == 64
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 2
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == drafter.config.ttt_steps
    assert spec["verifier"] == {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]}
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 2 and layer["vocab_size"] == VOCAB
    hf = LlamaConfig(**layer)  # what an engine builds from it
    assert (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (64, 4, 2, 16)
    assert hf.rope_parameters["rope_theta"] == target.model.config.rope_parameters["rope_theta"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
        assert f.get_tensor("lm_head.weight").shape == (160, 64) and f.get_tensor("fc.weight").shape == (64, 128)
        assert f.get_tensor("layers.0.self_attn.q_proj.weight").shape == (64, 128)
        assert f.get_tensor("layers.1.self_attn.q_proj.weight").shape == (64, 64)
        torch.testing.assert_close(f.get_tensor("embed_tokens.weight"), target.target_info().embed_weight)
    expected = {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    for i in (0, 1):
        expected |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        expected |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    expected |= {"layers.0.hidden_norm.weight"}
    assert names == expected


def test_eagle3_export_layout_and_foreign_names(tmp_path):
    from safetensors.torch import load_file, save_file

    target = tiny_target()
    drafter = trained_looking_drafter(target)
    drafter.save(str(tmp_path), "eagle3")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2] and config["draft_vocab_size"] == 160
    assert config["norm_before_residual"] is False and config["num_hidden_layers"] == 2
    native = tmp_path / "native"
    drafter.save(str(native), "native")
    assert "embed_tokens.weight" not in load_file(str(native / "model.safetensors"))  # native stays small
    # A SafeAILab / SpecForge style file: "midlayer." names, a "model." prefix on some weights, no t2d.
    tensors = load_file(str(tmp_path / "model.safetensors"))
    renamed = {("model." if k.startswith("norm") else "") + k.replace("layers.0.", "midlayer."): v
               for k, v in tensors.items() if k != "t2d"}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    loaded = Eagle3Drafter.load(str(tmp_path), target.target_info())
    batch = make_batch(target, drafter)
    torch.testing.assert_close(loaded(batch).logits, drafter(batch).logits, rtol=0, atol=0)
    assert torch.equal(loaded.t2d, drafter.t2d)


# ---- (e) bad input ---------------------------------------------------------------------------------------------
def test_bad_configs_name_the_field():
    info = tiny_target().target_info()
    with pytest.raises(ValueError, match=r"drafter\.layer_ids"):
        Eagle3Drafter(Eagle3Config(layer_ids=(1, 5), draft_vocab_size=64), info)
    with pytest.raises(ValueError, match=r"drafter\.layer_ids.*default"):
        Eagle3Drafter(Eagle3Config(draft_vocab_size=64), tiny_target(num_layers=2).target_info())
    with pytest.raises(ValueError, match=r"drafter\.draft_vocab_size"):
        Eagle3Drafter(Eagle3Config(draft_vocab_size=VOCAB + 1), info)
    with pytest.raises(ValueError, match=r"drafter\.init_layer_from_target"):
        Eagle3Drafter(Eagle3Config(draft_vocab_size=64, init_layer_from_target=4), info)
    with pytest.raises(ValueError, match=r"drafter\.layer_ids.*more than once"):
        Eagle3Drafter(Eagle3Config(layer_ids=(1, 3, 1), draft_vocab_size=64), info)
    assert Eagle3Drafter(Eagle3Config(layer_ids=(3, 1, 2), draft_vocab_size=64), info).layer_ids == (1, 2, 3)
    with pytest.raises(ValueError, match=r"drafter\.num_key_value_heads"):
        Eagle3Drafter(Eagle3Config(draft_vocab_size=64, num_key_value_heads=3), info)
    drafter = Eagle3Drafter(Eagle3Config(draft_vocab_size=64), info)
    with pytest.raises(ValueError, match="unknown EAGLE-3 export format|cannot export"):
        drafter.save("/nonexistent", "gguf")
    with pytest.raises(ValueError, match="before begin"):
        drafter.propose(2)


@pytest.mark.parametrize("fmt", ["native", "speculators", "eagle3"])
@pytest.mark.parametrize("other,field", [({"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2,
                                           "head_dim": 16}, "hidden_size"), ({"vocab_size": 300}, "vocab_size")])
def test_checkpoint_from_another_target_is_rejected(tmp_path, fmt, other, field):
    drafter = make_drafter(tiny_target())
    drafter.save(str(tmp_path), fmt)
    with pytest.raises(ValueError, match=field):
        Eagle3Drafter.load(str(tmp_path), tiny_target(**other).target_info())


# ---- (f) warm starts ---------------------------------------------------------------------------------------------
def test_warm_starts_copy_target_weights():
    target = tiny_target()
    info = target.target_info()
    config = Eagle3Config(draft_vocab_size=64, init_layer_from_target=3, fc_init="identity_high", layer_ids=(1, 3, 2))
    drafter = Eagle3Drafter(config, info)
    drafter.init_from_data(torch.arange(VOCAB, dtype=torch.float))  # the top 64 = ids 192..255
    torch.testing.assert_close(drafter.lm_head.weight, info.lm_head_weight[192:].float())
    torch.testing.assert_close(drafter.norm.weight, info.final_norm_weight.float())
    layer, weights = drafter.layers[0], info.weights
    q_proj = weights["model.layers.3.self_attn.q_proj.weight"].float()
    torch.testing.assert_close(layer.self_attn.q_proj.weight[:, 64:], q_proj)
    assert layer.self_attn.q_proj.weight[:, :64].abs().sum() > 0  # the embedding half keeps its random init
    torch.testing.assert_close(layer.mlp.down_proj.weight, weights["model.layers.3.mlp.down_proj.weight"].float())
    torch.testing.assert_close(layer.hidden_norm.weight, weights["model.layers.3.input_layernorm.weight"].float())
    features = {i: torch.randn(1, 5, 64) for i in drafter.layer_ids}
    fused = drafter.fc(torch.cat([features[i] for i in drafter.layer_ids], dim=-1))
    torch.testing.assert_close(fused, features[3])  # identity_high picks the highest tapped layer


# ---- lossless through the real engine, and training moves the metrics ---------------------------------------------
@pytest.mark.parametrize("batch_prompts", [[[5, 6, 7, 8]], [[5, 6, 7, 8, 9, 10], [40, 41], [100, 3, 77]]])
def test_greedy_speculative_output_equals_plain_greedy(batch_prompts):
    target = tiny_target()
    drafter = make_drafter(target, num_layers=2)
    plain = speculative_generate(target, None, batch_prompts, num_draft_tokens=0, max_new_tokens=24)
    spec = speculative_generate(target, drafter, batch_prompts, num_draft_tokens=4, max_new_tokens=24)
    assert spec.tokens == plain.tokens


def test_sampling_run_uses_draft_probs():
    target = tiny_target()
    drafter = make_drafter(target, sample_drafts=True)
    out = speculative_generate(target, drafter, [[5, 6, 7], [9, 10]], num_draft_tokens=3, max_new_tokens=12,
                               temperature=1.0, seed=3)
    assert all(len(tokens) == 12 or tokens[-1] in target.target_info().eos_token_ids for tokens in out.tokens)


def test_overfitting_one_batch_raises_accuracy():
    target = tiny_target()
    drafter = make_drafter(target, ttt_steps=2)
    batch = make_batch(target, drafter, seq_len=24)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss, metrics = drafter.loss(drafter(batch), batch)
        first = first or metrics
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # The soft CE cannot fall below the teacher's entropy (about 4.3 here); top-1 agreement can reach 1.
    assert metrics["loss_0"] < first["loss_0"] - 0.5 and first["acc_0"] < 0.2
    assert metrics["acc_0"] > 0.6 and metrics["acc_1"] > 0.6
    assert all(p.grad is None for p in [target.target_info().embed_weight, target.target_info().lm_head_weight])


def test_registry_and_detect_format():
    assert DRAFTERS["eagle3"] is Eagle3Drafter
    assert detect_format({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}) is None
    assert detect_format({"architectures": ["Eagle3LlamaForCausalLM"]}) == "eagle3"
    # save / load are drafters/base.py's; what is EAGLE-3's own (its native header, its layouts) lives in its package
    assert Eagle3Drafter.read_native.__code__.co_filename.endswith(os.path.join("eagle3", "model.py"))
    assert Eagle3Drafter.export_module.__name__ == "drafters.eagle3.export"


def test_soft_cross_entropy_value_and_gradient():
    from drafters.losses import simulated_accept_length, soft_cross_entropy

    logits = torch.randn(5, 3, 11, dtype=torch.float64, requires_grad=True)
    teacher = torch.softmax(torch.randn(5, 11, dtype=torch.float64), dim=-1)
    reference = -(teacher[:, None] * torch.log_softmax(logits, dim=-1)).sum(-1)
    torch.testing.assert_close(soft_cross_entropy(logits, teacher), reference)
    torch.testing.assert_close(soft_cross_entropy(logits[:, 1], teacher), reference[:, 1])
    assert torch.autograd.gradcheck(lambda z: soft_cross_entropy(z, teacher), (logits,))
    assert torch.autograd.gradcheck(lambda z: soft_cross_entropy(z, 0.5 * teacher[:, None]), (logits,))
    assert simulated_accept_length([0.5, 0.5, 0.0]) == pytest.approx(1.75)


def test_builds_on_meta_device():
    info = tiny_target().target_info()
    with torch.device("meta"):
        drafter = Eagle3Drafter(Eagle3Config(draft_vocab_size=64, init_layer_from_target=1), info)
    assert drafter.lm_head.weight.is_meta and drafter.lm_head.weight.shape == (64, 64)
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (64, 128)
