"""What each reader makes of a DFlash checkpoint, and the checks `draftsmith doctor` runs on one.

Readers modelled (the source lines are in docs/decisions.md, "Exports and doctor", "What each DFlash client reads";
facts in our words):
- vLLM (`method: dflash`; `vllm serve DIR` for the speculators layout): captures eagle_aux_hidden_state_layer_ids,
  else dflash_config.target_layer_ids + 1, in layer order (sorted, unique), into an fc built for the dflash_config
  ids; the mask token from dflash_config.mask_token_id, then mask_token_id, then pad_token_id; an own head of
  draft_vocab_size rows (the target's when absent), with d2t offsets when that is smaller than the target's
  vocabulary and no d2t parameter when it is not. Its speculators updater derives all of these from
  aux_hidden_state_layer_ids and mask_token_id, which it requires, and it refuses sample_from_anchor.
- dflash 0.1.0 (z-lab `DFlashDraftModel`): each key from dflash_config, then the top level; target_layer_ids t reads HF
  hidden_states[t + 1] (our id t + 1), without them its default rule over num_target_layers; block_size 16 and sliding
  attention only where layer_types says so; no default mask token; always the target's full lm_head.
- transformers 5.24 (`DFlashTokenCandidateGenerator` on a `MuseGlimmerAssistantModel`, with fc / hidden_norm mapped to
  encoder.fc / encoder.output_norm_enc): the top-level target_layer_ids (z-lab convention), block_size and
  mask_token_id, else MuseGlimmerAssistantConfig's [1, 13, 25, 37, 49], 16 and 201818, and every layer sliding without
  layer_types; always the target's full lm_head.
- speculators 0.9 (`DFlashDraftModel`): aux_hidden_state_layer_ids (our ids, distinct, in [0, N]), mask_token_id,
  block_size (default 8); the verifier's lm_head for a full vocabulary, the file's head and d2t for a reduced one.

`CHECKS` (drafters/readers.py; run by drafters/dflash/export.py `export_checks`) gives Check rows. A fail: a field
missing, out of range, inconsistent between the places readers look, or not matching the target; a reader the
layout is meant for that would misread or refuse it. A warn: another reader that would misread it, or one of the
z-lab readers, which cannot apply a reduced draft vocabulary at all. The field checks common to the backbone's layouts
are drafters/dflash/checks.py.
"""

from __future__ import annotations

from typing import Any, Mapping

from drafters.base import TargetInfo
from drafters.dflash.checks import Layout, at_path, backbone_checks, layer_config, meant_layer_ids
from drafters.readers import (Check, Checkpoint, FormatChecks, d2t_problem, meant_for, nested_rope,
                              reader_verdict)

READERS = {
    "draftsmith": "draftsmith's engine",
    "vllm": "vLLM (method dflash; vllm serve DIR for speculators)",
    "dflash": "dflash 0.1.0 DFlashDraftModel (z-lab)",
    "transformers": "transformers 5.24 DFlashTokenCandidateGenerator",
    "speculators": "speculators 0.9 DFlashDraftModel",
}
INTENDED_READERS = {"dflash": ("draftsmith", "vllm", "dflash", "transformers"),
                    "speculators": ("draftsmith", "vllm", "speculators")}
LAYOUTS_READ = {"draftsmith": ("dflash", "speculators"), "vllm": ("dflash", "speculators"), "dflash": ("dflash",),
                "transformers": ("dflash",), "speculators": ("speculators",)}
FORMAT_FOR = {"vllm": "speculators", "dflash": "dflash", "transformers": "dflash", "speculators": "speculators"}
NO_DRAFT_HEAD = ("dflash", "transformers")  # readers that always use the target's lm_head
SPECULATORS_DEFAULT_BLOCK_SIZE = 8
TRANSFORMERS_DEFAULTS = {"target_layer_ids": [1, 13, 25, 37, 49], "mask_token_id": 201818, "block_size": 16}
TARGET_HEAD = "the target's lm_head"
ZLAB_DEFAULT_BLOCK_SIZE = 16  # what dflash.model.DFlashDraftModel assumes when a config has none


