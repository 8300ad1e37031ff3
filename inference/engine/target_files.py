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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")  # one file, or the index of its shards
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")  # what a model directory keeps its weights in, any layout


def holds_weights(directory: str) -> bool:
    """Whether a model directory holds weight files (a safetensors or PyTorch checkpoint, sharded or not)."""
    return any(name.endswith(WEIGHT_FILES) for name in os.listdir(directory))


def holds_safetensors(path: str) -> bool:
    """Whether model directory `path` keeps its weights in safetensors, the files `load_head` reads."""
    return any(os.path.isfile(os.path.join(path, name)) for name in SAFETENSORS_FILES)


def load_tokenizer(path: str):
    """The tokenizer of model directory `path`; one line naming the directory when it holds none that loads
    (transformers' own message spans lines)."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0].rstrip(": ") if str(err).strip() else type(err).__name__
        raise ValueError(f"target {path}: no tokenizer could be read there ({first}); put the model's tokenizer "
                         "files (tokenizer.json, tokenizer_config.json) beside its config.json") from None


def meta_model(path: str, dtype: torch.dtype):
    """The model of directory `path` built from its config.json on the meta device: every parameter's shape and dtype,
    no weight read or allocated."""
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


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
    for module in (model.get_input_embeddings(), model.get_decoder().norm, model.get_output_embeddings()):
        for parameter in module.parameters():
            name = names[id(parameter)]
            key = name if name in weight_map else embed  # a tied lm_head is stored as the embeddings
            if key not in weight_map:
                raise ValueError(f"target {path}: weight {name} is not in its safetensors files")
            wanted[name] = key
    state = {}
    for name, key in wanted.items():
        with safe_open(os.path.join(path, weight_map[key]), framework="pt") as f:
            state[name] = f.get_tensor(key).to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
