"""Loss and metric functions shared by all drafters, so every drafter reports the same numbers the same way.

Legend: B batch, T sequence, N positions (flattened), K draft depth, V target vocab, V_d draft vocab, D hidden.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from drafters.chunked import chunked_rows, with_autocast_of_now
from drafters.output import DraftOutput


_ROWS_PER_CHUNK = 256  # rows of [V] per logsumexp chunk: small temporaries that the allocator can reuse


class _SoftCrossEntropy(torch.autograd.Function):
    """-sum_v p(v) log softmax(z)(v) = lse(z) * sum_v p(v) - <p, z>, with gradient softmax(z) * sum(p) - p.

    Memory-lean on purpose (this loss dominates drafter training on CPU): the forward materialises no [..., V]
    tensor besides small row chunks, the backward exactly one (the softmax, then updated in place). Fresh
    multi-hundred-MB temporaries are expensive on CPU (page faults), which plain autograd would create several of.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        # teacher [..., V] for logits [..., V], or [..., V] shared by the K rows of logits [..., K, V]
        shared = teacher.dim() == logits.dim() - 1
        mass = teacher.sum(dim=-1, keepdim=shared)  # [...] or [..., 1]
        rows = logits.reshape(-1, logits.shape[-1])
        lse = torch.cat([torch.logsumexp(chunk, dim=-1) for chunk in rows.split(_ROWS_PER_CHUNK)])
        lse = lse.view(logits.shape[:-1])
        equation = "...kv,...v->...k" if shared else "...v,...v->..."
        ctx.save_for_backward(logits, teacher, mass)
        ctx.shared = shared
        return lse * mass - torch.einsum(equation, logits, teacher)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, teacher, mass = ctx.saved_tensors
        teacher = teacher.unsqueeze(-2) if ctx.shared else teacher
        grad = torch.softmax(logits, dim=-1)
        grad.mul_(mass.unsqueeze(-1)).sub_(teacher).mul_(grad_output.unsqueeze(-1))
        return grad, None


