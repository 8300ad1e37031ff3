"""Which target hidden states a drafter reads, per target family: `layer_ids: auto` and the hybrid rule.

Ids follow docs/ARCHITECTURE.md's convention: id k is the residual stream entering decoder layer k, i.e. the output
of layer k - 1 (id 0 = the embeddings, id N = the final pre-norm output). `auto` (also what a recipe gets when it leaves the
field out) is each drafter's published default on an ordinary target.

Hybrid targets (config.layer_types mixes "linear_attention" with "full_attention": Qwen3-Next, Qwen3.5 / 3.6, Kimi
Linear, and the Mamba hybrids Nemotron-H, Granite 4.0-H, Jamba and Zamba2: a target's config dict carries them,
ragged_state.config_dict) may only be read at attention layers' outputs: allowed ids are {j + 1 : layer j is full
attention, or `hybrid`, attention beside Mamba} (in SpecForge's output-counting convention, the attention layers 3,
7, ..., 47 of Qwen3-Coder-Next, as the thoughtworks EAGLE-3 card requires). Wrong aux layers are the most common
cause of near-zero served acceptance in peers' trackers, so on a hybrid `auto` moves every default id to the nearest
allowed one (distinct, in order), and an id read from a linear-attention layer is refused naming the layer and the
allowed ids, unless the config sets `allow_linear_attention_ids` (z-lab's published Qwen3.5 / 3.6 DFlash checkpoints
read such layers; their readers set it, since the checkpoint was trained that way).
"""

from __future__ import annotations

from typing import Any, Iterable, Literal, Mapping

from drafters.base import text_config_of

AUTO = "auto"
ATTENTION = ("full_attention", "hybrid")  # the outputs a hybrid's drafter reads (`hybrid`: Falcon-H1's, Zamba2's)
LayerIds = tuple[int, ...] | Literal["auto"]  # the type of a drafter config's layer_ids field


def is_auto(layer_ids: Any) -> bool:
    """True for "auto" and for an empty list (the older spelling of the default)."""
    return layer_ids == AUTO or (not isinstance(layer_ids, str) and not tuple(layer_ids))


def hybrid_layer_types(config: Mapping[str, Any]) -> list[str] | None:
    """The target's layer_types when it is a linear / full attention hybrid, else None (the text config of a VLM)."""
    types = text_config_of(config).get("layer_types")
    if isinstance(types, (list, tuple)) and "linear_attention" in types:
        return [str(t) for t in types]
    return None


def attention_output_ids(config: Mapping[str, Any], max_id: int) -> list[int] | None:
    """Ids in [1, max_id] that read a full-attention layer's output on a hybrid; None for any other target."""
    types = hybrid_layer_types(config)
    if types is None:
        return None
    return [j + 1 for j, kind in enumerate(types) if kind in ATTENTION and j + 1 <= max_id]


def nearest_distinct(targets: Iterable[int], candidates: list[int]) -> tuple[int, ...]:
    """Each target moved to the nearest candidate not taken yet (ties to the lower id), sorted; at most
    len(candidates) ids."""
    free, chosen = sorted(candidates), []
    for target in targets:
        if not free:
            break
        best = min(free, key=lambda c: (abs(c - target), c))
        free.remove(best)
        chosen.append(best)
    return tuple(sorted(chosen))


def auto_layer_ids(defaults: tuple[int, ...], config: Mapping[str, Any], max_id: int, field: str) -> tuple[int, ...]:
    """`auto`: the drafter's `defaults` for this target, moved onto full-attention outputs on a hybrid."""
    allowed = attention_output_ids(config, max_id)
    if allowed is None:
        return defaults
    if not allowed:
        raise ValueError(f"{field}: this hybrid target has no full-attention layer whose output is an id in "
                         f"[1, {max_id}] (layer_types {hybrid_layer_types(config)}); set {field} explicitly and "
                         "allow_linear_attention_ids: true")
    return nearest_distinct(defaults, allowed)


def check_hybrid_ids(layer_ids: Iterable[int], config: Mapping[str, Any], max_id: int, field: str,
                     allow_linear: bool) -> None:
    """ValueError naming the first id that reads a linear-attention layer (or the embeddings) of a hybrid."""
    allowed = attention_output_ids(config, max_id)
    if allowed is None or allow_linear:
        return
    types = hybrid_layer_types(config) or []
    for i in layer_ids:
        if int(i) not in allowed:
            source = "the embeddings" if int(i) == 0 else f"the output of layer {int(i) - 1} ({types[int(i) - 1]})"
            raise ValueError(f"{field}: id {int(i)} reads {source} of this hybrid target; a served drafter reads "
                             f"full-attention layers' outputs, ids {allowed} (or set allow_linear_attention_ids: "
                             "true to keep it)")
