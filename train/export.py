"""`draftsmith export CKPT --format FORMAT --out DIR`: a trained drafter in a serving format.

Formats by drafter kind (`--help` lists them from the registry; each drafter's `save` refuses, naming the reader
and the alternative, what its layout cannot carry): EAGLE-3 speculators | eagle3 (plain, vLLM) | sglang (SGLang /
SpecForge); DFlash dflash (z-lab, read by the dflash package, transformers and vLLM) | speculators; DSpark
speculators | deepspec; MTP deepseek_v3 | qwen3_next | qwen3_5 | mimo | speculators; every drafter native.

    draftsmith export runs/smollm2_eagle3/final --format speculators --out runs/smollm2_eagle3/speculators

CKPT is any directory `draftsmith eval --drafter` takes (native or any layout above), or a training checkpoint
(<output.dir>/checkpoints/step_N, resume state): its drafter is rebuilt from the checkpoint's recipe and weights. The target's
head is read (offline) to check the checkpoint against it and to supply the shared tensors the formats carry (the
frozen embedding): from safetensors only the embeddings, final norm and lm_head (`export_target`); it is the
checkpoint's target unless --target names it. --verifier-name is the model id written as the
verifier in the speculators config, which vLLM serves as the main model: by default the target's Hugging Face Hub id
where its name or path shows one (the embedded SmolLM2, a Hub cache snapshot), else its local path, with a warning.
Every argument is checked before the target loads.

--draft-vocab-size N writes a frequency-ranked head (FR-Spec, Zhao et al. 2025): the N tokens the drafter's training
data uses most (its recipe's data, the tokens a loss reads, counted as training counts them) keep their rows of the
drafter's head, or of the target's head for a drafter that drafts through it (DFlash, DSpark, MTP; DSpark's Markov
head keeps the same rows of W2, and is written in the native format only); the rest can no longer be drafted. Each
kept token's logit is unchanged, so a draft is lost only where the best token is a rare one, and the head costs N
rows a position instead of the whole vocabulary (SmolLM2: 8,192 of 49,152).

    draftsmith export runs/smollm2_dflash_long/final --format native --draft-vocab-size 8192 --out runs/dflash_fr8k
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

from drafters import DRAFTERS, check_drafter_spec, check_trained_for, checkpoint_kind, training_run_hint
from drafters.files import check_writable_dir, replace_directory
from drafters.vocab import DraftHead
from inference.assets.store import hub_name, resolve_target, target_config
from inference.engine.target import TargetModel, head_target
from inference.engine.target_files import holds_safetensors
from inference.evaluation.settings import TRUST_REMOTE_CODE_HELP
from train.config import load_recipe
from train.data.dataset import build_dataset
from train.data.vocab import count_tokens
from train.fit.checkpoint import is_training_checkpoint, load_trained_drafter


def formats_by_kind() -> str:
    """"kind: format, ..." for every registered drafter that writes more than its native format."""
    return "; ".join(f"{kind}: {', '.join(cls.formats())}" for kind, cls in DRAFTERS.items() if len(cls.formats()) > 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="drafter checkpoint (a run's final/, any export) or a training checkpoint "
                                           "(checkpoints/step_N)")
    parser.add_argument("--format", required=True, help=f"a format the checkpoint's drafter writes ({formats_by_kind()};"
                                                        " every drafter: native)")
    parser.add_argument("--out", required=True, help="directory to write; an existing export there is replaced")
    parser.add_argument("--target", default=None, help="target name or directory (default: the checkpoint's)")
    parser.add_argument("--verifier-name", default=None,
                        help="model id written as the verifier of a speculators config, the model vLLM serves "
                             "(default: the target's Hub id where known, else its local path)")
    parser.add_argument("--draft-vocab-size", type=int, default=None, metavar="N",
                        help="keep the head's rows of the N tokens the checkpoint's training data uses most "
                             "(EAGLE-3, DFlash, MTP; DSpark in --format native; module doc)")
    parser.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)
    return parser


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def checkpoint_facts(directory: str) -> tuple[str, str | None, dict]:
    """(drafter kind, target name_or_path, the target sizes it was trained for) of a checkpoint, from its files
    alone: a training checkpoint's recipe.yaml and target.json, or a drafter checkpoint's config.json (the native
    header, or a speculators verifier, which records no sizes)."""
    if is_training_checkpoint(directory):
        recipe = load_recipe(os.path.join(directory, "recipe.yaml"))
        sizes_path = os.path.join(directory, "target.json")
        sizes = read_json(sizes_path) if os.path.isfile(sizes_path) else {}
        return recipe.drafter_kind, recipe.target.name_or_path, sizes
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(f"{directory}: not a drafter checkpoint (no config.json){training_run_hint(directory)}")
    kind = checkpoint_kind(directory)
    config = read_json(os.path.join(directory, "config.json"))
    sizes = config.get("target") or {}
    verifier = config.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    return kind, sizes.get("name_or_path") or verifier, sizes


def check_out(out: str, checkpoint: str) -> None:
    """--out is replaced as a whole: refuse a file, the checkpoint itself or a directory holding it, and a non-empty
    directory that holds no checkpoint (a run directory, a folder of runs), which the export would delete."""
    out_path, checkpoint_path = os.path.realpath(out), os.path.realpath(checkpoint)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out: {out} is a file; pass a directory")
    check_writable_dir(out, "--out")
    if checkpoint_path == out_path or checkpoint_path.startswith(out_path + os.sep):
        raise ValueError(f"--out: {out} holds the checkpoint being exported, and the export replaces it; "
                         "choose another directory")
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, "config.json")):
        raise ValueError(f"--out: {out} is a directory with other files, which the export would replace; pass a "
                         "new directory or an earlier export")


def verifier_name(given: str | None, target_name: str) -> str | None:
    """--verifier-name, else the target's Hub id where known; None keeps the local path, with a warning, since a
    serving machine rarely has the same path."""
    if given:
        return given
    hub = hub_name(target_name)
    if hub is None:
        print(f"draftsmith export: warning: a speculators config names the verifier {target_name!r} (a local path); "
              "pass --verifier-name ORG/NAME for the id the serving machine loads", file=sys.stderr)
    return hub


def check_arguments(args: argparse.Namespace) -> str:
    """Everything export can refuse before the target loads; returns the target name to load."""
    check_out(args.out, args.checkpoint)
    kind, trained_target, sizes = checkpoint_facts(args.checkpoint)
    formats = DRAFTERS[kind].formats() if kind in DRAFTERS else ("native",)
    if args.format not in formats:
        raise ValueError(f"--format {args.format!r}: {args.checkpoint} holds drafter kind {kind}, which writes "
                         f"{', '.join(formats)}")
    target_name = args.target or trained_target
    if not target_name:
        raise ValueError(f"{args.checkpoint} does not name its target; pass --target")
    if is_training_checkpoint(args.checkpoint):
        check_trained_for(args.checkpoint, sizes, target_config(target_name), target_name)
    else:
        check_drafter_spec(args.checkpoint, target_config(target_name), target_name)
    if args.draft_vocab_size is not None:
        check_draft_vocab_size(args, kind, sizes)
    check_reduced_head_format(args, kind)
    return target_name


def reduced_size(checkpoint: str) -> int | None:
    """The draft vocabulary size a native checkpoint's config.json records (None: the full one, or not native)."""
    config_path = os.path.join(checkpoint, "config.json")
    header = read_json(config_path) if os.path.isfile(config_path) else {}
    return (header.get("drafter_config") or {}).get("draft_vocab_size")


