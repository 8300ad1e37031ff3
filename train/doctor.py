"""`draftsmith doctor DRAFTER --target T [--prompts P] [--serve vllm]`: check a drafter checkpoint before it ships.

    draftsmith doctor runs/smollm2_eagle3/speculators --target smollm2-135m-instruct
    /work/envs/vllm/bin/draftsmith doctor runs/smollm2_eagle3/speculators --target smollm2-135m-instruct --serve vllm

Two kinds of checks, each printed as PASS / FAIL / WARN / INFO with what to fix:
1. The format checks the drafter's kind provides (its export module's `export_checks(directory, target_info)`,
   drafters/readers.py, over drafters/{eagle3,dflash,dspark,mtp}/readers.py):
   required fields present and explicit, layer ids in range, sorted, unique and the same in every place a reader
   looks, the mask token (block drafters), sizes and vocabulary matching the target, and which readers load the
   file correctly and which would misread it.
2. An engine check, the same for every kind: five prompts (rendered with the target's chat template exactly as
   `draftsmith eval` does) decoded greedily through our engine with the checkpoint, and again with a copy of the
   drafter whose weights are re-initialised at random (`reset_parameters` on every module that has it). The bar:
   the checkpoint's first-position acceptance must beat the random copy's by at least 0.10 and by three standard
   errors of the difference (a two-proportion z of 3), i.e. clearly above what a drafter that learned nothing
   gets on the same prompts. k is capped at the drafter's longest proposal (a DFlash block of 4 drafts 3). The
   per-position acceptance (unconditional: rounds whose first j drafts were all accepted / rounds) and
   tau = 1 + accepted / rounds are printed for both.
3. With `--serve vllm` (in an environment where vLLM is importable): the export served by vLLM on the same prompts,
   k and greedy settings beside our engine; differing outputs or acceptance (per position) fail (train/serve_check.py).

DRAFTER may also be `native-mtp` (the MTP modules in --target's own checkpoint) or a model directory whose checkpoint
holds MTP modules (an export into the target family's layout, `draftsmith export CKPT --format qwen3_5 ...`): the
format rows are then drafters/mtp/native_checks.py's, and vLLM serves that directory with `method: mtp`.

Exit status: 0 when nothing failed, 1 when a check failed, 2 for bad input (one line naming the field).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys

import torch

from drafters import DRAFTERS, NAMED_DRAFTERS, checkpoint_kind, load_drafter
from drafters.mtp import export as mtp_export
from drafters.mtp.native_checks import native_checks
from inference.assets.store import resolve_target
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel, default_device
from inference.evaluation.chat_template import check_chat_template, parse_template_kwargs, render_prompt
from inference.evaluation.eval import check_drafters
from inference.evaluation.metrics import acceptance_counts
from inference.evaluation.prompts import load_questions
from inference.evaluation.settings import DTYPE_CHOICES, TRUST_REMOTE_CODE_HELP, EvalSettings
from train import serve_check

MIN_GAIN = 0.10  # first-position acceptance over the random copy's
MIN_Z = 3.0  # two-proportion z of that difference
STATUS = {"pass": "PASS", "fail": "FAIL", "warn": "WARN", "info": "INFO"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", help="the checkpoint directory to check (native or any export; a target directory "
                        "with MTP modules in it), or native-mtp: the modules in --target's own checkpoint")
    parser.add_argument("--target", required=True, help="the target it will serve with (name or directory)")
    parser.add_argument("--prompts", default="mt_bench", help="builtin prompt set or FastChat question file")
    parser.add_argument("--num-draft-tokens", type=int, default=3, help="k for the engine check")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per prompt")
    parser.add_argument("--chat-template-kwargs", default=None, metavar="NAME=VALUE,...",
                        help="options the chat template reads, e.g. enable_thinking=false (the drafter's recipe's)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="what the target and drafter compute in; auto: float32 on a CPU, bfloat16 on a GPU")
    parser.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)
    parser.add_argument("--serve", default=None, metavar="SERVER",
                        help="also serve the export with SERVER (vllm) on the same prompts and compare its outputs and "
                             "acceptance with our engine's")
    return parser


def acceptance(target, drafter, prompts: list[list[int]], k: int, max_new_tokens: int) -> dict:
    """Greedy run through our engine -> rounds, unconditional per-position acceptance, tau."""
    out = speculative_generate(target, drafter, prompts, num_draft_tokens=k, max_new_tokens=max_new_tokens)
    counts = acceptance_counts(out)
    rounds = max(counts["rounds"], 1)
    return {"rounds": counts["rounds"], "per_position": [s / rounds for s in counts["survived"]],
            "tau": 1 + counts["accepted"] / rounds}


def randomised(drafter):
    """A copy of `drafter` (sharing the target's tensors) with every module that can re-initialise itself
    re-initialised (seeded); buffers such as a draft vocabulary are kept."""
    copied = copy.deepcopy(drafter, memo={id(drafter.target_info): drafter.target_info})
    torch.manual_seed(0)
    for module in copied.modules():
        if module is not copied and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return copied


def engine_check(trained: dict, random: dict) -> tuple[str, str]:
    """(status, detail) of the bar in the module docstring."""
    p1, n1 = trained["per_position"][0], trained["rounds"]
    p0, n0 = random["per_position"][0], random["rounds"]
    pooled = (p1 * n1 + p0 * n0) / max(n1 + n0, 1)
    error = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / max(n1, 1) + 1 / max(n0, 1)))
    z = (p1 - p0) / error
    detail = (f"acceptance per position {_fmt(trained['per_position'])} (tau {trained['tau']:.2f}, {n1} rounds) vs"
              f" random weights {_fmt(random['per_position'])} (tau {random['tau']:.2f}); gain {p1 - p0:+.2f}, z"
              f" {z:.1f}")
    if p1 - p0 >= MIN_GAIN and z >= MIN_Z:
        return "pass", detail
    return "fail", (detail + f"; needs a gain >= {MIN_GAIN} and z >= {MIN_Z}: the drafter drafts no better than"
                    " random weights here (wrong layer ids, a layer left at its init, another target, too little"
                    " training?)")


def served(target, drafter, directory: str, fields: dict, prompts: list[list[int]], k_asked: int,
           settings: EvalSettings, native: str | None = None) -> tuple[str, str]:
    """The export served by vLLM beside our engine (train/serve_check.py), as one row's (status, detail); fields:
    vLLM's speculative method and flags (serve_check.require); `native`: the model directory whose own MTP modules
    vLLM serves instead."""
    k = serve_check.served_k(drafter, k_asked)
    mine = serve_check.ours(target, drafter, prompts, k, settings.max_new_tokens)
    dtype = str(target.model.dtype).removeprefix("torch.")
    try:
        theirs = serve_check.vllm_served(native or target.name_or_path, None if native else directory, fields, k,
                                         prompts, settings.max_new_tokens, dtype, target.device.type,
                                         settings.trust_remote_code)
    except Exception as err:  # vLLM's refusal of the file (or of the target) is the finding: one line, the rows stand
        message = f"{type(err).__name__}: " + " ".join(str(err).split())[:400]
        if target.device.type == "cpu" and serve_check.CPU_LIMIT in str(err):
            return "warn", f"vLLM CPU cannot run this drafter beside this target ({message}): its MLA and standard " \
                "attention kernels share no KV block size, which says nothing of the export; serve it on a GPU"
        return "fail", f"vLLM (method {fields['method']}, k={k}) did not serve it (the export or the target: read " \
            "the error): " + message
    status, detail = serve_check.compare(theirs, mine)
    return status, f"k={k}, " + detail


def _header(directory: str) -> dict:
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


def settings_from(args: argparse.Namespace) -> EvalSettings:
    if args.num_draft_tokens < 1 or args.max_new_tokens < 1:
        raise ValueError("--num-draft-tokens and --max-new-tokens must be >= 1")
    return EvalSettings(target=args.target, drafter=(args.drafter,), prompts=(args.prompts,), num_prompts=5,
                        num_draft_tokens=(args.num_draft_tokens,), max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                        chat_template_kwargs=parse_template_kwargs(args.chat_template_kwargs),
                        trust_remote_code=args.trust_remote_code)


def native_mtp(spec: str, target: str) -> str | None:
    """The model directory whose own MTP modules DRAFTER names (module docstring), or None."""
    if spec in NAMED_DRAFTERS:
        directory = resolve_target(target)  # its own checkpoint: a name resolves as the target loads
        if not mtp_export.holds_native(directory):
            raise ValueError(f"DRAFTER {spec}: --target {target}'s checkpoint holds no MTP modules in a known layout "
                             f"({', '.join(mtp_export.NATIVE_LAYOUTS)}); check a trained MTP export instead")
        return directory
    if checkpoint_kind(spec) == "draft_model" and mtp_export.holds_native(spec):
        return spec
    return None


def run(settings: EvalSettings, serve: str | None = None) -> int:
    (directory,), (prompt_set,), (k_asked,) = settings.drafter, settings.prompts, settings.num_draft_tokens
    native = native_mtp(directory, settings.target)
    kind = "mtp" if native else checkpoint_kind(directory)
    if kind not in DRAFTERS:
        raise ValueError(f"{directory}: drafter kind {kind!r} is not registered; known: {sorted(DRAFTERS)}")
    fields = serve_check.require(serve, kind, _header(native or directory)) if serve else None
    check_drafters(settings, flag="DRAFTER")  # trained for a target of other sizes: refused before the target loads
    _, questions = load_questions(prompt_set, num_prompts=settings.num_prompts)
    device = default_device()
    target = TargetModel.from_pretrained(settings.target, dtype=settings.torch_dtype(device), device=device,
                                         trust_remote_code=settings.trust_remote_code)
    info = target.target_info()
    use_template = bool(getattr(target.tokenizer, "chat_template", None))
    check_chat_template(target.tokenizer, use_template, settings.target, settings.chat_template_kwargs)
    prompts = [render_prompt(target.tokenizer, q.turns[:1], [], use_template, settings.chat_template_kwargs)
               for q in questions]
    what = f"the MTP modules in {native}'s own checkpoint" if native else f"drafter kind {kind}"
    print(f"draftsmith doctor: {directory} ({what}) for target {settings.target}")
    module = DRAFTERS[kind].export_module
    native_state = None  # the module tensors the native rows read, handed to the drafter (read once)
    if native:
        checks, native_state = native_checks(native, info)
        rows = [tuple(row) for row in checks]
    elif module and module.export_checks:
        rows = [tuple(row) for row in module.export_checks(directory, info)]
    else:
        rows = [("format", "info", f"drafter kind {kind!r} provides no format checks")]
    rows += [row for row in (serve_check.routing(native or target.name_or_path),
                             serve_check.model_window(target.name_or_path) if kind != "medusa" else None) if row]
    try:  # on the target's device, in its dtype
        drafter = target.serve(DRAFTERS["mtp"].from_target(info, native, native_state) if native else
                               load_drafter(directory, info))
        del native_state
    except ValueError as err:
        rows.append(("engine", "fail", f"our engine cannot load it: {err}"))
    else:
        k = min(k_asked, drafter.max_draft_tokens() or k_asked)
        trained = acceptance(target, drafter, prompts, k, settings.max_new_tokens)
        random = acceptance(target, randomised(drafter), prompts, k, settings.max_new_tokens)
        rows.append(("engine", *engine_check(trained, random)))
        if fields:
            rows.append((f"serve {serve}", *served(target, drafter, directory, fields, prompts, k_asked, settings,
                                                    native)))
    width = max(len(name) for name, _, _ in rows)
    for name, status, detail in rows:
        print(f"  {STATUS[status]}  {name:<{width}}  {detail}")
    failed = sum(status == "fail" for _, status, _ in rows)
    print(f"{len(rows)} checks: {failed} failed, {sum(s == 'warn' for _, s, _ in rows)} warnings")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return run(settings_from(args), args.serve)
    except (ValueError, OSError, KeyError) as err:
        message = str(err).strip("'\"") if isinstance(err, KeyError) else str(err)
        print(f"draftsmith doctor: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
