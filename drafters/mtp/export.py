"""Where MTP weights live in checkpoints: import from a target's own checkpoint, export back into it, speculators.

The design notes behind this module: docs/decisions.md, "drafters/mtp/export.py".
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from drafters.base import TargetInfo, check_target_match, text_config_of
from drafters.mtp.config import MTPConfig
from drafters.mtp.experts import fuse_experts, split_experts
from drafters.mtp.layers import LAYOUTS, step_blocks, target_text_config
from drafters.mtp.readers import CHECKS
from drafters.mtp.records import (
    DRAFT_VOCAB_READERS,
    EXPORT_FORMATS,
    FAMILY_LAYOUTS,
    NATIVE_LAYOUTS,
    RECORDS,
    SHARED_COPIES,
    CheckpointLayout,
)
from drafters.speculators import speculators_section

SPECULATORS_VERSION = "0.3.0"
MTP_SHARD = "model-mtp.safetensors"
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


# ---- reading a checkpoint's tensor index -----------------------------------------------------------------------------
def checkpoint_index(directory: str) -> dict[str, str]:
    """{tensor name: safetensors file name} of an HF model directory (sharded or not), without loading tensors."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            return dict(json.load(f)["weight_map"])
    names: dict[str, str] = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(directory, file), "pt") as f:
                names.update({key: file for key in f.keys()})
    if not names:
        raise ValueError(f"{directory}: no safetensors weights (the MTP import reads the target's safetensors files)")
    return names


def read_tensors(directory: str, index: Mapping[str, str], names) -> dict[str, torch.Tensor]:
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in names:
        by_file[index[name]].append(name)
    out = {}
    for file, wanted in by_file.items():
        with safe_open(os.path.join(directory, file), "pt") as f:
            absent = sorted(set(wanted) - set(f.keys()))
            if absent:
                raise ValueError(f"{directory}: model.safetensors.index.json places {absent[:3]} in {file}, which "
                                 "does not hold them (a shard rewritten without its index)")
            out.update({name: f.get_tensor(name) for name in wanted})
    return out


def _summary(names) -> str:
    patterns = sorted({re.sub(r"\.\d+\.", ".{i}.", ".".join(n.split(".")[:4])) for n in names})
    return ", ".join(patterns[:12]) + (f" (+{len(patterns) - 12} more)" if len(patterns) > 12 else "")


@dataclass(frozen=True)
class NativeMTP:
    layout: str
    num_modules: int


def find_native(directory: str, num_layers: int, model_type: str | None = None) -> NativeMTP:
    """Recognise the MTP layout in a target checkpoint from its tensor names.

    Raises ValueError saying which layouts were looked for and what was found, when there is none, several, a
    numbering with gaps, or a layout that does not match the target's model_type.
    """
    index = checkpoint_index(directory)
    found = _marked(index, num_layers)
    if not found:
        looked = "; ".join(f"{layout} ({record.looked_for})" for layout, record in RECORDS.items() if record.marker)
        raise ValueError(f"{directory}: the target checkpoint has no MTP weights. Looked for the layouts {looked}; "
                         f"found only: {_summary(index)}")
    if len(found) > 1:
        raise ValueError(f"{directory}: MTP tensors of several layouts ({', '.join(found)}); cannot tell which to use")
    layout, indices = next(iter(found.items()))
    family = FAMILY_LAYOUTS.get(model_type or "")
    if family is not None and _same_names(RECORDS[family], RECORDS[layout]):
        layout = family  # the same names (qwen3_next, qwen3_5): the family decides
    if indices != list(range(len(indices))):
        raise ValueError(f"{directory}: {layout} MTP modules numbered {indices} (relative to the {num_layers} target"
                         " layers); expected 0..D-1")
    expected = FAMILY_LAYOUTS.get(model_type or "")
    if expected is not None and expected != layout:
        raise ValueError(f"{directory}: the target's model_type {model_type!r} ships MTP weights in the {expected} "
                         f"layout, but this checkpoint holds the {layout} layout")
    return NativeMTP(layout, len(indices))