def check_reduced_head_format(args: argparse.Namespace, kind: str) -> None:
    """A drafter kind whose serving layouts read only a full vocabulary (DraftHead.reduced_head_formats) writes a
    reduced head, asked for now or already in the checkpoint, in the formats that carry it."""
    allowed = getattr(DRAFTERS.get(kind), "reduced_head_formats", None)
    if allowed is None or args.format in allowed:
        return
    if args.draft_vocab_size is None and not reduced_size(args.checkpoint):
        return
    raise ValueError(f"--format {args.format}: its readers take a {kind} drafter over the full vocabulary, and this "
                     f"one has a reduced draft vocabulary; write it with --format {' or '.join(allowed)}, or export "
                     "the full checkpoint without --draft-vocab-size")


def check_draft_vocab_size(args: argparse.Namespace, kind: str, sizes: dict) -> None:
    """--draft-vocab-size: a drafter with a head of its own or the target's (DraftHead), a size below the tokens it
    drafts over now, and a recipe whose data the frequencies come from."""
    if kind not in DRAFTERS or not issubclass(DRAFTERS[kind], DraftHead):
        heads = ", ".join(name for name, cls in DRAFTERS.items() if issubclass(cls, DraftHead))
        raise ValueError(f"--draft-vocab-size: {args.checkpoint} holds drafter kind {kind}, whose head cannot be "
                         f"reduced ({heads} can); leave the option out")
    current = reduced_size(args.checkpoint) or sizes.get("vocab_size")
    if args.draft_vocab_size < 1 or (current and args.draft_vocab_size >= current):
        raise ValueError(f"--draft-vocab-size {args.draft_vocab_size}: must be in [1, {(current or 2) - 1}], below "
                         f"the {current or 'full'} tokens {args.checkpoint} drafts over now")
    if not os.path.isfile(os.path.join(args.checkpoint, "recipe.yaml")):
        raise ValueError(f"--draft-vocab-size: {args.checkpoint} has no recipe.yaml naming the data the token "
                         "frequencies come from (a run's final/ or checkpoints/step_N has one); export a "
                         "draftsmith-trained checkpoint")


