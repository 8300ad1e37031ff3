"""The target's side of tree verification: one forward over every tree node, then KV compaction to the accepted path.

Composes inference/target.TargetModel and its drafters/ragged_lm.RaggedLM cache (slots with a validity mask [B, L])
without changing them. Shapes: B batch, N tree nodes, L cache slots before the tree, W accepted path length (root
included), D hidden, V vocab.

The forward passes transformers a 4-D mask [B, 1, N, L + N], which transformers 5 uses as given (an already
prepared mask skips its own mask construction): each node sees the row's valid cached slots, then its ancestors and
itself among the tree slots. SDPA reads it as a boolean mask (True = attend), eager attention adds it to the
scores, so eager gets 0 / dtype-min; other attention kernels cannot take an arbitrary mask and are refused. Position
ids are each row's length + node depth, so every root-to-node path computes what the same tokens fed as a chain
would (tests/test_tree_target.py checks it against plain chains).

Hybrid targets (gated-DeltaNet layers) step the nodes in order, each from its parent's recorded state, and keep
the state of the last accepted node (drafters/ragged_state.py); sliding windows are applied by position.

Compaction moves the accepted path's K/V into the first W slots of the tree block in path order and lets
`RaggedLM.keep_after` keep them and crop the rest: afterwards the cache is the cache of the path fed as a chain.
"""

from __future__ import annotations

import torch

from drafters.base import FeatureRequest
from inference.engine.tree.draft import DraftTree

MASKABLE_ATTENTION = ("sdpa", "eager")


def tree_mask(target, tree: DraftTree):
    """The mask of the tree forward ([B, 1, N, L + N], or one per layer type where sliding windows apply by
    position), in the form the target's attention kernel reads (drafters/ragged_state.py)."""
    runner = target.runner
    kernel = getattr(runner.model.config, "_attn_implementation", "eager") or "eager"
    if kernel not in MASKABLE_ATTENTION:
        raise ValueError(f"tree verification needs attn_implementation in {MASKABLE_ATTENTION} (an arbitrary 4-D mask);"
                         f" the target uses {kernel!r}: load it with attn_implementation='sdpa'")
    return runner.family.tree_attention_mask(runner.slot_mask, tree.ancestor_mask(), tree.depth)


@torch.no_grad()
def tree_extend(target, tree: DraftTree, request: FeatureRequest | None = None) -> tuple[torch.Tensor, dict]:
    """Feed every node of `tree` after each row's sequence in one forward (the cache must hold a prefill).

    Returns: logits [B, N, V] (row i: the target's distribution after the root-to-i path) and the features `request`
    asks for over the N nodes, as DraftContext keyword arguments (as TargetModel.extend serves them).
    """
    runner = target.runner
    if runner.slot_mask is None:
        raise ValueError("tree_extend needs a prefilled cache (call target.prefill first)")
    request = request or FeatureRequest()
    mask = tree_mask(target, tree)
    position_ids = runner.lengths[:, None] + tree.depth.to(runner.device)
    runner.slot_mask = torch.cat([runner.slot_mask, torch.ones_like(tree.tokens, device=runner.device)], dim=1)
    runner.family.begin_block(runner.cache, None, parents=tree.parents.to(runner.device))  # per-node linear states
    try:
        with target.capture(request.layer_ids, want_last_hidden=request.final_hidden) as captured:
            logits = runner.model(input_ids=tree.tokens.to(runner.device), attention_mask=mask,
                                  position_ids=position_ids, use_cache=True,
                                  **{runner.cache_arg: runner.cache}).logits.float()
    finally:
        runner.family.end_block()
    served: dict = {"hidden": {layer_id: captured[layer_id] for layer_id in request.layer_ids}}
    if request.final_hidden:
        served["final_hidden"] = captured["last"]
    if request.top_k_logits:
        served["top_k"] = tuple(logits.topk(request.top_k_logits, dim=-1))
    return logits, served


def path_order(path: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """path [B, W] node ids (-1 past a row's end) -> a permutation [B, N] listing the path first, then the rest."""
    order = []
    for nodes in path.tolist():
        kept = [node for node in nodes if node >= 0]
        order.append(kept + [node for node in range(num_nodes) if node not in kept])
    return torch.tensor(order, dtype=torch.long, device=path.device)


@torch.no_grad()
def keep_path(target, mark: int, path: torch.Tensor, keep: torch.Tensor) -> None:
    """Compact the tree block fed since `mark` to the accepted path: row b keeps its first keep[b] path nodes (0 for
    a finished row) in slots mark.., everything else of the block is dropped.

    Args: mark from target.mark() before tree_extend; path [B, W]; keep [B] long (<= the row's path length).
    """
    runner = target.runner
    num_nodes = runner.num_slots - mark
    order = path_order(path, num_nodes).to(runner.device)  # [B, N]
    if runner.family.has_linear:  # linear states: the one recorded after the last kept node (0 = before the tree)
        keep_dev = keep.to(runner.device)
        last = path.to(runner.device).gather(1, (keep_dev - 1).clamp(min=0)[:, None])[:, 0]
        runner.family.keep_states(runner.cache, torch.where(keep_dev > 0, last + 1, torch.zeros_like(last)))
    for layer in runner.cache.layers:
        if getattr(layer, "keys", None) is None:  # linear-attention and KV-sharing layers hold no slots
            continue
        for name in ("keys", "values"):
            tensor = getattr(layer, name)  # [B, H_kv, L + N, d]
            block = tensor[:, :, mark:]
            index = order[:, None, :, None].expand(-1, block.shape[1], -1, block.shape[3])
            tensor[:, :, mark:] = block.gather(2, index)
    target.keep_after(mark, keep)


def path_features(served: dict, path: torch.Tensor) -> dict:
    """The served node features [B, N, ...] gathered along path [B, W] -> [B, W, ...] (padding reads node 0)."""
    index = path.clamp(min=0)

    def take(tensor: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(tensor.shape[0], device=tensor.device)[:, None]
        return tensor[rows, index.to(tensor.device)]

    gathered: dict = {"hidden": {layer_id: take(value) for layer_id, value in served["hidden"].items()}}
    if "final_hidden" in served:
        gathered["final_hidden"] = take(served["final_hidden"])
    if "top_k" in served:
        gathered["top_k"] = tuple(take(part) for part in served["top_k"])
    return gathered
