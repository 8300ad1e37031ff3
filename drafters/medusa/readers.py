"""What each reader makes of a Medusa checkpoint in vLLM's `medusa` layout (drafters/medusa/export.py), and the rows
`draftsmith doctor` checks there.

vLLM 0.32's Medusa (model_type medusa, MedusaConfig + MedusaModel): it takes num_heads and num_hidden_layers from any
top-level config key holding "num" and "heads" / "layers" (so FasterDecoding's medusa_num_heads is read), hidden_size
from config.json (its default 4,096 where absent, as in FasterDecoding's releases), the vocabulary from the target's
config; it builds the blocks' biases only with `medusa_fc_bias: true` and drops a file's biases otherwise; with
`original_lm_head` every head ends in the one stored lm_head.weight (or lm_heads.0.weight), else in lm_heads.{h}; its
loader fails on a parameter the file does not give. It proposes head h's argmax on the target's final hidden state
at the last accepted position, as our engine does. SGLang 0.5 serves no Medusa.

Rows: "heads" (the tensors hold what the config says), "sizes" (widths and vocabulary against the target), "head"
(with original_lm_head, the stored head is this target's: vLLM drafts with the stored one, draftsmith with the
target's), "reader draftsmith", "reader vllm" (a file it cannot load, or would load and misread).
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

import torch
from safetensors import safe_open

from drafters.base import TargetInfo
from drafters.readers import Check, Checkpoint, FormatChecks, reader_verdict

READER = "vLLM (method medusa)"
VLLM_DEFAULT_HIDDEN = 4096  # vLLM's MedusaConfig.hidden_size where config.json gives none
_BLOCK = re.compile(r"(?:blocks\.)?(\d+)\.(?:layers\.)?(\d+)\.(?:linear\.)?(weight|bias)$")
_OWN_HEAD = re.compile(r"(?:lm_heads\.(\d+)|(\d+)\.(\d+))\.weight$")
_FIX = "re-export with `draftsmith export CKPT --format medusa`"


def header_field(header: Mapping[str, Any], what: str) -> Any:
    """vLLM's reading of num_heads / num_hidden_layers (module doc); None when absent."""
    word = {"num_heads": "heads", "num_hidden_layers": "layers"}[what]
    found = [value for key, value in header.items() if "num" in key and word in key]
    return found[-1] if found else None


def layout(header: Mapping[str, Any], names: list[str], source: str) -> dict[str, Any]:
    """What the file holds (names with FasterDecoding's `medusa_heads.` prefix dropped): num_heads, num_layers,
    shared (original_lm_head), biases (the blocks' bias tensors are there), ours (file name -> our state-dict name;
    "lm_head" for the shared head). ValueError naming what does not fit."""
    num_heads, num_layers = header_field(header, "num_heads"), header_field(header, "num_hidden_layers")
    if num_heads is None or num_layers is None:
        raise ValueError(f"{source}: config.json gives no num_heads / num_hidden_layers (or medusa_num_heads / "
                         "medusa_num_layers)")
    num_heads, num_layers = int(num_heads), int(num_layers)
    shared = bool(header.get("original_lm_head", False))
    ours: dict[str, str] = {}
    for name in names:
        block, head = _BLOCK.match(name), _OWN_HEAD.match(name)
        if name == "lm_head.weight" or (shared and name == "lm_heads.0.weight"):
            ours[name] = "lm_head"
        elif block and (name.startswith("blocks.") or ".linear." in name):
            h, layer, part = block.groups()
            ours[name] = f"heads.{h}.blocks.{layer}.linear.{part}"
        elif head and (head[1] is not None or int(head[3]) == num_layers):
            ours[name] = f"heads.{head[1] or head[2]}.lm_head.weight"
        elif name == "token_map":
            raise ValueError(f"{source}: a token_map (a truncated draft vocabulary) is not read; draftsmith's Medusa "
                             "drafts over the full vocabulary")
        else:
            raise ValueError(f"{source}: tensor {name!r} is neither a Medusa block nor a head")
    cells = [(h, layer) for h in range(num_heads) for layer in range(num_layers)]
    weights = {f"heads.{h}.blocks.{layer}.linear.weight" for h, layer in cells} | (
        set() if shared else {f"heads.{h}.lm_head.weight" for h in range(num_heads)})
    biases = {f"heads.{h}.blocks.{layer}.linear.bias" for h, layer in cells}
    held = set(ours.values()) - {"lm_head"}
    missing, extra = sorted(weights - held), sorted(held - weights - biases)
    if held & biases and held & biases != biases:
        missing += sorted(biases - held)
    if missing or extra:
        raise ValueError(f"{source}: config.json says {num_heads} heads of {num_layers} blocks"
                         + ("" if shared else ", each with its own lm_head (original_lm_head is not set)")
                         + "; the tensors " + "; ".join(
                             f"{what} {', '.join(map(vllm_name, names[:3]))}{' ...' if len(names) > 3 else ''}"
                             for what, names in (("lack", missing), ("add", extra)) if names))
    if shared and "lm_head" not in ours.values():
        raise ValueError(f"{source}: original_lm_head is set and the file holds no lm_head.weight")
    return {"num_heads": num_heads, "num_layers": num_layers, "shared": shared, "ours": ours,
            "biases": any(n.endswith(".bias") for n in ours.values())}


