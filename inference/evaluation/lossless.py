"""What "lossless" means in the target's dtype, as `draftsmith eval` reports it beside `greedy_exact_match`.

Greedy speculative decoding emits the target's argmax at every position, so its output equals plain greedy decoding
exactly when both compute the same logits. They compute them with different GEMMs: a verify forward runs k + 1 rows,
a plain decode step one. In float64, and in float32 on the targets we test, the two differ far below the gap
between the top two logits, and the outputs are equal (tests/test_contract.py, test_eval_cli.py). In bf16 (what `--dtype auto`
picks on an accelerator) the two round differently in the low bits, and where the target's top two logits sit within
that rounding the argmax can flip: the outputs then part at a near-tie, and both continuations are the target's
greedy answer up to its own rounding. Anything else (a gap of many ulps) is an engine bug.

So, for every output that differs from plain greedy's for the same prompt, eval finds the first position where they
part, recomputes the target's logits there over the plain sequence (one forward, only when there is a divergence)
and measures how far the two tokens chosen there sit below the row's best logit, in units of the dtype's eps times
the row's logit scale (`tie_gap_ulps`). A divergence is a near-tie when that gap is at most NEAR_TIE_ULPS.
"""

from __future__ import annotations

import torch

# A few ulps of the logit scale: each rounding in the network (every layer's residual add and GEMM output, the head)
# moves a logit by at most half an ulp of its own size, and the verify and decode forwards differ by the rounding
# that piles up along the layers. Measured in bf16 on the tiny debug target: divergences at 0.5-0.6 ulps, the top two
# logits 10-20 ulps apart on average. Where the target's own top two sit within the bound a wrong token would pass
# too, so the record also carries the largest gap seen.
NEAR_TIE_ULPS = 8.0


def tie_gap_ulps(logits: torch.Tensor, tokens, dtype: torch.dtype) -> float:
    """How far the worse of `tokens` sits below the best logit of the row, in ulps of the row's logit scale.

    Args:
        logits: [V] the target's logits at one position.
        tokens: the token ids the two decodings chose there (one id when they agree).
        dtype: the dtype the target computed in (its eps sets the unit).
    Returns:
        (max(logits) - min(logits[tokens])) / (eps(dtype) * max|logits|): 0 when a chosen token is the argmax and
        the other ties it exactly; above NEAR_TIE_ULPS when one of them is clearly not the target's choice.
    """
    row = logits.detach().double()
    scale = max(float(row.abs().max()), torch.finfo(dtype).tiny)
    gap = float(row.max() - row[list(tokens)].min())
    return gap / (torch.finfo(dtype).eps * scale)


def is_near_tie(logits: torch.Tensor, tokens, dtype: torch.dtype) -> bool:
    """True when `tokens` (the two decodings' choices at one position) are a near-tie of `logits` [V] in `dtype`."""
    return tie_gap_ulps(logits, tokens, dtype) <= NEAR_TIE_ULPS


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (the shorter one's length when one is a prefix of the other), None
    when they are equal."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def divergence_gap(target, prompt: list[int], plain: list[int], speculative: list[int]) -> float | None:
    """`tie_gap_ulps` at the first position where `speculative` parts from `plain` (both generated after `prompt`),
    from one forward of the target over prompt + plain[:position]; None when they are equal, inf when one output
    stops where the other goes on (no pair of tokens to compare: never a rounding effect)."""
    position = first_divergence(plain, speculative)
    if position is None:
        return None
    if position >= min(len(plain), len(speculative)):
        return float("inf")
    ids = torch.tensor([prompt + plain[:position]], device=target.device)
    logits = target.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]
    return tie_gap_ulps(logits, (plain[position], speculative[position]), target.model.dtype)


def summarize(gaps: list[float]) -> dict:
    """The record's fields over the divergences' gaps (one per output that parted from plain greedy's): how many,
    whether every one is a near-tie, and the largest gap in ulps (None without a divergence, or when an output
    stopped where the other went on)."""
    largest = max(gaps, default=None)
    return {"divergences": len(gaps), "divergences_all_near_ties": all(gap <= NEAR_TIE_ULPS for gap in gaps),
            "divergence_max_gap_ulps": largest if largest is not None and largest < float("inf") else None,
            "near_tie_ulps": NEAR_TIE_ULPS}


def divergence_gaps(target, run, plain) -> dict:
    """{(question, turn): `divergence_gap`} for every output of `run` that differs from `plain`'s (the k = 0 run)
    for the same prompt; both hold `prompts` and `tokens` by (question, turn) (eval.RunResult). A later turn of a
    question whose earlier answer parted is asked after another history, so it is no divergence of its own."""
    return {key: divergence_gap(target, plain.prompts[key], tokens, run.tokens[key])
            for key, tokens in plain.tokens.items()
            if run.prompts[key] == plain.prompts[key] and run.tokens[key] != tokens}
