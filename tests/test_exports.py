"""Every EAGLE-3 export read back three ways.

1. By our own reader: the loaded drafter drafts exactly what the exported one does.
2. By each server's reader semantics, re-implemented here from their documented conventions (which config key
   holds the layer ids and what an id means, norm flags and their defaults, weight names) with plain tensor math
   in float64: the draft distributions of a served chain must equal our engine's, so a convention slip in the
   writer fails here without any peer installed.
3. By the peers themselves (`peer` marker): speculators' and SpecForge's model classes reproduce our logits to
   1e-4 in fp32; skipped with the reason when the peer is not importable (benchmarks/peers/peer_check.py installs them).
"""

from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_eagle3 import make_drafter, tiny_target

from drafters import load_drafter
from drafters.base import DraftContext
from drafters.eagle3 import Eagle3Drafter

N = 4  # target layers


# ---- the servers' reading conventions, written from their documentation ------------------------------------------
def convention(reader: str, config: dict) -> dict:
    """What `reader` takes from config.json: HF hidden-state indices in concat order, and the norm switches."""
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if reader == "vllm":  # top-level ids (vLLM id k = HF hidden_states[k]), else the nested ones; sorted, unique
        speculators = "speculators_config" in config
        return {"ids": sorted(set(top or nested)), "norm_before_residual": config.get("norm_before_residual",
                speculators), "final_norm": True, "recycle_post_norm": config.get("norm_output", False),
                "layer": config["transformer_layer_config"] if speculators else config}
    if reader == "speculators":  # vLLM ids in the listed order; norm_before_residual defaults to False
        return {"ids": list(top), "norm_before_residual": config.get("norm_before_residual", False),
                "final_norm": True, "recycle_post_norm": config.get("norm_output", False),
                "layer": config["transformer_layer_config"]}
    # SGLang and SpecForge: nested ids only, "output of decoder layer k" = HF hidden_states[k + 1]; no
    # norm_before_residual. SGLang's norm_output: recycle post-norm (default false); SpecForge's: final norm (true).
    ids = [k + 1 for k in nested] if nested is not None else [2, N // 2, N - 3]  # their default, as vLLM ids
    return {"ids": sorted(set(ids)), "norm_before_residual": False, "layer": config,
            "final_norm": config.get("norm_output", True) if reader == "specforge" else True,
            "recycle_post_norm": config.get("norm_output", False) if reader == "sglang" else False}


def read_weights(directory: str, reader: str) -> dict[str, torch.Tensor]:
    """float64 weights under the names the reader looks for (SpecForge knows only `midlayer.*`)."""
    weights = {}
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        for name, tensor in load_file(path).items():
            name = name.removeprefix("model.")
            if reader != "speculators":
                name = name.replace("midlayer.", "layers.0.")
            elif name.startswith("midlayer."):
                continue
            weights[name] = tensor.double() if tensor.is_floating_point() else tensor
    if reader == "specforge" and not any(name.startswith("midlayer.") for name in load_file(path)):
        raise LookupError("SpecForge finds no midlayer.* weights and keeps a random draft layer")
    return weights


def rms(x, weight, eps):
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x, position: int, theta: float):
    """Rotate-half RoPE of x [heads, d] at one position."""
    half = x.shape[-1] // 2
    freqs = position * theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    cos, sin = torch.cat([freqs.cos()] * 2), torch.cat([freqs.sin()] * 2)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def served_chain(directory: str, reader: str, target, prompt: list[int], next_token: int, drafts: list[int]):
    """Draft logits [K, V] (target vocab, -inf outside the draft vocab) of a chain served by `reader`: the prompt
    positions read (features at j, token j + 1), then each draft step reads (its recycled hidden, the draft)."""
    config = json.load(open(os.path.join(directory, "config.json")))
    conv, w = convention(reader, config), read_weights(directory, reader)
    layer = conv["layer"]
    eps, theta, heads, kv_heads = (layer["rms_norm_eps"], layer["rope_theta"], layer["num_attention_heads"],
                                   layer["num_key_value_heads"])
    head_dim = layer["head_dim"]
    ids = torch.tensor([prompt])
    pre_norm = []  # HF's last hidden_states entry is after the final norm; vLLM's id N is the input of that norm
    hook = target.model.model.norm.register_forward_pre_hook(lambda module, args: pre_norm.append(args[0]))
    hidden_states = target.model(ids, output_hidden_states=True).hidden_states[:-1] + tuple(pre_norm)
    hook.remove()
    features = torch.cat([hidden_states[i][0].double() for i in conv["ids"]], dim=-1)
    embed = target.target_info().embed_weight.double()
    caches = [([], []) for _ in range(layer["num_hidden_layers"])]

    def step(h, token, position):
        e = embed[token]
        for index, (keys, values) in enumerate(caches):
            p = f"layers.{index}."
            if index == 0:
                normed = rms(h, w[p + "hidden_norm.weight"], eps)
                x_in = torch.cat([rms(e, w[p + "input_layernorm.weight"], eps), normed])
                residual = normed if conv["norm_before_residual"] else h
            else:
                x_in, residual = rms(h, w[p + "input_layernorm.weight"], eps), h
            q = (w[p + "self_attn.q_proj.weight"] @ x_in).view(heads, head_dim)
            keys.append(rotate((w[p + "self_attn.k_proj.weight"] @ x_in).view(kv_heads, head_dim), position, theta))
            values.append((w[p + "self_attn.v_proj.weight"] @ x_in).view(kv_heads, head_dim))
            out = []
            for hd in range(heads):
                g = hd // (heads // kv_heads)
                scores = torch.stack([rotate(q[hd], position, theta) @ k[g] for k in keys]) / math.sqrt(head_dim)
                out.append((torch.softmax(scores, 0)[:, None] * torch.stack([v[g] for v in values])).sum(0))
            x = residual + w[p + "self_attn.o_proj.weight"] @ torch.cat(out)
            m = rms(x, w[p + "post_attention_layernorm.weight"], eps)
            h = x + w[p + "mlp.down_proj.weight"] @ (torch.nn.functional.silu(w[p + "mlp.gate_proj.weight"] @ m)
                                                      * (w[p + "mlp.up_proj.weight"] @ m))
        normed = rms(h, w["norm.weight"], eps)
        logits = w["lm_head.weight"] @ (normed if conv["final_norm"] else h)
        return (normed if conv["recycle_post_norm"] else h), logits

    tokens = prompt[1:] + [next_token]
    for j, token in enumerate(tokens):
        h, logits = step(w["fc.weight"] @ features[j], token, j)
    steps = [logits]
    for s, token in enumerate(drafts[:-1]):
        h, logits = step(h, token, len(tokens) + s)
        steps.append(logits)
    d2t = w.get("d2t", torch.zeros(steps[0].numel(), dtype=torch.long))
    full = torch.full((len(steps), target.target_info().vocab_size), -math.inf, dtype=torch.float64)
    full[:, torch.arange(d2t.numel()) + d2t] = torch.stack(steps)
    return full


