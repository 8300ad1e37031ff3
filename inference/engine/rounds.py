"""Round strategies, the engine's other seam: how a round's drafts are laid out, verified and committed.

A strategy has `drops_rows` (whether finished rows may leave the batch) and, per generation and round:

    rounds.begin(run)                        # after the drafter's begin
    rounds.keep_rows(rows)                   # finished rows left the batch
    draft = rounds.draft(run, width)         # the drafts of a round of `width` (timed as the drafter's)
    verdict = rounds.verify(run, draft)      # one target forward, the accept decision, the rollback
    rounds.commit(run, draft, verdict, was_active)   # tell the drafter what was kept

`ChainRounds` verifies one chain per row (width 0 = a plain AR round); inference/engine/tree/rounds.TreeRounds a draft
tree. Both tell the drafter through `commit_context`, the one place the commit's valid mask and position ids are
derived (tests/test_contract.py drives its forced-accept rounds through it too).
"""

from __future__ import annotations

import dataclasses

import torch

from drafters.base import DraftContext, select_rows
from drafters.served import Served
from inference.engine.run import Draft, Verdict
from inference.engine.verify import GREEDY, Sampling, block_verify, greedy_verify, sample_verify


def commit_context(target, block: torch.Tensor, num_accepted: torch.Tensor, active: torch.Tensor,
                   **features) -> DraftContext:
    """The drafter's `commit` context after a verified round whose rollback already ran: block [B, W] what the
    target was fed for the round in path order (the last emitted token, then the drafts); row b keeps
    num_accepted[b] + 1 of them when active[b] and none when it had finished. `features`: the other DraftContext
    fields (next_tokens, generator, temperature and the target's served features of `block`)."""
    steps = torch.arange(block.shape[1], device=block.device)
    valid = (steps[None, :] <= num_accepted[:, None]) & active[:, None]
    return DraftContext(block, valid, target.block_positions(valid), **features)


def roll_back(target, mark: int, num_accepted: torch.Tensor, active: torch.Tensor, request,
              served: Served) -> Served:
    """Row b keeps its last emitted token and its accepted drafts of what was fed since `mark`, a finished row
    nothing; the served KV view is re-read, since the rollback changed the cache the drafter reads."""
    target.keep_after(mark, torch.where(active, num_accepted + 1, torch.zeros_like(num_accepted)))
    if request.kv_layers:
        served = served.with_kv(target.kv_view(request.kv_layers))
    return served


def verify_chain(target, *, block: torch.Tensor, drafts: torch.Tensor, num_valid: torch.Tensor, request,
                 active: torch.Tensor, draft_probs=None, sampling: Sampling = GREEDY, generator=None):
    """One target forward over block [B, W + 1] = [last token, drafts], the accept decision and the rollback:
    greedy at temperature 0, else sampling.verification's test (token-wise min(1, p/q), or block verification) over
    sampling.probs(logits) (the run's warped distribution) with draft_probs q. Returns (num_accepted [B], new_tokens
    [B], served features of the block)."""
    mark = target.mark()
    logits, served = target.extend(block, request)
    if sampling.greedy:
        num_accepted, new_tokens = greedy_verify(drafts, logits, num_valid)
    else:
        verify = block_verify if sampling.verification == "block" else sample_verify
        num_accepted, new_tokens = verify(drafts, draft_probs, sampling.probs(logits), num_valid, generator)
    return num_accepted, new_tokens, roll_back(target, mark, num_accepted, active, request, served)