def _marked(index: Mapping[str, str], num_layers: int) -> dict[str, list[int]]:
    """{layout: the module indices its marker finds} over a checkpoint's tensor names."""
    found: dict[str, list[int]] = {}
    for layout, record in RECORDS.items():
        if record.marker is None or (record.requires and record.requires not in index):
            continue
        indices = sorted({int(m.group(1)) for m in map(re.compile(record.marker).fullmatch, index) if m})
        if record.after_decoder:
            indices = [i - num_layers for i in indices if i >= num_layers]
        if indices:
            found[layout] = indices
    return found


def holds_native(directory: str) -> bool:
    """Whether a model directory's checkpoint holds MTP tensors of a known layout (its config.json gives the layer
    count DeepSeek-V3's numbering starts from)."""
    with open(os.path.join(directory, "config.json")) as f:
        config = text_config_of(json.load(f))
    return bool(_marked(checkpoint_index(directory), int(config.get("num_hidden_layers") or 0)))


def _same_names(a: CheckpointLayout, b: CheckpointLayout) -> bool:
    return (a.fixed, a.fixed_prefix, a.block_prefix) == (b.fixed, b.fixed_prefix, b.block_prefix)


def read_native(directory: str, target_info: TargetInfo, layout: str, num_modules: int) -> dict[str, torch.Tensor]:
    """The MTP modules of a target checkpoint as the drafter's state dict (layers.{k}.*)."""
    index, record = checkpoint_index(directory), RECORDS[layout]
    quantised = sorted(n for n in index if n.endswith("_scale_inv") and record.owns(n, target_info.num_layers))
    if quantised:
        raise ValueError(f"{directory}: the MTP weights are FP8-quantised ({quantised[0]}, ...); dequantise the "
                         "checkpoint to bf16 first")
    state: dict[str, torch.Tensor] = {}
    num_blocks = len(step_blocks(target_info) or ())
    for k in range(num_modules):
        fixed_prefix, block_prefix = record.prefixes(target_info.num_layers, k)
        fixed = record.fixed_names(target_info.num_layers, k, num_blocks)
        missing = [name for name in fixed.values() if name not in index]
        if missing:
            raise ValueError(f"{directory}: {layout} MTP module {k} lacks {missing}")
        tensors = read_tensors(directory, index, fixed.values())
        state.update({f"layers.{k}.{ours}": tensors[theirs] for ours, theirs in fixed.items()})
        fixed_names = set(fixed.values())
        block_names = [n for n in index if n.startswith(block_prefix) and n not in fixed_names
                       and n.removeprefix(fixed_prefix) not in SHARED_COPIES]
        block = read_tensors(directory, index, block_names)
        fused = fuse_experts({name.removeprefix(block_prefix): t for name, t in block.items()})
        state.update({f"layers.{k}.block.{name}": t for name, t in fused.items()})
        if record.shared_copies:
            _check_shared_copies(directory, index, fixed_prefix, target_info)
    return state


def _check_shared_copies(directory, index, prefix: str, target_info: TargetInfo) -> None:
    """DeepSeek-V3 stores the embedding and head again per module; they must be the target's (we share those)."""
    for name, attribute in SHARED_COPIES.items():
        if prefix + name in index:
            stored = read_tensors(directory, index, [prefix + name])[prefix + name]
            ours = getattr(target_info, attribute).detach().to("cpu", stored.dtype)
            if stored.shape != ours.shape or not torch.equal(stored, ours):
                raise ValueError(f"{directory}: {prefix + name} differs from the target's "
                                 f"{attribute.removesuffix('_weight')}; draftsmith's MTP shares the target's embedding "
                                 "and lm_head")


