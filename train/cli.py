"""`draftsmith` console entry point: dispatches a subcommand to the module that owns it.

    draftsmith assets    [--draft-model-layers N]        install/convert the embedded default target
    draftsmith eval      --target T --drafter D ...      speculative decoding against the real target, report
    draftsmith train     RECIPE [key=value ...]          train a drafter (same as `accelerate launch -m train`)
    draftsmith prepare   RECIPE [key=value ...]          regenerate answers / write the offline feature cache
    draftsmith estimate  RECIPE [key=value ...]          disk and time an offline cache will take
    draftsmith export    CKPT --format F --out DIR       write a checkpoint in a serving format
    draftsmith doctor    DRAFTER --target T [--prompts P]  check an export the way each server reads it
    draftsmith calibrate DRAFTER --target T --prompts P --out DIR   fit and store confidence temperatures (STS)
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "assets": "inference.assets",
    "eval": "inference.eval",
    "train": "train.__main__",
    "prepare": "train.prepare",
    "estimate": "train.estimate",
    "export": "train.export",
    "doctor": "train.doctor",
    "calibrate": "inference.calibrate",
}


USER_ERRORS = (ValueError, FileNotFoundError, FloatingPointError)  # bad input, missing files, a run that diverged


def run_reporting_errors(prog: str, entry, argv: list[str] | None) -> int:
    """Run a subcommand's main; a user error becomes one line on stderr naming what to fix, and exit status 2.

    Every draftsmith error for bad input is a ValueError (or FileNotFoundError) whose message names the field and
    what to do, so the traceback adds nothing for the user."""
    try:
        return int(entry(argv) or 0)
    except USER_ERRORS as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown subcommand {argv[0]!r}; choose one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(SUBCOMMANDS[argv[0]])
    return run_reporting_errors(f"draftsmith {argv[0]}", module.main, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
