"""Evaluation prompt sets in the FastChat question format, read strictly.

Each non-blank line of a question file is a JSON object {"question_id", "category", "turns": [str, ...]} (extra keys
such as "reference" are ignored). A multi-turn question feeds turn 2 after the model's own answer to turn 1; that is
the caller's job, this module only reads and selects questions.

Builtin sets (inference/evaluation/prompt_sets/, copied from Spec-Bench and EAGLE, see /work/shared/eval/README.md):
    mt_bench (80, 8 categories, two turns), gsm8k (80), humaneval (80), spec_bench (480, 13 categories).

    name, questions = load_questions("mt_bench", num_prompts=16)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROMPT_SET_DIR = Path(__file__).parent / "prompt_sets"
DEFAULT_CATEGORY = "general"


@dataclass
class Question:
    """One evaluation question. `turns` are the user messages in order (one or more, each a non-empty string)."""

    question_id: int | str
    category: str
    turns: list[str]


def builtin_prompt_sets() -> list[str]:
    """Names of the prompt sets shipped in inference/evaluation/prompt_sets/."""
    return sorted(path.stem for path in PROMPT_SET_DIR.glob("*.jsonl"))


def _parse_line(line: str, where: str) -> Question:
    """Parse one question line; `where` is "file:line" for error messages."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: invalid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "question_id" not in record:
        raise ValueError(f"{where}: missing 'question_id'")
    question_id = record["question_id"]
    if isinstance(question_id, bool) or not isinstance(question_id, (int, str)):
        raise ValueError(f"{where}: 'question_id' must be an int or a string, got {question_id!r}")
    turns = record.get("turns")
    if turns is None:
        raise ValueError(f"{where}: missing 'turns'")
    if not isinstance(turns, list) or not all(isinstance(turn, str) for turn in turns):
        raise ValueError(f"{where}: 'turns' must be a list of strings, got {json.dumps(turns)[:80]}")
    if not turns or not all(turn.strip() for turn in turns):
        raise ValueError(f"{where}: 'turns' must hold at least one non-empty string")
    category = record.get("category") or DEFAULT_CATEGORY
    if not isinstance(category, str):
        raise ValueError(f"{where}: 'category' must be a string, got {category!r}")
    return Question(question_id=question_id, category=category, turns=list(turns))


def read_question_file(path: str | Path) -> list[Question]:
    """Read every question in a FastChat question jsonl file, in file order.

    Blank lines are skipped. A malformed line raises ValueError naming the file, the 1-based line number and the fault;
    a repeated question_id is an error too, since reports key results by it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file {str(path)!r} does not exist")
    questions, seen_ids = [], set()
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            question = _parse_line(line, f"{path}:{line_number}")
            if question.question_id in seen_ids:
                raise ValueError(f"{path}:{line_number}: duplicate question_id {question.question_id!r}")
            seen_ids.add(question.question_id)
            questions.append(question)
    if not questions:
        raise ValueError(f"question file {str(path)!r} holds no questions")
    return questions


def select_spread(questions: list[Question], num_prompts: int) -> list[Question]:
    """Pick `num_prompts` questions spread evenly over categories, deterministically.

    Categories take turns in order of first appearance, each giving its next question in file order, until
    `num_prompts` are chosen (a category that runs out drops out). So every category is represented once
    num_prompts >= number of categories, and counts differ by at most one while no category has run out.
    The chosen questions are returned in file order.
    """
    by_category: dict[str, list[int]] = {}
    for index, question in enumerate(questions):
        by_category.setdefault(question.category, []).append(index)
    chosen: list[int] = []
    round_index = 0
    while len(chosen) < min(num_prompts, len(questions)):
        for indices in by_category.values():
            if round_index < len(indices) and len(chosen) < num_prompts:
                chosen.append(indices[round_index])
        round_index += 1
    return [questions[index] for index in sorted(chosen)]


def _resolve_spec(spec: str) -> tuple[str, Path]:
    """A builtin name -> (name, its file); otherwise a path -> (a name derived from it, the path)."""
    if spec in builtin_prompt_sets():
        return spec, PROMPT_SET_DIR / f"{spec}.jsonl"
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"prompt set {spec!r} is neither a builtin ({', '.join(builtin_prompt_sets())}) nor an existing file"
        )
    # FastChat/EAGLE lay sets out as <name>/question.jsonl; name those after their folder.
    name = path.parent.name if path.stem == "question" and path.parent.name else path.stem
    return name, path


def load_questions(
    spec: str, num_prompts: int | None = None, categories: list[str] | None = None
) -> tuple[str, list[Question]]:
    """Load a prompt set by builtin name or path, optionally filtered by category and cut to `num_prompts`.

    Args:
        spec: a builtin name (see `builtin_prompt_sets()`) or a path to a FastChat question jsonl file.
        num_prompts: None for all; otherwise at most this many, spread over categories (see `select_spread`).
        categories: keep only these categories (applied before `num_prompts`); an unknown name is an error.
    Returns:
        (dataset name, questions in file order). The name is the builtin name, or the file's stem (its folder's
        name for a FastChat-style <name>/question.jsonl).
    """
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1 or None, got {num_prompts}")
    name, path = _resolve_spec(spec)
    questions = read_question_file(path)
    if categories is not None:
        if not categories:
            raise ValueError("categories must name at least one category, or be None for all")
        available = sorted({question.category for question in questions})
        unknown = sorted(set(categories) - set(available))
        if unknown:
            raise ValueError(f"{path}: unknown categories {unknown}; this set has {available}")
        questions = [question for question in questions if question.category in set(categories)]
    if num_prompts is not None:
        questions = select_spread(questions, num_prompts)
    return name, questions