LAYOUTS = {
    "dflash": Layout(
        "dflash", None,
        id_places=(("dflash_config.target_layer_ids", 1), ("target_layer_ids", 1),
                   ("eagle_aux_hidden_state_layer_ids", 0), ("aux_hidden_state_layer_ids", 0),
                   ("draftsmith.layer_ids", 0)),
        mask_places=("dflash_config.mask_token_id", "mask_token_id"),
        required=(("dflash_config.target_layer_ids", "the dflash package falls back to its default ids"),
                  ("target_layer_ids", "transformers reads [1, 13, 25, 37, 49]"),
                  ("eagle_aux_hidden_state_layer_ids", "older vLLM captures (2, N/2, N-3)"),
                  ("dflash_config.mask_token_id", "the dflash package cannot load it, vLLM takes mask_token_id or"
                   " pad_token_id"),
                  ("mask_token_id", "transformers reads 201818"),
                  ("block_size", "the dflash package and transformers use 16"),
                  ("layer_types", "transformers makes every layer sliding-window"),
                  ("model_type", "AutoConfig cannot read it"),
                  ("draft_vocab_size", "vLLM sizes the head by the target's vocabulary"))),
    "speculators": Layout(
        "speculators", "transformer_layer_config",
        id_places=(("aux_hidden_state_layer_ids", 0), ("draftsmith.layer_ids", 0)),
        mask_places=("mask_token_id",),
        required=(("aux_hidden_state_layer_ids", "vLLM refuses it"), ("mask_token_id", "vLLM refuses it"),
                  ("block_size", "speculators uses 8"), ("draft_vocab_size", "vLLM sizes the head by the target's"
                   " vocabulary"), ("sample_from_anchor", "DSpark's layouts default it to true"),
                  ("transformer_layer_config", "vLLM refuses it"),
                  ("speculators_config.proposal_methods", "vLLM cannot tell how many tokens to propose"))),
}


# ---- DFlash-only checks --------------------------------------------------------------------------------------------
def draft_vocab_check(header, shapes, index, directory: str, vocab: int) -> Check:
    """The head: none (the target's lm_head), or an own head of draft_vocab_size rows with d2t when reduced."""
    layer = header.get("transformer_layer_config") or header
    declared = header.get("draft_vocab_size") or layer.get("vocab_size") or vocab
    rows = shapes["lm_head.weight"][0] if "lm_head.weight" in shapes else None
    if rows is None:
        if declared != vocab or "d2t" in shapes:
            return Check("draft vocab", "fail", f"draft_vocab_size {declared} (d2t {'d2t' in shapes}) but no"
                         " lm_head.weight: export the checkpoint's draft head")
        return Check("draft vocab", "pass", f"full vocabulary ({vocab}) through the target's lm_head")
    if rows != declared:
        return Check("draft vocab", "fail", f"lm_head.weight has {rows} rows, draft_vocab_size says {declared}")
    if rows == vocab:
        if "d2t" in shapes:
            return Check("draft vocab", "fail", "d2t is written for a full-vocabulary head: vLLM's strict loader"
                         " refuses it; re-export with this draftsmith")
        return Check("draft vocab", "pass", f"an own full-vocabulary head ({vocab} rows), no d2t needed")
    if not 0 < rows < vocab or "d2t" not in shapes:
        return Check("draft vocab", "fail", f"a {rows}-row head for a {vocab}-token target needs a d2t table of"
                     " offsets (every reader would take draft id i for target id i)")
    problem = d2t_problem(directory, index, rows, vocab)
    if problem:
        return Check("draft vocab", "fail", problem)
    return Check("draft vocab", "pass", f"{rows} draft ids, d2t maps them to increasing target ids")


