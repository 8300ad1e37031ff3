"""The settings of `draftsmith eval`, `calibrate` and `doctor`: parsed and checked once from the command line into one
frozen dataclass, which the commands then pass around instead of a mutated argparse namespace.

List flags hold tuples (eval sweeps them; calibrate and doctor give one value each). `--dtype auto` computes in float32
on a CPU and bfloat16 on an accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.engine.target import resolve_dtype

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EvalSettings:
    """Field names are the flags' (argparse dests); see each command's --help."""

    target: str
    drafter: tuple[str, ...] = ("none",)
    prompts: tuple[str, ...] = ("mt_bench",)
    categories: tuple[str, ...] | None = None
    num_prompts: int | None = None
    max_new_tokens: int = 128
    temperature: tuple[float, ...] = (0.0,)
    top_p: float = 1.0
    top_k: int = 0
    verification: str = "token"  # how a sampled chain is verified (inference/engine/verify.Sampling)
    num_draft_tokens: tuple = ("auto",)  # ints and the word "auto"
    batch_size: tuple[int, ...] = (1,)
    seed: int = 0
    threads: int | None = None
    no_chat_template: bool = False
    dtype: str = "auto"
    tree_budget: tuple[int, ...] = ()
    schedule: tuple[str, ...] = ("fixed",)
    out: str | None = None
    outputs: str | None = None
    append: bool = False
    chat_template_kwargs: dict | None = None  # options the chat template reads (e.g. enable_thinking)
    target_path: str = "auto"  # eval: "auto" = the fast target path where supported, "hf" = the model's own modules
    trust_remote_code: bool = False  # run the tokenizer code the target ships (target_files.load_tokenizer)

    def torch_dtype(self, device) -> torch.dtype:
        """The dtype the target and drafters compute in on `device`: --dtype, or for auto float32 on a CPU and
        bfloat16 on an accelerator."""
        return resolve_dtype(self.dtype, device)


TRUST_REMOTE_CODE_HELP = ("run the tokenizer code the target ships where it has no tokenizer.json (Kimi-K2.5's); "
                          "read that code first. The model is always built from transformers' own classes")


def split(text: str) -> tuple[str, ...]:
    """"a, b,,a" -> ("a", "b"): comma-separated, stripped, without empties or repeats."""
    return tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))


def numbers(text: str, flag: str, kind: type) -> tuple:
    """Comma-separated values >= 0 of `kind`; a ValueError naming `flag` otherwise."""
    try:
        values = tuple(kind(part) for part in split(text))
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated {kind.__name__} values, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag}: no value given")
    if any(value < 0 for value in values):
        raise ValueError(f"{flag}: values must be >= 0, got {text!r}")
    return values


def check_at_least(*checks: tuple[str, int | None, int]) -> None:
    """(flag, value, lowest) each: a value below its lowest (None = not given) is a ValueError naming the flag."""
    for flag, value, low in checks:
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
