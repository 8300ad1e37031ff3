"""What each server makes of an EAGLE-3 checkpoint, and the checks `draftsmith doctor` runs on one.

Readers modelled (read from their released source; facts in our own words; docs/benchmarks.md "Served by"):
- vLLM 0.32: the speculators layout (updater: norm_before_residual defaults True) and the plain layout (top-level
  ids, else nested eagle_config ids read as vLLM ids, else (2, N//2, N-3)); captures sorted(set(ids)); fc sized
  by num_aux_hidden_states (else the nested id count, else 3); refuses d2t for a full-vocabulary head.
- speculators 0.9: distinct ids in [0, N], fc sized by their count, norm_before_residual defaults False.
- SGLang 0.5.23 and SpecForge 0.2.0: only the nested ids, in "output of layer k" convention (ours = k + 1).
  SGLang never captures our id N and norms draft layers >= 1 with hidden_norm; SpecForge builds one `midlayer`
  (a `layers.0.*` file keeps a random layer), a 3-state fc, and reads norm_output as "apply the final norm".

`CHECKS` (drafters/readers.py; run by drafters/eagle3/export.py `export_checks`) gives Check(name, status, detail)
rows, status one of pass / fail / warn / info: a fail is a reader the layout is meant for (INTENDED_READERS) that
would misread or refuse it, or a field that is missing, out of range or does not match the target; a warn is
another reader that would misread it.
"""

from __future__ import annotations

from typing import Any, Mapping

from drafters.base import TargetInfo
from drafters.eagle3.layers import default_layer_ids
from drafters.readers import (Check, Checkpoint, FormatChecks, d2t_problem, meant_for, nested_rope,
                              reader_verdict)

READERS = {
    "draftsmith": "draftsmith's engine",
    "vllm": "vLLM 0.32 (vllm serve DIR, or method eagle3)",
    "speculators": "speculators 0.9 Eagle3DraftModel",
    "sglang": "SGLang 0.5.23 (--speculative-algorithm EAGLE3)",
    "specforge": "SpecForge 0.2.0 LlamaForCausalLMEagle3",
}
INTENDED_READERS = {"speculators": ("draftsmith", "vllm", "speculators"), "eagle3": ("draftsmith", "vllm"),
                    "sglang": ("draftsmith", "sglang", "specforge")}
LAYOUTS_READ = {"draftsmith": ("speculators", "eagle3", "sglang"), "vllm": ("speculators", "eagle3", "sglang"),
                "speculators": ("speculators",), "sglang": ("eagle3", "sglang"), "specforge": ("eagle3", "sglang")}
FORMAT_FOR = {"draftsmith": "speculators", "vllm": "speculators", "speculators": "speculators", "sglang": "sglang",
              "specforge": "sglang"}


# ---- the ids each layout lists ----------------------------------------------------------------------------------
def nested_layer_ids(config: Mapping[str, Any]) -> list[int] | None:
    """`eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang / SpecForge convention), or None."""
    nested = config.get("eagle_config")
    return nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, Mapping) else None


def listed_layer_ids(header: Mapping[str, Any], fmt: str, num_target_layers: int) -> tuple[int, ...]:
    """The aux layer ids in our (vLLM) convention, in the order the file's fc blocks follow.

    Top-level `eagle_aux_hidden_state_layer_ids` are vLLM ids. Nested `eagle_config` ids (the SGLang / SpecForge
    layout) count layer outputs: ours = theirs + 1; when both are present they must agree. None at all: the
    target's default (2, N//2, N-3), which is what vLLM and SGLang then capture.
    """
    top = header.get("eagle_aux_hidden_state_layer_ids")
    nested = nested_layer_ids(header) if fmt == "sglang" else None
    if nested is not None:
        shifted = [int(i) + 1 for i in nested]
        if top and [int(i) for i in top] != shifted:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(top)} (vLLM convention) and"
                             f" eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} (SGLang convention,"
                             f" = {shifted} in vLLM's) disagree: vLLM and SGLang would read different layers")
        return tuple(shifted)
    if top:
        return tuple(int(i) for i in top)
    return default_layer_ids(num_target_layers)