def block_check(fmt: str, header: Mapping[str, Any]) -> Check:
    """block_size >= 2, the same in every place, and (speculators) the proposal length block_size - 1."""
    block = header.get("block_size", at_path(header, "dflash_config.block_size"))
    if block is None:
        return Check("block", "fail", "no block_size (readers default to 8 or 16)")
    problems = [f"block_size {block} < 2"] if int(block) < 2 else []
    nested = at_path(header, "dflash_config.block_size")
    if nested is not None and int(nested) != int(block):
        problems.append(f"dflash_config.block_size {nested} != block_size {block}")
    if fmt == "speculators":
        tokens = (at_path(header, "speculators_config.proposal_methods") or [{}])[0].get("speculative_tokens")
        if tokens is not None and int(tokens) != int(block) - 1:
            problems.append(f"speculative_tokens {tokens} != block_size - 1 = {int(block) - 1} (vLLM proposes it)")
        if header.get("sample_from_anchor"):
            problems.append("sample_from_anchor is true (DSpark's block; DFlash's anchor slot is the bonus token)")
    if problems:
        return Check("block", "fail", "; ".join(problems))
    return Check("block", "pass", f"block_size {block}: {int(block) - 1} drafts per round")


# ---- what each reader drafts from the file ------------------------------------------------------------------------
def reader_view(reader: str, fmt: str, header: Mapping[str, Any], shapes: Mapping[str, tuple], num_target_layers: int,
                vocab_size: int) -> dict[str, Any] | str:
    """The fields that decide `reader`'s drafts from a serving-layout checkpoint (config.json dict `header`, tensor
    name -> shape `shapes`), or a string saying why it cannot load the file. layer_ids are ours, in the order the
    reader concatenates the features."""
    if fmt not in LAYOUTS_READ[reader]:
        return f"not its layout ({fmt}); export with --format {FORMAT_FOR[reader]}"
    if reader == "vllm":
        view = _vllm_view(fmt, header, shapes, vocab_size)
    elif reader == "speculators":
        view = _speculators_view(header, shapes, num_target_layers, vocab_size)
    else:
        view = _zlab_view(reader, header, num_target_layers)
    if isinstance(view, str):
        return view
    fc, hidden = shapes.get("fc.weight"), layer_config(LAYOUTS[fmt], header).get("hidden_size") or 1
    num_fc = view.pop("num_fc", len(view["layer_ids"]))
    if fc is not None and fc[1] != num_fc * hidden:
        return f"it builds fc for {num_fc} target features; the file's fc.weight takes {fc[1] // hidden}"
    return view


def zlab_default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's rule when a config lists no ids (z-lab convention, layer outputs): the middle layer for one draft
    layer, else one id per draft layer spread uniformly from 1 to L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _zlab_view(reader: str, header: Mapping[str, Any], n: int) -> dict[str, Any] | str:
    """The dflash package (dflash_config first, then the top level) and transformers (the top level, with
    MuseGlimmerAssistantConfig's defaults). Both: z-lab ids (ours - 1), the target's lm_head."""
    if reader == "dflash":
        nested = header.get("dflash_config") or {}
        ids = nested.get("target_layer_ids", header.get("target_layer_ids"))
        if ids is None:
            if header.get("num_target_layers") is None:
                return "it finds neither target_layer_ids nor num_target_layers"
            ids = zlab_default_layer_ids(int(header["num_target_layers"]), int(header.get("num_hidden_layers", 1)))
        mask = nested.get("mask_token_id", header.get("mask_token_id"))
        if mask is None:
            return "it has no default mask_token_id"
        block = nested.get("block_size", header.get("block_size", ZLAB_DEFAULT_BLOCK_SIZE))
        sliding = any(t != "full_attention" for t in header.get("layer_types") or ())
    else:
        ids, mask, block = (header.get(key, default) for key, default in TRANSFORMERS_DEFAULTS.items())
        sliding = header.get("layer_types") is None or any(t != "full_attention" for t in header["layer_types"])
    ours = tuple(int(t) + 1 for t in ids)
    if not all(0 <= i <= n for i in ours):
        return f"target_layer_ids {list(ids)} index past the target's hidden states (hidden_states[t + 1], t < {n})"
    return {"layer_ids": ours, "mask_token_id": int(mask), "block_size": int(block),
            "attention": "sliding-window" if sliding else "full", "draft_head": TARGET_HEAD}


