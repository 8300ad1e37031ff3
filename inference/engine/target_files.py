"""A target's files read without running it: its tokenizer, its modules built from config.json on the meta device,
the head's tensors (embeddings, final norm, lm_head) out of its safetensors, and which weight files it holds.
inference/engine/target.py builds its TargetModel constructors on these (`from_pretrained`, `from_config`,
`head_target`); `draftsmith estimate` and `export` ask which files a target holds.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from drafters.ragged_state import decoder_of, one_row_refusal

SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")  # one file, or the index of its shards
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")  # what a model directory keeps its weights in, any layout


def holds_weights(directory: str) -> bool:
    """Whether a model directory holds weight files (a safetensors or PyTorch checkpoint, sharded or not)."""
    return any(name.endswith(WEIGHT_FILES) for name in os.listdir(directory))


def holds_safetensors(path: str) -> bool:
    """Whether model directory `path` keeps its weights in safetensors, the files `load_head` reads."""
    return any(os.path.isfile(os.path.join(path, name)) for name in SAFETENSORS_FILES)


def quantization_method(path: str) -> str | None:
    """The `quant_method` model directory `path`'s config.json declares for its weights (at its top level, or in the
    text config of a vision-language release), None for unquantized weights."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    quantization = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    return (quantization or {}).get("quant_method")


def stored_bytes(path: str) -> int | None:
    """The bytes of model directory `path`'s safetensors files (its weights as stored, quantized ones at their own
    width), None when it holds none."""
    names = [name for name in os.listdir(path) if name.endswith(".safetensors")]
    return sum(os.path.getsize(os.path.join(path, name)) for name in names) if names else None


def shipped_tokenizer_code(path: str) -> str | None:
    """The tokenizer class model directory `path` ships as code (tokenizer_config.json's auto_map AutoTokenizer, e.g.
    Kimi-K2.5's `tokenization_kimi.TikTokenTokenizer`) when it holds no tokenizer.json transformers reads instead:
    transformers then builds a fast tokenizer of its own from the vocabulary files, whose pre-tokenizer is its
    default, not the shipped code's (Kimi's splits Han script and keeps its <think> tokens whole). None otherwise."""
    config_path = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(os.path.join(path, "tokenizer.json")) or not os.path.exists(config_path):
        return None
    with open(config_path) as f:
        auto = (json.load(f).get("auto_map") or {}).get("AutoTokenizer")
    names = [name for name in (auto if isinstance(auto, list) else [auto]) if name]
    return names[0] if names else None


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer of model directory `path`; one line naming the directory when it holds none that loads
    (transformers' own message spans lines). A tokenizer that exists only as code the model ships
    (`shipped_tokenizer_code`) is refused, since transformers' stand-in splits text otherwise, unless the user asked
    for it (`trust_remote_code`: target.trust_remote_code, --trust-remote-code): then that class alone is imported
    and run, no other code of the model's."""
    code = shipped_tokenizer_code(path)
    if code and not trust_remote_code:
        raise ValueError(f"target {path}: its tokenizer is code the model ships ({code}) and no tokenizer.json; "
                         "transformers' conversion of its vocabulary would split text differently. Read that code, "
                         "then pass target.trust_remote_code=true (eval, doctor, calibrate, export: "
                         "--trust-remote-code)")
    try:
        if code:
            from transformers.dynamic_module_utils import get_class_from_dynamic_module

            return get_class_from_dynamic_module(code, path).from_pretrained(path)
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0].rstrip(": ") if str(err).strip() else type(err).__name__
        raise ValueError(f"target {path}: no tokenizer could be read there ({first}); put the model's tokenizer "
                         "files (tokenizer.json, tokenizer_config.json) beside its config.json") from None


def auto_model(config):
    """The transformers auto class that builds a model of `config`: AutoModelForCausalLM, or for a vision-language
    config that it does not map (Kimi-K2.5's `kimi_k25`, whose text model is DeepSeek-V3's) the image-text-to-text
    model, whose text model `language_model` keeps. Anything else stays AutoModelForCausalLM's, whose error names the
    config."""
    if type(config) not in AutoModelForCausalLM._model_mapping and type(config) in \
            AutoModelForImageTextToText._model_mapping and config.get_text_config(decoder=True) is not config:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def check_one_row(path: str, asked: list[tuple[str, str, str]]) -> None:
    """Refuse, from config.json alone (before any weight loads), the first of `asked` ((flag as typed, what it asks
    the engine to decode, what to do instead), e.g. ("--batch-size 4", "a batch of several rows", "use --batch-size
    1")) where the target of directory `path` decodes one row at a time, in chains (ragged_state.one_row_refusal)."""
    if not asked or not os.path.isfile(os.path.join(path, "config.json")):
        return
    config = AutoConfig.from_pretrained(path, trust_remote_code=False).get_text_config(decoder=True)
    for flag, what, instead in asked:
        refusal = one_row_refusal(config, what)
        if refusal:
            raise ValueError(f"{flag}: {refusal}; {instead}")