def reader_view(reader: str, fmt: str, header: Mapping[str, Any], shapes: Mapping[str, tuple],
                num_target_layers: int, vocab_size: int) -> dict[str, Any] | str:
    """The drafter `reader` builds from a serving-layout checkpoint (config.json dict `header`, tensor name ->
    shape `shapes`) as the fields that decide its drafts, or a string saying why it cannot load the file.

    layer_ids are in vLLM convention, in the order the reader concatenates the features: the servers capture
    sorted(set(ids)); our engine reads the fc blocks in the order the file lists the ids (see `read`).
    """
    if fmt not in LAYOUTS_READ[reader]:
        return f"not its layout ({fmt}); export with --format {FORMAT_FOR[reader]}"
    layer = header.get("transformer_layer_config") or {} if fmt == "speculators" else header
    names = {name.removeprefix("model.").split(".")[0] for name in shapes}
    draft_vocab = header.get("draft_vocab_size") or layer.get("vocab_size")
    view = {"num_layers": int(layer.get("num_hidden_layers", 1)), "layers_loaded": bool(names & {"layers", "midlayer"}),
            "norm_before_residual": False, "final_norm": True, "recycle_post_norm": False,
            "later_layer_norm": "input_layernorm", "d2t": "d2t" in shapes or draft_vocab == vocab_size}
    if reader == "draftsmith":
        view.update(layer_ids=listed_layer_ids(header, fmt, num_target_layers),
                    norm_before_residual=bool(header.get("norm_before_residual", fmt == "speculators")))
        return view
    update = (_vllm_view if reader in ("vllm", "speculators") else _sglang_view)(reader, fmt, header, layer, names,
                                                                                 num_target_layers)
    if isinstance(update, str):
        return update
    view.update(update)
    if reader == "vllm" and draft_vocab == vocab_size and "d2t" in shapes:
        return "its strict loader has no parameter for d2t when the draft vocabulary is the whole target's"
    fc = shapes.get("fc.weight") or shapes.get("model.fc.weight")
    hidden = int(header.get("target_hidden_size") or layer.get("hidden_size") or 1)
    num_aux = view.pop("num_aux")
    if fc is not None and fc[1] != num_aux * hidden:
        return f"it builds fc for {num_aux} aux states; the file's fc.weight has {fc[1] // hidden}"
    if len(view["layer_ids"]) != num_aux:
        return f"it captures {len(view['layer_ids'])} aux states for an fc built for {num_aux}"
    return view


def _vllm_view(reader, fmt, header, layer, names, n) -> dict[str, Any] | str:
    """vLLM (both layouts) and the speculators library. vLLM's speculators updater defaults norm_before_residual
    to True; everything else to False. vLLM reads nested eagle_config ids as vLLM ids when the top level has none."""
    if reader == "vllm" and (problem := nested_rope(layer)):
        return problem
    nested = nested_layer_ids(header) if fmt != "speculators" else None
    ids = header.get("eagle_aux_hidden_state_layer_ids") or (nested if reader == "vllm" else None)
    ids = tuple(int(i) for i in ids) if ids else default_layer_ids(n)
    if reader == "speculators":
        if len(set(ids)) != len(ids) or not all(0 <= i <= n for i in ids):
            return f"its loader refuses target layer ids {list(ids)} (distinct ids in [0, {n}])"
        return {"layer_ids": ids, "num_aux": len(ids), "norm_before_residual": bool(header.get(
            "norm_before_residual", False)), "recycle_post_norm": bool(header.get("norm_output", False))}
    return {"layer_ids": tuple(sorted(set(ids))), "num_aux": layer.get("num_aux_hidden_states") or len(nested or ())
            or 3, "norm_before_residual": bool(header.get("norm_before_residual", fmt == "speculators")),
            "recycle_post_norm": bool(header.get("norm_output", False))}


