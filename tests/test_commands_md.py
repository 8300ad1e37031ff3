"""docs/commands.md's option tables are what the parsers say: regenerating them (`python -m train.commands_md`)
changes nothing, and the options a user could not find there before are there now."""

from __future__ import annotations

import re

from train.cli import SUBCOMMANDS
from train.commands_md import PAGE, render


def read_page() -> str:
    with open(PAGE) as f:
        return f.read()


def test_the_page_is_what_the_parsers_generate():
    page = read_page()
    assert render(page) == page, "docs/commands.md is stale: run `python -m train.commands_md`"


def test_every_command_has_a_table_and_the_once_missing_options_are_in_it():
    page = read_page()
    assert sorted(re.findall(r"<!-- options: ([a-z]+) -->", page)) == sorted(SUBCOMMANDS)
    table = {name: page.split(f"<!-- options: {name} -->")[1].split("<!-- end -->")[0] for name in SUBCOMMANDS}
    for name, flag in [("eval", "--top-p"), ("eval", "--target-path"), ("eval", "--dtype"), ("eval", "--outputs"),
                       ("export", "--verifier-name"), ("doctor", "--num-draft-tokens"), ("assets", "--cache-dir")]:
        assert f"`{flag} " in table[name] or f"`{flag}`" in table[name], (name, flag)
    assert "`--top-p TOP_P` | `1.0` |" in table["eval"]  # with its default
    formats = page.split("<!-- formats -->")[1].split("<!-- end -->")[0]
    assert "| mtp | " in formats and "`qwen3_5`" in formats


def test_a_stale_table_is_rewritten():
    stale = "<!-- options: assets -->\n| old |\n<!-- end -->\n"
    fresh = render(stale)
    assert "| old |" not in fresh and "`--cache-dir CACHE_DIR`" in fresh
