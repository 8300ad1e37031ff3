"""`draftsmith calibrate DRAFTER --target T --prompts P --out DIR`: fit the temperatures of a drafter's confidence head.

    draftsmith calibrate runs/smollm2_dspark/final --target smollm2-135m-instruct --prompts spec_bench \\
        --categories translation,summarization,qa,rag --num-prompts 48 --max-new-tokens 96 \\
        --out runs/smollm2_dspark/calibration

Runs held-out prompts (first turns, chat template) through the engine with every proposal verified in full (k = the
drafter's longest proposal, no schedule), records per round the confidence logits of the drafts and which prefix
was accepted, fits Sequential Temperature Scaling (drafters/calibration.py: one temperature per position,
in order, each with the earlier ones frozen) and stores the temperatures in the checkpoint (config.json only; the
weights are untouched). DIR gets calibration.json (per position: ece_before, ece_after, auroc, brier, temperature,
and the "before" values and reliability bins) and reliability.png (predicted vs observed prefix survival per
position, before and after). Calibrate at the temperature you serve at (--temperature): acceptance, hence the
labels, depends on it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from drafters import DRAFTERS, checkpoint_kind, load_drafter
from drafters.calibration import NUM_BINS, TEMPERATURE_GRID, calibration_report, check_rounds, fit_sts
from drafters.files import write_json_atomic
from inference.engine.api import speculative_generate
from inference.engine.target import TargetModel, default_device
from inference.evaluation.chat_template import check_chat_template, parse_template_kwargs, render_prompt
from inference.evaluation.eval import check_drafters, load_prompt_sets
from inference.evaluation.settings import DTYPE_CHOICES, TRUST_REMOTE_CODE_HELP, EvalSettings, check_at_least, split


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", help="drafter checkpoint directory whose proposals carry confidences (DSpark)")
    parser.add_argument("--target", required=True, help="target name (smollm2-135m-instruct) or HF model directory")
    parser.add_argument("--prompts", default="spec_bench", help="comma-separated held-out prompt sets (paths or names)")
    parser.add_argument("--num-prompts", type=int, default=None, help="questions per prompt set (default: all)")
    parser.add_argument("--categories", default=None,
                        help="comma-separated categories to keep (keep the calibration prompts apart from eval's)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature to calibrate for")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts decoded together")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-chat-template", action="store_true", help="feed the prompts as plain text")
    parser.add_argument("--chat-template-kwargs", default=None, metavar="NAME=VALUE,...",
                        help="options the chat template reads, e.g. enable_thinking=false (the drafter's recipe's)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="what the target and drafter compute in; auto: float32 on a CPU, bfloat16 on a GPU")
    parser.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)
    parser.add_argument("--out", required=True, help="directory for calibration.json and reliability.png")
    return parser


def collect(target, drafter, prompts: list[list[int]], settings: EvalSettings
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run every prompt; return confidence logits, prefix-acceptance labels and validity, each [rounds, K]."""
    k = drafter.max_draft_tokens()
    eos = target.target_info().eos_token_ids
    (batch_size,), (temperature,), (name,) = settings.batch_size, settings.temperature, settings.drafter
    logits, labels, valid = [], [], []
    for start in range(0, len(prompts), batch_size):
        out = speculative_generate(target, drafter, prompts[start: start + batch_size], num_draft_tokens=k,
                                   max_new_tokens=settings.max_new_tokens, temperature=temperature,
                                   seed=settings.seed + start, eos_token_ids=eos)
        for row_logits, row_accepts in zip(out.confidence_logits, out.accept_lengths):
            if len(row_logits) != len(row_accepts):
                raise ValueError(f"DRAFTER {name!r}: its proposals carry no confidence logits; only a "
                                 "drafter with a confidence head (DSpark) can be calibrated")
            for round_logits, accepted in zip(row_logits, row_accepts):
                n = len(round_logits)
                logits.append(torch.tensor(round_logits + [0.0] * (k - n), dtype=torch.float64))
                labels.append(torch.arange(k) < accepted)
                valid.append(torch.arange(k) < n)
    if not logits:
        raise ValueError(f"DRAFTER {name!r}: no round carried confidence logits (a drafter without a "
                         "confidence head cannot be calibrated)")
    return torch.stack(logits), torch.stack(labels), torch.stack(valid)


def plot_reliability(report: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(4, len(report))
    rows = (len(report) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 3.4 * rows), squeeze=False)
    for axis, entry in zip(axes.flat, report):
        axis.plot([0, 1], [0, 1], "--", color="0.6", linewidth=1)
        for key, style, label in (("reliability_before", "o:", "before"), ("reliability_after", "o-", "after STS")):
            bins = entry[key]
            axis.plot([b["predicted"] for b in bins], [b["observed"] for b in bins], style, markersize=3, label=label)
        axis.set_title(f"position {entry['position']}: ECE {entry['ece_before']:.3f} -> {entry['ece_after']:.3f}\n"
                       f"T = {entry['temperature']:.2f}, AUROC {entry['auroc']:.3f}", fontsize=9)
        axis.set_xlim(0, 1)
        axis.set_ylim(0, 1)
        axis.set_xlabel("predicted prefix survival", fontsize=8)
        axis.set_ylabel("observed", fontsize=8)
        axis.legend(fontsize=7, loc="upper left")
    for axis in list(axes.flat)[len(report):]:
        axis.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