def soft_cross_entropy(student_logits: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """Per-position soft cross-entropy -sum_v p(v) log q(v) (forward KL to the teacher plus its entropy).

    Args:
        student_logits: [..., V], or [..., K, V] for K depths that share one teacher row.
        teacher_probs: [..., V] non-negative (rows normally sum to 1); it receives no gradient.
    Returns:
        [...] or [..., K] per-position loss, in at least float32.
    """
    logits = student_logits.to(torch.promote_types(student_logits.dtype, torch.float32))
    return _SoftCrossEntropy.apply(logits, teacher_probs.detach().to(logits.dtype))


# LK losses (Samarin et al. 2026, arXiv 2602.23881): train on the acceptance itself. eta 3: the paper's best setting
# of the hybrid's adaptive weight (speculators' lk_hybrid default, vllm-project/speculators#673).
LK_LOSSES, LK_DEFAULT_ETA = ("lk", "lk_hybrid"), 3.0


class _ExpectedAcceptance(torch.autograd.Function):
    """alpha = sum_v min(p(v), q(v)) with q = softmax(z): the probability that rejection sampling accepts a draft drawn
    from q where the target's law is p (1 - TV(p, q)). d alpha / dz_u = q_u (g_u - <q, g>) with g = 1[q < p] (the
    overlap grows only where the draft is below the target); the backward recomputes q from z, as _SoftCrossEntropy."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        ctx.shared = teacher.dim() == logits.dim() - 1  # one teacher row for the K rows of logits [..., K, V]
        ctx.save_for_backward(logits, teacher)
        target = teacher.unsqueeze(-2) if ctx.shared else teacher
        return torch.minimum(torch.softmax(logits, dim=-1), target).sum(dim=-1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, teacher = ctx.saved_tensors
        target = teacher.unsqueeze(-2) if ctx.shared else teacher
        q = torch.softmax(logits, dim=-1)
        below = q * (q < target)
        below.sub_(q.mul_(below.sum(dim=-1, keepdim=True))).mul_(grad_output.unsqueeze(-1))
        return below, None


def expected_acceptance(student_logits: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """sum_v min(p(v), q(v)) per position, q = softmax(student_logits [..., V], or [..., K, V] for K depths sharing
    one teacher row), p = teacher_probs [..., V] (rows sum to 1, no gradient). Returns [...] or [..., K] (>= fp32)."""
    logits = student_logits.to(torch.promote_types(student_logits.dtype, torch.float32))
    return _ExpectedAcceptance.apply(logits, teacher_probs.detach().to(logits.dtype))


def lk_cell_loss(student_logits: torch.Tensor, teacher_probs: torch.Tensor, loss: str,
                 eta: float = LK_DEFAULT_ETA) -> tuple[torch.Tensor, torch.Tensor]:
    """LK loss per position (shapes as `expected_acceptance`): "lk" = -log alpha, whose gradient is TV's scaled by
    1 / alpha, so it does not vanish where the draft is far off; "lk_hybrid" = lam KL(p || q) + (1 - lam)(1 - alpha)
    with lam = exp(-eta alpha) detached: KL's strong pull while the overlap is small, TV (the acceptance) as it grows.

    Returns (loss, alpha detached), each [...] or [..., K]."""
    assert loss in LK_LOSSES, loss
    alpha = expected_acceptance(student_logits, teacher_probs)
    if loss == "lk":
        return -torch.log(alpha.clamp(min=torch.finfo(alpha.dtype).tiny)), alpha.detach()
    teacher = teacher_probs.detach().to(alpha.dtype)
    entropy = -torch.special.xlogy(teacher, teacher).sum(dim=-1)
    kl = soft_cross_entropy(student_logits, teacher) - (entropy.unsqueeze(-1) if alpha.dim() > entropy.dim()
                                                        else entropy)
    weight = torch.exp(-eta * alpha.detach())
    return weight * kl + (1.0 - weight) * (1.0 - alpha), alpha.detach()


def check_lk_eta(eta: float) -> None:  # at 0 the hybrid is KL alone
    if not eta >= 0:
        raise ValueError(f"drafter.lk_eta {eta} must be >= 0 (the LK hybrid's KL weight is exp(-lk_eta * acceptance))")


def acceptance_metric(alpha: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"expected_accept": mean alpha [N, K] over the valid cells [N, K]} (a 0-dim tensor, unread) for LK losses."""
    return {"expected_accept": (alpha * valid).sum() / valid.sum().clamp(min=1)}


def masked_depth_means(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of values [N, K] over the rows where mask [N, K] is set, per depth.

    Returns:
        means [K] (0 at a depth without any position) and counts [K].
    """
    mask = mask.to(values.dtype)
    counts = mask.sum(dim=0)
    return (values * mask).sum(dim=0) / counts.clamp(min=1), counts


def decayed_sum(per_depth: torch.Tensor, step_decay: float) -> torch.Tensor:
    """sum_k step_decay**k * per_depth[k] (EAGLE-3 weights its TTT steps by 0.8**k)."""
    weights = step_decay ** torch.arange(per_depth.numel(), device=per_depth.device, dtype=per_depth.dtype)
    return (weights * per_depth).sum()


def simulated_accept_length(per_depth_acc: Sequence[float]) -> float:
    """Expected tokens per round of a chain with the given per-depth accuracies, bonus token included:
    1 + sum_k prod_{j<=k} acc_j. acc_k is measured with ground-truth inputs, i.e. it stands in for the
    acceptance at depth k given that all earlier drafts were accepted."""
    total, running = 1.0, 1.0
    for acc in per_depth_acc:
        running = running * (acc if isinstance(acc, torch.Tensor) else float(acc))  # a tensor is not read
        total = total + running
    return total


def output_metrics(output, batch: Mapping[str, Any], cell_loss: torch.Tensor,
                   predicted: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The one way every drafter turns its DraftOutput into per-depth loss, accuracy and simulated acceptance.

    Accuracy at a cell is top-1 agreement with the target: the draft argmax (in target ids) against the target's
    own argmax at the position before the cell's label (the token greedy verification would accept there).
    data_acc is agreement with the data token at the label over all supervised cells (the training accuracy
    SpecForge and Model Optimizer log); the two coincide on answers the target regenerated greedily.

    Args:
        output: a drafters.output.DraftOutput (logits [N, K, V_d], batch_index [N], label_position [N, K],
            depth_valid [N, K], draft_ids).
        batch: the training batch (target_argmax [B, T]).
        cell_loss: [N, K] the drafter's per-cell loss (any weighting is the drafter's business).
        predicted: [N, K] the draft argmax (draft-vocabulary indices) when the loss already has it (a chunked loss
            never holds all logits); None = the argmax of output.logits.
    Returns:
        per-depth mean loss [K] (differentiable) and the metrics dict of `depth_metrics`.
    """
    valid = output.depth_valid
    with torch.no_grad():
        rows = output.batch_index.unsqueeze(1).expand_as(output.label_position)
        agreed = batch["target_argmax"][rows, output.label_position - 1]  # label_position lies in 1..T-1
        if predicted is None:
            predicted = output.logits.detach().argmax(dim=-1)
        predicted = output.target_ids(predicted)
        accuracy, _ = masked_depth_means((predicted == agreed).float(), valid)
        data_right = (predicted == batch["input_ids"][rows, output.label_position]) & valid
        data_accuracy = data_right.sum().double() / valid.sum().clamp(min=1).double()  # on the device, unread
    per_depth, counts = masked_depth_means(cell_loss, valid)
    return per_depth, {**depth_metrics(per_depth.detach(), accuracy, counts), "data_acc": data_accuracy}


def position_cells(batch: Mapping[str, Any],
                   num_depths: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cells of a drafter that reads the hidden state at position i (the position before its anchor) and predicts
    depth k there, the token at i + k + 2 (MTP modules, Medusa heads): every row i with a loss at some depth.

    Args:
        batch: input_ids, attention_mask, loss_mask [B, T] (right padding).
    Returns:
        batch_index [N], position [N], label_position [N, K] = position + k + 2 (clamped to T - 1 past the end) and
        depth_valid [N, K] (label inside the sequence and a loss token).
    """
    input_ids = batch["input_ids"]
    seq_len, device = input_ids.shape[1], input_ids.device
    lengths = batch["attention_mask"].long().sum(dim=1)
    in_loss = F.pad(batch["loss_mask"].bool() & batch["attention_mask"].bool(), (0, num_depths + 2))
    labels = torch.arange(seq_len, device=device)[:, None] + 2 + torch.arange(num_depths, device=device)  # [T, K]
    valid = (labels < lengths[:, None, None]) & in_loss[:, labels]  # [B, T, K]
    batch_index, position = valid.any(dim=-1).nonzero(as_tuple=True)
    return batch_index, position, labels[position].clamp(max=seq_len - 1), valid[batch_index, position]


def chained_depths(batch: Mapping[str, Any], num_depths: int,
                   step: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                   head: Callable[[torch.Tensor], torch.Tensor]) -> DraftOutput:
    """The teacher-forced training forward of a drafter whose depth k at position i reads the token at i + k + 1 and
    depth k - 1's hidden state there (depth 0: the target's final hidden state), MTP modules and the assistant alike.

    Args:
        batch: input_ids, attention_mask, loss_mask [B, T], final_hidden [B, T, D].
        step: (depth, tokens [B, T], hidden [B, T, D]) -> (hidden for the next depth, normed output [B, T, D]).
        head: normed rows [n, K, D] -> logits [n, K, V]; only the rows with a loss (position_cells) reach it, a chunk
            of rows at a time when the loss reads them (`full_vocab_cross_entropy`), under the forward's autocast.
    """
    seq_len = batch["input_ids"].shape[1]
    batch_index, position, label_position, depth_valid = position_cells(batch, num_depths)
    tokens = F.pad(batch["input_ids"], (0, num_depths + 1))  # depth k at position i reads tokens[i + k + 1]
    hidden, rows = batch["final_hidden"], []
    for depth in range(num_depths):
        hidden, normed = step(depth, tokens[:, depth + 1 : depth + 1 + seq_len], hidden)
        rows.append(normed[batch_index, position])
    head_input = torch.stack(rows, dim=1)  # [N, K, D]
    return DraftOutput(batch_index=batch_index, label_position=label_position, depth_valid=depth_valid,
                       head=with_autocast_of_now(lambda chunk: head(head_input[chunk]), head_input.device))


def full_vocab_cross_entropy(output, batch: Mapping[str, Any], lm_head_weight: torch.Tensor,
                             soft: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-cell cross-entropy of target-vocabulary draft logits: "soft" against the target's distribution at the
    position before each label (softmax of its lm_head over final_hidden there), else against the data token.
    `distilled_cells` with loss "soft" or "hard": (cell loss [N, K], draft argmax [N, K])."""
    cell_loss, predicted, _ = distilled_cells(output, batch, lm_head_weight, "soft" if soft else "hard")
    return cell_loss, predicted


def distilled_cells(output, batch: Mapping[str, Any], lm_head_weight: torch.Tensor, loss: str,
                    eta: float = LK_DEFAULT_ETA) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-cell loss of draft logits against the target: "soft" cross-entropy against its distribution at the position
    before each label, "hard" against the data token, "lk" / "lk_hybrid" (`lk_cell_loss`) against that distribution.

    With a draft vocabulary (output.draft_ids) the logits cover V_d: the teacher is the target's distribution
    renormalised on those ids (as EAGLE-3's), and a hard label is the data token's draft index (a cell whose token lies
    outside is the drafter's to mark invalid; it reads a neighbour's index here). Target mass outside the draft
    vocabulary can never be accepted whatever the draft does, so it is left out of alpha, not counted as a constant.
    A chunk of rows at a time (chunked.chunked_rows): [N, K, V] logits and teacher exist whole only up to its limit.

    Args:
        output: a DraftOutput with logits (or a head) [N, K, V_d], batch_index [N], label_position [N, K], draft_ids.
        batch: input_ids [B, T] and final_hidden [B, T, D]. lm_head_weight: [V, D] the target's frozen head,
            in the target's dtype: the teacher's product runs in it, its softmax in at least float32.
    Returns:
        cell loss [N, K] (>= fp32), the draft argmax [N, K] (draft indices), alpha [N, K] for an LK loss, else None.
    """
    rows = output.batch_index.unsqueeze(1).expand_as(output.label_position)
    head, draft_ids = lm_head_weight, output.draft_ids
    if draft_ids is not None:
        head = lm_head_weight.index_select(0, draft_ids.to(lm_head_weight.device))

    def cells(chunk):  # one chunk of rows: its logits [n, K, V] and teacher exist only here
        logits = output.logits_of(chunk)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if loss != "hard":
            teacher = _teacher_cells(batch, rows[chunk], output.label_position[chunk], head, logits.dtype)
            if loss in LK_LOSSES:
                cell_loss, alpha = lk_cell_loss(logits, teacher, loss, eta)
                return cell_loss, logits.detach().argmax(dim=-1), alpha
            return soft_cross_entropy(logits, teacher), logits.detach().argmax(dim=-1)
        labels = batch["input_ids"][rows[chunk], output.label_position[chunk]]
        if draft_ids is not None:  # sorted ids: a token's draft index, without a host sync
            labels = torch.searchsorted(draft_ids, labels).clamp(max=draft_ids.numel() - 1)
        cell_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
        return cell_loss, logits.detach().argmax(dim=-1)

    depths, vocab = output.label_position.shape[1], head.shape[0]
    parts = chunked_rows(cells, output.num_rows, depths * vocab)
    return parts[0], parts[1], parts[2] if len(parts) > 2 else None


@torch.no_grad()
def _teacher_cells(batch: Mapping[str, Any], rows: torch.Tensor, label_position: torch.Tensor,
                   lm_head_weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, K, V] in dtype: the target's distribution at the position before each cell's label (rows, label_position
    [n, K]). Cells (i, k) and (i + 1, k - 1) read one teacher position: its head runs once."""
    seq_len = batch["final_hidden"].shape[1]
    cells, cell_of = torch.unique(rows * seq_len + label_position - 1, return_inverse=True)
    hidden = batch["final_hidden"][cells // seq_len, cells % seq_len].to(lm_head_weight.dtype)
    return torch.softmax(F.linear(hidden, lm_head_weight).to(dtype), dim=-1)[cell_of]


def weighted_depth_loss(output, batch: Mapping[str, Any], cell_loss: torch.Tensor, weights: torch.Tensor,
                        predicted: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """sum_k weights[k] * mean of cell_loss over depth k's valid cells of all processes (global_mean), and the
    metrics of `output_metrics`. output: a DraftOutput (depth_valid [N, K]); cell_loss: [N, K]; weights: [K] in
    cell_loss's dtype and device; predicted: [N, K] the draft argmax when the loss has it (None = output.logits')."""
    _, metrics = output_metrics(output, batch, cell_loss, predicted)
    valid = output.depth_valid.to(cell_loss.dtype)
    per_depth = global_mean((cell_loss * valid).sum(dim=0), valid.sum(dim=0), batch)
    return (weights * per_depth).sum(), metrics


def global_mean(total: torch.Tensor, weight: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """total / (weight summed over all training processes) * number of processes.

    Data-parallel training averages the gradients of the processes' losses; with this normalisation that average is
    the gradient of sum(total) / sum(weight) over all processes, so a weighted loss does not depend on how the data
    is split. Outside a multi-process run (no `sum_over_processes` in the batch) it is total / weight.
    """
    reduce = batch.get("sum_over_processes")
    weight = weight.detach()
    if reduce is None:
        return total / weight.clamp(min=1e-12)
    return total / reduce(weight).clamp(min=1e-12) * int(batch.get("num_processes", 1))


def depth_metrics(losses: torch.Tensor, accuracies: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
    """The metrics every drafter reports: loss_k, acc_k, positions_k per depth and sim_accept_length, as 0-dim
    tensors on the device (the training loop reads them once per log line; float() reads one anywhere else).
    losses, accuracies, counts: [K] per-depth mean loss, top-1 agreement with the teacher, positions used."""
    metrics: dict[str, float] = {}
    for k in range(losses.numel()):
        metrics[f"loss_{k}"], metrics[f"acc_{k}"], metrics[f"positions_{k}"] = losses[k], accuracies[k], counts[k]
    metrics["sim_accept_length"] = simulated_accept_length(accuracies.double().unbind())  # float64, as floats were
    return metrics


def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE per-position loss weights of a block drafter (dynamic per-position CE weighting, arXiv 2605.18810,
    Eqs. 7-9), detached.

    The weight of depth j is the expected number of drafts the block still yields from j on if it reaches j:
    w_j = sum_{m >= j} C_m with C_m = prod_{i <= m} q~_i, where q~_i = alpha + (1 - alpha) q_i smooths the draft's
    confidence q_i toward 1 (so every weight stays >= alpha^K > 0). An invalid cell is a no-op in the product
    (q~ = 1) and adds nothing to the sum. A depth whose drafts are already right (q near 1) passes its weight on to
    the depths after it; a block that fails early puts its weight on its first cells.

    Args:
        confidence: [N, K] the draft's probability of each cell's label (exp(-CE)), any dtype.
        valid: [N, K] bool, the supervised cells.
        alpha: smoothing in (0, 1]; 1 gives w_j = number of valid cells from j on (no adaptation).
    Returns:
        [N, K] weights in confidence's dtype promoted to at least float32, zero at invalid cells.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"dpace_alpha must be in (0, 1], got {alpha}")
    with torch.no_grad():
        q = confidence.to(torch.promote_types(confidence.dtype, torch.float32))
        keep = valid.to(q.dtype)
        smoothed = torch.where(valid.bool(), alpha + (1.0 - alpha) * q, torch.ones_like(q))
        cumulative = torch.cumprod(smoothed, dim=-1) * keep
        return cumulative.flip(-1).cumsum(-1).flip(-1) * keep


def auf_support(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N, K] bool, Spec-AUF's loss support (accept-until-fail, arXiv 2607.01893): a block's valid cells up to and
    including its first valid cell whose draft argmax misses the label (correct [N, K] False); verification never
    reaches the cells past it. An invalid cell neither ends the support nor joins it (as in dpace_weights)."""
    failed = (valid & ~correct).long()
    return valid & (failed.cumsum(dim=-1) - failed == 0)


def depth_loss_weights(kind: str, decay: torch.Tensor, cell_ce: torch.Tensor, valid: torch.Tensor,
                       alpha: float, correct: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] per-cell loss weights of a block drafter: "decay" the fixed depth weights decay [K] at every valid cell,
    "dpace" `dpace_weights` from the cells' own confidence exp(-CE) (detached), "auf" decay on `auf_support` (correct
    [N, K]: the draft argmax equals the cell's label)."""
    if kind == "dpace":
        return dpace_weights(torch.exp(-cell_ce.detach()), valid, alpha).to(cell_ce.dtype)
    if kind == "auf":
        valid = auf_support(correct, valid)
    elif kind != "decay":
        raise ValueError(f"loss_weighting must be 'decay', 'dpace' or 'auf', got {kind!r}")
    return decay.to(cell_ce.dtype).unsqueeze(0) * valid.to(cell_ce.dtype)


def listed_depth_weights(loss_weights: Sequence[float], num_steps: int) -> list[float]:
    """[K] per-depth loss weights from a config's `loss_weights`: the first num_steps of them, or 1 / K each when
    the list is empty (MTP and the assistant; ValueError naming drafter.loss_weights when it is too short)."""
    if not loss_weights:
        return [1.0 / num_steps] * num_steps
    if len(loss_weights) < num_steps:
        raise ValueError(f"drafter.loss_weights has {len(loss_weights)} entries for {num_steps} steps "
                         "(drafter.num_steps); give one weight per depth")
    return [float(w) for w in loss_weights[:num_steps]]


def target_distilled_loss(output, batch: Mapping[str, Any], lm_head_weight: torch.Tensor, loss: str,
                          weights: Sequence[float], eta: float = LK_DEFAULT_ETA) -> tuple[torch.Tensor, dict]:
    """sum_k weights[k] * mean cell loss at depth k over its valid cells of all processes (`distilled_cells`: loss
    "soft", "hard", "lk" or "lk_hybrid"), for drafters whose cells read the target's (or a draft) vocabulary."""
    cell_loss, predicted, alpha = distilled_cells(output, batch, lm_head_weight, loss, eta)
    weights = torch.tensor(list(weights), dtype=cell_loss.dtype, device=cell_loss.device)
    total, metrics = weighted_depth_loss(output, batch, cell_loss, weights, predicted)
    return total, metrics if alpha is None else {**metrics, **acceptance_metric(alpha, output.depth_valid)}
