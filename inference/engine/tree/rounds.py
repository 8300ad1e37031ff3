"""The tree round strategy: grow a draft tree, verify every node in one target forward, keep the accepted path.

    out = tree_speculative_generate(target, drafter, prompts, tree_budget=8, max_new_tokens=128)

The engine's loop (inference/engine/generate.py) with `TreeRounds` where chains use `ChainRounds`:
- a round of width W grows a tree of W + 1 nodes, root included (inference/engine/tree/draft.py), so it costs the
  verify forward of a chain of W drafts. A drafter that expands branches (Drafter.expands_trees: EAGLE-3) grows an
  EAGLE-2 dynamic tree; any other drafter proposes min(W, max_draft_tokens) drafts and gets a DDTree over the
  per-depth marginals of its proposal (Proposal.log_probs: exact marginals for block drafters and Medusa, the top-1
  chain's conditionals for sequential ones); a drafter with neither verifies its chain as a one-branch tree.
- verification walks the tree (inference/engine/tree/verify.py), greedy or lossless sampling, and the cache is
  compacted to the accepted path (inference/engine/tree/target.py);
- the drafter hears about the round through its ordinary `commit` (rounds.commit_context), with the accepted path
  as the block and the target's features of those nodes, exactly what a chain round accepting the same tokens
  would give it.

The output is the chain's `GenerateOutput`: num_draft_tokens = tree_budget - 1, proposed = the round's valid drafted
nodes, accept_lengths = the accepted path's depth (so the per-position acceptance is along the accepted path and
tau = 1 + accepted / rounds as for chains). Finished rows stay in the batch (masked out): the per-row tree walk
draws its uniforms row by row, so dropping rows would change the random streams of a sampled run.
"""

from __future__ import annotations

import torch

from drafters.base import Drafter
from inference.engine.rounds import commit_context
from inference.engine.run import Draft, Verdict
from inference.engine.tree.draft import DraftTree, chain_tree, ddtree, dynamic_tree
from inference.engine.tree.target import tree_extend
from inference.engine.tree.verify import greedy_tree_verify, sample_tree_verify


def grow_tree(drafter: Drafter | None, root: torch.Tensor, budget: int, top_k: int) -> DraftTree:
    """The round's tree for root [B] (see the module docstring for which builder a drafter gets)."""
    if drafter is None or budget == 1:
        return chain_tree(root, root.new_zeros(root.shape[0], 0))
    if drafter.expands_trees:
        return dynamic_tree(drafter, root, budget, top_k)
    limit = drafter.max_draft_tokens()
    proposal = drafter.propose(budget - 1 if limit is None else min(budget - 1, limit))
    if proposal.log_probs is not None:
        return ddtree(root, proposal.log_probs.to(root.device), budget)
    return chain_tree(root, proposal.tokens.to(root.device), proposal.num_valid)


class TreeRounds:
    """Draft trees of width + 1 nodes; top_k: children per expanded node and frontier width of EAGLE-2 trees."""

    drops_rows = False

    def __init__(self, top_k: int = 4):
        self.top_k = top_k

    def begin(self, run) -> None:
        pass

    def keep_rows(self, rows: torch.Tensor) -> None:
        pass

    def draft(self, run, width: int) -> Draft:
        tree = run.clock.run("draft", grow_tree, run.drafter, run.next_tokens, width + 1, self.top_k)
        return Draft(width, tree.tokens, tree.valid[:, 1:].sum(-1), tree=tree)

    def verify(self, run, draft: Draft) -> Verdict:
        """One target forward over the tree, the walk, the compaction; the path's features for the drafter."""
        target, tree, request = run.target, draft.tree, run.request
        mark = target.mark()
        logits, served = tree_extend(target, tree, request)
        if run.sampling.greedy:
            path, num_accepted, new_tokens = greedy_tree_verify(tree, logits)
        else:
            path, num_accepted, new_tokens = sample_tree_verify(tree, run.sampling.probs(logits), run.generator)
        target.keep_path(mark, path, torch.where(run.active, num_accepted + 1, torch.zeros_like(num_accepted)))
        features = served.along(path)
        if request.kv_layers:  # read after compaction: the cache a chain accepting the same path would leave
            features = features.with_kv(target.kv_view(request.kv_layers))
        drafts = tree.tokens.gather(1, path[:, 1:].clamp(min=0))  # [B, W - 1]
        return Verdict(num_accepted, new_tokens, drafts, tree.tokens.gather(1, path.clamp(min=0)), features)

    def commit(self, run, draft: Draft, verdict: Verdict, was_active: torch.Tensor) -> None:
        context = commit_context(run.target, verdict.block, verdict.num_accepted, was_active,
                                 next_tokens=verdict.new_tokens, generator=run.draft_generator,
                                 temperature=run.sampling.temperature, **verdict.served.context())
        run.clock.run("draft", run.drafter.commit, verdict.num_accepted, context)