def _sglang_view(reader, fmt, header, layer, names, n) -> dict[str, Any] | str:
    """SGLang and SpecForge read only the nested ids, counting layer outputs (ours = theirs + 1); without them both
    capture (2, N//2, N-3). SGLang never captures our id N and norms layers >= 1 with hidden_norm; SpecForge builds
    one `midlayer` and a 3-state fc, and reads norm_output as "apply the final norm" (default true)."""
    nested = nested_layer_ids(header)
    ids = tuple(int(i) + 1 for i in nested) if nested is not None else default_layer_ids(n)
    if reader == "sglang":
        return {"layer_ids": tuple(sorted({i for i in ids if i < n})), "later_layer_norm": "hidden_norm",
                "num_aux": header.get("num_aux_hidden_states") or len(nested or ()) or 3,
                "recycle_post_norm": bool(header.get("norm_output", False))}
    if len(ids) != 3 or min(ids) < 1:
        return f"it needs exactly three non-negative ids in eagle_config.eagle_aux_hidden_state_layer_ids, got {nested}"
    return {"layer_ids": tuple(sorted(set(ids))), "num_aux": 3, "num_layers": 1, "layers_loaded": "midlayer" in names,
            "final_norm": bool(header.get("norm_output", True))}


def compare_views(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The fields in which a reader's drafter differs from the one the file describes."""
    return [f"{key} {theirs[key]} (the file means {ours[key]})" for key in ours if theirs.get(key) != ours[key]
            and not (key == "later_layer_norm" and ours["num_layers"] == 1)]


# ---- the doctor's checks ----------------------------------------------------------------------------------------
def _body(directory: str, opened: Checkpoint, target_info: TargetInfo) -> list[Check]:
    fmt, header, index, _ = opened
    n = target_info.num_layers
    return [_fields_check(fmt, header, n), layer_ids_check(fmt, header, n),
            sizes_check(fmt, header, opened.shapes, target_info),
            vocab_check(fmt, header, index, directory, target_info.vocab_size)]


def _our_view(opened: Checkpoint, target_info: TargetInfo) -> dict[str, Any]:
    return reader_view("draftsmith", opened.fmt, opened.header, opened.shapes, target_info.num_layers,
                       target_info.vocab_size)


def _reader_rows(opened: Checkpoint, target_info: TargetInfo, outcome) -> list[Check]:
    """Every server's row, once our reader accepts the file (what it reads is what the file means)."""
    if outcome is None:
        return []
    n, vocab = target_info.num_layers, target_info.vocab_size
    return [_reader_check(reader, opened.fmt, opened.header, opened.shapes, outcome[0], n, vocab)
            for reader in READERS if reader != "draftsmith"]


def _reader_check(reader, fmt, header, shapes, ours, n, vocab) -> Check:
    theirs = reader_view(reader, fmt, header, shapes, n, vocab)
    return reader_verdict(f"reader {reader}", READERS[reader],
                          theirs if isinstance(theirs, str) else compare_views(theirs, ours),
                          "fail" if reader in INTENDED_READERS[fmt] else "warn",
                          f"to serve it there, re-export with `draftsmith export CKPT --format {FORMAT_FOR[reader]}`")


def _fields_check(fmt, header, n) -> Check:
    """Fields a reader silently defaults differently when they are missing."""
    layer = header.get("transformer_layer_config") or {} if fmt == "speculators" else header
    try:
        listed = listed_layer_ids(header, fmt, n) if header.get("eagle_aux_hidden_state_layer_ids") or \
            nested_layer_ids(header) is not None else ()
    except ValueError:  # the ids check reports it
        listed = ()
    missing = []
    if fmt == "sglang" and nested_layer_ids(header) is None or fmt != "sglang" and not header.get(
            "eagle_aux_hidden_state_layer_ids"):
        missing.append("the aux layer ids (the readers silently use (2, N//2, N-3))")
    if "draft_vocab_size" not in header:
        missing.append("draft_vocab_size")
    if fmt == "speculators" and "norm_before_residual" not in header:
        missing.append("norm_before_residual (vLLM defaults it to true, speculators to false)")
    if listed and len(set(listed)) != 3 and "num_aux_hidden_states" not in layer:
        where = "transformer_layer_config." if fmt == "speculators" else ""
        missing.append(f"{where}num_aux_hidden_states (vLLM and SGLang build the fc for 3 aux states without it)")
    if fmt == "sglang" and "norm_output" in header:
        missing.append("no norm_output key (SpecForge reads it as 'apply the final norm', SGLang/vLLM otherwise)")
    if not missing:
        return Check("fields", "pass", "every field a reader looks for is explicit")
    return Check("fields", "fail", "missing or ambiguous: " + "; ".join(missing)
                 + "; re-export with `draftsmith export CKPT --format " + fmt + "`")


def layer_ids_check(fmt, header, n) -> Check:
    try:
        listed = list(listed_layer_ids(header, fmt, n))
    except ValueError as err:
        return Check("layer ids", "fail", str(err))
    problems = [f"ids {[i for i in listed if not 0 <= i <= n]} outside [0, {n}]"] if not all(
        0 <= i <= n for i in listed) else []
    if listed != sorted(set(listed)):
        problems.append("not sorted and unique (vLLM and SGLang capture sorted(set(ids)), so the fc blocks would"
                        " meet other features); re-export with this draftsmith")
    where = "eagle_config.eagle_aux_hidden_state_layer_ids (+1)" if fmt == "sglang" and \
        not header.get("eagle_aux_hidden_state_layer_ids") else "eagle_aux_hidden_state_layer_ids"
    if problems:
        return Check("layer ids", "fail", f"{where} = {listed} in vLLM convention: " + "; ".join(problems))
    return Check("layer ids", "pass", f"{listed} (vLLM convention) from {where}: in range, sorted, unique")


def sizes_check(fmt, header, shapes, info: TargetInfo) -> Check:
    layer = header.get("transformer_layer_config") or {} if fmt == "speculators" else header
    hidden, vocab, problems = info.hidden_size, info.vocab_size, []
    for field, value, want in (("hidden_size", layer.get("hidden_size"), hidden), ("vocab_size",
                               layer.get("vocab_size"), vocab), ("target_hidden_size",
                               header.get("target_hidden_size", hidden), hidden)):
        if value != want:
            problems.append(f"{field} {value} != the target's {want}")
    draft_vocab = header.get("draft_vocab_size") or layer.get("vocab_size")
    expected = {"lm_head.weight": (draft_vocab, hidden), "embed_tokens.weight": (vocab, hidden)}
    try:
        expected["fc.weight"] = (hidden, hidden * len(listed_layer_ids(header, fmt, info.num_layers)))
    except ValueError:
        pass
    for name, want in expected.items():
        shape = shapes.get(name) or shapes.get("model." + name)
        if shape is None and name != "embed_tokens.weight" or shape is not None and tuple(shape) != want:
            problems.append(f"{name} has shape {shape}, expected {list(want)}")
    if problems:
        return Check("sizes", "fail", "; ".join(problems) + " (was it trained for another target?)")
    return Check("sizes", "pass", f"hidden {hidden}, vocab {vocab}, fc and lm_head shapes match the target")


def vocab_check(fmt, header, index, directory, vocab) -> Check:
    layer = header.get("transformer_layer_config") or {} if fmt == "speculators" else header
    draft_vocab = int(header.get("draft_vocab_size") or layer.get("vocab_size") or 0)
    if draft_vocab == vocab:
        if "d2t" in index and fmt != "sglang":
            return Check("draft vocab", "fail", "d2t is written for a full-vocabulary head: vLLM's strict loader"
                         " refuses it (no parameter draft_id_to_target_id); re-export with this draftsmith")
        return Check("draft vocab", "pass", f"full vocabulary ({vocab}), no d2t needed")
    if not 0 < draft_vocab < vocab:
        return Check("draft vocab", "fail", f"draft_vocab_size {draft_vocab} is not in [1, {vocab}]")
    if "d2t" not in index:
        return Check("draft vocab", "fail", f"draft_vocab_size {draft_vocab} < {vocab} but no d2t table: every"
                     " reader would take draft id i for target id i; export the checkpoint's d2t")
    problem = d2t_problem(directory, index, draft_vocab, vocab)
    if problem:
        return Check("draft vocab", "fail", problem)
    return Check("draft vocab", "pass", f"{draft_vocab} draft ids, d2t maps them to increasing target ids")


CHECKS = FormatChecks(
    "eagle3", "`draftsmith export DIR --format speculators` (vLLM) or `--format sglang` (SGLang, SpecForge)",
    layout=lambda fmt: meant_for(fmt, READERS, INTENDED_READERS), body=_body, view=_our_view, readers=_reader_rows)