def reduce_draft_vocab(drafter, checkpoint: str, target: TargetModel, size: int) -> None:
    """The frequency-ranked head: token counts of the checkpoint's recipe's training data (as training counts them
    for a reduced vocabulary), then DraftHead.reduce_draft_vocab."""
    recipe = load_recipe(os.path.join(checkpoint, "recipe.yaml"))
    data = build_dataset(target.tokenizer, recipe.data)
    vocab = target.target_info().vocab_size
    counts = count_tokens(data.train, vocab)
    drafter.reduce_draft_vocab(counts, size)
    share = float(counts[drafter.draft_ids().cpu()].sum()) / max(1, int(counts.sum()))
    print(f"draft vocabulary: {size} tokens, {share:.2%} of the {int(counts.sum())} tokens of the "
          f"{len(data.train)} training conversations it was trained on")


def export_target(name: str, trust_remote_code: bool = False) -> TargetModel:
    """What export reads of the target, in float32: the sizes, the tokenizer and the head's tensors a format carries
    (embeddings, final norm, lm_head). From safetensors files only those are read (`head_target`: the decoder stays
    on the meta device, so a 70B target's drafter exports in a few GB); any other layout loads whole."""
    path = resolve_target(name)
    if holds_safetensors(path):
        return head_target(path, torch.float32, "cpu", trust_remote_code)
    return TargetModel.from_pretrained(name, dtype=torch.float32, trust_remote_code=trust_remote_code)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    target_name = check_arguments(args)
    target = export_target(target_name, args.trust_remote_code)
    info = target.target_info()
    if args.format == "speculators":
        name = verifier_name(args.verifier_name, target_name)
        info = dataclasses.replace(info, name_or_path=name) if name else info
    drafter = load_trained_drafter(args.checkpoint, info)
    if drafter is None:
        raise ValueError(f"{args.checkpoint}: not a drafter checkpoint (an HF model directory or a name, not a "
                         "trained drafter)")
    if args.draft_vocab_size is not None:
        reduce_draft_vocab(drafter, args.checkpoint, target, args.draft_vocab_size)
    with replace_directory(args.out) as tmp_dir:  # a refused format leaves an existing --out untouched
        drafter.save(tmp_dir, args.format)
    print(f"wrote {args.format} checkpoint to {args.out}")
    return 0


if __name__ == "__main__":
    from train.cli import run_reporting_errors

    sys.exit(run_reporting_errors("draftsmith export", main, None, build_parser))
