"""Tree verification: pure functions, no model code (the tree counterpart of inference/engine/verify.py).

Shapes: B batch, N tree nodes (inference/tree.DraftTree, node 0 = root), V vocab. `target_logits` / `target_probs`
[B, N, V]: row i is the target's distribution for the token after node i given the root-to-i path (one forward with
the ancestor mask), target_probs already transformed by temperature / top-k / top-p (verify.sampling_probs).

Both rules walk from the root and return the accepted path: path [B, W] node ids (root first, -1 past the end),
num_accepted [B] (drafted nodes on it, 0..W-1) and next_tokens [B] (the correction or bonus token).

Greedy: follow the child whose token is the target's argmax at the current node; stop when none matches and emit the
argmax. The output is the target's greedy continuation whatever the tree.
Sampling (reference theory_and_metrics.md D.1, "multiple siblings"; EAGLE-2 A.6 step 4): the tree's drafts are
deterministic (chosen by rank, not sampled), so each is a one-hot q. At node u with residual p' = p_u, try its
children one by one: accept child x with probability p'(x); on rejection p' <- normalise(p' with x zeroed) and try the
next sibling. If every child is rejected, emit a sample of p'. This is recursive rejection sampling with one-hot
drafts, so the emitted token at u has law p_u exactly: P(x) = p'(x) at the moment x is tried, times the probability
that every earlier sibling was rejected, which telescopes to p_u(x).
"""

from __future__ import annotations

import torch

from inference.engine.tree.draft import DraftTree


def greedy_tree_verify(tree: DraftTree, target_logits: torch.Tensor):
    """Args: tree; target_logits [B, N, V]. Returns (path [B, W], num_accepted [B], next_tokens [B])."""
    argmax = target_logits.argmax(-1).tolist()  # [B][N]
    tokens = tree.tokens.tolist()
    paths, emitted = [], []
    for row in range(tree.tokens.shape[0]):
        kids, node, path = tree.children(row), 0, [0]
        while True:
            match = [child for child in kids[node] if tokens[row][child] == argmax[row][node]]
            if not match:
                break
            node = match[0]
            path.append(node)
        paths.append(path)
        emitted.append(argmax[row][node])
    return _pack(paths, emitted, tree.tokens.device)


def sample_tree_verify(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None = None):
    """Lossless sibling-by-sibling rejection sampling (module docstring).

    Args: tree; target_probs [B, N, V]; generator for the uniforms and the emitted token.
    Returns: (path [B, W], num_accepted [B], next_tokens [B]).
    """
    tokens = tree.tokens.tolist()
    paths, emitted = [], []
    for row in range(tree.tokens.shape[0]):
        kids, node, path = tree.children(row), 0, [0]
        while True:
            residual = target_probs[row, node].double()  # float64: repeated renormalisation stays exact enough
            accepted = None
            for child in kids[node]:
                token = tokens[row][child]
                uniform = float(torch.rand((), generator=generator, device=residual.device))
                if uniform < float(residual[token]):
                    accepted = child
                    break
                residual = _without(residual, token)
            if accepted is None:
                emitted.append(int(torch.multinomial(residual.float(), 1, generator=generator)))
                break
            node = accepted
            path.append(node)
        paths.append(path)
    return _pack(paths, emitted, tree.tokens.device)


def _without(probs: torch.Tensor, token: int) -> torch.Tensor:
    """normalise(probs with `token` zeroed); unchanged when nothing else has mass (then `token` had probability 1
    and was accepted, so this is never sampled from)."""
    rest = probs.clone()
    rest[token] = 0.0
    mass = rest.sum()
    return rest / mass if float(mass) > 0 else probs


def _pack(paths: list[list[int]], emitted: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(path) for path in paths)
    path = torch.full((len(paths), width), -1, dtype=torch.long)
    for row, nodes in enumerate(paths):
        path[row, : len(nodes)] = torch.tensor(nodes)
    num_accepted = torch.tensor([len(nodes) - 1 for nodes in paths])
    return path.to(device), num_accepted.to(device), torch.tensor(emitted, dtype=torch.long).to(device)
