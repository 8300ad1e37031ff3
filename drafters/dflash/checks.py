"""Field checks of a checkpoint of the DFlash backbone in a serving layout, for `draftsmith doctor`: required fields
present, layer ids consistent between every place a reader looks (each in its own convention) and in range, sorted
and unique, the mask token written, consistent and not a text token of the target's tokenizer, and sizes matching
the target. One `Layout` says where a layout keeps these fields; DFlash's layouts are in drafters/dflash/readers.py,
DSpark's in drafters/dspark/readers.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from drafters.base import TargetInfo
from drafters.readers import Check


@dataclass(frozen=True)
class Layout:
    """Where one serving layout of the DFlash backbone keeps its fields (dotted paths into config.json).

    id_places: (field, our id minus the file's id) for every list of layer ids a reader may look at; the first
    present one is what our reader reads. mask_places: every mask token id field. required: (field, what a reader
    does without it). layer_config: the nested draft-layer config, None = the top level.
    """

    name: str
    layer_config: str | None
    id_places: tuple[tuple[str, int], ...]
    mask_places: tuple[str, ...]
    required: tuple[tuple[str, str], ...]


def at_path(header: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path of a config dict, or None."""
    value: Any = header
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def layer_config(layout: Layout, header: Mapping[str, Any]) -> Mapping[str, Any]:
    """The draft layers' HF config inside a config.json dict of `layout`."""
    return header if layout.layer_config is None else header.get(layout.layer_config) or {}


# ---- field checks shared by the layouts of the backbone (DFlash, DSpark) -------------------------------------------
def backbone_checks(layout: Layout, header: Mapping[str, Any], shapes: Mapping[str, tuple],
                    info: TargetInfo) -> list[Check]:
    """fields, layer ids, mask token and sizes of a checkpoint in `layout` against the target `info`."""
    ids = meant_layer_ids(layout, header)
    return [fields_check(layout, header), layer_ids_check(layout, header, info.num_layers),
            mask_check(layout, header, info), sizes_check(layout, header, shapes, info, len(ids) if ids else None)]


def fields_check(layout: Layout, header: Mapping[str, Any]) -> Check:
    missing = [f"{path} ({consequence})" for path, consequence in layout.required if at_path(header, path) is None]
    if not missing:
        return Check("fields", "pass", "every field a reader looks for is explicit")
    return Check("fields", "fail", "missing: " + "; ".join(missing)
                 + f"; re-export with `draftsmith export CKPT --format {layout.name}`")


def _id_lists(layout: Layout, header: Mapping[str, Any]) -> dict[str, tuple[list[int], list[int]]]:
    """{field: (ids as written, the same in our convention)} of every id list present."""
    found = {}
    for path, offset in layout.id_places:
        value = at_path(header, path)
        if isinstance(value, (list, tuple)):
            found[path] = ([int(i) for i in value], [int(i) + offset for i in value])
    return found


def _agreement(found: Mapping[str, tuple[list[int], list[int]]]) -> tuple[dict[tuple[int, ...], list[str]],
                                                                        tuple[int, ...]]:
    """The id lists grouped by the ids they mean, and the ids taken as meant: those the drafter was trained with
    (our own record, when present), else the majority's, else our reader's."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for path, (_, ours) in found.items():
        groups.setdefault(tuple(ours), []).append(path)
    first, record = next(iter(found)), "draftsmith.layer_ids"
    return groups, max(groups, key=lambda ids: (record in groups[ids], len(groups[ids]), first in groups[ids]))


def meant_layer_ids(layout: Layout, header: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The ids the file means (see `_agreement`), or None when it lists none."""
    found = _id_lists(layout, header)
    return _agreement(found)[1] if found else None


def layer_ids_check(layout: Layout, header: Mapping[str, Any], num_layers: int) -> Check:
    """Every id list present names the same ids (after each one's convention), in [0, N-1], sorted and unique."""
    found = _id_lists(layout, header)
    if not found:
        places = ", ".join(path for path, _ in layout.id_places[:-1])
        return Check("layer ids", "fail", f"no layer ids in {places}: every reader would guess them")
    groups, agreed = _agreement(found)
    if len(groups) > 1:
        wrong = [f"{path} {found[path][0]} (= our ids {found[path][1]})" for path in found if path not in
                 groups[agreed]]
        return Check("layer ids", "fail", f"{'; '.join(wrong)} disagree with {', '.join(groups[agreed])}"
                     f" (= our ids {list(agreed)}): one convention slipped (target_layer_ids count layer outputs:"
                     f" our id - 1); re-export with `draftsmith export CKPT --format {layout.name}`")
    ids, problems = list(agreed), []
    outside = [i for i in ids if not 0 <= i < num_layers]
    if outside:
        problems.append(f"ids {outside} outside [0, {num_layers - 1}] (id {num_layers}, the final pre-norm output,"
                        " would be read post-norm by the HF readers)")
    if ids != sorted(set(ids)):
        problems.append("not sorted and unique (vLLM captures in layer order, the z-lab readers in the listed order:"
                        " the fc blocks would meet other features)")
    where = ", ".join(found)
    if problems:
        return Check("layer ids", "fail", f"our ids {ids} from {where}: " + "; ".join(problems))
    return Check("layer ids", "pass", f"our ids {ids} from {where}: consistent, in range, sorted, unique")


def mask_check(layout: Layout, header: Mapping[str, Any], info: TargetInfo) -> Check:
    """The mask token: written, the same everywhere, in the vocabulary and not a token the tokenizer uses for text."""
    written = {path: at_path(header, path) for path in layout.mask_places}
    present = {path: int(value) for path, value in written.items() if value is not None}
    if not present:
        return Check("mask token", "fail", f"no {' / '.join(layout.mask_places)}: the drafter cannot be used without"
                     " the vocabulary row it was trained to read as a masked slot")
    if len(set(present.values())) > 1:
        return Check("mask token", "fail", "disagree: " + ", ".join(f"{p} {v}" for p, v in present.items()))
    mask, where = next(iter(present.values())), ", ".join(present)
    if not 0 <= mask < info.vocab_size:
        return Check("mask token", "fail", f"{where} {mask} is outside the target vocabulary [0, {info.vocab_size})")
    unused = info.unused_token_ids
    if unused is None:
        return Check("mask token", "info", f"{where} {mask}; the target has no tokenizer, so whether it is a text"
                     " token is unknown")
    if mask not in unused:
        allowed = bool(at_path(header, "draftsmith.allow_text_mask_token"))
        return Check("mask token", "warn" if allowed else "fail", f"{where} {mask} is a token the target's tokenizer"
                     f" uses for text, so a masked slot looks like that token; unused ids: {list(unused[:8])}"
                     + (" (the checkpoint records allow_text_mask_token: true)" if allowed else ""))
    return Check("mask token", "pass", f"{where} {mask}: a row of the target's vocabulary no text produces")


def sizes_check(layout: Layout, header: Mapping[str, Any], shapes: Mapping[str, tuple], info: TargetInfo,
                num_ids: int | None) -> Check:
    """Hidden and vocabulary sizes, the target's depth, the fc / embedding / head shapes and the draft layers."""
    layer, hidden, vocab, problems = layer_config(layout, header), info.hidden_size, info.vocab_size, []
    for name, value, want in (("hidden_size", layer.get("hidden_size"), hidden),
                              ("vocab_size", layer.get("vocab_size", vocab), vocab),
                              ("target_hidden_size", header.get("target_hidden_size", hidden), hidden),
                              ("num_target_layers", header.get("num_target_layers", info.num_layers),
                               info.num_layers)):
        if value != want:
            problems.append(f"{name} {value} != the target's {want}")
    expected = {"embed_tokens.weight": (vocab, hidden)}
    if num_ids:
        expected["fc.weight"] = (hidden, num_ids * hidden)
    for name, want in expected.items():
        shape = shapes.get(name)
        if shape is None and name == "fc.weight" or shape is not None and tuple(shape) != want:
            problems.append(f"{name} has shape {None if shape is None else list(shape)}, expected {list(want)}")
    if "lm_head.weight" in shapes and shapes["lm_head.weight"][1] != hidden:
        problems.append(f"lm_head.weight has {shapes['lm_head.weight'][1]} columns, expected {hidden}")
    problems += _layer_problems(layer, shapes)
    if problems:
        return Check("sizes", "fail", "; ".join(problems) + " (was it built for another target?)")
    return Check("sizes", "pass", f"hidden {hidden}, vocab {vocab}, {info.num_layers} target layers; fc and"
                 f" {layer.get('num_hidden_layers')} draft layers present")


def _layer_problems(layer: Mapping[str, Any], shapes: Mapping[str, tuple]) -> list[str]:
    """Draft layers the weights lack (readers keep them at a random init) or hold beyond num_hidden_layers."""
    present = {int(name.split(".")[1]) for name in shapes if name.startswith("layers.")}
    declared = set(range(int(layer.get("num_hidden_layers") or 0)))
    problems = [f"layers.{i}.* missing (num_hidden_layers {len(declared)}): a reader keeps a random layer there"
                for i in sorted(declared - present)]
    return problems + [f"layers.{i}.* is beyond num_hidden_layers {len(declared)}: readers drop it"
                       for i in sorted(present - declared)]
