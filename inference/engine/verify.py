"""Verification: pure functions, no model code (docs/ARCHITECTURE.md, engine loop; theory_and_metrics.md D.1).

Shapes: B batch, K drafts per row, V vocab. Target probabilities `p` are [B, K+1, V]: position j is the target's
distribution for the token after draft j (position 0 = after the last accepted token), already transformed by
temperature / top-k / top-p exactly as plain sampling does (`sampling_probs`).

Greedy: accept the longest prefix where the draft equals the target argmax; the next token is the target argmax at
the first mismatch (correction) or after the last draft (bonus).
Sampling (Leviathan et al. 2023): accept draft x with probability min(1, p(x) / q(x)); on the first rejection emit a
token from the residual norm(max(p - q, 0)); if all are accepted emit a bonus token from p. Deterministic drafts
(argmax, n-gram) use q = one-hot, so acceptance is p(x) and the residual is p with x removed. Block verification
(Sun et al. 2024; vLLM's rejection_sample_method "block"), a chain's alternative: `block_weights`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


VERIFICATIONS = ("token", "block")  # how a sampled chain is verified (Sampling.verification)


@dataclass(frozen=True)
class Sampling:
    """How the target samples its tokens, one value through the engine: temperature (0 = greedy), top-k (0 = off),
    top-p (1 = off), the seed of the run's two random streams (the target's and the drafter's), and how a sampled
    chain is verified: "token" (sample_verify) or "block" (block_verify); greedy verification ignores it."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    verification: str = "token"

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"verification must be one of {', '.join(VERIFICATIONS)}, got {self.verification!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's distribution under these settings (`sampling_probs`)."""
        return sampling_probs(logits, self.temperature, self.top_k, self.top_p)


GREEDY = Sampling()


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k, then top-p (the HF / vLLM order).

    temperature 0 gives the one-hot argmax distribution (greedy).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p  # keep the smallest prefix whose mass reaches top_p (always >= 1 token)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor, num_valid: torch.Tensor | None = None):
    """Args: draft_tokens [B, K]; target_logits [B, K+1, V]; num_valid [B] (drafts past it never accepted).
    Returns: (num_accepted [B] long, next_tokens [B] long)."""
    target_tokens = target_logits.argmax(-1)  # [B, K+1]
    return _accept_prefix(draft_tokens == target_tokens[:, :-1], num_valid, lambda rows, pos: target_tokens[rows, pos])


def acceptance_probability(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) for each drafted x. p [..., V], q [..., V] or None (one-hot draft), tokens [...]."""
    if q is None:
        return p.gather(-1, tokens[..., None]).squeeze(-1).clamp(max=1.0)
    return _unclamped_ratio(p, q, tokens).clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) [..., V]; q None means one-hot at `tokens`. Falls back to p where the residual is empty
    (only possible when p == q, in which case rejection has probability 0)."""
    if q is None:
        q = torch.nn.functional.one_hot(tokens, p.shape[-1]).to(p.dtype)
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)


def sample_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    num_valid: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
):
    """Lossless rejection sampling over a chain.

    Args: draft_tokens [B, K]; draft_probs [B, K, V] or None (deterministic drafts); target_probs [B, K+1, V];
    num_valid [B]; generator for the uniforms and the emitted token.
    Returns: (num_accepted [B] long, next_tokens [B] long).
    """
    batch, num_drafts = draft_tokens.shape
    if draft_probs is not None:
        draft_probs = draft_probs.to(target_probs.dtype)
    accept_p = acceptance_probability(target_probs[:, :num_drafts], draft_probs, draft_tokens)  # [B, K]
    uniforms = torch.rand(accept_p.shape, generator=generator, device=accept_p.device)

    def emit(rows, pos):
        # Rejected at pos < K: residual at pos; all accepted (pos == number drafted): bonus from p at pos.
        probs = target_probs[rows, pos].clone()
        limit = torch.full_like(pos, num_drafts) if num_valid is None else num_valid[rows].clamp(max=num_drafts)
        rejected = pos < limit  # stopping at num_valid after accepting every valid draft is a bonus, not a rejection
        if bool(rejected.any()):
            r_rows, r_pos = rows[rejected], pos[rejected]
            q = None if draft_probs is None else draft_probs[r_rows, r_pos]
            probs[rejected] = residual_distribution(target_probs[r_rows, r_pos], q, draft_tokens[r_rows, r_pos])
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    return _accept_prefix(uniforms < accept_p, num_valid, emit)


