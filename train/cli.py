"""`draftsmith` console entry point: dispatches a subcommand to the module that owns it.

    draftsmith assets    [--draft-model-layers N]        install/convert the embedded default target
    draftsmith eval      --target T --drafter D ...      speculative decoding against the real target, report
    draftsmith train     RECIPE [key=value ...]          train a drafter (same as `accelerate launch -m train`)
    draftsmith prepare   RECIPE [key=value ...]          regenerate answers / write the offline feature cache
    draftsmith estimate  RECIPE [key=value ...]          disk and time an offline cache will take
    draftsmith export    CKPT --format F --out DIR       write a checkpoint in a serving format
    draftsmith doctor    DRAFTER --target T [--prompts P]  check an export the way each server reads it
    draftsmith calibrate DRAFTER --target T --prompts P --out DIR   fit and store confidence temperatures (STS)

Bad input gets one line naming the field or file and what to do, exit status 2; add --debug anywhere on the
command line (or set DRAFTSMITH_DEBUG=1) to see the traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import importlib
import os
import sys

import yaml

SUBCOMMANDS = {
    "assets": "inference.assets.store",
    "eval": "inference.evaluation.eval",
    "train": "train.__main__",
    "prepare": "train.prepare",
    "estimate": "train.estimate",
    "export": "train.export",
    "doctor": "train.doctor",
    "calibrate": "inference.evaluation.calibrate",
}


# bad input, missing or unwritable files, a run that diverged; and any OSError of a full disk (is_user_error)
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
               FloatingPointError)
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # drafters.files.DiskFullError and raw ones alike
DEBUG_FLAG = "--debug"
DEBUG_ENV = "DRAFTSMITH_DEBUG"


def is_user_error(err: BaseException) -> bool:
    """Errors the user can fix (a recipe that is not valid YAML included, or an error class that says so with
    `user_error = True`, as a lost stream producer does); anything else is a bug: traceback."""
    return (isinstance(err, USER_ERRORS + (yaml.YAMLError,)) or getattr(err, "user_error", False) is True
            or (isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS))


def describe(err: BaseException) -> str:
    """The one line for a user error. Errors raised by the OS itself ("[Errno 2] No such file or directory: 'x'")
    are reworded to lead with the file; our own (drafters.files.DiskFullError included) already name the field
    or file and what to do."""
    if type(err).__module__ == "builtins" and isinstance(err, OSError) and err.filename and err.strerror:
        remedy = ("free space there or choose another output directory" if err.errno in DISK_FULL_ERRNOS
                  else "check the path (and its permissions)")
        return f"{err.filename}: {err.strerror.lower()}; {remedy}"
    if isinstance(err, yaml.YAMLError):  # PyYAML's message spans lines and names the file, line and column
        return f"not valid YAML: {' '.join(str(err).split())}; fix the recipe there"
    return str(err)


def command_parser(name: str) -> argparse.ArgumentParser:
    """The argparse parser of subcommand `name` (each command module's build_parser)."""
    return importlib.import_module(SUBCOMMANDS[name]).build_parser()


def check_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Parse `argv` once up front so that a missing, unknown or malformed argument is a ValueError (one line) rather
    than argparse's usage block; the command parses it again itself. --help still prints the help and exits."""
    def refuse(message: str):
        raise ValueError(f"{message} ({parser.prog} --help lists the options)")

    parser.error = refuse  # this parser object only: it is built for this check and dropped
    parser.parse_args(argv)


def run_reporting_errors(prog: str, entry, argv: list[str] | None, build_parser=None) -> int:
    """Run a subcommand's main; a user error becomes one line on stderr naming what to fix, and exit status 2.

    Every draftsmith error for bad input is a ValueError (or a file error) whose message names the field and what
    to do, so the traceback adds nothing for the user; `--debug` or DRAFTSMITH_DEBUG=1 lets it through. With
    `build_parser`, the arguments are checked against it first (check_arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [arg for arg in argv if arg != DEBUG_FLAG]
    try:
        if build_parser is not None:
            check_arguments(build_parser(), argv)
        return int(entry(argv) or 0)
    except Exception as err:  # noqa: BLE001 - only user errors are caught, the rest is re-raised
        if debug or not is_user_error(err):
            raise
        print(f"{prog}: error: {describe(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def unknown_command(name: str) -> str:
    """The one line for a subcommand that does not exist, with the closest one when it looks like a typo."""
    close = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
    guess = f"did you mean {close[0]!r}? " if close else ""
    return f"draftsmith: error: unknown command {name!r}; {guess}commands: {', '.join(SUBCOMMANDS)} (draftsmith --help)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if DEBUG_FLAG in argv[:1]:  # `draftsmith --debug train ...` as well as `draftsmith train ... --debug`
        argv = argv[1:] + [DEBUG_FLAG]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(unknown_command(argv[0]), file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]])
    return run_reporting_errors(f"draftsmith {argv[0]}", module.main, argv[1:], module.build_parser)


if __name__ == "__main__":
    sys.exit(main())
