"""`draftsmith export CKPT --format FORMAT --out DIR`: a trained drafter in a serving format.

Formats by drafter kind (`--help` lists them from the registry; each drafter's `save` refuses, naming the reader
and the alternative, what its layout cannot carry): EAGLE-3 speculators | eagle3 (plain, vLLM) | sglang (SGLang /
SpecForge); DFlash dflash (z-lab, read by the dflash package, transformers and vLLM) | speculators; DSpark
speculators | deepspec; MTP deepseek_v3 | qwen3_next | qwen3_5 | mimo | speculators; every drafter native.

    draftsmith export runs/smollm2_eagle3/final --format speculators --out runs/smollm2_eagle3/speculators \
        --verifier-name HuggingFaceTB/SmolLM2-135M-Instruct

CKPT is any directory `draftsmith eval --drafter` takes (native or any layout above), or a training checkpoint
(<output.dir>/checkpoints/step_N, resume state): its drafter is rebuilt from the checkpoint's recipe and weights. The target is loaded
(offline) to check the checkpoint against it and to supply the shared tensors the formats carry (the frozen
embedding); it is read from the checkpoint unless --target names it. --verifier-name is the model id written as the
verifier in the speculators config (vLLM serves it as the main model); by default the target's local path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

from drafters import DRAFTERS
from drafters.files import replace_directory
from inference.engine.target import TargetModel
from train.fit.checkpoint import is_training_checkpoint, load_trained_drafter, training_checkpoint_target



def formats_by_kind() -> str:
    """"kind: format, ..." for every registered drafter that writes more than its native format."""
    return "; ".join(f"{kind}: {', '.join(cls.formats())}" for kind, cls in DRAFTERS.items() if len(cls.formats()) > 1)


def not_a_drafter(directory: str, why: str) -> ValueError:
    """The error for a directory that holds no drafter; a training checkpoint (resume state) points at final/."""
    parent = os.path.dirname(os.path.abspath(directory))
    hint = ""
    if os.path.basename(parent) == "checkpoints":
        hint = (f"; it is a training checkpoint (resume state): export the run's "
                f"{os.path.join(os.path.dirname(parent), 'final')} instead")
    return ValueError(f"{directory}: not a drafter checkpoint ({why}){hint}")


def checkpoint_target(directory: str) -> str | None:
    """The target a checkpoint names: the native header's target, or a speculators verifier."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise not_a_drafter(directory, "no config.json")
    with open(path) as f:
        config = json.load(f)
    target = config.get("target", {}).get("name_or_path")
    verifier = config.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    return target or verifier


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftsmith export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--format", required=True, help=f"a format the checkpoint's drafter writes ({formats_by_kind()};"
                                                        " every drafter: native)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", default=None, help="target name or directory (default: the checkpoint's)")
    parser.add_argument("--verifier-name", default=None, help="verifier id written into the speculators config")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    training = is_training_checkpoint(args.checkpoint)
    try:
        target_name = args.target or (training_checkpoint_target(args.checkpoint) if training
                                      else checkpoint_target(args.checkpoint))
        if not target_name:
            raise ValueError(f"{args.checkpoint} does not name its target; pass --target")
        target = TargetModel.from_pretrained(target_name, dtype=torch.float32)
        info = target.target_info()
        if args.verifier_name:
            info = dataclasses.replace(info, name_or_path=args.verifier_name)
        drafter = load_trained_drafter(args.checkpoint, info)
        if drafter is None:
            raise not_a_drafter(args.checkpoint, "an HF model directory or a name, not a trained drafter")
        with replace_directory(args.out) as tmp_dir:  # a refused format leaves an existing --out untouched
            drafter.save(tmp_dir, args.format)
    except ValueError as err:
        print(f"draftsmith export: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.format} checkpoint to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
