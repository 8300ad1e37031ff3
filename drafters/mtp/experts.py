"""MoE expert tensors in MTP checkpoints: one by one (mlp.experts.{e}.gate_proj / up_proj / down_proj, how
DeepSeek-V3, Qwen3-Next and most Qwen3.5 checkpoints store them) <-> transformers' fused 3-D tensors
(experts.gate_up_proj [E, 2I, D] = gate rows then up rows, experts.down_proj [E, D, I]; Nemotron-H's experts are not
gated: experts.up_proj [E, I, D] alone). Both directions are exact (stacking and slicing), so an import -> export
round trip is bitwise (drafters/mtp/export.py).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Mapping

import torch


def fuse_experts(block: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names (mlp.experts.{e}.{gate,up,down}_proj.weight) -> transformers' fused 3-D experts."""
    pattern = re.compile(r"(.*experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out = {}
    for name, tensor in block.items():
        match = pattern.fullmatch(name)
        if match:
            experts[match.group(1)][int(match.group(2))][match.group(3)] = tensor
        else:
            out[name] = tensor
    for prefix, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"{prefix}: experts numbered {sorted(by_index)}, expected 0..E-1")
        ordered = [by_index[e] for e in range(len(by_index))]
        if all("gate_proj" not in p for p in ordered):  # not gated (Nemotron-H)
            out[f"{prefix}.up_proj"] = torch.stack([p["up_proj"] for p in ordered])
        else:
            out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([p["gate_proj"], p["up_proj"]]) for p in ordered])
        out[f"{prefix}.down_proj"] = torch.stack([p["down_proj"] for p in ordered])
    return out


def split_experts(block: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of fuse_experts (exact: slicing)."""
    out = {}
    for name, tensor in block.items():
        if name.endswith("experts.gate_up_proj"):
            prefix, half = name.removesuffix(".gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :half]
                out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, half:]
        elif name.endswith(("experts.down_proj", "experts.up_proj")):
            prefix, part = name.rsplit(".", 1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.{part}.weight"] = tensor[e]
        elif tensor.dim() > 2:
            raise ValueError(f"block tensor {name} {tuple(tensor.shape)}: a fused layout draftsmith cannot split")
        else:
            out[name] = tensor
    return out