def block_weights(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                  num_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification's tests and emitted laws for a chain (Sun et al. 2024, "Block verification accelerates
    speculative decoding"; what vLLM calls rejection_sample_method "block").

    With the draft law q (one-hot at each draft when None) and weights w_0 = 1, w_i = min(1, w_{i-1} p(x_i) / q(x_i)):
    the i-th test passes with h_i = m_i / (m_i + 1 - w_i), m_i = sum_v max(w_i p_i(v) - q_i(v), 0) the residual mass
    after i drafts (p_i, q_i: the laws of the token after draft i), and h_i = w_i at the row's last draft (num_valid,
    else K); tests past it never pass. Every test is drawn, and the round keeps drafts up to the LAST test that passed
    (tau; 0 when none did), then emits from law tau: norm(max(w_tau p_tau - q_tau, 0)) below the row's last draft,
    p at it. Token-wise verification stops at the first failure instead; block verification keeps at least as many
    drafts in expectation, and both emit the target's law (tests/test_verify.py enumerates it exactly).

    Args: draft_tokens [B, K]; draft_probs [B, K, V] or None; target_probs [B, K+1, V]; num_valid [B].
    Returns: h [B, K] (test i at column i - 1) and laws [B, K+1, V] (the emitted token's law when tau = t).
    """
    batch, num_drafts = draft_tokens.shape
    p = target_probs
    q = (torch.nn.functional.one_hot(draft_tokens, p.shape[-1]).to(p.dtype) if draft_probs is None
         else draft_probs.to(p.dtype))
    limit = torch.full((batch,), num_drafts, device=p.device) if num_valid is None else num_valid.clamp(0, num_drafts)
    ratio = _unclamped_ratio(p[:, :num_drafts], q, draft_tokens)  # p(x_i) / q(x_i) [B, K]
    weights = [torch.ones(batch, dtype=p.dtype, device=p.device)]
    for i in range(num_drafts):
        weights.append(torch.minimum(weights[-1] * ratio[:, i], torch.ones_like(weights[-1])))
    w = torch.stack(weights, dim=1)  # [B, K+1]
    raw = (w[:, :num_drafts, None] * p[:, :num_drafts] - q).clamp(min=0)  # [B, K, V]
    mass = raw.sum(-1)
    denominator = mass + 1 - w[:, :num_drafts]
    inner = torch.where(denominator > 0, mass / denominator.clamp(min=1e-30), torch.zeros_like(mass))
    steps = torch.arange(1, num_drafts + 1, device=p.device)[None, :]  # test i = 1..K
    h = torch.cat([inner[:, 1:], torch.zeros_like(inner[:, :1])], dim=1)  # test i from the residual after draft i
    h = torch.where(steps == limit[:, None], w[:, 1:], torch.where(steps < limit[:, None], h, torch.zeros_like(h)))
    residual = torch.where(mass[..., None] > 0, raw / mass[..., None].clamp(min=1e-30), p[:, :num_drafts])
    laws = torch.cat([residual, p[:, num_drafts:]], dim=1)  # [B, K+1, V]
    rows = torch.arange(batch, device=p.device)
    laws[rows, limit] = p[rows, limit]  # all of the row's drafts kept: the bonus from p
    return h, laws


def _unclamped_ratio(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """p(x) / q(x) for each drafted x (q(x) = 0, a token the draft law never proposes: 1, as acceptance_probability)."""
    p_x = p.gather(-1, tokens[..., None]).squeeze(-1)
    q_x = q.gather(-1, tokens[..., None]).squeeze(-1)
    return torch.where(q_x > 0, p_x / q_x.clamp(min=1e-30), torch.ones_like(p_x))


def block_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    num_valid: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
):
    """Lossless block verification over a chain (`block_weights`). Same arguments and returns as sample_verify."""
    h, laws = block_weights(draft_tokens, draft_probs, target_probs, num_valid)
    uniforms = torch.rand(h.shape, generator=generator, device=h.device)
    steps = torch.arange(1, h.shape[1] + 1, device=h.device)
    passed = torch.where(uniforms < h, steps, torch.zeros_like(steps))  # [B, K]: i where test i passed, else 0
    num_accepted = torch.cat([passed.new_zeros(h.shape[0], 1), passed], dim=1).amax(dim=1)  # the last one (0: none)
    rows = torch.arange(h.shape[0], device=h.device)
    return num_accepted, torch.multinomial(laws[rows, num_accepted], 1, generator=generator).squeeze(-1)


def _accept_prefix(accepted: torch.Tensor, num_valid: torch.Tensor | None, emit):
    """accepted [B, K] per-draft test results -> (num_accepted [B], next_tokens [B] = emit(rows, first_rejected))."""
    batch, num_drafts = accepted.shape
    if num_valid is not None:
        accepted = accepted & (torch.arange(num_drafts, device=accepted.device)[None, :] < num_valid[:, None])
    num_accepted = accepted.long().cumprod(-1).sum(-1)
    rows = torch.arange(batch, device=accepted.device)
    return num_accepted, emit(rows, num_accepted)
