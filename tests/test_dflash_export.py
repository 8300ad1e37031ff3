"""DFlash export layouts (drafters/dflash/export.py) and parity with DFlash implementations we did not write.

(a) export -> our reader -> identical logits, for the z-lab ("dflash") and speculators layouts, full and reduced vocab;
(b) readers re-implemented here from each client's documented conventions (z-lab: target_layer_ids t reads HF
    hidden_states[t + 1]; speculators / vLLM: aux id k reads hidden_states[k], d2t offsets scattered into the full
    vocabulary) load only the exported files and must reproduce our logits, so a layer-id slip fails without any
    peer installed; the refusals name the field;
(c) peers (marker `peer`): the `dflash` package (z-lab, PyPI) and transformers' own DFlash support
    (DFlashTokenCandidateGenerator + MuseGlimmerAssistantModel) load the z-lab export, speculators' DFlashDraftModel
    the speculators export; each must give our draft logits to 1e-4 in fp32, and the two that run speculative
    decoding must equal our engine greedily, round by round (same output, same drafts; the dflash package also
    reports the same acceptance). Each skips with the reason when the client is absent (pinned transformers 5.24
    has its DFlash support, so those run everywhere; dflash / speculators run in a throwaway venv, see
    benchmarks/peers/dflash_clients.py).

benchmarks/peers/dflash_clients.py runs the same comparisons and prints the table of docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import edit_config, make_tiny_model
from safetensors.torch import load_file, save_file

from drafters.dflash import DFlashConfig, DFlashDrafter
from drafters.dflash import export as dflash_export
from drafters.dflash.layers import default_layer_ids
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel

NUM_TARGET_LAYERS = 4
LAYER_IDS = (1, 3)  # ours (vLLM): HF hidden_states[1], [3]; z-lab writes (0, 2)
BLOCK_SIZE = 4
MASK_TOKEN_ID = 255
DRAFT_VOCAB = 100
ANCHORS = (2, 6, 9)
DFLASH_REASON = "dflash package not installed: pip install --no-deps dflash==0.1.0"
TRANSFORMERS_REASON = ("this transformers has no DFlash support (DFlashTokenCandidateGenerator / "
                       "MuseGlimmerAssistantModel)")


# ---- shared set-up (also used by benchmarks/peers/dflash_clients.py) ---------------------------------------------------
def make_target(dtype=torch.float64, seed: int = 0) -> TargetModel:
    return TargetModel(make_tiny_model("qwen3", seed=seed, num_layers=NUM_TARGET_LAYERS, dtype=dtype),
                       name_or_path="tiny-qwen3")


def make_drafter(target: TargetModel, draft_vocab_size: int | None = None, seed: int = 1, layer_ids=LAYER_IDS,
                 block_size: int = BLOCK_SIZE, num_layers: int = 2,
                 mask_token_id: int = MASK_TOKEN_ID) -> DFlashDrafter:
    """Random weights (norms perturbed too, so a swapped norm would show); a reduced vocab from random counts."""
    torch.manual_seed(seed)
    config = DFlashConfig(layer_ids=tuple(layer_ids), num_layers=num_layers, block_size=block_size,
                          mask_token_id=mask_token_id, draft_vocab_size=draft_vocab_size)
    drafter = DFlashDrafter(config, target.target_info())
    if draft_vocab_size is not None:
        drafter.init_from_data(torch.randint(0, 50, (target.target_info().vocab_size,),
                                             generator=torch.Generator().manual_seed(seed + 1)))
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.mul_(1 + 0.2 * torch.rand_like(param))
    # Built in fp32 and then cast: the weights stay exactly representable in the fp32 drafter `load` builds.
    return drafter.to(target.target_info().embed_weight.dtype).eval()


def train_briefly(target: TargetModel, drafter: DFlashDrafter, prompts, steps: int = 15,
                  new_tokens: int = 40) -> DFlashDrafter:
    """A few Adam steps (fp32) on the target's greedy continuations of `prompts`, so that speculative decoding on
    them accepts 0 to S-1 drafts per round (multi-token commits exercised), then cast back to the target's dtype."""
    with torch.no_grad():
        sequences = torch.cat([target.model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                                                     eos_token_id=None) for p in prompts])
    mask = torch.ones_like(sequences)
    features = target.features(sequences, mask, drafter.target_layer_ids())
    batch = {"input_ids": sequences, "attention_mask": mask, "loss_mask": mask, "target_argmax": features.argmax,
             "hidden": {i: h.float() for i, h in features.hidden.items()}}
    drafter = drafter.float().train()
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for step in range(steps):
        loss, _ = drafter.loss(drafter({**batch, "epoch": step}), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.to(target.target_info().embed_weight.dtype).eval()


def make_batch(target: TargetModel, drafter: DFlashDrafter, seq_len: int = 14, seed: int = 3) -> dict:
    input_ids = torch.randint(3, drafter.mask_token_id, (1, seq_len), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(input_ids)
    features = target.features(input_ids, mask, drafter.target_layer_ids())
    return {"input_ids": input_ids, "attention_mask": mask, "loss_mask": mask, "hidden": features.hidden}


def our_logits(drafter: DFlashDrafter, batch: dict, anchors=ANCHORS) -> torch.Tensor:
    """[A, S-1, V] draft logits in target ids (-inf outside a reduced draft vocabulary)."""
    with torch.no_grad():
        out = drafter.block_logits(batch, torch.tensor([list(anchors)]))
    return _full_vocab(out.logits, out.draft_ids, drafter.target_info.vocab_size)


def _full_vocab(logits: torch.Tensor, draft_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    if draft_ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., draft_ids] = logits
    return full


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over entries finite in both; the -inf pattern (draft vocabulary) must agree."""
    assert a.shape == b.shape and torch.equal(torch.isinf(a), torch.isinf(b))
    finite = torch.isfinite(a)
    return float((a[finite].double() - b[finite].double()).abs().max())


def hf_hidden_states(target: TargetModel, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """HF output_hidden_states: index 0 = embedding output, i = output of decoder layer i - 1, last = after norm."""
    with torch.no_grad():
        return target.model(input_ids=input_ids, output_hidden_states=True).hidden_states


# ---- (b) readers re-implemented from each client's conventions ---------------------------------------------------
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [n, heads, d] rotated pairwise (i, i + d/2) by position * theta**(-2i/d) (HF / vLLM neox layout)."""
    half = x.shape[-1] // 2
    angles = positions[:, None].double() * theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def reference_block_logits(directory: str, convention: str, target: TargetModel, input_ids: torch.Tensor,
                           anchors=ANCHORS) -> torch.Tensor:
    """What a client reading `directory` with `convention` ("zlab" or "speculators") drafts for the block at each
    anchor, from the files only: [A, S-1, V] logits in target ids. Context = tokens strictly before the anchor."""
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    weights = load_file(os.path.join(directory, "model.safetensors"))
    hidden_states = hf_hidden_states(target, input_ids)
    if convention == "zlab":  # dflash.model.extract_context_feature: hidden_states[layer_id + 1]
        layer, nested = config, config["dflash_config"]
        indices = [t + 1 for t in nested["target_layer_ids"]]
        mask_token, block_size = nested["mask_token_id"], config["block_size"]
    else:  # speculators / vLLM: aux id k is captured entering decoder layer k = HF hidden_states[k]
        layer = config["transformer_layer_config"]
        indices = list(config["aux_hidden_state_layer_ids"])
        mask_token, block_size = config["mask_token_id"], config["block_size"]
    eps, theta = layer["rms_norm_eps"], layer["rope_parameters"]["rope_theta"]
    heads, kv_heads, head_dim = layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]
    info = target.target_info()
    w = {name: t.to(info.embed_weight.dtype) for name, t in weights.items()}
    features = torch.cat([hidden_states[i][0] for i in indices], dim=-1)  # [T, m*D]
    context_all = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    rows = []
    for anchor in anchors:
        context = context_all[:anchor]
        tokens = torch.tensor([int(input_ids[0, anchor])] + [mask_token] * (block_size - 1))
        h = info.embed_weight[tokens]
        positions = torch.arange(anchor + block_size)
        for i in range(layer["num_hidden_layers"]):
            p = f"layers.{i}."
            x = _rms(h, w[p + "input_layernorm.weight"], eps)
            kv_in = torch.cat([context, x])
            q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).view(block_size, heads, head_dim),
                     w[p + "self_attn.q_norm.weight"], eps)
            k = _rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, head_dim),
                     w[p + "self_attn.k_norm.weight"], eps)
            v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, head_dim)
            q, k = _rope(q, positions[anchor:], theta), _rope(k, positions, theta)
            k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
            # No mask: every context key lies before the anchor, and the block attends both ways.
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
            attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(block_size, heads * head_dim)
            h = h + attended @ w[p + "self_attn.o_proj.weight"].T
            x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
            h = h + (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[
                p + "mlp.down_proj.weight"].T
        h = _rms(h, w["norm.weight"], eps)[1:]  # slot 0 (the anchor) is not a draft
        if "lm_head.weight" in w:  # vLLM: draft logits scattered to arange + d2t in a -inf full-vocab tensor
            d2t = weights["d2t"] if "d2t" in weights else torch.zeros(w["lm_head.weight"].shape[0], dtype=torch.long)
            rows.append(_full_vocab(h @ w["lm_head.weight"].T, torch.arange(d2t.numel()) + d2t, info.vocab_size))
        else:
            rows.append(h @ info.lm_head_weight.T)
    return torch.stack(rows)


# ---- (c) peer adapters ------------------------------------------------------------------------------------------
def block_inputs(target: TargetModel, input_ids: torch.Tensor, indices, anchor: int, mask_token: int,
                 block_size: int):
    """(context features [1, anchor, m*D] from HF hidden_states[indices], block embeddings [1, S, D], position ids
    [1, anchor + S]): what a DFlash client feeds its model for the block at `anchor`."""
    hidden_states = hf_hidden_states(target, input_ids)
    context = torch.cat([hidden_states[i][:, :anchor] for i in indices], dim=-1)
    tokens = torch.tensor([[int(input_ids[0, anchor])] + [mask_token] * (block_size - 1)])
    return context, target.model.get_input_embeddings()(tokens), torch.arange(anchor + block_size)[None]


def load_dflash_package_model(directory: str, dtype):
    from dflash.model import DFlashDraftModel

    return DFlashDraftModel.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa").eval()


def dflash_package_logits(directory: str, target: TargetModel, input_ids: torch.Tensor, anchors=ANCHORS):
    """The dflash package's DFlashDraftModel on the export: [A, S-1, V] logits through the target's lm_head."""
    model = load_dflash_package_model(directory, target.model.dtype)
    indices = [t + 1 for t in model.target_layer_ids]  # the package's own convention (extract_context_feature)
    rows = []
    with torch.no_grad():
        for anchor in anchors:
            context, noise, positions = block_inputs(target, input_ids, indices, anchor, model.mask_token_id,
                                                     model.block_size)
            hidden = model(position_ids=positions, noise_embedding=noise, target_hidden=context)
            rows.append(model.compute_logits(hidden[0, 1:], target.model.lm_head))
    return torch.stack(rows)


def transformers_has_dflash() -> bool:
    import transformers
    from transformers import generation

    return hasattr(generation, "DFlashTokenCandidateGenerator") and hasattr(transformers, "MuseGlimmerAssistantModel")


def load_transformers_assistant(directory: str, target: TargetModel):
    """transformers' DFlash assistant (MuseGlimmerAssistantModel) built from the z-lab export. Same tensors, two names
    differ (vLLM's qwen3_dflash.py maps them the same way): encoder.fc = fc, encoder.output_norm_enc = hidden_norm.
    Ids stay in the z-lab convention: DFlashTokenCandidateGenerator reads hidden_states[t + 1]."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    nested = config["dflash_config"]
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "layer_types", "hidden_act")
    target_config = target.model.config
    assistant_config = MuseGlimmerAssistantConfig(
        **{key: config[key] for key in keys}, block_size=config["block_size"], mask_token_id=nested["mask_token_id"],
        target_layer_ids=list(nested["target_layer_ids"]), bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id, pad_token_id=target_config.pad_token_id)
    renames = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    state = {renames.get(name, name): t for name, t in load_file(os.path.join(directory, "model.safetensors")).items()}
    model = MuseGlimmerAssistantModel(assistant_config).to(target.model.dtype).eval()
    model.load_state_dict(state, strict=True)
    return model


def transformers_logits(directory: str, target: TargetModel, input_ids: torch.Tensor, anchors=ANCHORS):
    model = load_transformers_assistant(directory, target)
    config = model.config
    indices = [t + 1 for t in config.target_layer_ids]  # as DFlashTokenCandidateGenerator asks the target
    rows = []
    with torch.no_grad():
        for anchor in anchors:
            context, noise, positions = block_inputs(target, input_ids, indices, anchor, config.mask_token_id,
                                                     config.block_size)
            hidden = model(noise_embeds=noise, context_hidden_states=context, position_ids=positions).last_hidden_state
            rows.append(target.model.lm_head(hidden[0, 1:]))
    return torch.stack(rows)


def speculators_logits(directory: str, target: TargetModel, input_ids: torch.Tensor):
    """speculators' DFlashDraftModel (its training backbone, the only forward it has) on the speculators export, with
    every position that has a full block after it as an anchor: (anchors, [A, S-1, V] logits in target ids). It
    loads the verifier's embedding / lm_head from speculators_config.verifier.name_or_path (a local directory)."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs torch.compile
    model = DFlashDraftModel.from_pretrained(directory, config=config).to(target.model.dtype).eval()
    hidden_states = hf_hidden_states(target, input_ids)
    features = torch.cat([hidden_states[i] for i in model.target_layer_ids], dim=-1)  # vLLM ids: hidden_states[k]
    seq_len, block_size = input_ids.shape[1], model.block_size
    ones = torch.ones_like(input_ids)
    with torch.no_grad():
        _, logits, _, _, slots = model._backbone_forward(features, input_ids, ones, hidden_states[-1],
                                                         torch.zeros_like(input_ids), max_anchors=seq_len)
    num_anchors = seq_len - block_size  # the positions select_anchors allows; the rest are padding blocks
    anchors = slots.view(-1, block_size)[:num_anchors, 0].tolist()
    logits = logits.view(-1, block_size, logits.shape[-1])[:num_anchors, 1:]
    draft_ids = None if model.d2t is None else torch.arange(model.d2t.numel()) + model.d2t
    return anchors, _full_vocab(logits, draft_ids, target.target_info().vocab_size)


def engine_rounds(target: TargetModel, drafter: DFlashDrafter, prompt: list[int], max_new_tokens: int):
    """Our engine, greedy, no EOS: (new tokens, drafts per round, accepted per round)."""
    drafts = []
    propose = drafter.propose

    def recording(num_tokens):
        proposal = propose(num_tokens)
        drafts.append(proposal.tokens[0].tolist())
        return proposal

    drafter.propose = recording
    try:
        out = speculative_generate(target, drafter, [prompt], num_draft_tokens=drafter.max_draft_tokens(),
                                   max_new_tokens=max_new_tokens, eos_token_ids=[])
    finally:
        del drafter.propose
    return out.tokens[0], drafts, out.accept_lengths[0]


def dflash_package_rounds(directory: str, target: TargetModel, prompt: list[int], max_new_tokens: int):
    """dflash.model.dflash_generate, greedy: (new tokens, drafts of the full-size blocks, accepted per round)."""
    import dflash.model as package

    model = load_dflash_package_model(directory, target.model.dtype)
    drafts = []
    compute_logits = model.compute_logits

    def recording(hidden, head):
        logits = compute_logits(hidden, head)
        if logits.shape[1] == model.block_size - 1:  # the last rounds shrink the block to fit max_new_tokens
            drafts.append(logits[0].argmax(-1).tolist())
        return logits

    model.compute_logits = recording
    timer, package._cuda_time = package._cuda_time, time.perf_counter  # its stats timer synchronises CUDA
    try:
        out = package.dflash_generate(model, target.model, torch.tensor([prompt]), max_new_tokens, None,
                                      temperature=0.0, return_stats=True)
    finally:
        package._cuda_time = timer
    return out.output_ids[0, len(prompt):].tolist(), drafts, [n - 1 for n in out.acceptance_lengths]


def transformers_rounds(directory: str, target: TargetModel, prompt: list[int], max_new_tokens: int):
    """target.generate(assistant_model=..., speculation_type="dflash"), greedy: (new tokens, drafts per round)."""
    model = load_transformers_assistant(directory, target)
    drafts = []

    def hook(module, args, kwargs, output):
        drafts.append(target.model.lm_head(output.last_hidden_state[0, 1:]).argmax(-1).tolist())

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            out = target.model.generate(torch.tensor([prompt]), assistant_model=model, speculation_type="dflash",
                                        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
    finally:
        handle.remove()
    return out[0, len(prompt):].tolist(), drafts


# ---- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target64():
    return make_target(torch.float64)


@pytest.fixture(scope="module", params=[None, DRAFT_VOCAB], ids=["full_vocab", "draft_vocab"])
def drafter64(request, target64):
    return make_drafter(target64, request.param)


def export(drafter: DFlashDrafter, directory, fmt: str) -> str:
    drafter.save(str(directory), fmt)
    return str(directory)


# ---- (a) our reader ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["dflash", "speculators"])
def test_export_read_back_gives_identical_logits_and_drafts(tmp_path, target64, drafter64, fmt):
    directory = export(drafter64, tmp_path, fmt)
    loaded = DFlashDrafter.load(directory, target64.target_info()).to(torch.float64).eval()
    assert loaded.layer_ids == drafter64.layer_ids and loaded.mask_token_id == MASK_TOKEN_ID
    for field in ("block_size", "num_layers", "draft_vocab_size", "num_anchors", "loss_decay_gamma", "label_source"):
        assert getattr(loaded.config, field) == getattr(drafter64.config, field), field
    batch = make_batch(target64, drafter64)
    assert torch.equal(our_logits(loaded, batch), our_logits(drafter64, batch))
    prompt = batch["input_ids"][0, :6].tolist()
    assert engine_rounds(target64, loaded, prompt, 12) == engine_rounds(target64, drafter64, prompt, 12)


@pytest.mark.parametrize("fmt", ["dflash", "speculators"])
def test_training_settings_survive_export(tmp_path, target64, fmt):
    drafter = make_drafter(target64)
    settings = {"num_anchors": 7, "loss_decay_gamma": 3.0, "label_source": "target", "allow_text_mask_token": True}
    drafter.config = dataclasses.replace(drafter.config, **settings)
    loaded = DFlashDrafter.load(export(drafter, tmp_path, fmt), target64.target_info())
    assert {name: getattr(loaded.config, name) for name in settings} == settings


def test_registry_detects_both_layouts(tmp_path, target64):
    from drafters import checkpoint_kind, load_drafter

    drafter = make_drafter(target64)
    for fmt in dflash_export.EXPORT_FORMATS:
        directory = export(drafter, tmp_path / fmt, fmt)
        assert checkpoint_kind(directory) == "dflash"
        assert isinstance(load_drafter(directory, target64.target_info()), DFlashDrafter)


def test_dflash_layout(tmp_path, target64, drafter64):
    directory = export(drafter64, tmp_path, "dflash")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert "auto_map" not in config  # this directory ships no dflash.py for trust_remote_code
    assert config["dflash_config"] == {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": [0, 2],
                                       "block_size": BLOCK_SIZE}
    assert config["target_layer_ids"] == [0, 2] and config["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    assert config["block_size"] == BLOCK_SIZE and config["num_target_layers"] == NUM_TARGET_LAYERS
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 256 and config["tie_word_embeddings"] is False
    assert config["layer_types"] == ["full_attention"] * 2
    names = set(load_file(os.path.join(directory, "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert not any(n.startswith("model.") or n.startswith("embed_tokens") for n in names)
    reduced = drafter64.config.draft_vocab_size is not None
    assert ({"lm_head.weight", "d2t", "t2d"} <= names) == reduced and ("lm_head.weight" in names) == reduced
    assert config["draft_vocab_size"] == (DRAFT_VOCAB if reduced else 256)


def test_speculators_layout(tmp_path, target64, drafter64):
    directory = export(drafter64, tmp_path, "speculators")
    config = json.loads((tmp_path / "config.json").read_text())
    assert "model_type" not in config  # vLLM routes on speculators_config
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashSpeculator"]
    assert config["aux_hidden_state_layer_ids"] == [1, 3] and config["mask_token_id"] == MASK_TOKEN_ID
    assert config["block_size"] == BLOCK_SIZE and config["sample_from_anchor"] is False
    assert config["target_hidden_size"] == 64
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["vocab_size"] == 256
    spec = config["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == BLOCK_SIZE - 1
    assert spec["verifier"] == {"name_or_path": "tiny-qwen3", "architectures": []}  # a config built in memory
    names = set(load_file(os.path.join(directory, "model.safetensors")))
    reduced = drafter64.config.draft_vocab_size is not None
    assert ({"lm_head.weight", "d2t", "t2d"} <= names) == reduced and "embed_tokens.weight" not in names
    if reduced:
        weights = load_file(os.path.join(directory, "model.safetensors"))
        assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
        assert torch.equal(torch.arange(DRAFT_VOCAB) + weights["d2t"], drafter64.draft_ids())  # offsets


# ---- (b) independent readers --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,convention", [("dflash", "zlab"), ("speculators", "speculators")])
def test_reference_readers_reproduce_our_logits(tmp_path, target64, drafter64, fmt, convention):
    directory = export(drafter64, tmp_path, fmt)
    batch = make_batch(target64, drafter64)
    reference = reference_block_logits(directory, convention, target64, batch["input_ids"])
    assert max_diff(reference, our_logits(drafter64, batch)) < 1e-6


@pytest.mark.parametrize("fmt,convention,field", [
    ("dflash", "zlab", ("dflash_config", "target_layer_ids")),
    ("speculators", "speculators", ("aux_hidden_state_layer_ids",)),
])
def test_an_off_by_one_layer_id_is_caught(tmp_path, target64, fmt, convention, field):
    """The classic slip (writing our ids where z-lab ids belong, or z-lab ids in the vLLM field): the independent
    reader then sees other features and the logits move far beyond the tolerance above; our reader refuses it when
    the two id lists of the z-lab layout disagree."""
    drafter = make_drafter(target64)
    directory = export(drafter, tmp_path, fmt)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    slot = config
    for key in field[:-1]:
        slot = slot[key]
    slot[field[-1]] = [i + (1 if fmt == "dflash" else -1) for i in slot[field[-1]]]
    path.write_text(json.dumps(config))
    batch = make_batch(target64, drafter)
    assert max_diff(reference_block_logits(directory, convention, target64, batch["input_ids"]),
                    our_logits(drafter, batch)) > 1e-2
    if fmt == "dflash":
        with pytest.raises(ValueError, match="disagree"):
            DFlashDrafter.load(directory, target64.target_info())


def test_zlab_default_ids_match_ours():
    assert dflash_export.zlab_default_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B-DFlash-b16
    assert dflash_export.zlab_default_layer_ids(36, 1) == [18]
    for layers in (28, 36, 48):
        assert list(default_layer_ids(layers)) == [t + 1 for t in dflash_export.zlab_default_layer_ids(layers, 5)]


@pytest.mark.parametrize("fmt,change,message", [
    ("dflash", lambda c: (c["dflash_config"].pop("mask_token_id"), c.pop("mask_token_id")),
     "dflash_config.mask_token_id"),
    ("speculators", lambda c: c.pop("mask_token_id"), "mask_token_id"),
    ("dflash", lambda c: (c["dflash_config"].update(target_layer_ids=[1, 3]), c.pop("target_layer_ids"),
                          c.pop("eagle_aux_hidden_state_layer_ids")), "do not fit a 4-layer target"),
    ("dflash", lambda c: (c["dflash_config"].update(target_layer_ids=[-2, 0]), c.pop("target_layer_ids"),
                          c.pop("eagle_aux_hidden_state_layer_ids")), "do not fit a 4-layer target"),
    ("speculators", lambda c: c.update(aux_hidden_state_layer_ids=[1, 4]), "do not fit a 4-layer target"),
    ("speculators", lambda c: c.pop("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids"),
    ("dflash", lambda c: c.update(num_target_layers=36), "num_target_layers"),
    ("dflash", lambda c: (c["dflash_config"].update(target_layer_ids=[0]), c.pop("target_layer_ids"),
                          c.pop("eagle_aux_hidden_state_layer_ids")), "fc.weight"),
    ("dflash", lambda c: c.update(hidden_size=32), "hidden_size"),
    ("dflash", lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "sliding"),
    ("dflash", lambda c: c.update(architectures=["DFlash2DraftModel"]), "DFlash2DraftModel"),
    ("dflash", lambda c: c["dflash_config"].update(causal=True), "causal"),
    ("speculators", lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
    ("speculators", lambda c: c.update(mask_token_id=256), "outside the target vocabulary"),
    ("dflash", lambda c: c.update(rms_norm_eps=1e-5), "rms_norm_eps"),
])
def test_read_refuses_and_names_the_field(tmp_path, target64, fmt, change, message):
    directory = export(make_drafter(target64), tmp_path, fmt)
    edit_config(directory, change)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        DFlashDrafter.load(directory, target64.target_info())


def test_foreign_checkpoint_shapes_load(tmp_path, target64):
    """A z-lab file with only dflash_config (no draftsmith block, no extra id lists) and an older speculators file
    that carries embed_tokens and a full-vocabulary lm_head both load and give our logits."""
    drafter = make_drafter(target64)
    batch = make_batch(target64, drafter)
    zlab = export(drafter, tmp_path / "zlab", "dflash")
    edit_config(zlab, lambda c: [c.pop(k) for k in ("draftsmith", "target_layer_ids", "mask_token_id",
                                              "eagle_aux_hidden_state_layer_ids", "draft_vocab_size")])
    spec = export(drafter, tmp_path / "spec", "speculators")
    weights = load_file(os.path.join(spec, "model.safetensors"))
    info = target64.target_info()
    weights |= {"embed_tokens.weight": info.embed_weight.clone(), "lm_head.weight": info.lm_head_weight.clone()}
    save_file(weights, os.path.join(spec, "model.safetensors"))
    for directory in (zlab, spec):
        loaded = DFlashDrafter.load(directory, info).to(torch.float64)
        assert torch.allclose(our_logits(loaded, batch), our_logits(drafter, batch), atol=1e-10)


def test_speculators_refuses_a_trained_full_vocab_head(tmp_path, target64):
    drafter = make_drafter(target64, draft_vocab_size=256)
    with pytest.raises(ValueError, match="speculators reloads"):
        drafter.save(str(tmp_path), "speculators")
    directory = export(drafter, tmp_path / "zlab", "dflash")  # the z-lab layout keeps it (without identity d2t)
    assert {"lm_head.weight"} <= set(load_file(os.path.join(directory, "model.safetensors"))) and not {
        "d2t", "t2d"} & set(load_file(os.path.join(directory, "model.safetensors")))
    batch = make_batch(target64, drafter)
    loaded = DFlashDrafter.load(directory, target64.target_info()).to(torch.float64)
    assert torch.equal(our_logits(loaded, batch), our_logits(drafter, batch))


# ---- (c) peers ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target32():
    return make_target(torch.float32)


@pytest.mark.peer
def test_dflash_package_logits_match_fp32(tmp_path, target32):
    pytest.importorskip("dflash.model", reason=DFLASH_REASON)
    drafter = make_drafter(target32)
    directory = export(drafter, tmp_path, "dflash")
    batch = make_batch(target32, drafter)
    assert max_diff(dflash_package_logits(directory, target32, batch["input_ids"]), our_logits(drafter, batch)) < 1e-4


@pytest.mark.peer
def test_transformers_dflash_logits_match_fp32(tmp_path, target32):
    if not transformers_has_dflash():
        pytest.skip(TRANSFORMERS_REASON)
    drafter = make_drafter(target32)
    directory = export(drafter, tmp_path, "dflash")
    batch = make_batch(target32, drafter)
    assert max_diff(transformers_logits(directory, target32, batch["input_ids"]), our_logits(drafter, batch)) < 1e-4


PROMPT = [5, 17, 33, 9, 101, 64, 7]
PROMPTS = [PROMPT, [140, 8, 211, 77, 19, 56, 230]]


@pytest.fixture(scope="module")
def trained64(target64):
    return train_briefly(target64, make_drafter(target64), PROMPTS)


@pytest.mark.peer
def test_dflash_package_greedy_decoding_equals_ours(tmp_path, target64, trained64):
    pytest.importorskip("dflash.model", reason=DFLASH_REASON)
    directory = export(trained64, tmp_path, "dflash")
    all_accepted = []
    for prompt in PROMPTS:
        tokens, drafts, accepted = engine_rounds(target64, trained64, prompt, 24)
        peer_tokens, peer_drafts, peer_accepted = dflash_package_rounds(directory, target64, prompt, 24)
        assert peer_tokens == tokens
        assert len(peer_drafts) >= 4 and peer_drafts == drafts[: len(peer_drafts)]
        full = min(len(peer_drafts), len(peer_accepted) - 1)  # its last round is clipped to max_new_tokens
        assert peer_accepted[:full] == accepted[:full]
        all_accepted += accepted
    assert 0 in all_accepted and max(all_accepted) >= 2  # rejections and multi-token commits both happened


@pytest.mark.peer
def test_transformers_generate_greedy_equals_ours(tmp_path, target64, trained64):
    if not transformers_has_dflash():
        pytest.skip(TRANSFORMERS_REASON)
    directory = export(trained64, tmp_path, "dflash")
    all_accepted = []
    for prompt in PROMPTS:
        tokens, drafts, accepted = engine_rounds(target64, trained64, prompt, 24)
        peer_tokens, peer_drafts = transformers_rounds(directory, target64, prompt, 24)
        assert peer_tokens == tokens
        rounds = min(len(drafts), len(peer_drafts))
        assert rounds >= 4 and peer_drafts[:rounds] == drafts[:rounds]
        all_accepted += accepted
    assert 0 in all_accepted and max(all_accepted) >= 2


@pytest.mark.peer
@pytest.mark.parametrize("draft_vocab_size", [None, DRAFT_VOCAB], ids=["full_vocab", "draft_vocab"])
def test_speculators_package_logits_match_fp32(tmp_path, draft_vocab_size):
    pytest.importorskip("speculators.models.dflash",
                        reason="speculators not installed: pip install --no-deps speculators==0.9.0 (+ loguru, ...)")
    model = make_tiny_model("qwen3", num_layers=NUM_TARGET_LAYERS, dtype=torch.float32)
    model.save_pretrained(str(tmp_path / "verifier"))  # speculators reloads embed / lm_head from the verifier path
    target = TargetModel(model, name_or_path=str(tmp_path / "verifier"))
    drafter = make_drafter(target, draft_vocab_size)
    directory = export(drafter, tmp_path / "speculators", "speculators")
    batch = make_batch(target, drafter)
    anchors, logits = speculators_logits(directory, target, batch["input_ids"])
    assert max_diff(logits, our_logits(drafter, batch, anchors)) < 1e-4
