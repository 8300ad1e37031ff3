"""Measure what an engine round costs on this machine: d(W) and v(W) for one drafter, before a policy reads them.

    costs = profile_costs(target, drafter, prompts, max_width=7)          # fixed-W engine runs, W = 0..7
    AdaptiveK(costs)                                                      # inference/engine/adaptive.py

The profile is a measurement, so it lives beside the evaluation that runs it (inference/evaluation/eval.py profiles
every drafter, then builds its methods with the profile); the engine only reads the result
(inference/engine/costs.py `CostProfile`).
"""

from __future__ import annotations

import time

import torch

from inference.engine.api import speculative_generate
from inference.engine.costs import CostProfile
from inference.engine.rounds import verify_chain
from inference.engine.run import left_pad
from inference.engine.target import synchronize


def profile_costs(target, drafter, prompts: list[list[int]], max_width: int, *, max_new_tokens: int = 8,
                  repeats: int = 3) -> CostProfile:
    """Measure d(W) and v(W) for W = 0..max_width on this machine, at the batch of `prompts`: per W the median over
    `repeats` (after one untimed warm-up pass), the widths taking turns within each repeat so that a drift of the
    machine's load hits every W alike; both curves are then made non-decreasing in W (a running maximum: more drafts
    never cost less, and a noisy v(1) < v(0) would make proposing look free).

    d(W): the engine's fixed-W runs over `prompts`, the drafter's seconds per round (its propose and catch-up commit:
    a chain drafter's W steps, a block drafter's one forward).
    v(W): the engine's verify round (rounds.verify_chain: the forward with the drafter's feature request, the accept
    decision, the rollback) over W + 1 tokens per row after the prompts, the cost of a round in which every row
    proposes W. Timing the fixed-W runs' verifies instead would price a drafter that often proposes fewer tokens (the
    n-gram drafter on a miss) at the widths it happened to verify, and make wide rounds look free.
    """
    if max_width < 1 or repeats < 1 or not prompts:
        raise ValueError(f"profile_costs: need max_width >= 1, repeats >= 1 and prompts; got {max_width}, "
                         f"{repeats}, {len(prompts)} prompts")
    widths = range(max_width + 1)
    draft: dict[int, list[float]] = {width: [] for width in widths}
    verify: dict[int, list[float]] = {width: [] for width in widths}
    request = drafter.feature_request()
    for attempt in range(repeats + 1):
        seconds = _verify_seconds(target, prompts, request, max_width)
        for width in widths:
            out = speculative_generate(target, drafter if width else None, prompts, num_draft_tokens=width,
                                       max_new_tokens=max_new_tokens, eos_token_ids=[])
            if attempt:
                draft[width].append(out.time_draft / max(out.verify_forwards, 1))
                verify[width].append(seconds[width])
    d_curve, v_curve = [], []
    for width in widths:
        d = sorted(draft[width])[repeats // 2] if width else 0.0
        v = max(sorted(verify[width])[repeats // 2], 1e-9)
        d_curve.append(max([d] + d_curve))
        v_curve.append(max([v] + v_curve))
    return CostProfile(tuple(d_curve), tuple(v_curve), num_rows=len(prompts))


@torch.no_grad()
def _verify_seconds(target, prompts: list[list[int]], request, max_width: int) -> list[float]:
    """Seconds of one engine verify round per width 0..max_width after a prefill of `prompts`, rolled back each
    time; the drafts are random token ids (rejected: a rollback as long as a real round's)."""
    device = target.device
    input_ids, attention_mask = left_pad(prompts, 0)
    target.prefill(input_ids.to(device), attention_mask.to(device), request)
    generator = torch.Generator().manual_seed(0)
    vocab = target.target_info().vocab_size
    active = torch.ones(len(prompts), dtype=torch.bool, device=device)
    seconds = []
    for width in range(max_width + 1):
        block = torch.randint(0, vocab, (len(prompts), width + 1), generator=generator).to(device)
        num_valid = torch.full((len(prompts),), width, dtype=torch.long, device=device)
        mark = target.mark()
        synchronize(device)
        start = time.perf_counter()
        verify_chain(target, block=block, drafts=block[:, 1:], num_valid=num_valid, request=request, active=active)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        target.keep_after(mark, torch.zeros(len(prompts), dtype=torch.long, device=device))
    return seconds
