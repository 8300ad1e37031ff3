"""EAGLE-2 dynamic-tree bookkeeping for the EAGLE-3 drafter (reference A.6; the engine's loop is inference/engine/tree/draft.py).

A round's tree is fed to the drafter in calls of M new nodes each. Node 0 is the root (the committed state, never
fed); fed node i >= 1 sits in the drafter's cache column base + i - 1, base = each row's committed length, so a set
of ancestors over node ids maps to cache columns by an offset. `ExpansionTree` keeps, per row, what later calls need:
the fed nodes' pre-norm outputs, their depths and ancestor sets. Shapes: B rows, n nodes so far, M new, C columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ExpansionTree:
    hidden: torch.Tensor     # [B, n, D] pre-norm output of every node (the root's = the committed state)
    base: torch.Tensor       # [B] the row's committed cache length
    depth: torch.Tensor      # [B, n] depth of every node (root 0)
    ancestors: torch.Tensor  # [B, n, n] bool: node j is node i's ancestor or itself

    @classmethod
    def root(cls, hidden: torch.Tensor, base: torch.Tensor) -> "ExpansionTree":
        """hidden [B, D] the committed state, base [B]."""
        batch, device = hidden.shape[0], hidden.device
        return cls(hidden[:, None], base.clone(), torch.zeros(batch, 1, dtype=torch.long, device=device),
                   torch.ones(batch, 1, 1, dtype=torch.bool, device=device))

    def add(self, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Register M new nodes with parents [B, M] (node ids < n). Returns their ancestor sets [B, M, n + M] and
        depths [B, M]; `hidden` is appended by the caller (`append_hidden`) once the nodes are computed."""
        batch, num_new = parents.shape
        rows = torch.arange(batch, device=parents.device)[:, None]
        own = torch.eye(num_new, dtype=torch.bool, device=parents.device).expand(batch, num_new, num_new)
        ancestors = torch.cat([self.ancestors[rows, parents], own], dim=-1)
        self.ancestors = torch.cat([F.pad(self.ancestors, (0, num_new)), ancestors], dim=1)
        depth = self.depth[rows, parents] + 1
        self.depth = torch.cat([self.depth, depth], dim=1)
        return ancestors, depth

    def parent_hidden(self, parents: torch.Tensor) -> torch.Tensor:
        """parents [B, M] -> the parents' pre-norm outputs [B, M, D], what the new nodes read."""
        rows = torch.arange(parents.shape[0], device=parents.device)[:, None]
        return self.hidden[rows, parents]

    def append_hidden(self, hidden: torch.Tensor) -> None:
        self.hidden = torch.cat([self.hidden, hidden], dim=1)

    def cache_mask(self, ancestors: torch.Tensor, committed_valid: torch.Tensor) -> torch.Tensor:
        """ancestors [B, M, n_fed + M] over node ids (from `add`), committed_valid [B, >= max base] the cache's valid
        slots -> mask [B, 1, M, C] over cache columns: the row's committed valid columns (< base) plus the columns of
        its ancestors. n_fed counts the nodes before this call, root included."""
        num_new = ancestors.shape[1]
        num_fed = ancestors.shape[2] - num_new
        base, longest = self.base, int(self.base.max())
        used = longest + num_fed - 1 + num_new
        columns = torch.arange(used, device=base.device)[None, :]
        committed = F.pad(committed_valid[:, :longest], (0, used - longest)) & (columns < base[:, None])  # [B, C]
        node = columns - base[:, None] + 1  # [B, C] node id held by each column (>= 1 for tree columns)
        in_tree = (node >= 1) & (node < num_fed + num_new)
        index = node.clamp(0, num_fed + num_new - 1)[:, None, :].expand(-1, num_new, -1)
        return (committed[:, None, :] | (ancestors.gather(-1, index) & in_tree[:, None, :]))[:, None]
