"""The engine's public calls: speculative decoding in chains or trees, with the settings users pass by name.

    out = speculative_generate(target, drafter, prompts, num_draft_tokens=7, max_new_tokens=128)
    out = tree_speculative_generate(target, drafter, prompts, tree_budget=16, max_new_tokens=128, temperature=0.7)

Each builds a round strategy, a width policy and one `Sampling` value and runs the loop (inference/engine/generate.py
`decode`). `timed=False` runs untimed rounds: no device synchronisation for the phase clock (GenerateOutput's time_*
fields stay 0), for callers who want the tokens and the acceptance, not the timings; a policy that reads the clock
(a schedule) keeps it on. A target the engine decodes one row at a time (TargetModel.one_row: MiniMax-M3's
slot-anchored indexer, Llama 4's slot-read NoPE temperature) runs a chain call's prompts one after another, as one
output; trees refuse it.
"""

from __future__ import annotations

import torch

from drafters.base import Drafter
from inference.engine.generate import GenerateOutput, decode
from inference.engine.policy import FixedWidth, Scheduled, WidthPolicy
from inference.engine.rounds import ChainRounds
from inference.engine.tree.draft import check_budget
from inference.engine.tree.rounds import TreeRounds
from inference.engine.verify import Sampling

__all__ = ["GenerateOutput", "speculative_generate", "tree_speculative_generate"]


def speculative_generate(target, drafter: Drafter | None, prompts: list[list[int]], *, num_draft_tokens: int,
                         max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                         seed: int = 0, eos_token_ids=None, schedule=None, adaptive: WidthPolicy | None = None,
                         drop_finished_rows: bool = True, timed: bool = True,
                         verification: str = "token") -> GenerateOutput:
    """Chain rounds of num_draft_tokens drafts (target: an inference.engine.target.TargetModel). `adaptive`: a width
    policy choosing each round's width in 0..num_draft_tokens (adaptive.AdaptiveK; None = k every round);
    `schedule`: schedule.StaticThreshold or PrefixScheduler cutting each row's proposal by its confidences;
    `verification`: how a sampled round is verified (verify.Sampling: "token" or "block")."""
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    if adaptive is not None and adaptive.max_width != num_draft_tokens:
        raise ValueError(f"adaptive k: it chooses widths up to {adaptive.max_width}, num_draft_tokens is "
                         f"{num_draft_tokens}")
    width = num_draft_tokens if drafter is not None else 0
    policy = adaptive if adaptive is not None and width > 0 else FixedWidth(width)
    if schedule is not None and width > 0:
        policy = Scheduled(schedule, policy)

    def run(rows: list[list[int]], row_seed: int) -> GenerateOutput:
        return decode(target, drafter if width else None, rows, ChainRounds(), policy, max_new_tokens=max_new_tokens,
                      sampling=Sampling(temperature, top_p, top_k, row_seed, verification),
                      eos_token_ids=eos_token_ids, drop_finished_rows=drop_finished_rows, timed=timed)

    if len(prompts) > 1 and getattr(target, "one_row", False):  # MiniMax-M3, Llama 4: eval refuses a batch instead
        # each row its own random streams, drawn from `seed` (one seed for every row would repeat one sample)
        seeds = torch.randint(0, 2**62, (len(prompts),), generator=torch.Generator().manual_seed(seed)).tolist()
        return GenerateOutput.one_after_another([run([p], s) for p, s in zip(prompts, seeds)])
    return run(prompts, seed)


def tree_speculative_generate(target, drafter: Drafter | None, prompts: list[list[int]], *, tree_budget: int,
                              max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                              seed: int = 0, eos_token_ids=None, tree_top_k: int = 4,
                              timed: bool = True, verification: str = "token") -> GenerateOutput:
    """Tree rounds of tree_budget nodes (root included; 1 = plain autoregression). tree_top_k: children per
    expanded node and frontier width of EAGLE-2 trees (inference/engine/tree/rounds.py). A tree's sampled rounds are
    verified node by node (`verification` "token"; block verification is a chain's)."""
    check_budget(tree_budget)
    if verification != "token":
        raise ValueError(f"verification {verification!r}: block verification tests a chain; a tree is verified "
                         "token by token")
    return decode(target, drafter if tree_budget > 1 else None, prompts, TreeRounds(tree_top_k),
                  FixedWidth(tree_budget - 1), max_new_tokens=max_new_tokens,
                  sampling=Sampling(temperature, top_p, top_k, seed), eos_token_ids=eos_token_ids, timed=timed)
