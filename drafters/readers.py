"""The plumbing of `draftsmith doctor`'s format checks, shared by every kind that exports a serving layout.

A kind's readers.py models what each server makes of its layouts and says which rows to check in a `FormatChecks`;
its export module declares `export_checks(directory, target_info)` (drafters/base.py), which runs that spec with the
module's own `detect_format` and `read`. Every run has the same shape: open the checkpoint (one layout row ends it:
no config.json, our native format, a layout the kind does not know), the layout row, the kind's body rows, the
"reader draftsmith" row (our own reader on the file), then the kind's per-reader rows.

A row is Check(name, status, detail), status one of pass / fail / warn / info.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import torch
from safetensors import safe_open

from drafters.base import NATIVE_KIND_KEY, TargetInfo
from drafters.layers import rope_by_layer_type


class Check(NamedTuple):
    name: str
    status: str  # "pass", "fail", "warn" or "info"
    detail: str


class Checkpoint(NamedTuple):
    """A checkpoint directory in a serving layout: its format, config.json dict, tensor index and path."""

    fmt: str
    header: dict[str, Any]
    index: dict[str, tuple]  # tensor name -> (shape, file name)
    directory: str

    @property
    def shapes(self) -> dict[str, tuple]:
        return {name: shape for name, (shape, _) in self.index.items()}


Detect = Callable[[Mapping[str, Any]], "str | None"]
Read = Callable[[str, Mapping[str, Any], str, TargetInfo], Any]  # an export module's read(directory, header, fmt, info)


@dataclass(frozen=True)
class FormatChecks:
    """Which rows `draftsmith doctor` checks in one kind's serving layouts.

    kind: the drafter kind (a native header of another kind is not its checkpoint). run_instead: what to run on a
    native checkpoint. layout: fmt -> the detail of the passing layout row. body: the kind's field, size and
    vocabulary rows, given (directory, checkpoint, target_info). view: what the file means to our reader, computed
    before `read` inside the "reader draftsmith" row (its errors fail that row too); None = nothing. readers: the
    per-reader rows, given (view, what `read` returned), or None when our reader refused the file.
    """

    kind: str
    run_instead: str
    layout: Callable[[str], str]
    body: Callable[[str, Checkpoint, TargetInfo], list[Check]]
    view: Callable[[Checkpoint, TargetInfo], Any] | None = None
    readers: Callable[[Checkpoint, TargetInfo, "tuple[Any, Any] | None"], list[Check]] | None = None

    def run(self, directory: str, target_info: TargetInfo, detect: Detect, read: Read) -> list[Check]:
        opened = open_checkpoint(directory, self.kind, detect, self.run_instead)
        if isinstance(opened, Check):
            return [opened]
        checks = [Check("layout", "pass", self.layout(opened.fmt)), *self.body(directory, opened, target_info)]

        def read_back():
            view = self.view(opened, target_info) if self.view else None
            return view, read(directory, opened.header, opened.fmt, target_info)

        row, outcome = our_reader(read_back)
        checks.append(row)
        return checks + (self.readers(opened, target_info, outcome) if self.readers else [])


def meant_for(fmt: str, readers: Mapping[str, str], intended: Mapping[str, tuple[str, ...]]) -> str:
    """The layout row's detail: the layout and the servers (not our engine) it is written for."""
    return f"{fmt} layout, meant for " + ", ".join(readers[r] for r in intended[fmt] if r != "draftsmith")


def open_checkpoint(directory: str, kind: str, detect: Detect, exports: str) -> Checkpoint | Check:
    """The serving-layout checkpoint at `directory`, or the one layout row that ends its checks: no config.json,
    draftsmith's native format of drafter `kind` (`exports` says what to run instead), or a layout `detect` does not
    know."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return Check("layout", "fail", f"{directory} has no config.json")
    with open(path) as f:
        header = json.load(f)
    fmt = "native" if header.get(NATIVE_KIND_KEY) == kind else detect(header)
    if fmt is None:
        return Check("layout", "fail", f"config.json is not a {kind} checkpoint")
    if fmt == "native":
        return Check("layout", "info", "draftsmith's native checkpoint: only draftsmith reads it; for a server run "
                     + exports)
    return Checkpoint(fmt, header, tensor_index(directory), directory)


def our_reader(read_file: Callable[[], Any]) -> tuple[Check, Any]:
    """The "reader draftsmith" row of calling `read_file`, and what it read (None when it refused the file)."""
    try:
        result = read_file()
    except (ValueError, KeyError) as err:
        return Check("reader draftsmith", "fail", f"draftsmith cannot read it: {err}"), None
    return Check("reader draftsmith", "pass", "draftsmith's engine reads it as written"), result


def reader_verdict(name: str, label: str, outcome: str | list[str], bad: str, fix: str) -> Check:
    """The row of one reader: `outcome` says why it cannot use the file (a string; "not its layout ..." is only
    information) or what it would misread (a list, empty when nothing); `bad` is the status of a problem and `fix`
    what to do about it."""
    if isinstance(outcome, str):
        if outcome.startswith("not its layout"):
            return Check(name, "info", f"{label}: {outcome}")
        return Check(name, bad, f"{label} cannot use it: {outcome}; {fix}")
    if not outcome:
        return Check(name, "pass", f"{label} loads it correctly")
    return Check(name, bad, f"{label} would load it and misread {'; '.join(outcome)}; {fix}")


def nested_rope(layer: Mapping[str, Any]) -> str | None:
    """Why vLLM cannot build the draft layers of a layer config whose rope_parameters are nested by layer type (as
    a Gemma target's are; drafters.layers.rope_parameters writes the one RoPE a drafter computes), or None."""
    if rope_by_layer_type(layer.get("rope_parameters") or {}):
        return ("its draft layer builds one rotary and cannot from rope_parameters nested by layer type (an export "
                "of a Gemma target before draftsmith wrote them flat)")
    return None


def d2t_problem(directory: str, index: Mapping[str, tuple], draft_vocab: int, vocab: int) -> str | None:
    """What is wrong with the file's d2t table for draft_vocab ids over a target vocabulary of `vocab`, or None."""
    with safe_open(os.path.join(directory, index["d2t"][1]), "pt") as f:
        d2t = f.get_tensor("d2t").long()
    target_ids = torch.arange(d2t.numel()) + d2t
    if d2t.numel() != draft_vocab or int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab or bool(
            (target_ids[1:] <= target_ids[:-1]).any()):
        return (f"d2t ({d2t.numel()} offsets) does not map {draft_vocab} draft ids to increasing target ids in"
                f" [0, {vocab})")
    return None


def tensor_index(directory: str) -> dict[str, tuple]:
    """{tensor name: (shape, file name)} over the directory's safetensors files, without loading the tensors."""
    shapes: dict[str, tuple] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                shapes.update({key: (tuple(f.get_slice(key).get_shape()), name) for key in f.keys()})
    return shapes
