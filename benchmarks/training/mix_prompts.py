"""Prompts for the data-mix lever (issue 37): ShareGPT conversations the shipped 10k file did not answer, picked by
domain from their first user turn, written as OpenAI-format records for `draftsmith prepare` to answer with the target.

    python benchmarks/training/mix_prompts.py --domain code --num 110 --out runs/levers/mix/sharegpt_code_prompts.jsonl

The rule is a plain word match on the first user turn, no model: "code" when the turn holds a code fence or names a
programming language, a code artefact (code, function, API, JSON, regex, SQL) or a build error ("class" and
"script" are left out: essays and films use them); "math" when it
asks to solve, calculate or prove, names a maths object (equation, integral, derivative, probability, matrix) or holds
an arithmetic expression; "other" is neither. A turn that matches both counts as code. A conversation is left out when
it is a part of one the shipped file holds (ShareGPT splits long conversations into ids BASE_0, BASE_1, ...: the
held-out slice's included) or when its first turn repeats one seen before, shipped or not (unique_prompts). The order is the package's, so the first N
of a domain are the same on every machine; regeneration then samples them with its own seed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

from train.data.conversations import iter_conversations  # noqa: E402

SHIPPED = "recipes/smollm2/data/sharegpt_smollm2_10k.jsonl.gz"
CODE = re.compile(r"```|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|react|node\.?js|bash|"
                  r"php|kotlin|swift|regex|function|code|api|json|compile|compiler|bug|exception|"
                  r"stack ?trace)\b", re.I)
MATH = re.compile(r"\b(solve|calculate|compute|prove|equation|integral|derivative|probability|matrix|"
                  r"how many|percent(age)?|sum of)\b|\d+(\.\d+)?\s*[-+*/^x]\s*\d+", re.I)


def domain(text: str) -> str:
    return "code" if CODE.search(text) else "math" if MATH.search(text) else "other"


def first_turn(record: dict) -> str | None:
    return next((m["content"] for m in record["messages"] if m["role"] == "user"), None)


def shipped_ids(path: str) -> set[str]:
    with gzip.open(path, "rt") as f:
        return {json.loads(line)["id"] for line in f if line.strip()}


def base_id(record_id: str) -> str:
    """ShareGPT's conversation id without its part number ("dxaRH3j_11" -> "dxaRH3j")."""
    return record_id.rsplit("_", 1)[0]


def select(wanted: str, num: int | None, exclude: set[str]) -> list[dict]:
    """The first `num` ShareGPT conversations of domain `wanted` that share no conversation with `exclude` and no
    first user turn with anything before them (the excluded ones included)."""
    records = [r for r in iter_conversations("sharegpt") if not r["skip_reason"]]
    excluded = {base_id(i) for i in exclude}
    seen = {first_turn(r) for r in records if base_id(r["id"]) in excluded}
    chosen = []
    for record in records:
        first = first_turn(record)
        if base_id(record["id"]) in excluded or first is None or first in seen:
            continue
        seen.add(first)
        if domain(first) == wanted:
            chosen.append({"id": record["id"], "messages": record["messages"]})
            if num is not None and len(chosen) == num:
                break
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domain", choices=("code", "math", "other"), required=True)
    parser.add_argument("--num", type=int, default=None, help="how many (default: every one)")
    parser.add_argument("--exclude", default=SHIPPED, help="a .jsonl.gz whose ids are left out (the shipped file)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.num is not None and args.num < 1:
        print("mix_prompts: error: --num must be at least 1", file=sys.stderr)
        return 2
    records = select(args.domain, args.num, shipped_ids(args.exclude))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:  # whole or absent: levers.sh keeps a file that exists
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(args.out + ".tmp", args.out)
    print(f"wrote {len(records)} {args.domain} conversations to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
