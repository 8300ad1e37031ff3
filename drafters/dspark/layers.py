"""DSpark building blocks: the rules of its config (drafters/dspark/config.py), the sequential heads (Markov low
rank, vanilla and gated; RNN) and the confidence head. The backbone itself is DFlash's (drafters/dflash/backbone.py),
used as it is.

Reference: algorithms_dflash_dspark.md section 2.1 (DSpark, Cheng et al. 2026; DeepSpec's trainer) and 5.2.
- Sequential head: the backbone gives every block slot k a hidden state h_k (after the final norm) and base logits
  U_k = lm_head(h_k); the head adds a bias B_k that depends on the token drawn at slot k-1 (x_{-1} = the anchor):
  p_k(v) = softmax_v(U_k(v) + B_k(v)).
  - "vanilla" Markov: B_k = W2 W1[x_{k-1}], W1 an embedding table V x r, W2 a linear r -> V without bias.
  - "gated" Markov: B_k = W2 (sigmoid(G [h_k ; W1[x_{k-1}]] + g) * W1[x_{k-1}]).
  - "rnn": s_{-1} = 0; z_k = [s_{k-1} ; W1[x_{k-1}] ; h_k]; one linear (2r + D -> 3r, with bias) splits into gate,
    candidate, output pre-activations; s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c); B_k = W2 tanh(o).
  At training time the previous tokens are the ground truth (teacher forcing): vanilla and gated run on all slots
  at once, the RNN unrolls over the block; at inference the same `step` runs slot by slot on the drafted tokens.
- Confidence head: c_k = sigmoid(w [h_k ; W1[x_{k-1}]] + b) (or on h_k alone without the Markov embedding), the
  estimate of P(draft k accepted | drafts < k accepted). It reads x_{k-1}, never x_k: it is known before x_k is drawn,
  which is what lets a scheduler use it without biasing the output (inference/engine/schedule.py).
Parameter names follow DeepSpec's (markov_head.markov_w1 / markov_w2 / gate_proj / joint_proj, confidence_head.proj),
so exports are renames-free.

Initialisation (ours): W1 ~ N(0, 0.02), W2 = 0, so an untrained head adds nothing and training starts from the
plain block drafter (W2's gradient is W1[x]-weighted from the first step); the other linears use PyTorch's default.

Shapes: N cells' rows, S block size (= drafts per forward), D hidden, r Markov rank, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from drafters.dflash.config import DFlashConfig, backbone_fields
from drafters.dspark.config import DSparkConfig

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn", "none")


def backbone_config(config: DSparkConfig) -> DFlashConfig:
    """The DFlash backbone DSpark runs on (DFlash's resolve / shape rules then apply unchanged)."""
    return DFlashConfig(**backbone_fields(config))


def check_config(config: DSparkConfig) -> None:
    """Raise ValueError naming the field for values DSpark cannot use (the backbone's are DFlash's check)."""
    if config.block_size < 1:
        raise ValueError(f"drafter.block_size {config.block_size} must be >= 1 (DSpark drafts from the anchor slot on)")
    if config.markov_head_type not in MARKOV_HEAD_TYPES:
        raise ValueError(f"drafter.markov_head_type {config.markov_head_type!r}: choose one of {MARKOV_HEAD_TYPES}")
    if config.markov_rank < 1:
        raise ValueError(f"drafter.markov_rank {config.markov_rank} must be >= 1 (set drafter.markov_head_type: none "
                         "for no sequential head)")
    if config.enable_confidence_head and config.confidence_head_with_markov and config.markov_head_type == "none":
        raise ValueError("drafter.confidence_head_with_markov: the confidence head reads the Markov embedding of the "
                         "previous token, but drafter.markov_head_type is none; set confidence_head_with_markov: "
                         "false or choose a sequential head")
    for name in ("ce_weight", "l1_weight", "confidence_weight"):
        if getattr(config, name) < 0:
            raise ValueError(f"drafter.{name} {getattr(config, name)} must be >= 0")
    if not config.loss_decay_gamma > 0:
        raise ValueError(f"drafter.loss_decay_gamma {config.loss_decay_gamma} must be > 0")
    if not 0.0 < config.dpace_alpha <= 1.0:
        raise ValueError(f"drafter.dpace_alpha {config.dpace_alpha} must be in (0, 1]")
    temperatures = config.confidence_temperatures
    if temperatures and (len(temperatures) != config.block_size or not all(t > 0 for t in temperatures)):
        raise ValueError(f"drafter.confidence_temperatures {list(temperatures)}: need one positive temperature per "
                         f"block slot ({config.block_size}), or none (uncalibrated)")


def depth_weights(num_depths: int, gamma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """[K] loss weights exp(-k / gamma), k = 0..K-1 (DeepSpec's code; the paper writes exp(-(k-1)/gamma))."""
    return torch.exp(-torch.arange(num_depths, device=device, dtype=dtype) / gamma)


class MarkovHead(nn.Module):
    """The sequential head (module docstring). `step` is the one formula; `teacher_forced` runs it over a block."""

    def __init__(self, head_type: str, vocab_size: int, rank: int, hidden_size: int, out_size: int | None = None):
        """W1 embeds any of the vocab_size target tokens; W2 writes out_size logits (default vocab_size; a
        frequency-ranked head's draft vocabulary, in draft ids)."""
        super().__init__()
        self.head_type = head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_size or vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)
        if not self.markov_w1.weight.is_meta:
            with torch.no_grad():
                self.markov_w1.weight.normal_(0.0, 0.02)
                self.markov_w2.weight.zero_()

    def embed(self, previous: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: previous tokens [...] -> [..., r]."""
        return self.markov_w1(previous)

    def initial_state(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """s_{-1} for rows shaped like hidden [..., D] (zeros [..., r]); None for the memoryless heads."""
        return hidden.new_zeros(*hidden.shape[:-1], self.rank) if self.head_type == "rnn" else None

    def step(self, previous_embedding: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """One slot: (bias [..., V], new state) from W1[x_{k-1}] [..., r], h_k [..., D] and s_{k-1}."""
        embedding = previous_embedding.to(self.markov_w2.weight.dtype)
        if self.head_type == "vanilla":
            return self.markov_w2(embedding), state
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(embedding.dtype), embedding], dim=-1)))
            return self.markov_w2(gate * embedding), state
        joint = self.joint_proj(torch.cat([state, embedding, hidden.to(embedding.dtype)], dim=-1))
        gate, candidate, output = joint.chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), state  # B_k reads o_k, computed from s_{k-1}

    def teacher_forced(self, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Biases of a whole block with the true previous tokens: previous [N, S], hidden [N, S, D] -> [N, S, V]."""
        embedding = self.embed(previous)
        if self.head_type != "rnn":
            return self.step(embedding, hidden, None)[0]
        state = self.initial_state(hidden[:, 0])
        biases = []
        for k in range(previous.shape[1]):
            bias, state = self.step(embedding[:, k], hidden[:, k], state)
            biases.append(bias)
        return torch.stack(biases, dim=1)


class ConfidenceHead(nn.Module):
    """c_k logit = proj([h_k ; W1[x_{k-1}]]) (or proj(h_k)); a single Linear with bias, as DeepSpec."""

    def __init__(self, input_size: int):
        super().__init__()
        self.proj = nn.Linear(input_size, 1)

    def forward(self, hidden: torch.Tensor, previous_embedding: torch.Tensor | None) -> torch.Tensor:
        """hidden [..., D], previous_embedding [..., r] or None -> logits [...] (float32 or wider)."""
        features = hidden if previous_embedding is None else torch.cat(
            [hidden, previous_embedding.to(hidden.dtype)], dim=-1)
        logits = self.proj(features.to(self.proj.weight.dtype)).squeeze(-1)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
