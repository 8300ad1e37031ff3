"""Where the blocks of a training row sit (reference algorithms_dflash_dspark.md section 1.2): the anchors (sampled
per epoch from a pure function of seed, epoch and sample index), the positions of every block slot, the attention mask
over [context ; blocks], and the cells each block supervises. Shared by every drafter on the DFlash backbone (DFlash,
DSpark).

Shapes: B batch, T sequence, A anchors per row, S block size, N kept anchors, K depths per block.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """anchors [B, A] -> positions [B, A * S] of every block slot (slot j of the block at a sits at a + j)."""
    slots = torch.arange(block_size, device=anchors.device)
    return (anchors.unsqueeze(-1) + slots).flatten(1)


def block_attention_mask(anchors: torch.Tensor, anchor_valid: torch.Tensor, context_valid: torch.Tensor,
                         block_size: int) -> torch.Tensor:
    """The training mask over keys [T context ; A * S block slots] (section 1.2, step 4).

    A query of a kept block at anchor a sees context keys j < a (strictly: the anchor's own target feature does not
    exist yet at inference) where context_valid holds, and every slot of its own block (bidirectional); nothing of
    other blocks. A padding block (anchor_valid False) sees its own block only, so no row is empty.

    Args:
        anchors: [B, A] positions; anchor_valid: [B, A] bool; context_valid: [B, T] bool (attention mask).
    Returns:
        [B, 1, A * S, T + A * S] bool, True = may attend.
    """
    batch, num_anchors = anchors.shape
    seq_len = context_valid.shape[1]
    device = anchors.device
    columns = torch.arange(seq_len, device=device)
    context = (columns < anchors.unsqueeze(-1)) & context_valid.unsqueeze(1) & anchor_valid.unsqueeze(-1)  # [B, A, T]
    context = context.repeat_interleave(block_size, dim=1)  # [B, A*S, T]
    block_of = torch.arange(num_anchors, device=device).repeat_interleave(block_size)  # [A*S]
    own = (block_of.unsqueeze(1) == block_of.unsqueeze(0)).expand(batch, -1, -1)  # [B, A*S, A*S]
    return torch.cat([context, own], dim=-1).unsqueeze(1)


def anchor_candidates(attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions a where attention_mask and loss_mask hold at a and at a + 1 (section 1.2, step 2)."""
    usable = attention_mask.bool() & loss_mask.bool()
    candidates = torch.zeros_like(usable)
    candidates[:, :-1] = usable[:, :-1] & usable[:, 1:]
    return candidates


def anchor_seed(seed: int, epoch: int, sample_index: int) -> int:
    """The generator seed of one sequence's anchors in one epoch (a pure function: resume and any process split
    draw the same anchors)."""
    return ((int(seed) * 1_000_003 + int(epoch)) * 1_000_033 + int(sample_index)) % (2**63 - 1)


def sample_anchors(attention_mask: torch.Tensor, loss_mask: torch.Tensor, num_anchors: int, *, seed: int = 0,
                   epoch: int = 0, sample_index=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to num_anchors anchors per row, uniform without replacement among `anchor_candidates`, sorted.

    Row b draws from a CPU generator seeded by anchor_seed(seed, epoch, sample_index[b]) (sample_index defaults to the
    row number). A row with fewer candidates takes all of them; rows are padded to a common A (at least 1) with
    anchor 0 marked invalid.

    Returns:
        anchors [B, A] long and anchor_valid [B, A] bool, on the device of the masks.
    """
    candidates = anchor_candidates(attention_mask, loss_mask).cpu()
    batch = candidates.shape[0]
    indices = range(batch) if sample_index is None else [int(i) for i in sample_index]
    chosen = []
    for row, index in zip(range(batch), indices):
        positions = candidates[row].nonzero().flatten()
        generator = torch.Generator().manual_seed(anchor_seed(seed, epoch, index))
        pick = torch.randperm(positions.numel(), generator=generator)[:num_anchors]
        chosen.append(positions[pick].sort().values)
    width = max(1, max(c.numel() for c in chosen))
    anchors = torch.zeros(batch, width, dtype=torch.long)
    valid = torch.zeros(batch, width, dtype=torch.bool)
    for row, positions in enumerate(chosen):
        anchors[row, : positions.numel()] = positions
        valid[row, : positions.numel()] = True
    return anchors.to(attention_mask.device), valid.to(attention_mask.device)


def batch_anchors(batch: Mapping[str, Any], num_anchors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This epoch's anchors of a training batch: `sample_anchors` seeded by its seed, epoch and sample indices."""
    return sample_anchors(batch["attention_mask"], batch["loss_mask"], num_anchors, seed=int(batch.get("seed", 0)),
                          epoch=int(batch.get("epoch", 0)), sample_index=batch.get("sample_index"))


def block_cells(anchors: torch.Tensor, anchor_valid: torch.Tensor, num_depths: int, attention_mask: torch.Tensor,
                loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cells of the kept blocks: depth k of the block at anchor a predicts the token at a + 1 + k.

    Args:
        anchors, anchor_valid: [B, A]; num_depths: K; attention_mask, loss_mask: [B, T].
    Returns:
        rows, columns [N] of the kept anchors (row-major); label_position [N, K] (clamped to T - 1 past the end);
        supervised [N, K] bool: the label lies inside the sequence and is a real loss token.
    """
    seq_len = attention_mask.shape[1]
    rows, columns = anchor_valid.nonzero(as_tuple=True)
    depth = torch.arange(num_depths, device=anchors.device)
    unclamped = anchors[rows, columns].unsqueeze(1) + 1 + depth  # [N, K]
    label_position = unclamped.clamp(max=seq_len - 1)  # cells past the end stay indexable (and unsupervised)
    row_index = rows.unsqueeze(1).expand_as(label_position)
    supervised = (unclamped < seq_len) & attention_mask.bool()[row_index, label_position]
    supervised &= loss_mask.bool()[row_index, label_position]
    return rows, columns, label_position, supervised
