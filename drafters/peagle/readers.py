"""What vLLM makes of a P-EAGLE checkpoint, and the checks `draftsmith doctor` runs on one.

vLLM 0.32 reads `speculators_model_type: peagle` as method eagle3 with parallel drafting (its speculators config
code); its P-EAGLE updater takes EAGLE-3's fields but defaults norm_before_residual to false, requires
`mask_token_id` (read as `pard_token`), and its loader copies `mask_hidden` into a buffer of n_features * D values
(a file without it fails to load: "mask_hidden not found in weights"). Its drafts are then EAGLE-3's over the same
layers, so what it reads is checked as EAGLE-3's speculators layout is (drafters/eagle3/readers.py), on the header
with P-EAGLE's default filled in, plus the parallel-drafting row.
"""

from __future__ import annotations

from typing import Any, Mapping

from drafters.base import TargetInfo
from drafters.eagle3.readers import (
    compare_views,
    layer_ids_check,
    listed_layer_ids,
    reader_view,
    sizes_check,
    vocab_check,
)
from drafters.readers import Check, Checkpoint, FormatChecks, meant_for, reader_verdict

READERS = {"draftsmith": "draftsmith's engine",
           "vllm": "vLLM 0.32 (vllm serve DIR: eagle3 with parallel drafting)"}
INTENDED_READERS = {"speculators": ("draftsmith", "vllm")}


def with_defaults(header: Mapping[str, Any]) -> dict[str, Any]:
    """The header as vLLM's P-EAGLE updater completes it (norm_before_residual false unless stated)."""
    return {"norm_before_residual": False, **header}


def mask_hidden_problem(shape: tuple | None, num_features: int, hidden: int) -> str | None:
    """Why a mask_hidden tensor of `shape` (None: absent) cannot feed an fc over num_features * hidden inputs."""
    if shape is None:
        return "no mask_hidden tensor (vLLM's loader fails: 'mask_hidden not found in weights')"
    numel = 1
    for size in shape:
        numel *= int(size)
    if numel != num_features * hidden:
        return (f"mask_hidden has shape {list(shape)}, {numel} values; fc reads {num_features} features x {hidden} ="
                f" {num_features * hidden}")
    return None


def _parallel_check(header, shapes, target_info: TargetInfo) -> Check:
    token = header.get("mask_token_id")
    problems = []
    if token is None:
        problems.append("no mask_token_id (vLLM's P-EAGLE updater requires it)")
    elif not 0 <= int(token) < target_info.vocab_size:
        problems.append(f"mask_token_id {token} is outside the target vocabulary [0, {target_info.vocab_size})")
    try:
        num_features = len(listed_layer_ids(header, "speculators", target_info.num_layers))
    except ValueError:  # the ids row reports it
        num_features = None
    if num_features is not None:
        problem = mask_hidden_problem(shapes.get("mask_hidden"), num_features, target_info.hidden_size)
        problems += [problem] if problem else []
    if problems:
        return Check("parallel drafting", "fail", "; ".join(problems) + "; re-export with `draftsmith export CKPT "
                     "--format speculators`")
    return Check("parallel drafting", "pass", f"mask row {token}, mask_hidden of {num_features} features")


def _body(directory: str, opened: Checkpoint, target_info: TargetInfo) -> list[Check]:
    fmt, header, index, _ = opened
    header, n = with_defaults(header), target_info.num_layers
    return [_parallel_check(header, opened.shapes, target_info), layer_ids_check(fmt, header, n),
            sizes_check(fmt, header, opened.shapes, target_info),
            vocab_check(fmt, header, index, directory, target_info.vocab_size)]


def _view(reader: str, opened: Checkpoint, target_info: TargetInfo):
    return reader_view(reader, opened.fmt, with_defaults(opened.header), opened.shapes, target_info.num_layers,
                       target_info.vocab_size)


def _reader_rows(opened: Checkpoint, target_info: TargetInfo, outcome) -> list[Check]:
    """vLLM's row, once our reader accepts the file: the EAGLE-3 drafter it builds against the one the file means."""
    if outcome is None:
        return []
    theirs = _view("vllm", opened, target_info)
    return [reader_verdict("reader vllm", READERS["vllm"], theirs if isinstance(theirs, str) else
                           compare_views(theirs, outcome[0]), "fail",
                           "re-export with `draftsmith export CKPT --format speculators`")]


CHECKS = FormatChecks(
    "peagle", "`draftsmith export DIR --format speculators` (vLLM)",
    layout=lambda fmt: meant_for(fmt, READERS, INTENDED_READERS), body=_body,
    view=lambda opened, info: _view("draftsmith", opened, info), readers=_reader_rows)
