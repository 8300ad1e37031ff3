"""`draftsmith train RECIPE [key=value ...]` and `accelerate launch [--config_file X.yaml] -m train RECIPE [k=v ...]`.

Load the recipe, build the run, fit. Exit status: 0 done, 2 bad input or a run that diverged (one line says which
field or step), 143 preempted by SIGTERM after writing a checkpoint (rerun with train.resume_from=latest;
docs/reliability.md). For example:

    draftsmith train recipes/debug/tiny_eagle3.yaml output.dir=runs/debug
    accelerate launch --config_file recipes/accelerate/8gpu_ddp.yaml -m train recipes/llama3.1-8b/eagle3.yaml \\
        train.resume_from=latest
"""

from __future__ import annotations

import sys
import time

from drafters.files import check_writable_dir
from inference.evaluation.prompts import load_questions
from train.build import build_trainer
from train.cli import run_reporting_errors
from train.config import Recipe, recipe_from_argv, recipe_parser
from train.fit.checkpoint import resolve_resume
from train.fit.loop import PREEMPTED_EXIT_CODE, Preempted
from train.fit.metrics import check_trackers
from train.warm_start import check_init_from

DESCRIPTION = "Train a drafter from a recipe."
PROG = "draftsmith train"


def build_parser():
    return recipe_parser(PROG, DESCRIPTION)


def check_before_loading(recipe: Recipe) -> None:
    """What the run would refuse only after loading the target and the data: an output.dir it cannot write, the
    checkpoint to resume from or start from, the prompt set of the decoding probe, and trackers accelerate would drop
    without a word when not installed."""
    check_writable_dir(recipe.output.dir, "output.dir")
    resolve_resume(recipe.output.dir, recipe.train.resume_from)
    check_init_from(recipe)
    if recipe.eval.num_prompts > 0:
        load_questions(recipe.eval.prompts)
    check_trackers(recipe.logging.trackers)


def main(argv: list[str] | None = None) -> int:
    recipe = recipe_from_argv(PROG, DESCRIPTION, argv)
    check_before_loading(recipe)
    started = time.perf_counter()
    trainer = build_trainer(recipe)
    try:
        final_dir = trainer.fit()
    except Preempted as stop:
        trainer.accelerator.print(f"draftsmith train: {stop}")
        trainer.accelerator.end_training()
        return PREEMPTED_EXIT_CODE
    trainer.accelerator.print(f"wrote {final_dir} ({time.perf_counter() - started:.1f} s, step {trainer.step})")
    trainer.accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(run_reporting_errors("train", main, None, build_parser))