def _vllm_view(fmt: str, header: Mapping[str, Any], shapes: Mapping[str, tuple], vocab: int) -> dict[str, Any] | str:
    """vLLM's runner and its speculators updater (module docstring); the block size is the user's k + 1."""
    if fmt == "speculators":
        if not header.get("aux_hidden_state_layer_ids") or header.get("mask_token_id") is None:
            return "its speculators updater requires aux_hidden_state_layer_ids and mask_token_id"
        if header.get("sample_from_anchor"):
            return "it refuses sample_from_anchor=true for DFlash (the anchor is the bonus token)"
        captured = [int(i) for i in header["aux_hidden_state_layer_ids"]]
        num_fc, mask = len(captured), header["mask_token_id"]
    else:
        nested = header.get("dflash_config") or {}
        zlab, aux = nested.get("target_layer_ids"), header.get("eagle_aux_hidden_state_layer_ids")
        if zlab is None and aux is None:
            return "it finds no layer ids (eagle_aux_hidden_state_layer_ids, dflash_config.target_layer_ids)"
        captured = [int(i) for i in aux] if aux is not None else [int(t) + 1 for t in zlab]
        num_fc = len(zlab) if zlab is not None else len(captured)
        mask = nested.get("mask_token_id", header.get("mask_token_id", header.get("pad_token_id")))
        if mask is None:
            return "it finds no mask token (dflash_config.mask_token_id, mask_token_id or pad_token_id)"
    layer_ids = tuple(sorted(set(captured)))
    if len(layer_ids) != num_fc:
        return f"it captures {len(layer_ids)} target features for an fc built for {num_fc}"
    layer = header.get("transformer_layer_config") or header
    if problem := nested_rope(layer):
        return problem
    draft_vocab = int(header.get("draft_vocab_size") or layer.get("vocab_size") or vocab)
    rows = shapes["lm_head.weight"][0] if "lm_head.weight" in shapes else None
    if rows is None and draft_vocab != vocab or rows is not None and rows != draft_vocab:
        return f"it builds a head of draft_vocab_size {draft_vocab} rows; the file's lm_head.weight has {rows}"
    if draft_vocab == vocab and "d2t" in shapes:
        return "its strict loader has no parameter for d2t when the draft vocabulary is the whole target's"
    return {"layer_ids": layer_ids, "num_fc": num_fc, "mask_token_id": int(mask),
            "draft_head": _head(rows, draft_vocab < vocab and "d2t" not in shapes)}


def _speculators_view(header: Mapping[str, Any], shapes: Mapping[str, tuple], n: int,
                      vocab: int) -> dict[str, Any] | str:
    ids = tuple(int(i) for i in header.get("aux_hidden_state_layer_ids") or ())
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i <= n for i in ids):
        return f"its loader refuses aux_hidden_state_layer_ids {list(ids)} (distinct ids in [0, {n}])"
    if header.get("mask_token_id") is None:
        return "it needs mask_token_id"
    layer = header.get("transformer_layer_config") or {}
    draft_vocab = int(header.get("draft_vocab_size") or layer.get("vocab_size") or vocab)
    if draft_vocab < vocab and "lm_head.weight" not in shapes:
        return f"draft_vocab_size {draft_vocab} but no lm_head.weight"
    head = TARGET_HEAD if draft_vocab == vocab else _head(draft_vocab, "d2t" not in shapes)
    return {"layer_ids": ids, "mask_token_id": int(header["mask_token_id"]), "draft_head": head,
            "block_size": int(header.get("block_size", SPECULATORS_DEFAULT_BLOCK_SIZE)),
            "anchor_slot": "drafts" if header.get("sample_from_anchor") else "the bonus token"}