def expected_shape(ours: str, hidden: int, vocab: int) -> tuple[int, ...]:
    """The shape of our state-dict tensor `ours` (or "lm_head", the shared head) for a target of these widths."""
    return (hidden,) if ours.endswith(".bias") else (hidden, hidden) if ".blocks." in ours else (vocab, hidden)


def vllm_name(ours: str) -> str:
    """Our state-dict name of a Medusa tensor -> vLLM's name for it (heads.{h}.blocks.{l}.linear.weight ->
    blocks.{h}.layers.{l}.weight; heads.{h}.lm_head.weight -> lm_heads.{h}.weight)."""
    h, rest = ours.removeprefix("heads.").split(".", 1)
    if rest.startswith("blocks."):
        layer, part = rest.removeprefix("blocks.").split(".linear.")
        return f"blocks.{h}.layers.{layer}.{part}"
    return f"lm_heads.{h}.weight"


def stored(directory: str, index: Mapping[str, tuple], names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of the checkpoint (index: drafters.readers.tensor_index), keyed as the file names them."""
    out = {}
    for name in names:
        file = next(key for key in index if key.removeprefix("medusa_heads.") == name)
        with safe_open(os.path.join(directory, index[file][1]), "pt") as f:
            out[name] = f.get_tensor(file)
    return out


def vllm_outcome(directory: str, opened: Checkpoint, target_info: TargetInfo) -> str | list[str]:
    """Why vLLM cannot load the file (a string), or what it would misread (a list; empty: nothing)."""
    header = opened.header
    names = [n.removeprefix("medusa_heads.") for n in opened.index]
    try:
        found = layout(header, names, "the file")
    except ValueError as err:
        return str(err).removeprefix("the file: ")
    hidden = int(header.get("hidden_size") or VLLM_DEFAULT_HIDDEN)
    if hidden != target_info.hidden_size:
        return (f"it builds blocks of hidden_size {hidden}" + (" (its default: config.json gives none)" if
                "hidden_size" not in header else "") + f" for a target of {target_info.hidden_size}; set "
                f"hidden_size: {target_info.hidden_size} in config.json")
    truncated = header.get("truncated_vocab_size")
    if truncated is not None and int(truncated) < int(header.get("vocab_size", truncated)) and \
            "token_map" not in names:
        return f"truncated_vocab_size {truncated} without a token_map tensor fails its loader"
    if header.get("medusa_fc_bias") and not found["biases"] and found["num_layers"]:
        return "medusa_fc_bias is true and the file holds no bias tensors, which its loader requires"
    misread = []
    if found["biases"] and not header.get("medusa_fc_bias"):
        biases = stored(directory, opened.index, [n for n, ours in found["ours"].items() if ours.endswith(".bias")])
        if any(bool(t.any()) for t in biases.values()):
            misread.append("the blocks' biases (medusa_fc_bias is not true: it builds none and drops the file's; "
                           "set medusa_fc_bias: true in config.json)")
    return misread


def _body(directory: str, opened: Checkpoint, target_info: TargetInfo) -> list[Check]:
    names = {n.removeprefix("medusa_heads."): shape for n, (shape, _) in opened.index.items()}
    try:
        found = layout(opened.header, list(names), "the file")
    except ValueError as err:
        return [Check("heads", "fail", str(err).removeprefix("the file: "))]
    rows = [Check("heads", "pass", f"{found['num_heads']} heads of {found['num_layers']} residual blocks, "
                  + ("one shared lm_head (original_lm_head)" if found["shared"] else "each with its own lm_head"))]
    d, v = target_info.hidden_size, target_info.vocab_size
    wrong = [f"{name} {list(names[name])}" for name, ours in found["ours"].items()
             if names[name] != expected_shape(ours, d, v)]
    rows.append(Check("sizes", "fail", f"not the target's widths (hidden {d}, vocab {v}): {', '.join(wrong)}")
                if wrong else Check("sizes", "pass", f"hidden {d}, vocab {v}: the target's"))
    if found["shared"] and not wrong:
        name = next(n for n, ours in found["ours"].items() if ours == "lm_head")
        head = stored(directory, opened.index, [name])[name]
        mine = target_info.lm_head_weight.detach().to("cpu")
        rows.append(Check("head", "pass", "original_lm_head: the stored head is the target's lm_head")
                    if torch.equal(head.to(mine.dtype), mine) else
                    Check("head", "fail", "original_lm_head: the stored head is not this target's lm_head; vLLM "
                          "drafts with the stored one, draftsmith with the target's: export the drafter from this "
                          "target"))
    return rows


def _reader_rows(opened: Checkpoint, target_info: TargetInfo, outcome) -> list[Check]:
    return [reader_verdict("reader vllm", READER, vllm_outcome(opened.directory, opened, target_info), "fail", _FIX)]


CHECKS = FormatChecks(
    "medusa", "`draftsmith export DIR --format medusa` (vLLM)",
    layout=lambda fmt: f"{fmt} layout (vLLM's MedusaModel), meant for {READER}", body=_body, readers=_reader_rows)
