"""Long sequences in bounded memory: attention and losses computed in chunks of rows, each chunk recomputed in the
backward pass (torch.utils.checkpoint), so no [n, n] score or mask tensor and no [N, K, V] logits tensor is ever held
for all rows at once; and activation checkpointing of whole draft layers (`maybe_checkpoint`).

When everything fits one chunk (the budgets below), each function runs the plain one-shot computation, unchanged, so
short sequences cost nothing extra; past it, chunking changes only the summation order (results equal to the
dtype's rounding). Budgets are in values (elements), so they mean the same bytes per dtype on every device.

Shapes: B batch, H query heads, H_kv key/value heads, n query positions, d head dim, N rows, K depths, V vocabulary.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from drafters.layers import attention, attention_with_diagonal

# Score values of one attention chunk (64 MiB in fp32), or mask values where SDPA runs it: its fused kernels
# (drafters/layers.attention, K/V repeated to every head off the CPU) hold the mask and a float copy, never scores.
ATTENTION_CHUNK_VALUES = 1 << 24
LOSS_CHUNK_VALUES = 1 << 24  # logits values of one loss chunk
# Up to this many logits values a loss runs in one shot: recomputing chunks in the backward costs about half the
# head's time again, which short-sequence CPU training (e.g. 2 x 384 tokens, TTT 7: 44M values) should not pay.
LOSS_ONE_SHOT_VALUES = 1 << 26


def maybe_checkpoint(enabled: bool, function: Callable, *args):
    """function(*args), its activations recomputed in the backward pass when `enabled` and grad is on."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False)
    return function(*args)


def with_autocast_of_now(function: Callable, device: torch.device) -> Callable:
    """function, to be called later under the autocast state `device` has now: a head built in `forward` (where an
    accelerator's mixed precision applies) and run chunk by chunk in `loss` computes as it would in the forward."""
    kind = device.type
    enabled = torch.is_autocast_enabled(kind)
    dtype = torch.get_autocast_dtype(kind)

    def run(*args):
        with torch.autocast(kind, dtype=dtype, enabled=enabled):
            return function(*args)

    return run


def rows_per_chunk(values_per_row: int, budget: int) -> int:
    """How many rows of values_per_row values fit a chunk of `budget` values (at least one)."""
    return max(1, budget // max(1, values_per_row))


def chunked_rows(function: Callable[[slice], Sequence[torch.Tensor]], num_rows: int, values_per_row: int,
                 budget: int | None = None) -> tuple[torch.Tensor, ...]:
    """function(rows) for consecutive row slices covering range(num_rows), outputs concatenated along dim 0.

    function(rows) returns tensors that concatenate along dim 0 in row order (e.g. per-cell losses [n, K] and draft
    argmaxes [n, K]); what it builds inside (logits [n, K, V]) lives only while its chunk runs, in the forward and
    again in the backward. Up to LOSS_ONE_SHOT_VALUES values in all, one slice covering every row runs plainly,
    without recomputation. budget: values of one chunk's logits, and the one-shot limit (None = the constants).
    """
    one_shot = num_rows * values_per_row <= (LOSS_ONE_SHOT_VALUES if budget is None else budget)
    step = rows_per_chunk(values_per_row, LOSS_CHUNK_VALUES if budget is None else budget)
    if one_shot or step >= num_rows:
        return tuple(function(slice(0, num_rows)))
    parts = [checkpoint(function, slice(start, min(num_rows, start + step)), use_reentrant=False,
                        preserve_rng_state=False) for start in range(0, num_rows, step)]
    return tuple(torch.cat(pieces, dim=0) for pieces in zip(*parts))


def _causal_chunk(start: int, q, k, v, key_valid, diagonal_k, diagonal_v):
    """Queries start..start+c (q [B, H, c, d]) against keys 0..start+c-1 (k, v), causal and key_valid, plus their
    diagonal keys; the query's own column is always visible (no empty row)."""
    end = k.shape[2]
    columns = torch.arange(end, device=q.device)
    rows = torch.arange(start, end, device=q.device).unsqueeze(1)
    causal = columns <= rows  # [c, end]
    if key_valid is None:
        mask = causal[None, None]
    else:
        mask = ((causal & key_valid[:, None, :end]) | (columns == rows)).unsqueeze(1)  # [B, 1, c, end]
    if not diagonal_k:
        return attention(q, k, v, mask)
    return attention_with_diagonal(q, k, v, mask, list(diagonal_k), list(diagonal_v))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
                     diagonal_k: Sequence[torch.Tensor] = (), diagonal_v: Sequence[torch.Tensor] = (),
                     budget: int | None = None) -> torch.Tensor:
    """Causal attention over keys that are valid (key_valid), each query also seeing its own position, plus one extra
    key per query for each entry of diagonal_k (EAGLE-3's training-time test: layers.attention_with_diagonal).

    Equals attention_with_diagonal(q, k, v, ((causal & key_valid) | eye)[:, None], diagonal_k, diagonal_v)
    (or `attention` without diagonal keys). Without diagonal keys and with every key valid it is one causal SDPA
    (a flash kernel: no [n, n] scores). Otherwise query chunks of at most `budget` score values (None =
    ATTENTION_CHUNK_VALUES) attend to the keys up to their last row, each chunk recomputed in the backward pass, so
    memory is linear in n.

    Args:
        q: [B, H, n, d]; k, v: [B, H_kv, n, d]; key_valid: [B, n] bool, or None when every key is valid;
        diagonal_k / diagonal_v: J tensors like k.
    Returns:
        [B, H, n, d]
    """
    batch, heads, n, _ = q.shape
    if not diagonal_k and key_valid is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != k.shape[1])
    step = rows_per_chunk(batch * heads * (n + len(diagonal_k)), ATTENTION_CHUNK_VALUES if budget is None else budget)
    if step >= n:
        return _causal_chunk(0, q, k, v, key_valid, tuple(diagonal_k), tuple(diagonal_v))
    parts = []
    for start in range(0, n, step):
        end = min(n, start + step)
        parts.append(checkpoint(_causal_chunk, start, q[:, :, start:end], k[:, :, :end], v[:, :, :end], key_valid,
                                tuple(t[:, :, start:end] for t in diagonal_k),
                                tuple(t[:, :, start:end] for t in diagonal_v),
                                use_reentrant=False, preserve_rng_state=False))
    return torch.cat(parts, dim=2)