class ChainRounds:
    """A chain of `width` drafts per row; rounds of width 0 verify the last token alone and defer the drafter's
    catch-up (`Deferred`) to one commit before its next proposal."""

    drops_rows = True

    def begin(self, run) -> None:
        self.deferred = Deferred()

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.deferred.keep_rows(rows)

    def draft(self, run, width: int) -> Draft:
        if width == 0 or not run.drafting:
            return Draft(0, run.next_tokens.new_zeros((len(run.index), 0)),
                         torch.zeros(len(run.index), dtype=torch.long, device=run.device))
        return run.clock.run("draft", self._propose, run, width, run.draft_seconds())

    def _propose(self, run, width: int, draft_seconds: float) -> Draft:
        if self.deferred:  # rounds that proposed nothing: the drafter catches up on them in one commit
            run.drafter.commit(*self.deferred.merged())
        proposal = run.drafter.propose(width)
        if proposal.tokens.shape[1] < width and proposal.num_valid is None:
            raise ValueError(f"drafter proposed {proposal.tokens.shape[1]} tokens, {width} were asked for")
        num_valid = torch.full_like(run.active, width, dtype=torch.long)
        if proposal.num_valid is not None:
            num_valid = proposal.num_valid.to(run.device).clamp(max=width)
        num_valid = torch.where(run.active, num_valid, torch.zeros_like(num_valid))
        num_valid = run.policy.cut(proposal, num_valid, run.active, draft_seconds)
        longest = int(num_valid.max())
        probs = None if proposal.probs is None else proposal.probs[:, :longest].to(run.device)
        return Draft(width, proposal.tokens[:, :longest].to(run.device), num_valid, probs,
                     proposal.confidence_logits)

    def verify(self, run, draft: Draft) -> Verdict:
        block = torch.cat([run.next_tokens[:, None], draft.tokens], dim=1)  # [B, width + 1]
        num_accepted, new_tokens, served = verify_chain(
            run.target, block=block, drafts=draft.tokens, num_valid=draft.num_valid, request=run.request,
            active=run.active, draft_probs=draft.probs, sampling=run.sampling, generator=run.generator)
        return Verdict(num_accepted, new_tokens, draft.tokens, block, served)

    def commit(self, run, draft: Draft, verdict: Verdict, was_active: torch.Tensor) -> None:
        context = commit_context(run.target, verdict.block, verdict.num_accepted, was_active,
                                 next_tokens=verdict.new_tokens, generator=run.draft_generator,
                                 temperature=run.sampling.temperature, **verdict.served.context())
        if draft.width > 0:
            run.clock.run("draft", run.drafter.commit, verdict.num_accepted, context)
        else:
            self.deferred.add(context)


class Deferred:
    """The verify contexts of rounds that proposed nothing, merged into one catch-up `commit`.

    A run of n such rounds verified the tokens t_0, t_1, ..., t_{n-1} one by one ([previous token] each time) and
    emitted t_n: exactly what a verify of [t_0, t_1..t_{n-1}] accepting all n - 1 drafts would have produced. So the
    drafter receives one block of n positions, `valid` a prefix per row (a row that finished during the run stops
    being valid there), num_accepted = valid positions - 1, the features of every position concatenated, the KV
    view of the last forward (its last n slots are this block's) and next_tokens t_n.
    """

    def __init__(self):
        self.contexts: list[DraftContext] = []

    def __bool__(self) -> bool:
        return bool(self.contexts)

    def add(self, context: DraftContext) -> None:
        self.contexts.append(context)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` of every deferred context (the engine dropped the others)."""
        self.contexts = [select_rows(context, rows) for context in self.contexts]

    def merged(self) -> tuple[torch.Tensor, DraftContext]:
        """(num_accepted [B], context [B, n]) of the deferred rounds; empties the queue. Every per-position field
        of DraftContext is concatenated over the rounds, every other one is the last round's."""
        contexts, self.contexts = self.contexts, []
        merged = DraftContext(**{
            f.name: _along_positions([getattr(c, f.name) for c in contexts]) if f.metadata.get("per_position")
            else getattr(contexts[-1], f.name) for f in dataclasses.fields(DraftContext)})
        return (merged.valid.long().sum(-1) - 1).clamp(min=0), merged


def _along_positions(values: list):
    """Per-position values of successive forwards joined along S: tensors, dicts and tuples of them, or None."""
    first = values[0]
    if first is None:
        return None
    if isinstance(first, dict):
        return {key: torch.cat([value[key] for value in values], dim=1) for key in first}
    if isinstance(first, tuple):
        return tuple(torch.cat(parts, dim=1) for parts in zip(*values))
    return torch.cat(values, dim=1)
