"""Draft trees: the flattened tree the target verifies in one forward, and the two ways of growing one.

Shapes: B batch, N tree nodes per row (the verify budget, root included), V vocab, L proposal depth.

A tree is flattened in creation order: node 0 is the root (the token the target just emitted, not yet in any
cache), every other node's parent has a smaller index, and depth counts edges from the root. In the target forward a
node sees the cached past, the root, its ancestors and itself (`ancestor_mask`) at position start + depth, so each
root-to-node path computes what the same tokens fed as a plain chain would.

Builders (reference: algorithms_dflash_dspark.md section 3 for DDTree, algorithms_eagle3_mtp.md A.6 for EAGLE-2):
- `ddtree`: best-first over per-depth marginals q_d (Proposal.log_probs). Under the factorised surrogate
  Q(y_1..y_L) = prod_d q_d(y_d) the expected accepted depth of a prefix-closed tree is the sum of its prefixes'
  probabilities, so the best tree of N - 1 drafted nodes is the N - 1 most probable prefixes (DDTree Prop. 2), found
  with a heap over (depth, rank) in O(N log N) from the top min(N - 1, V) tokens of each depth (Lemma 1).
- `dynamic_tree`: EAGLE-2's dynamic tree for a drafter that expands branches (Drafter.expands_trees): each step feeds
  the top_k frontier nodes by path score in one drafter forward, records top_k children per node, keeps the best
  top_k as the next frontier; the tree is the N - 1 best recorded nodes. Path scores never increase along a path, so
  with ties broken by creation order the selection is prefix-closed. Expansion stops as soon as no frontier node can
  still enter the selection (its children score at most its own score).
- `chain_tree`: a chain as a one-branch tree, for drafters that return neither marginals nor branch expansion.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """tokens [B, N] target ids (node 0 = root); parents [B, N] (-1 at the root, parents[b, i] < i); depth [B, N]
    (0 at the root); valid [B, N] bool: padding nodes (a row that found fewer than N - 1 candidates) are never
    accepted."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def ancestor_mask(self) -> torch.Tensor:
        """[B, N, N] bool: mask[b, i, j] is True when node j is node i or one of its ancestors."""
        batch, num_nodes = self.tokens.shape
        mask = torch.eye(num_nodes, dtype=torch.bool, device=self.tokens.device).repeat(batch, 1, 1)
        rows = torch.arange(batch, device=self.tokens.device)
        for node in range(1, num_nodes):  # parents come first, so their rows are final when read
            mask[:, node] |= mask[rows, self.parents[:, node]]
        return mask

    def children(self, row: int) -> list[list[int]]:
        """Per node of `row`, its valid children in creation order (the order siblings are tried in)."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for node, (parent, ok) in enumerate(zip(self.parents[row].tolist(), self.valid[row].tolist())):
            if node > 0 and ok:
                kids[parent].append(node)
        return kids


def check_budget(budget: int) -> None:
    """A tree of `budget` nodes, root included, is verified per round (budget 1 = plain autoregression)."""
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"tree_budget must be an integer >= 1 (nodes verified per round, root included), "
                         f"got {budget!r}")


def chain_tree(root: torch.Tensor, drafts: torch.Tensor, num_valid: torch.Tensor | None = None) -> DraftTree:
    """root [B], drafts [B, K] (num_valid [B]: drafts past it are padding) -> a one-branch tree of K + 1 nodes."""
    batch, num_drafts = drafts.shape
    device = drafts.device
    index = torch.arange(num_drafts + 1, device=device).expand(batch, -1)
    valid = torch.ones(batch, num_drafts + 1, dtype=torch.bool, device=device)
    if num_valid is not None:
        valid = index <= num_valid.to(device)[:, None]
    return DraftTree(torch.cat([root[:, None], drafts], dim=1), index - 1, index.clone(), valid)


def ddtree(root: torch.Tensor, log_probs: torch.Tensor, budget: int) -> DraftTree:
    """The top budget - 1 prefixes under prod_d q_d (module docstring), one heap per row.

    Args: root [B]; log_probs [B, L, V] per-depth draft log-marginals; budget N (nodes, root included).
    Returns: DraftTree of N nodes, children after their parents, siblings in decreasing score.
    """
    check_budget(budget)
    batch, depth_limit, vocab = log_probs.shape
    num_draft = budget - 1
    nodes = [[] for _ in range(batch)]  # per row: (token, parent, depth)
    if num_draft > 0 and depth_limit > 0:
        values, ids = log_probs.float().topk(min(num_draft, vocab), dim=-1)  # [B, L, R]
        for row in range(batch):
            nodes[row] = _best_prefixes(values[row].tolist(), ids[row].tolist(), num_draft)
    return _tree_from_nodes(root, nodes, budget)


def _best_prefixes(values: list[list[float]], ids: list[list[int]], num_draft: int) -> list[tuple[int, int, int]]:
    """DDTree Algorithm 1 on one row: values/ids [L][R] sorted per depth -> (token, parent node, depth) nodes.

    A heap entry is a prefix not yet taken: (-score, tie, parent node, depth index d, rank r, parent score). Popping
    it adds node (ids[d][r]) and pushes its next sibling (rank r + 1 under the same parent) and its first child
    (rank 0 at depth d + 1): every prefix is pushed only after its parent and its better sibling were taken."""
    depth_limit, ranks = len(values), len(values[0])
    heap = [(-values[0][0], 0, 0, 0, 0, 0.0)]
    nodes: list[tuple[int, int, int]] = []
    tie = 1
    while heap and len(nodes) < num_draft:
        negative, _, parent, d, r, parent_score = heapq.heappop(heap)
        if negative == float("inf"):  # only drafts outside the draft vocabulary remain
            break
        nodes.append((ids[d][r], parent, d + 1))
        node, score = len(nodes), -negative
        if r + 1 < ranks:
            heapq.heappush(heap, (-(parent_score + values[d][r + 1]), tie, parent, d, r + 1, parent_score))
        if d + 1 < depth_limit:
            heapq.heappush(heap, (-(score + values[d + 1][0]), tie + 1, node, d + 1, 0, score))
        tie += 2
    return nodes


def _tree_from_nodes(root: torch.Tensor, nodes: list[list[tuple[int, int, int]]], budget: int) -> DraftTree:
    """Per-row node lists -> DraftTree of `budget` nodes; short rows are padded with invalid depth-1 nodes."""
    batch, device = root.shape[0], root.device
    tokens = torch.zeros(batch, budget, dtype=torch.long)
    parents = torch.zeros(batch, budget, dtype=torch.long)
    depth = torch.ones(batch, budget, dtype=torch.long)
    valid = torch.zeros(batch, budget, dtype=torch.bool)
    parents[:, 0], depth[:, 0], valid[:, 0] = -1, 0, True
    for row, row_nodes in enumerate(nodes):
        for index, (token, parent, node_depth) in enumerate(row_nodes, start=1):
            tokens[row, index], parents[row, index], depth[row, index] = token, parent, node_depth
            valid[row, index] = True
    tokens[:, 0] = root.cpu()
    return DraftTree(tokens.to(device), parents.to(device), depth.to(device), valid.to(device))


@torch.no_grad()
def dynamic_tree(drafter, root: torch.Tensor, budget: int, top_k: int) -> DraftTree:
    """EAGLE-2's dynamic tree (module docstring) grown with drafter.expand_tree.

    Candidates are recorded in creation order with their path score (sum of log q), parent candidate (-1 = root),
    the drafter's id of the fed parent node and depth. Args: root [B]; budget N; top_k children per expanded node
    and frontier width. Returns: DraftTree of N nodes.
    """
    check_budget(budget)
    if top_k < 1:
        raise ValueError(f"tree_top_k must be >= 1, got {top_k}")
    batch, device = root.shape[0], root.device
    num_draft = budget - 1
    log_q = drafter.expand_tree(root[:, None], torch.full((batch, 1), -1, dtype=torch.long, device=device))
    if num_draft == 0:
        return chain_tree(root, root.new_zeros(batch, 0))
    width = min(top_k, num_draft, log_q.shape[-1])
    score, token = log_q[:, 0].topk(width, dim=-1)  # [B, W]: the first layer
    parent = torch.full_like(token, -1)
    fed_parent = torch.zeros_like(token)  # the drafter's node id of each candidate's parent (root = 0)
    depth = torch.ones_like(token)
    frontier = torch.arange(width, device=device).expand(batch, -1)
    num_fed = 1
    for _ in range(num_draft - 1):
        if score.shape[1] >= num_draft:
            kth = score.topk(num_draft, dim=-1).values[:, -1:]
            if bool((score.gather(1, frontier) <= kth).all()):  # no child can enter the selection any more
                break
        fed_ids = num_fed + torch.arange(width, device=device).expand(batch, -1)
        log_q = drafter.expand_tree(token.gather(1, frontier), fed_parent.gather(1, frontier))  # [B, W, V]
        num_fed += width
        child_score, child_token = log_q.topk(width, dim=-1)  # [B, W, W]
        child_score = (score.gather(1, frontier)[:, :, None] + child_score).flatten(1)
        first_new = score.shape[1]
        score = torch.cat([score, child_score], dim=1)
        token = torch.cat([token, child_token.flatten(1)], dim=1)
        parent = torch.cat([parent, frontier.repeat_interleave(width, dim=1)], dim=1)
        fed_parent = torch.cat([fed_parent, fed_ids.repeat_interleave(width, dim=1)], dim=1)
        depth = torch.cat([depth, (depth.gather(1, frontier) + 1).repeat_interleave(width, dim=1)], dim=1)
        frontier = first_new + _stable_top(child_score, width)
    return _select(root, score, token, parent, depth, num_draft)


def _stable_top(score: torch.Tensor, count: int) -> torch.Tensor:
    """[B, C] -> indices [B, count] of the best scores, ties to the earlier candidate (which keeps a selection by
    score prefix-closed: a parent ties its child at best and was created first)."""
    return torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :count]


def _select(root, score, token, parent, depth, num_draft: int) -> DraftTree:
    """The num_draft best candidates [B, C], in creation order, as a DraftTree (node i + 1 = i-th selected)."""
    batch = score.shape[0]
    chosen = _stable_top(score, num_draft).sort(dim=-1).values  # [B, n], creation order
    numbers = torch.arange(1, num_draft + 1, device=score.device).expand(batch, -1)
    node_of = torch.full_like(token, -1).scatter(1, chosen, numbers)
    parent_candidate = parent.gather(1, chosen)
    parent_node = torch.where(parent_candidate < 0, 0, node_of.gather(1, parent_candidate.clamp(min=0)))
    assert bool((parent_node >= 0).all()), "a selected node's parent was not selected"
    ones = torch.ones(batch, 1, dtype=torch.long, device=score.device)
    return DraftTree(torch.cat([root[:, None], token.gather(1, chosen)], dim=1),
                     torch.cat([-ones, parent_node], dim=1), torch.cat([0 * ones, depth.gather(1, chosen)], dim=1),
                     torch.cat([ones.bool(), score.gather(1, chosen) > float("-inf")], dim=1))
