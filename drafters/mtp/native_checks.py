"""The checks `draftsmith doctor` runs on a target checkpoint with MTP modules in its family's layout (deepseek_v3,
qwen3_next, qwen3_5, mimo, nemotron_h: an export, `draftsmith export CKPT --format <layout>`, or the target's own,
`native-mtp`), as vLLM reads it: the layout found, the module count vLLM builds from config.json, whether vLLM routes
the config to an MTP model at all (records.VLLM_ROUTES), and every tensor's name and shape against a module built from
the target's config. The speculators layout is a drafter directory: drafters/mtp/readers.py.
"""

from __future__ import annotations

import json
import os

import torch

from drafters.base import TargetInfo
from drafters.mtp import export
from drafters.mtp.config import MTPConfig
from drafters.mtp.layers import convention_of, target_text_config
from drafters.mtp.model import MTPDrafter
from drafters.mtp.records import DRAFT_VOCAB_READERS, RECORDS, VLLM_ROUTES
from drafters.readers import Check


def native_checks(directory: str, target_info: TargetInfo) -> tuple[list[Check], dict | None]:
    """`draftsmith doctor`'s rows for a target checkpoint with MTP weights (module docstring), and the module tensors
    they read (MTPDrafter.from_target's `state`, so a module of many GB is read once), None when none were read."""
    model_type = target_text_config(target_info).get("model_type")
    try:
        found = export.find_native(directory, target_info.num_layers, model_type)
    except ValueError as err:
        return [Check("layout", "fail", str(err))], None
    layout, record = found.layout, RECORDS[found.layout]
    served = convention_of(layout, model_type, served_steps=True)  # how the servers run a checkpoint's modules
    rows = [Check("layout", "pass", f"{layout}: {found.num_modules} MTP module(s) in the checkpoint, for "
                  f"{DRAFT_VOCAB_READERS[layout]} ({served.describe()})")]
    with open(os.path.join(directory, "config.json")) as f:
        header = json.load(f)
    counted = record.counted(header)
    key = ("text_config." if counted is not header else "") + record.count_key
    count = counted.get(record.count_key)
    rows.append(Check("count", "pass", f"config.json {key}: {count}") if count == found.num_modules else Check(
        "count", "fail", f"config.json {key} is {count!r} but the checkpoint holds {found.num_modules} module(s): vLLM "
        f"builds the count it reads there; set it to {found.num_modules}"))
    model_types, architectures = VLLM_ROUTES[layout]
    model_type, first = header.get("model_type"), (header.get("architectures") or [None])[0]
    if model_type in model_types or first in architectures:
        routed = f"model_type {model_type}" if model_type in model_types else f"architecture {first}"
        rows.append(Check("server", "pass", f"vLLM maps {routed} to its MTP model (method mtp)"))
    else:
        wanted = " or ".join([f"model_type {' / '.join(sorted(model_types))}"] * bool(model_types)
                             + [f"architectures[0] {' / '.join(sorted(architectures))}"] * bool(architectures))
        rows.append(Check("server", "fail", f"model_type {model_type!r}, architectures[0] {first!r}: vLLM builds no "
                          f"MTP model for it (method mtp wants {wanted} for the {layout} layout); fix config.json"))
    config = MTPConfig(num_modules=found.num_modules, reuse=True, layout=layout, init_from_native=True)
    with torch.device("meta"):
        built = MTPDrafter(config, target_info).layers.state_dict()
    expected = {f"layers.{name}": t.shape for name, t in built.items()}
    read = export.read_native(directory, target_info, layout, found.num_modules)
    stored = {name: t.shape for name, t in read.items()}
    problems = [f"missing {sorted(set(expected) - set(stored))[:4]}"] * bool(set(expected) - set(stored))
    problems += [f"unexpected {sorted(set(stored) - set(expected))[:4]}"] * bool(set(stored) - set(expected))
    problems += [f"{name} {list(stored[name])}, a block of the target's config has {list(shape)}"
                 for name, shape in expected.items() if name in stored and stored[name] != shape][:4]
    rows.append(Check("sizes", "fail", "; ".join(problems) + " (names as the module holds them; was it built for "
                      "another config?)") if problems else Check(
        "sizes", "pass", f"all {len(stored)} module tensors present with the shapes of a block of the target's config"))
    return rows, read