def load_model(path: str, dtype: torch.dtype):
    """The causal LM of model directory `path` in `dtype` on the CPU: its text model alone when the checkpoint is a
    vision-language one (`language_model`)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)  # never the model's own code, never a prompt
    return language_model(auto_model(config).from_pretrained(path, config=config, dtype=dtype))


def meta_model(path: str, dtype: torch.dtype):
    """The model of directory `path` built from its config.json on the meta device: every parameter's shape and dtype,
    no weight read or allocated (a vision-language checkpoint's text model alone, as `load_model`)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    with torch.device("meta"):
        return language_model(auto_model(config).from_config(config, dtype=dtype))


def language_model(model):
    """`model` when it is a text-only causal LM; for a vision-language model (Gemma 4's released checkpoints, whose
    `gemma4` config transformers' AutoModelForCausalLM loads as Gemma4ForConditionalGeneration) the causal LM of its
    text config made of its decoder and lm_head, the vision and audio towers dropped: a drafter's target is the text
    model, as vLLM's `--language-model-only` serves it. Same tensors, so the logits of text input are the same."""
    config = model.config
    text = config.get_text_config(decoder=True)
    if text is config:
        return model
    with torch.device("meta"):
        causal = AutoModelForCausalLM.from_config(text, dtype=model.dtype)
    inner = decoder_of(causal)  # its attribute (Llama 4's text model: `model`, whatever its base_model_prefix says)
    setattr(causal, next(name for name, child in causal.named_children() if child is inner), decoder_of(model))
    causal.set_output_embeddings(model.get_output_embeddings())
    unset = [name for name, tensor in (*causal.named_parameters(), *causal.named_buffers()) if tensor.is_meta]
    if unset and not next(model.parameters()).is_meta:
        raise ValueError(f"target {type(model).__name__}: its text model {type(causal).__name__} has tensors that "
                         f"the vision-language model does not ({unset[:3]}); load a text-only checkpoint")
    causal.config._name_or_path = getattr(config, "_name_or_path", "")
    causal.config.architectures = config.architectures  # the checkpoint's (a speculators export names its verifier)
    causal.generation_config = model.generation_config  # generation_config.json's EOS ids, not the text config's
    return causal.eval()


# Llama and most; Nemotron-H; Jamba, Bamba, Zamba2, Falcon-H1; LFM2 (applied after its last layer, despite the name)
FINAL_NORMS = ("norm", "norm_f", "final_layernorm", "embedding_norm")


def final_norm(decoder):
    """The decoder's final norm, under the name its family gives it."""
    for name in FINAL_NORMS:
        if isinstance(getattr(decoder, name, None), torch.nn.Module):
            return getattr(decoder, name)
    raise ValueError(f"target decoder {type(decoder).__name__} has no final norm named one of {FINAL_NORMS}")


def checkpoint_key(name: str, weight_map) -> str | None:
    """The key under which a checkpoint stores parameter `name` of the text model: the name itself, or inside a
    vision-language checkpoint's language model, as transformers names it (`model.language_model.` for `model.`:
    Gemma 4, Qwen3.5 / 3.6) or as LLaVA-style releases store it (`language_model.` before the text model's own name:
    Kimi-K2.5's `language_model.model.embed_tokens.weight` and `language_model.lm_head.weight`); or under another
    prefix for the decoder (Nemotron-H's checkpoints keep `backbone.`, which transformers 5.2x renames `model.` on
    load): the one key that is the name with its first component replaced."""
    for key in (name, name.replace("model.", "model.language_model.", 1), "language_model." + name):
        if key in weight_map:
            return key
    rest = name.partition(".")[2]
    others = [key for key in weight_map if key.endswith("." + rest) and key.count(".") == name.count(".")] if rest \
        else []
    return others[0] if len(others) == 1 else None


def load_head(model, path: str, dtype: torch.dtype, device) -> None:
    """Load into `model` (built by `meta_model`) its input embeddings, final norm and lm_head from the safetensors of
    directory `path`, on `device` in `dtype`; the decoder layers stay on the meta device. A tied lm_head is stored
    as the embeddings, and stays tied."""
    names = {id(p): n for n, p in model.named_parameters()}  # a tied lm_head is named as the embeddings
    single, index = SAFETENSORS_FILES
    if os.path.exists(os.path.join(path, index)):
        with open(os.path.join(path, index)) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(path, single), framework="pt") as f:
            weight_map = {key: single for key in f.keys()}
    embed = names[id(model.get_input_embeddings().weight)]
    wanted = {}
    for module in (model.get_input_embeddings(), final_norm(decoder_of(model)), model.get_output_embeddings()):
        for parameter in module.parameters():
            name = names[id(parameter)]
            key = checkpoint_key(name, weight_map) or checkpoint_key(embed, weight_map)  # tied lm_head: the embeddings
            if key is None:
                raise ValueError(f"target {path}: weight {name} is not in its safetensors files")
            wanted[name] = key
    state = {}
    for name, key in wanted.items():
        with safe_open(os.path.join(path, weight_map[key]), framework="pt") as f:
            state[name] = f.get_tensor(key).to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
