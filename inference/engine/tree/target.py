"""The tree loop's view of the target: one forward over every tree node (its features gathered along a path by
drafters/base.py `Served.along`).

The target does the work behind its own API (inference/engine/target.TargetModel.extend_tree and keep_path, over
drafters/ragged_lm.RaggedLM): the forward passes transformers a 4-D mask [B, 1, N, L + N] (each node sees the row's
valid cached slots, then its ancestors and itself; SDPA reads it as boolean, eager gets 0 / dtype-min; other
attention kernels are refused), position ids are each row's length + node depth, so every root-to-node path computes
what the same tokens fed as a chain would (tests/test_tree_target.py); hybrid targets step each node from its
parent's recorded state. `TargetModel.keep_path` then moves the accepted path's K/V to the front of the block and
rolls back with the one `keep_after`. Shapes: B batch, N tree nodes, W accepted path length (root included).
"""

from __future__ import annotations

import torch

from drafters.base import FeatureRequest
from drafters.served import Served
from inference.engine.tree.draft import DraftTree


@torch.no_grad()
def tree_extend(target, tree: DraftTree, request: FeatureRequest | None = None) -> tuple[torch.Tensor, Served]:
    """Feed every node of `tree` after each row's sequence in one forward (the cache must hold a prefill).

    Returns: logits [B, N, V] (row i: the target's distribution after the root-to-i path) and the features `request`
    asks for over the N nodes (drafters/served.py `Served`, as TargetModel.extend serves them; `Served.along(path)`
    gathers them along a path).
    """
    return target.extend_tree(tree.tokens, tree.ancestor_mask(), tree.depth, tree.parents, request)
