"""The checks `draftsmith doctor` runs on a DSpark checkpoint (drafters/dspark/export.py layouts).

The backbone's field checks are DFlash's (drafters/dflash/checks.py) over DSpark's two layouts: speculators' "dspark"
(vLLM `method: dspark`, speculators 0.9 `DSparkDraftModel`: our layer ids in aux_hidden_state_layer_ids) and
DeepSpec's (`Qwen3DSparkModel`: target_layer_ids count layer outputs, our id - 1). Added here: the block (the anchor
slot drafts, so the proposal is block_size tokens and sample_from_anchor is true), the sequential and confidence heads
(their weights match the fields that tell a reader to build them), and whether our own reader loads the file.
Per-reader views as for EAGLE-3 and DFlash are not modelled: both layouts have one reader family each, whose fields
the checks above cover. `CHECKS` (drafters/readers.py) is run by drafters/dspark/export.py `export_checks`.
"""

from __future__ import annotations

from typing import Any, Mapping

from drafters.base import TargetInfo
from drafters.dflash.checks import Layout, at_path, backbone_checks
from drafters.readers import Check, Checkpoint, FormatChecks

_HEADS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
LAYOUTS = {
    "speculators": Layout(
        "speculators", "transformer_layer_config",
        id_places=(("aux_hidden_state_layer_ids", 0), ("draftsmith.layer_ids", 0)),
        mask_places=("mask_token_id",),
        required=(("aux_hidden_state_layer_ids", "vLLM refuses it"), ("mask_token_id", "vLLM refuses it"),
                  ("block_size", "readers use their default"), ("transformer_layer_config", "vLLM refuses it"),
                  ("sample_from_anchor", "a DFlash reader would take the anchor slot for the bonus token"),
                  ("speculators_config.proposal_methods", "vLLM cannot tell how many tokens to propose"))
        + tuple((name, "readers build the heads from their defaults") for name in _HEADS)),
    "deepspec": Layout(
        "deepspec", None,
        id_places=(("target_layer_ids", 1), ("draftsmith.layer_ids", 0)),
        mask_places=("mask_token_id",),
        required=(("target_layer_ids", "DeepSpec cannot build the context projection"),
                  ("mask_token_id", "DeepSpec cannot fill the block"), ("block_size", "DeepSpec uses its default"),
                  ("num_target_layers", "DeepSpec cannot check the target"))
        + tuple((name, "DeepSpec builds the heads from its defaults") for name in _HEADS)),
}
MEANT_FOR = {"speculators": "vLLM (method dspark), speculators 0.9 DSparkDraftModel",
             "deepspec": "DeepSpec Qwen3DSparkModel.from_pretrained"}


def block_check(fmt: str, header: Mapping[str, Any]) -> Check:
    """block_size >= 1 drafts, and (speculators) sample_from_anchor true with a proposal of block_size tokens."""
    block = header.get("block_size")
    if block is None:
        return Check("block", "fail", "no block_size")
    problems = [f"block_size {block} < 1"] if int(block) < 1 else []
    if fmt == "speculators":
        tokens = (at_path(header, "speculators_config.proposal_methods") or [{}])[0].get("speculative_tokens")
        if tokens is not None and int(tokens) != int(block):
            problems.append(f"speculative_tokens {tokens} != block_size {block} (the anchor slot drafts too)")
        if header.get("sample_from_anchor") is False:
            problems.append("sample_from_anchor is false (DFlash's block: the anchor slot would not draft)")
    if problems:
        return Check("block", "fail", "; ".join(problems))
    return Check("block", "pass", f"block_size {block}: {block} drafts per round, from the anchor slot on")


def heads_check(header: Mapping[str, Any], shapes: Mapping[str, tuple], info: TargetInfo) -> Check:
    """The weights of the sequential and confidence heads match the fields a reader builds them from."""
    hidden, vocab = info.hidden_size, info.vocab_size
    rank = int(header.get("markov_rank") or 0)
    kind = header.get("markov_head_type", "vanilla")
    expected: dict[str, tuple] = {}
    if rank > 0:
        expected = {"markov_head.markov_w1.weight": (vocab, rank), "markov_head.markov_w2.weight": (vocab, rank)}
        if kind == "gated":
            expected["markov_head.gate_proj.weight"] = (rank, hidden + rank)
        elif kind == "rnn":
            expected["markov_head.joint_proj.weight"] = (3 * rank, 2 * rank + hidden)
    if header.get("enable_confidence_head"):
        with_markov = bool(header.get("confidence_head_with_markov")) and rank > 0
        expected["confidence_head.proj.weight"] = (1, hidden + (rank if with_markov else 0))
    if "lm_head.weight" in shapes:  # DeepSpec's frozen copy of the target's head
        expected["lm_head.weight"] = (vocab, hidden)
    problems = [f"{name} has shape {None if shapes.get(name) is None else list(shapes[name])}, expected {list(want)}"
                for name, want in expected.items() if tuple(shapes.get(name) or ()) != want]
    modules = {name.rsplit(".", 1)[0] for name in expected}  # their biases come along
    unread = sorted(name for name in shapes if name.split(".")[0] in ("markov_head", "confidence_head")
                    and name.rsplit(".", 1)[0] not in modules)
    if unread:
        problems.append(f"{', '.join(unread)} written but the fields ({', '.join(_HEADS)}) tell readers not to build"
                        " them: a trained head would be dropped")
    if problems:
        return Check("heads", "fail", "; ".join(problems))
    markov = f"{kind} Markov head, rank {rank}" if rank > 0 else "no sequential head"
    confidence = "a confidence head" if header.get("enable_confidence_head") else "no confidence head"
    return Check("heads", "pass", f"{markov}, {confidence}: weights match")


def _body(directory: str, opened: Checkpoint, target_info: TargetInfo) -> list[Check]:
    fmt, header, _, _ = opened
    return [*backbone_checks(LAYOUTS[fmt], header, opened.shapes, target_info), block_check(fmt, header),
            heads_check(header, opened.shapes, target_info)]


CHECKS = FormatChecks(
    "dspark", "`draftsmith export DIR --format speculators` (vLLM) or `--format deepspec` (DeepSpec)",
    layout=lambda fmt: f"{fmt} layout, meant for {MEANT_FOR[fmt]}", body=_body)