NOT_CALIBRATABLE = "not a drafter with a confidence head (DSpark) that stores calibration temperatures"


def check_calibratable(name: str) -> None:
    """What main refuses after loading, from the checkpoint's files alone: a drafter whose kind stores no
    calibration temperatures (no confidence head), or no checkpoint directory at all."""
    kind = checkpoint_kind(name) if os.path.isdir(name) else None
    module = getattr(DRAFTERS.get(kind), "export_module", None)
    if getattr(module, "store_confidence_temperatures", None) is None:
        raise ValueError(f"DRAFTER {name!r}: {NOT_CALIBRATABLE}")


def main(argv: list[str] | None = None) -> int:
    """Entry point; bad input is a ValueError that `draftsmith` reports in one line (exit 2)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    check_at_least(("--max-new-tokens", args.max_new_tokens, 1), ("--batch-size", args.batch_size, 1),
                   ("--num-prompts", args.num_prompts, 1), ("--threads", args.threads, 1))
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    settings = EvalSettings(
        target=args.target, drafter=(args.drafter,), prompts=split(args.prompts),
        categories=split(args.categories) if args.categories else None, num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens, temperature=(args.temperature,), batch_size=(args.batch_size,),
        seed=args.seed, threads=args.threads, no_chat_template=args.no_chat_template, dtype=args.dtype, out=args.out,
        chat_template_kwargs=parse_template_kwargs(args.chat_template_kwargs), trust_remote_code=args.trust_remote_code)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if os.path.exists(settings.out) and not os.path.isdir(settings.out):
        raise ValueError(f"--out: {settings.out} is a file; pass a directory")
    prompt_sets = load_prompt_sets(settings)
    check_drafters(settings, "DRAFTER")  # the drafter is the positional argument
    check_calibratable(args.drafter)
    device = default_device()
    target = TargetModel.from_pretrained(settings.target, dtype=settings.torch_dtype(device), device=device,
                                         trust_remote_code=settings.trust_remote_code)
    check_chat_template(target.tokenizer, not settings.no_chat_template, settings.target,
                        settings.chat_template_kwargs)
    (name,) = settings.drafter
    drafter = load_drafter(name, target.target_info())
    module = drafter.export_module if drafter is not None else None
    store = module.store_confidence_temperatures if module is not None else None
    if store is None or drafter.max_draft_tokens() is None:
        raise ValueError(f"DRAFTER {name!r}: {NOT_CALIBRATABLE}")
    drafter = target.serve(drafter)  # on the target's device, in its dtype, in eval mode
    prompts = [render_prompt(target.tokenizer, q.turns[:1], [], not settings.no_chat_template,
                             settings.chat_template_kwargs)
               for _, questions in prompt_sets for q in questions]
    logits, labels, valid = collect(target, drafter, prompts, settings)
    check_rounds(valid)
    temperatures = fit_sts(logits, labels, valid)
    report = calibration_report(logits, labels, valid, temperatures)
    os.makedirs(settings.out, exist_ok=True)
    summary = {"drafter": name, "target": settings.target, "temperature": settings.temperature[0],
               "num_prompts": len(prompts), "rounds": int(valid[:, 0].sum()), "num_bins": NUM_BINS,
               "temperatures": temperatures, "positions": report}
    write_json_atomic(os.path.join(settings.out, "calibration.json"), summary, indent=2)
    plot_reliability(report, os.path.join(settings.out, "reliability.png"))
    store(name, temperatures)
    print("position  rounds  temperature  ece_before  ece_after  auroc  brier")
    for entry in report:
        print(f"{entry['position']:>8}  {entry['rounds']:>6}  {entry['temperature']:>11.3f}"
              f"  {entry['ece_before']:>10.4f}"
              f"  {entry['ece_after']:>9.4f}  {entry['auroc']:.3f}  {entry['brier']:.4f}")
    edges = [e["position"] for e in report if e["temperature"] in (TEMPERATURE_GRID[0], TEMPERATURE_GRID[-1])]
    if edges:  # temperature scaling rescales logits; it cannot move a confidence that is biased at logit 0
        print(f"note: positions {edges} hit the edge of the temperature grid ({TEMPERATURE_GRID[0]:g}.."
              f"{TEMPERATURE_GRID[-1]:g}): their confidences are biased, not merely over- or under-confident")
    print(f"stored the temperatures in {name}; wrote {settings.out}/calibration.json and reliability.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