def _head(rows: int | None, identity: bool = False) -> str:
    if rows is None:
        return TARGET_HEAD
    return f"its own {rows}-row head" + (", draft id i read as target id i" if identity else "")


def _our_view(config) -> dict[str, Any]:
    """What the file means, from our reader's DFlashConfig."""
    return {"layer_ids": tuple(config.layer_ids), "mask_token_id": int(config.mask_token_id),
            "block_size": int(config.block_size), "attention": "full", "anchor_slot": "the bonus token",
            "draft_head": _head(config.draft_vocab_size)}


def _header_view(fmt: str, header: Mapping[str, Any], shapes: Mapping[str, tuple]) -> dict[str, Any]:
    """What the file means when our reader refuses it: the ids it was trained with (checks.meant_layer_ids), the
    first mask token and block size written (None when absent), and the head it holds."""
    layout = LAYOUTS[fmt]
    masks = [at_path(header, path) for path in layout.mask_places if at_path(header, path) is not None]
    return {"layer_ids": meant_layer_ids(layout, header), "mask_token_id": masks[0] if masks else None,
            "block_size": header.get("block_size", at_path(header, "dflash_config.block_size")), "attention": "full",
            "anchor_slot": "the bonus token", "draft_head": _head(shapes.get("lm_head.weight", (None,))[0])}


def _reader_check(reader: str, fmt: str, header, shapes, ours: dict[str, Any], n: int, vocab: int) -> Check:
    theirs = reader_view(reader, fmt, header, shapes, n, vocab)
    bad = "fail" if reader in INTENDED_READERS[fmt] else "warn"
    fix = f"to serve it there, re-export with `draftsmith export CKPT --format {FORMAT_FOR[reader]}`"
    if isinstance(theirs, str):
        return reader_verdict(f"reader {reader}", READERS[reader], theirs, bad, fix)
    diffs = {key: f"{key} {theirs[key]} (the file means {ours[key]})" for key in theirs
             if key in ours and theirs[key] != ours[key]}
    if reader in NO_DRAFT_HEAD and set(diffs) == {"draft_head"}:
        bad, fix = "warn", ("it cannot apply a reduced draft vocabulary: serve this drafter with vLLM, or give it a "
                            "full one (drafter.draft_vocab_size: null, no export --draft-vocab-size)")
    return reader_verdict(f"reader {reader}", READERS[reader], list(diffs.values()), bad, fix)


# ---- the doctor's entry point --------------------------------------------------------------------------------------
def _body(directory: str, opened: Checkpoint, target_info: TargetInfo) -> list[Check]:
    fmt, header, index, _ = opened
    shapes = opened.shapes
    return [*backbone_checks(LAYOUTS[fmt], header, shapes, target_info),
            draft_vocab_check(header, shapes, index, directory, target_info.vocab_size), block_check(fmt, header)]


def _reader_rows(opened: Checkpoint, target_info: TargetInfo, outcome) -> list[Check]:
    """Every reader's row against what the file means: what our reader read, else what its header says."""
    fmt, header, _, _ = opened
    shapes = opened.shapes
    ours = _header_view(fmt, header, shapes) if outcome is None else _our_view(outcome[1][0])
    return [_reader_check(reader, fmt, header, shapes, ours, target_info.num_layers, target_info.vocab_size)
            for reader in READERS if reader != "draftsmith"]


CHECKS = FormatChecks(
    "dflash", "`draftsmith export DIR --format dflash` (vLLM, the dflash package, transformers) or `--format"
    " speculators` (vLLM, speculators)", layout=lambda fmt: meant_for(fmt, READERS, INTENDED_READERS), body=_body,
    readers=_reader_rows)
