"""docs/commands.md's option tables, generated from the commands' own parsers, so that the page lists every option
with its default and every export format, and cannot drift from the code (tests/test_commands_md.py regenerates
the page and compares).

    python -m train.commands_md          # rewrite the generated blocks of docs/commands.md in place

The page's prose is written by hand; each generated block sits between `<!-- options: NAME -->` (or
`<!-- formats -->`) and `<!-- end -->`, and only those blocks are replaced.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from drafters import DRAFTERS
from train.cli import SUBCOMMANDS, command_parser

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "commands.md")
BLOCK = re.compile(r"(<!-- (options: [a-z]+|formats) -->\n).*?(<!-- end -->)", re.DOTALL)


def cell(text: str) -> str:
    """Markdown table cell text: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def invocation(action: argparse.Action) -> str:
    """How the argument is written: `--flag VALUE`, `--flag` for a switch, `NAME` for a positional."""
    if not action.option_strings:
        return (action.metavar or action.dest.upper()) + (" ..." if action.nargs == "*" else "")
    flag = max(action.option_strings, key=len)
    if action.nargs == 0:
        return flag
    return f"{flag} {action.metavar or action.dest.upper()}"


def default_text(action: argparse.Action) -> str:
    if action.required or (not action.option_strings and action.nargs not in ("?", "*")):
        return "required"
    if action.nargs == 0:
        return "off"
    if action.default is None or action.default == []:
        return "-"
    return f"`{action.default}`"


def description(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%(" in text:  # argparse's own help placeholders
        text = text % {**vars(action), "prog": prog}
    if action.choices:
        text = f"{text}; one of: {', '.join(map(str, action.choices))}".lstrip("; ")
    return cell(text)


def options_table(name: str) -> str:
    """The table of `draftsmith NAME`'s arguments: how each is written, its default, what it does."""
    parser = command_parser(name)
    rows = ["| argument | default | what it sets |", "|---|---|---|"]
    for action in parser._actions:  # argparse keeps no public list of a parser's arguments
        if isinstance(action, argparse._HelpAction):
            continue
        rows.append(f"| `{invocation(action)}` | {default_text(action)} | {description(action, parser.prog)} |")
    return "\n".join(rows) + "\n"


def formats_table() -> str:
    """Every drafter kind and the formats `draftsmith export --format` writes for it."""
    rows = ["| drafter kind | `--format` |", "|---|---|"]
    rows += [f"| {kind} | {', '.join(f'`{fmt}`' for fmt in cls.formats())} |" for kind, cls in DRAFTERS.items()]
    return "\n".join(rows) + "\n"


def render(page: str) -> str:
    """`page` with every generated block rebuilt; a block naming an unknown command is a ValueError."""
    def block(match: re.Match) -> str:
        key = match.group(2)
        if key == "formats":
            return match.group(1) + formats_table() + match.group(3)
        name = key.removeprefix("options: ")
        if name not in SUBCOMMANDS:
            raise ValueError(f"{PAGE}: a block names {name!r}, which is not a command ({', '.join(SUBCOMMANDS)})")
        return match.group(1) + options_table(name) + match.group(3)

    return BLOCK.sub(block, page)


def write_commands_md(path: str = PAGE) -> str:
    with open(path) as f:
        page = f.read()
    with open(path, "w") as f:
        f.write(render(page))
    return path


if __name__ == "__main__":
    print(f"wrote {write_commands_md()}")
    sys.exit(0)