# ---- writing -------------------------------------------------------------------------------------------------------
def check_exportable(drafter, fmt: str) -> None:
    """ValueError naming the field when `fmt` cannot carry the drafter as it runs."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"mtp cannot export format {fmt!r}; it writes: {', '.join(('native',) + EXPORT_FORMATS)}")
    if getattr(drafter, "lm_head", None) is not None:
        raise ValueError(f"--format {fmt}: {DRAFT_VOCAB_READERS[fmt]} runs the MTP modules through the target's own "
                         f"full-vocabulary lm_head and has no d2t / t2d; this drafter has a draft vocabulary "
                         f"(drafter.draft_vocab_size {drafter.config.draft_vocab_size}), which only --format native "
                         "carries (or train with draft_vocab_size: null)")
    ours, theirs = LAYOUTS[drafter.config.layout], LAYOUTS[fmt]
    if ours != theirs:
        raise ValueError(f"--format {fmt}: servers run that layout with other conventions ({theirs.describe()}) than"
                         f" this drafter was trained with (drafter.layout {drafter.config.layout!r}: "
                         f"{ours.describe()}); train with drafter.layout: {fmt} to export it there")
    expected = FAMILY_LAYOUTS.get(str(target_text_config(drafter.target_info).get("model_type") or ""))
    if fmt in NATIVE_LAYOUTS and expected is not None and expected != fmt:
        raise ValueError(f"--format {fmt}: the target's family ships its MTP weights in the {expected} layout, which "
                         f"is what its servers read; export with --format {expected} (train with drafter.layout: "
                         f"{expected})")
    blocks = step_blocks(drafter.target_info)
    if blocks and fmt != expected:
        raise ValueError(f"--format {fmt} carries one decoder layer per MTP module; this target's MTP step is "
                         f"{len(blocks)} blocks ({', '.join(blocks)}), which its family's layout carries: export with "
                         f"--format {expected} (train with drafter.layout: {expected})")
    if RECORDS[fmt].one_module and drafter.config.num_modules != 1:
        raise ValueError(f"--format {fmt} carries exactly one MTP module; drafter.num_modules is "
                         f"{drafter.config.num_modules}")


def layout_tensors(drafter, layout: str, fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """The drafter's modules under `layout`'s names (block experts split for the checkpoint layouts, unless
    `fused_experts`: a Qwen3.5 source that stores them fused)."""
    num_layers, out, record = drafter.target_info.num_layers, {}, RECORDS[layout]
    num_blocks = len(step_blocks(drafter.target_info) or ())
    for k, module in enumerate(drafter.layers):
        state = {name: t.detach().cpu() for name, t in module.state_dict().items()}
        fixed_prefix, block_prefix = record.prefixes(num_layers, k)
        out.update({theirs: state[ours] for ours, theirs in record.fixed_names(num_layers, k, num_blocks).items()})
        block = {name.removeprefix("block."): t for name, t in state.items() if name.startswith("block.")}
        if record.split_experts and not fused_experts:
            block = split_experts(block)
        out.update({block_prefix + name: t for name, t in block.items()})
        if record.shared_copies:
            # Own copies: safetensors refuses tensors that share memory (several modules, tied embeddings).
            out[fixed_prefix + "embed_tokens.weight"] = drafter.target_info.embed_weight.detach().cpu().clone()
            out[fixed_prefix + "shared_head.head.weight"] = drafter.target_info.lm_head_weight.detach().cpu().clone()
    return out


def write(drafter, directory: str, fmt: str) -> None:
    """Write `drafter` (an MTPDrafter) in `fmt` (one of EXPORT_FORMATS) to `directory`."""
    check_exportable(drafter, fmt)
    if fmt == "speculators":
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(speculators_config(drafter), f, indent=2)
        tensors = {name: t.contiguous() for name, t in layout_tensors(drafter, fmt).items()}
        save_file(tensors, os.path.join(directory, "model.safetensors"))
        return
    write_native_layout(drafter, directory, fmt)


def write_native_layout(drafter, directory: str, layout: str) -> None:
    """The target's directory with this drafter's MTP modules in `layout` (see the module docstring)."""
    source = drafter.target_info.name_or_path
    if not os.path.isfile(os.path.join(source, "config.json")):
        raise ValueError(f"--format {layout} writes the target's checkpoint with the MTP modules in it, but the "
                         f"target {source!r} is not a local model directory (pass --target DIR)")
    index = checkpoint_index(source)
    num_layers = drafter.target_info.num_layers
    old = {name for name in index if any(RECORDS[known].owns(name, num_layers) for known in NATIVE_LAYOUTS)}
    dtype = _stored_dtype(source, index)
    fused = any(RECORDS[layout].owns(name, num_layers) and name.endswith("experts.gate_up_proj") for name in index)
    ours = {name: t.to(dtype if t.is_floating_point() else t.dtype).contiguous()
            for name, t in layout_tensors(drafter, layout, fused).items()}
    os.makedirs(directory, exist_ok=True)
    weight_map = {name: file for name, file in index.items() if name not in old}
    for file in sorted(os.listdir(source)):
        path, out = os.path.join(source, file), os.path.join(directory, file)
        if file in ("model.safetensors.index.json", MTP_SHARD, "config.json") or os.path.isdir(path):
            continue
        if file in set(index.values()) and any(index[name] == file for name in old):
            with safe_open(path, "pt") as f:
                kept = {name: f.get_tensor(name) for name in f.keys() if name not in old}
            save_file(kept, out, metadata={"format": "pt"})
        else:
            _link_or_copy(path, out)
    save_file(ours, os.path.join(directory, MTP_SHARD), metadata={"format": "pt"})
    weight_map.update({name: MTP_SHARD for name in ours})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    record = RECORDS[layout]
    record.counted(config)[record.count_key] = drafter.config.num_modules
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _stored_dtype(directory: str, index: Mapping[str, str]) -> torch.dtype:
    """The dtype the target checkpoint stores its embedding in (the MTP tensors are written alike)."""
    name = next((n for n in ("model.embed_tokens.weight", "lm_head.weight") if n in index), next(iter(index)))
    with safe_open(os.path.join(directory, index[name]), "pt") as f:
        stored = f.get_slice(name).get_dtype()
    return _SAFETENSORS_DTYPES.get(stored, torch.float32)


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def speculators_config(drafter) -> dict[str, Any]:
    """The speculators `mtp` config.json dict (no top-level model_type; vLLM routes on speculators_config)."""
    info = drafter.target_info
    return {
        "speculators_model_type": "mtp",
        "speculators_version": SPECULATORS_VERSION,
        "architectures": ["MTPDraftModel"],
        "transformer_layer_config": target_text_config(info),
        "num_nextn_predict_layers": 1,
        "speculators_config": speculators_section("mtp", info, drafter.num_steps),
        "torch_dtype": str(next(drafter.parameters()).dtype).removeprefix("torch."),
        "tie_word_embeddings": False,
        "draftsmith": {"num_steps": drafter.num_steps, "loss_weights": list(drafter.config.loss_weights),
                       "loss": drafter.config.loss},
    }


def detect_format(config: Mapping[str, Any]) -> str | None:
    """"speculators" for a speculators mtp config.json dict, else None (the native header is the model's business;
    the checkpoint layouts are target directories, read through `--drafter native-mtp`)."""
    if config.get("speculators_model_type") == "mtp" and "speculators_config" in config:
        return "speculators"
    return None


def read(directory: str, header: Mapping[str, Any], fmt: str, target_info: TargetInfo):
    """(MTPConfig, state dict) of a drafter directory in `fmt`: "speculators", the one layout `detect_format` finds
    (the target-checkpoint layouts are target directories, read by this module's `read_native`)."""
    assert fmt == "speculators", fmt
    layer = header.get("transformer_layer_config") or {}
    check_target_match(target_info, layer.get("hidden_size"), layer.get("vocab_size"), directory)
    if int(header.get("num_nextn_predict_layers", 1)) != 1:
        raise ValueError(f"{directory}: num_nextn_predict_layers {header['num_nextn_predict_layers']}; the "
                         "speculators mtp layout holds exactly 1")
    proposals = header.get("speculators_config", {}).get("proposal_methods") or [{}]
    ours = header.get("draftsmith") or {}
    config = MTPConfig(num_modules=1, reuse=True,
                       num_steps=int(ours.get("num_steps") or proposals[0].get("speculative_tokens", 1)),
                       loss_weights=tuple(ours.get("loss_weights") or ()), loss=ours.get("loss", "soft"),
                       layout="speculators")
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    record = RECORDS["speculators"]
    prefix = record.prefixes(0, 0)[1]
    inverse = {theirs: ours for ours, theirs in record.fixed.items()}
    state = {}
    for name, tensor in tensors.items():
        if not name.startswith(prefix):
            raise ValueError(f"{directory}: unexpected tensor {name} in a speculators mtp checkpoint")
        local = name.removeprefix(prefix)
        state["layers.0." + inverse.get(local, "block." + local)] = tensor
    return config, state


store_confidence_temperatures = None  # no confidence head (drafters/base.py: the export module's contract)


def export_checks(directory: str, target_info: TargetInfo) -> list:
    """`draftsmith doctor`'s checks of an MTP checkpoint directory (speculators layout) against `target_info`."""
    return CHECKS.run(directory, target_info, detect_format, read)