# ---- our engine's side -------------------------------------------------------------------------------------------
PROMPT, NEXT, K = [5, 17, 33, 9, 120, 41, 7], 77, 3


def our_chain(drafter: Eagle3Drafter, target):
    """(draft tokens [K], draft probs [K, V]) of our proposer on PROMPT (sampled drafts, so probs are returned)."""
    drafter.config.sample_drafts = True
    ids = torch.tensor([PROMPT])
    features = target.features(ids, torch.ones_like(ids), drafter.target_layer_ids())
    context = DraftContext(ids, torch.ones_like(ids, dtype=torch.bool), torch.arange(len(PROMPT))[None],
                           features.hidden, torch.tensor([NEXT]), generator=torch.Generator().manual_seed(0))
    drafter.begin(context)
    proposal = drafter.propose(K)
    return proposal.tokens[0].tolist(), proposal.probs[0].double()


def trained_looking(target, **config) -> Eagle3Drafter:
    drafter = make_drafter(target, **config)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return drafter.float()


CASES = {  # format -> (drafter config, the readers the format is written for)
    "speculators": ({"num_layers": 2, "norm_before_residual": True, "layer_ids": (0, 2, 4)}, ["vllm", "speculators"]),
    "eagle3": ({"num_layers": 2, "norm_before_residual": True, "layer_ids": (0, 2, 4)}, ["vllm"]),
    "sglang": ({"num_layers": 1, "layer_ids": (1, 2, 3)}, ["sglang", "specforge", "vllm"]),
    "speculators-full-vocab": ({"num_layers": 1, "layer_ids": (1, 3), "draft_vocab_size": 256},
                               ["vllm", "speculators"]),
    "sglang-full-vocab": ({"num_layers": 1, "layer_ids": (1, 2, 3), "draft_vocab_size": 256}, ["sglang", "specforge"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_export_is_served_as_our_engine_drafts(tmp_path, case):
    fmt = case.split("-")[0]
    config, readers = CASES[case]
    target = tiny_target(num_layers=N)
    drafter = trained_looking(target, **config)
    drafter.save(str(tmp_path), fmt)
    tokens, probs = our_chain(drafter, target)
    loaded = load_drafter(str(tmp_path), target.target_info())  # 1. our reader
    assert loaded.layer_ids == drafter.layer_ids
    loaded_tokens, loaded_probs = our_chain(loaded, target)
    assert loaded_tokens == tokens
    torch.testing.assert_close(loaded_probs, probs, rtol=0, atol=0)
    for reader in readers:  # 2. each server's conventions
        served = torch.softmax(served_chain(str(tmp_path), reader, target, PROMPT, NEXT, tokens), dim=-1)
        torch.testing.assert_close(served, probs, rtol=0, atol=2e-6, msg=f"{reader} reads {case} differently")
    names = set(load_file(str(tmp_path / "model.safetensors")))
    full_vocab = drafter.config.draft_vocab_size == target.target_info().vocab_size
    assert ("d2t" in names) == (fmt == "sglang" or not full_vocab)  # vLLM refuses d2t for a full-vocabulary head
    assert any(n.startswith("midlayer.") for n in names) == (fmt == "sglang")


def test_convention_slips_change_what_servers_draft(tmp_path):
    """The checks above would catch the old bugs: nested ids in vLLM convention, `layers.0.*` names for SpecForge,
    norm_output false (SpecForge then skips the final norm)."""
    target = tiny_target(num_layers=N)
    drafter = trained_looking(target, num_layers=1, layer_ids=(1, 2, 3))
    tokens, probs = our_chain(drafter, target)
    drafter.save(str(tmp_path), "sglang")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and "norm_output" not in config
    for slip in ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, {"norm_output": False}):
        (tmp_path / "config.json").write_text(json.dumps({**config, **slip}))
        served = torch.softmax(served_chain(str(tmp_path), "specforge", target, PROMPT, NEXT, tokens), dim=-1)
        assert not torch.allclose(served, probs, atol=1e-3), slip
    drafter.save(str(tmp_path / "plain"), "eagle3")
    with pytest.raises(LookupError, match="random draft layer"):
        served_chain(str(tmp_path / "plain"), "specforge", target, PROMPT, NEXT, tokens)


# ---- import: checkpoints written by others -----------------------------------------------------------------------
def test_specforge_speculators_and_legacy_checkpoints_import(tmp_path):
    target = tiny_target(num_layers=N)
    drafter = trained_looking(target, num_layers=1, layer_ids=(1, 2, 3))
    tokens, probs = our_chain(drafter, target)
    tensors = {"embed_tokens.weight": target.target_info().embed_weight.float(), **drafter.state_dict()}
    # SpecForge writes midlayer.*, its ids nested in output-of-layer convention, no top-level ids.
    specforge = {**drafter.layer_config, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 160,
                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    # A file from an older draftsmith: ids [3, 1, 2, 2] listed unsorted with a repeat, fc blocks in that order.
    h = 64
    fc = drafter.fc.weight.detach()
    legacy_fc = torch.cat([fc[:, 2 * h :], fc[:, :h], 0.5 * fc[:, h : 2 * h], 0.5 * fc[:, h : 2 * h]], dim=1)
    legacy = {**drafter.layer_config, "architectures": ["Eagle3LlamaForCausalLM"], "draft_vocab_size": 160,
              "eagle_aux_hidden_state_layer_ids": [3, 1, 2, 2]}
    speculators = {"speculators_model_type": "eagle3", "speculators_config": {"proposal_methods": [
        {"speculative_tokens": 3}]}, "transformer_layer_config": drafter.layer_config, "draft_vocab_size": 160,
        "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    layouts = {
        "specforge": (specforge, {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}),
        "legacy": (legacy, {**tensors, "fc.weight": legacy_fc}),
        "speculators": (speculators, {**tensors, "verifier_lm_head.weight": torch.zeros(3, h)}),
    }
    for name, (config, weights) in layouts.items():
        directory = tmp_path / name
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
        loaded = load_drafter(str(directory), target.target_info())
        assert loaded.layer_ids == (1, 2, 3), name
        loaded_tokens, loaded_probs = our_chain(loaded, target)
        assert loaded_tokens == tokens, name
        torch.testing.assert_close(loaded_probs, probs, rtol=0, atol=1e-6, msg=name)


def test_native_checkpoint_with_configured_order_loads(tmp_path):
    """A native checkpoint written before ids were sorted: the default (2, 2, 1) of a 4-layer target, 3 fc blocks."""
    target = tiny_target(num_layers=N)
    drafter = trained_looking(target, num_layers=1)
    assert drafter.layer_ids == (1, 2)
    tokens, probs = our_chain(drafter, target)
    drafter.save(str(tmp_path), "native")
    header = json.loads((tmp_path / "config.json").read_text())
    assert header["drafter_config"]["layer_ids"] == [1, 2]
    header["drafter_config"]["layer_ids"] = []
    (tmp_path / "config.json").write_text(json.dumps(header))
    state = load_file(str(tmp_path / "model.safetensors"))
    fc = state["fc.weight"]
    state["fc.weight"] = torch.cat([0.5 * fc[:, 64:], 0.5 * fc[:, 64:], fc[:, :64]], dim=1)  # (2, 2, 1)
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_drafter(str(tmp_path), target.target_info())
    assert loaded.layer_ids == (1, 2) and our_chain(loaded, target)[0] == tokens


# ---- what a format cannot carry is refused, naming the reader and the alternative ----------------------------------
@pytest.mark.parametrize("config,reason", [
    ({"num_layers": 2, "layer_ids": (1, 2, 3)}, "2 draft layers"),
    ({"num_layers": 1, "layer_ids": (1, 2, 3), "norm_before_residual": True}, "norm_before_residual"),
    ({"num_layers": 1, "layer_ids": (1, 3)}, "2 aux layer ids"),
    ({"num_layers": 1, "layer_ids": (0, 1, 2)}, "layer id 0"),
    ({"num_layers": 1, "layer_ids": (1, 2, 4)}, "layer id 4"),
])
def test_sglang_export_refuses_what_its_readers_cannot_express(tmp_path, config, reason):
    target = tiny_target(num_layers=N)
    drafter = make_drafter(target, **config)
    with pytest.raises(ValueError, match=rf"SGLang and SpecForge.*{reason}.*--format speculators"):
        drafter.save(str(tmp_path / "out"), "sglang")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    drafter.save(str(tmp_path / "ok"), "speculators")  # the alternative carries it


# ---- the peers themselves ----------------------------------------------------------------------------------------
PEER_REASON = "{} is not installed here; `python benchmarks/peers/peer_check.py parity` runs this test in a venv that has it"
SEQUENCE = [[5, 17, 33, 9, 120, 41, 7, 200, 64, 90, 11, 3, 250, 18]]


def ttt_logits(drafter: Eagle3Drafter, target, ids: torch.Tensor) -> torch.Tensor:
    """Our training-time-test logits as a grid [K, T - 1, V_d] (drafter position t reads the features at t and
    token t + 1 + k at step k); NaN where our forward computes no cell (position T - 2 and the first k steps)."""
    features = target.features(ids, torch.ones_like(ids), drafter.target_layer_ids())
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
             "hidden": features.hidden, "final_hidden": features.final_hidden,
             "target_argmax": torch.full_like(ids, int(drafter.draft_ids()[0]))}
    with torch.no_grad():
        out = drafter(batch)
    steps = drafter.config.ttt_steps
    grid = torch.full((steps, ids.shape[1] - 1, drafter.config.draft_vocab_size), math.nan)
    for k in range(steps):
        keep = out.depth_valid[:, k]
        grid[k, out.label_position[keep, k] - 2 - k] = out.logits[keep, k].float()
    return grid


def fp32_setup(tmp_path, **config):
    """A float32 tiny target saved as the verifier directory (speculators reads its config) and a drafter for it."""
    target = tiny_target(num_layers=N, dtype=torch.float32)
    target.model.save_pretrained(tmp_path / "verifier")
    target.name_or_path = str(tmp_path / "verifier")
    return target, trained_looking(target, **config)


@pytest.mark.peer
def test_speculators_model_class_reproduces_our_logits(tmp_path):
    pytest.importorskip("speculators", reason=PEER_REASON.format("speculators"))
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    target, drafter = fp32_setup(tmp_path, num_layers=2, layer_ids=(1, 2, 4), norm_before_residual=True)
    drafter.save(str(tmp_path / "export"), "speculators")
    config = Eagle3SpeculatorConfig.from_pretrained(str(tmp_path / "export"))
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention wants lengths % 128 == 0
    model = Eagle3DraftModel.from_pretrained(str(tmp_path / "export"), config=config).float().eval()
    ids = torch.tensor(SEQUENCE)
    features = target.features(ids, torch.ones_like(ids), drafter.target_layer_ids()).hidden
    hidden = torch.cat([features[i][:, :-1] for i in config.eagle_aux_hidden_state_layer_ids], dim=-1)
    captured = []
    model.lm_head.register_forward_hook(lambda module, args, output: captured.append(output.detach()))
    with torch.no_grad():
        model(hidden_states=hidden, input_ids=ids[:, 1:], document_ids=torch.zeros_like(ids[:, 1:]),
              ttt_steps=drafter.config.ttt_steps)
    theirs, ours = torch.stack(captured)[:, 0], ttt_logits(drafter, target, ids)
    computed = ~ours.isnan()
    assert int(computed.sum()) > 0
    print(f"peer max abs diff {(theirs[computed] - ours[computed]).abs().max().item():.3g}")
    torch.testing.assert_close(theirs[computed], ours[computed], rtol=0, atol=1e-4)


@pytest.mark.peer
def test_specforge_model_class_reproduces_our_logits(tmp_path):
    pytest.importorskip("specforge", reason=PEER_REASON.format("specforge"))
    torch._dynamo.config.disable = True  # its norms and RoPE are torch.compile'd; eager is the same math
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3 as SpecForgeEagle3

    target, drafter = fp32_setup(tmp_path, num_layers=1, layer_ids=(1, 2, 3))
    drafter.save(str(tmp_path / "export"), "sglang")
    model = SpecForgeEagle3.from_pretrained(str(tmp_path / "export"), attention_backend="sdpa").float().eval()
    # Its RoPE cos/sin tables are non-persistent buffers that from_pretrained (transformers 5.19) leaves
    # uninitialised; rebuild them as its constructor does (weights are untouched; loading reported no missing key).
    model.midlayer.self_attn._init_rope()
    ids = torch.tensor(SEQUENCE)
    length = ids.shape[1] - 1
    features = target.features(ids, torch.ones_like(ids), drafter.target_layer_ids()).hidden
    ids_theirs = [i + 1 for i in model.config.eagle_config["eagle_aux_hidden_state_layer_ids"]]
    hidden = torch.cat([features[i][:, :-1] for i in ids_theirs], dim=-1)
    with torch.no_grad():
        embeds = model.embed_input_ids(ids[:, 1:])
        mask = model.prepare_decoder_attention_mask(torch.ones(1, length), hidden, 1, length, 0)
        out = model.backbone(embeds, model.project_hidden_states(hidden), None, mask,
                             torch.arange(length)[None], use_cache=False)
        theirs = model.compute_logits(out)[0]
    ours = ttt_logits(drafter, target, ids)[0]
    computed = ~ours.isnan().any(-1)
    print(f"peer max abs diff {(theirs[computed] - ours[computed]).abs().max().item():.3g}")
    torch.testing.assert_close(theirs[computed], ours[computed], rtol=0, atol=1e-4)


def test_export_reads_only_the_head_of_a_safetensors_target(tmp_path, monkeypatch):
    """`draftsmith export` reads of the target only what a format carries (embeddings, final norm, lm_head: the
    decoder's weights are never loaded), and writes the same bytes as from the whole target."""
    from transformers import AutoModelForCausalLM

    import train.export
    from drafters import DRAFTERS
    from inference.engine.target import TargetModel
    from train.export import main as export

    info = TargetModel.from_pretrained("debug:tiny-llama").target_info()
    drafter = DRAFTERS["eagle3"](DRAFTERS["eagle3"].Config(draft_vocab_size=128), info)
    drafter.save(str(tmp_path / "final"), "native")
    with monkeypatch.context() as whole:  # the reference: the whole target loaded, as export did before
        whole.setattr(train.export, "head_target",
                      lambda path, dtype, device, trust_remote_code=False: TargetModel.from_pretrained(
                          path, dtype=dtype, device=device, trust_remote_code=trust_remote_code))
        assert export([str(tmp_path / "final"), "--format", "speculators", "--out", str(tmp_path / "whole")]) == 0

    def whole_target(*args, **kwargs):
        raise AssertionError("export loaded the whole target")

    monkeypatch.setattr(TargetModel, "from_pretrained", whole_target)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", whole_target)
    assert export([str(tmp_path / "final"), "--format", "speculators", "--out", str(tmp_path / "head")]) == 0
    for name in os.listdir(tmp_path / "whole"):
        assert (tmp_path / "head" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
