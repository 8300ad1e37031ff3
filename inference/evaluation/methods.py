"""What `draftsmith eval` runs: a Method is one drafter at one proposal rule (fixed k, `auto`, a verification
schedule or a draft tree of B nodes), and `generate` is the one engine call every method goes through, so the eval
loop, its warm-up and anything else that runs methods never branch on how a method verifies."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from drafters import Drafter, load_drafter
from inference.engine.adaptive import AdaptiveK
from inference.engine.api import speculative_generate, tree_speculative_generate
from inference.engine.costs import CostProfile
from inference.engine.generate import GenerateOutput
from inference.engine.schedule import PrefixScheduler
from inference.engine.target import TargetModel

AUTO_MAX_DRAFT_TOKENS = 8  # the widest round `auto` may choose for a drafter without a limit of its own


@dataclass(frozen=True)
class Method:
    """One thing to evaluate: a drafter (None = plain AR) at one k, or at run-time k up to num_draft_tokens.

    `auto` and the prefix scheduler decide from the drafter's measured costs, so such a method runs only once
    `profiled` has built it over the cost profile of the batch size about to run (eval profiles first, then builds
    the methods it runs); until then `unprofiled` is what the warm-up runs."""

    name: str
    drafter: Drafter | None
    num_draft_tokens: int
    schedule: object = None  # inference/engine/schedule.py; None = every proposal verified in full
    auto: bool = False  # k chosen per round (inference/engine/adaptive.py)
    tree_budget: int | None = None  # verify draft trees of this many nodes (num_draft_tokens = budget - 1)
    adaptive: AdaptiveK | None = None  # auto's policy over one batch size's profile (`profiled`)

    @property
    def label(self):
        """The record's num_draft_tokens: k, or "auto"."""
        return "auto" if self.auto else self.num_draft_tokens

    @property
    def needs_costs(self) -> bool:
        return self.tree_budget is None and (self.auto or isinstance(self.schedule, PrefixScheduler))

    def profiled(self, costs: CostProfile) -> "Method":
        """This method over the drafter's cost profile at one batch size: `auto` gets its AdaptiveK (one per batch
        size, carried across that batch size's calls), the prefix scheduler its verify cost."""
        if not self.needs_costs:
            return self
        schedule = replace(self.schedule, cost=costs) if isinstance(self.schedule, PrefixScheduler) else self.schedule
        adaptive = AdaptiveK(costs, max_width=self.num_draft_tokens) if self.auto else None
        return replace(self, schedule=schedule, adaptive=adaptive)

    def unprofiled(self) -> "Method":
        """What runs before any profile (the warm-up): the largest k, the prefix scheduler off."""
        schedule = None if isinstance(self.schedule, PrefixScheduler) else self.schedule
        return replace(self, auto=False, schedule=schedule, adaptive=None)


def generate(target, method: Method, prompts: list[list[int]], **options) -> GenerateOutput:
    """One call of the engine for `method`: chain (fixed k, auto, scheduled) or tree verification."""
    if method.tree_budget is not None:
        return tree_speculative_generate(target, method.drafter, prompts, tree_budget=method.tree_budget, **options)
    unprofiled = isinstance(method.schedule, PrefixScheduler) and method.schedule.cost is None
    if unprofiled or (method.auto and method.adaptive is None):
        raise ValueError(f"method {method.name!r} ({'auto' if method.auto else 'scheduler'}) decides from the "
                         "drafter's costs: build it with Method.profiled(profile_costs(...)) first")
    return speculative_generate(target, method.drafter, prompts, num_draft_tokens=method.num_draft_tokens,
                                schedule=method.schedule, adaptive=method.adaptive, **options)


def load_methods(names: list[str], target: TargetModel, ks: list, tree_budgets: list[int] = ()) -> list[Method]:
    """Load every drafter (errors name the drafter) and pair it with every k > 0, auto and every tree budget > 1;
    k = 0 is the baseline."""
    info = target.target_info()
    methods = []
    for name in names:
        try:
            drafter = target.serve(load_drafter(name, info))
        except (ValueError, OSError) as err:
            raise ValueError(f"--drafter {name!r}: {err}") from None
        if drafter is None:
            continue
        try:  # what the drafter reads (layer ids, KV layers, top-k) must exist in this target
            target.check_request(drafter.feature_request())
        except ValueError as err:
            raise ValueError(f"--drafter {name!r}: {err}") from None
        limit = drafter.max_draft_tokens()
        too_long = [k for k in ks if k != "auto" and limit is not None and k > limit]
        if too_long:
            raise ValueError(f"--num-draft-tokens {','.join(map(str, too_long))}: drafter {name!r} ({drafter.kind}) "
                             f"proposes at most {limit} tokens per round; allowed values: 0..{limit}")
        label = name if name == "ngram" else f"{drafter.kind}:{os.path.basename(os.path.normpath(name))}"
        auto = limit if limit is not None else AUTO_MAX_DRAFT_TOKENS
        methods += [Method(label, drafter, auto, auto=True) if k == "auto" else Method(label, drafter, k)
                    for k in ks if k != 0]
        methods += [Method(f"{label}@tree", drafter, budget - 1, tree_budget=budget)
                    for budget in tree_budgets if budget > 1]
    return methods
