"""Speculative decoding with draft trees: grow a tree, verify every node in one target forward, keep the accepted path.

    out = tree_speculative_generate(target, drafter, prompts, tree_budget=8, max_new_tokens=128)

The loop of inference/engine/generate.py (its helpers are imported, not repeated) with a tree where the chain was:
- the tree (inference/engine/tree/draft.py) has `tree_budget` nodes, root included, so it costs the verify forward of a chain of
  tree_budget - 1 drafts. A drafter that expands branches (Drafter.expands_trees: EAGLE-3) grows an EAGLE-2 dynamic
  tree; any other drafter proposes min(tree_budget - 1, max_draft_tokens) drafts and gets a DDTree over the
  per-depth marginals of its proposal (Proposal.log_probs: exact marginals for block drafters and Medusa, the
  top-1 chain's conditionals for sequential ones); a drafter with neither verifies its chain as a one-branch tree.
- verification walks the tree (inference/engine/tree/verify.py), greedy or lossless sampling, and the cache is compacted to
  the accepted path (inference/engine/tree/target.py);
- the drafter hears about the round through its ordinary `commit`, with the accepted path as the block and the
  target's features of those nodes, exactly what a chain round accepting the same tokens would give it.

Returns the same `GenerateOutput` as speculative_generate, so inference/evaluation/metrics.py reports it: num_draft_tokens =
tree_budget - 1, proposed = the round's valid drafted nodes, accept_lengths = the accepted path's depth (so the
per-position acceptance is along the accepted path and tau = 1 + accepted / rounds as for chains).
"""

from __future__ import annotations

import time

import torch

from drafters.base import DraftContext, Drafter, FeatureRequest
from inference.engine.generate import GenerateOutput, _Clock, _emit, _eos_ids, _generators, _prefill
from inference.engine.tree.draft import DraftTree, chain_tree, check_budget, ddtree, dynamic_tree
from inference.engine.tree.target import keep_path, path_features, tree_extend
from inference.engine.tree.verify import greedy_tree_verify, sample_tree_verify
from inference.engine.verify import sampling_probs


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


@torch.no_grad()
def tree_speculative_generate(
    target,
    drafter: Drafter | None,
    prompts: list[list[int]],
    *,
    tree_budget: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    eos_token_ids=None,
    tree_top_k: int = 4,
) -> GenerateOutput:
    """Generate up to max_new_tokens per prompt with trees of tree_budget nodes (root included; 1 = plain
    autoregression). tree_top_k: children per expanded node and frontier width of EAGLE-2 trees."""
    check_budget(tree_budget)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    drafter = drafter if tree_budget > 1 else None
    device = target.device
    request = drafter.feature_request() if drafter is not None else FeatureRequest()
    clock = _Clock(device)
    start = time.perf_counter()

    def pick(logits):
        return sampling_probs(logits, temperature, top_k, top_p)

    eos, generator, draft_generator = _eos_ids(target, eos_token_ids), *_generators(device, seed)
    first = _prefill(target, prompts, request, clock, pick, temperature, generator, eos)
    next_tokens = first.next_tokens
    batch = len(prompts)
    out = GenerateOutput([[] for _ in range(batch)], [[] for _ in range(batch)], [[] for _ in range(batch)],
                         tree_budget - 1, target_forwards=1)
    out.confidence_logits = [[] for _ in range(batch)]
    active = torch.ones(batch, dtype=torch.bool, device=device)
    active = _emit(out, active, next_tokens.new_zeros((batch, 0)), torch.zeros_like(next_tokens), next_tokens, eos,
                   max_new_tokens)
    if drafter is not None:
        clock.run("prefill", drafter.begin, first.context(draft_generator, temperature))

    while bool(active.any()):
        tree = clock.run("draft", grow_tree, drafter, next_tokens, tree_budget, tree_top_k)
        start_positions = target.runner.lengths.clone()
        path, num_accepted, new_tokens, served = clock.run(
            "verify", _verify_tree, target, tree, request, pick, temperature, generator, active)
        out.target_forwards += 1
        out.verify_forwards += 1
        if drafter is not None:
            num_drafted = tree.valid[:, 1:].sum(-1)
            for row in active.nonzero().flatten().tolist():
                out.accept_lengths[row].append(int(num_accepted[row]))
                out.proposed[row].append(int(num_drafted[row]))
        drafts = tree.tokens.gather(1, path[:, 1:].clamp(min=0))  # [B, W - 1]
        was_active = active.clone()
        active = _emit(out, active, drafts, num_accepted, new_tokens, eos, max_new_tokens)
        next_tokens = new_tokens
        if drafter is not None:
            width = path.shape[1]
            steps = torch.arange(width, device=device)
            valid = (steps[None, :] <= num_accepted[:, None]) & was_active[:, None]
            context = DraftContext(tree.tokens.gather(1, path.clamp(min=0)), valid, start_positions[:, None] + steps,
                                   next_tokens=next_tokens, generator=draft_generator, temperature=temperature,
                                   **served)
            clock.run("draft", drafter.commit, num_accepted, context)

    out.time_total = time.perf_counter() - start
    out.time_draft, out.time_verify = clock.totals["draft"], clock.totals["verify"]
    out.time_prefill = clock.totals["prefill"]
    out.time_other = max(out.time_total - out.time_draft - out.time_verify - out.time_prefill, 0.0)
    return out


def _verify_tree(target, tree, request, pick, temperature, generator, active):
    """One target forward over the tree, the walk, the compaction; the path's features for the drafter."""
    mark = target.mark()
    logits, served = tree_extend(target, tree, request)
    if temperature == 0:
        path, num_accepted, new_tokens = greedy_tree_verify(tree, logits)
    else:
        path, num_accepted, new_tokens = sample_tree_verify(tree, pick(logits), generator)
    keep_path(target, mark, path, torch.where(active, num_accepted + 1, torch.zeros_like(num_accepted)))
    features = path_features(served, path)
    if request.kv_layers:  # read after compaction: the cache a chain accepting the same path would leave
        features.update(target.kv_view(request.kv_layers))
    return path, num_accepted, new_tokens, features
