"""Peak memory of one training step (forward, backward, AdamW step) of EAGLE-3, DFlash and DSpark, from the shapes
alone: what `draftsmith estimate` prints as the drafter's step peak (`step_shape` reads them off a built drafter),
checked against measurement by benchmarks/training/long_sequence_memory.py (docs/benchmarks.md, "Long sequences").

The model counts values (then bytes per value) of what is alive at the peak:
- static: the drafter's parameters and buffers, the target tensors it computes with (embedding, lm_head), the batch's
  features ((number of layer ids + 1) x T x D) and its int64 rows, and torch's runtime (kernel code and buffers
  first touched by a step, RUNTIME_BYTES);
- state: gradients and the two AdamW moments of the trained parameters (3 values each);
- activations: what autograd keeps for the backward pass, per token and draft layer (and per TTT step), counted tensor
  by tensor in the functions below; with activation checkpointing only each layer's input and outputs stay;
- the largest chunk computation alive on top of them (`peak_activation_values`): a loss chunk
  (drafters/chunked.LOSS_CHUNK_VALUES logits) or an attention chunk (ATTENTION_CHUNK_VALUES scores or mask values),
  or the whole tensor when a short sequence fits a single chunk.

Shapes: B batch, T sequence, D hidden, H / H_kv heads of d, I MLP width, V vocabulary, V_d draft vocabulary,
K depths (TTT steps), A anchors, S block size, n_f feature layers, P trained parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from drafters.chunked import ATTENTION_CHUNK_VALUES, LOSS_CHUNK_VALUES, LOSS_ONE_SHOT_VALUES

RUNTIME_BYTES = 80 << 20  # torch's kernels and buffers first touched by a training step, measured on CPU
LOSS_CHUNK_COPIES = 2  # a loss chunk's recomputed logits and their gradient
ATTENTION_CHUNK_COPIES = 5  # EAGLE-3's score chunk: scores, masked scores, with the diagonal, softmax, gradient
MASK_CHUNK_COPIES = 2  # a DFlash block-mask chunk: the boolean mask and SDPA's float copy (1 + 4 bytes ~ 1.25 x 4)


@dataclass(frozen=True)
class StepShape:
    """One training step's shapes, as the drafter's config declares them (its `step_shape`). kind: a label. step:
    "ttt" (EAGLE-3's test-time-training steps over every position) or "block" (DFlash / DSpark blocks at anchors).
    depths: TTT steps or block size S. anchors: A (block drafters). head_vocab: V_d of the trained or frozen head the
    loss runs through. markov_rank: r of a sequential head's Markov embedding (0 = none). slot_extra: values a block
    slot keeps beyond DFlash's (DSpark: its post-norm state and Markov embedding). num_features: n_f target layers.
    params: P trained parameters (None = counted from the shapes)."""

    kind: str
    step: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    num_layers: int
    vocab: int
    head_vocab: int
    num_features: int
    seq_len: int
    batch: int
    depths: int
    anchors: int = 0
    markov_rank: int = 0
    extra_params: int = 0  # DSpark's sequential-head gates and confidence head
    slot_extra: int = 0
    checkpointing: bool = False
    bytes_per_value: int = 4
    params: int | None = None

    @classmethod
    def for_drafter(cls, kind: str, config, *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                    intermediate: int, vocab: int, num_features: int | None, seq_len: int, batch: int,
                    checkpointing: bool, params: int | None = None) -> "StepShape":
        """The shape of a drafter config (drafters/<kind>/config.py) on a target of the given widths: the config
        declares its own step (`config.step_shape`); a config without one has no memory model here."""
        if not hasattr(config, "step_shape"):
            raise ValueError(f"no memory model for drafter kind {kind!r} (its config declares no step_shape)")
        declared = config.step_shape(hidden=hidden, vocab=vocab, seq_len=seq_len)
        default_features = declared.pop("default_features")
        return cls(kind=kind, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   intermediate=intermediate, num_layers=config.num_layers, vocab=vocab,
                   num_features=num_features or default_features, seq_len=seq_len, batch=batch,
                   checkpointing=checkpointing, params=params, **declared)


def layer_params(s: StepShape, input_width: int) -> int:
    """q/k/v/o, the SwiGLU MLP and two norms of one draft layer whose q/k/v read input_width features."""
    qkv = input_width * (s.heads + 2 * s.kv_heads) * s.head_dim
    return qkv + s.heads * s.head_dim * s.hidden + 3 * s.hidden * s.intermediate + 2 * s.hidden


def trained_params(s: StepShape) -> int:
    if s.params is not None:
        return s.params
    fc = s.num_features * s.hidden * s.hidden
    if s.step == "ttt":  # the first layer reads [embedding ; hidden], a trained draft head
        return fc + layer_params(s, 2 * s.hidden) + (s.num_layers - 1) * layer_params(s, s.hidden) \
            + s.head_vocab * s.hidden + 2 * s.hidden  # + hidden_norm and the final norm
    layers = s.num_layers * (layer_params(s, s.hidden) + 2 * s.head_dim)  # + q_norm / k_norm
    head = s.head_vocab * s.hidden if s.head_vocab != s.vocab else 0  # a reduced DFlash vocabulary is trained
    return fc + layers + head + 2 * s.vocab * s.markov_rank + s.extra_params + 2 * s.hidden


def eagle3_layer_values(s: StepShape, checkpointed: bool) -> int:
    """Values one EAGLE-3 layer keeps per position and TTT step: the norms' outputs (hidden, embedding, post-
    attention), the [embedding ; hidden] input, the residual and the output (7 D), q and k three times each
    (projection, rotated half, RoPE result) and v, the o_proj input, the MLP's gate, up, SiLU and product (4 I);
    checkpointed, only its output and this step's keys and values."""
    h, qd, kvd = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    return h + 2 * kvd if checkpointed else 7 * h + 4 * qd + 4 * kvd + 4 * s.intermediate


def eagle3_values_per_token(s: StepShape) -> int:
    """Values autograd keeps per position: every layer of every TTT step (eagle3_layer_values), per step the
    gathered, normed rows (2 D) and cos / sin (2 d); once the fc input and output, the embeddings and the head
    input (n_f D + D + D + K D)."""
    h = s.hidden
    per_step = s.num_layers * eagle3_layer_values(s, s.checkpointing) + 2 * h + 2 * s.head_dim
    return s.depths * per_step + (s.num_features + 2 + s.depths) * h


def block_layer_values(s: StepShape, checkpointed: bool) -> tuple[int, int]:
    """(per context token, per block slot) values one DFlash / DSpark layer keeps: the context's keys (projection,
    k_norm, rotated, RoPE) and values; the block stream's norms, q and k four times each, v, the o_proj input, the
    residual, the output and the MLP (4 D + 5 H d + 5 H_kv d + 4 I); checkpointed, only its output."""
    h, qd, kvd = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    if checkpointed:
        return 0, h
    return 5 * kvd, 4 * h + 5 * qd + 5 * kvd + 4 * s.intermediate


def block_values(s: StepShape) -> tuple[int, int]:
    """(values per context token, values per block slot) autograd keeps in a DFlash / DSpark step: the context's
    fc input and output and its norm, every layer (block_layer_values), per slot the embedding, cos / sin and the
    gathered final state (DSpark: also the post-norm state and the Markov embedding of the previous token)."""
    layer_context, layer_slot = block_layer_values(s, s.checkpointing)
    context = (s.num_features + 2) * s.hidden + s.num_layers * layer_context
    slot = 2 * s.hidden + 2 * s.head_dim + s.num_layers * layer_slot + s.slot_extra
    return context, slot


def activation_values(s: StepShape) -> int:
    """All values autograd keeps at the end of the forward pass."""
    if s.step == "ttt":
        return s.batch * s.seq_len * eagle3_values_per_token(s)
    context, slot = block_values(s)
    return s.batch * s.seq_len * context + s.batch * s.anchors * s.depths * slot


def recomputed_values(s: StepShape) -> int:
    """With activation checkpointing, the values of the one layer (and TTT step) the backward pass recomputes."""
    if not s.checkpointing:
        return 0
    if s.step == "ttt":
        return s.batch * s.seq_len * eagle3_layer_values(s, False)
    context, slot = block_layer_values(s, False)
    return s.batch * s.seq_len * context + s.batch * s.anchors * s.depths * slot


def loss_chunk_values(cells: int) -> int:
    """Logits values one loss computation holds at once (drafters/chunked.chunked_rows): all of them up to the
    one-shot limit, else one chunk."""
    return cells if cells <= LOSS_ONE_SHOT_VALUES else LOSS_CHUNK_VALUES


def peak_activation_values(s: StepShape) -> int:
    """Kept activations plus the largest computation on top of them, the larger of two moments:
    - the backward pass starts at the loss: every activation is kept while a loss chunk's logits and their gradient
      (LOSS_CHUNK_COPIES chunks; EAGLE-3 also its teacher, 1 / K of them) are live;
    - then the layers: EAGLE-3 reaches the attention of its last TTT step once that step's other tensors are freed
      (about 1 / K of the activations) with a score chunk and its softmax and gradient (ATTENTION_CHUNK_COPIES)
      live; a block drafter's attention chunk holds the boolean block mask and SDPA's float copy of it
      (MASK_CHUNK_COPIES); with checkpointing, the recomputed layer's activations are live too.
    A short sequence's loss holds all its logits at once (chunked.LOSS_ONE_SHOT_VALUES), and attention that fits one
    chunk holds that chunk, the whole tensor, as the one-shot paths do."""
    kept, recomputed = activation_values(s), recomputed_values(s)
    if s.step == "ttt":
        loss = loss_chunk_values(s.batch * s.seq_len * s.depths * s.head_vocab)
        scores = min(s.batch * s.heads * s.seq_len * (s.seq_len + s.depths), ATTENTION_CHUNK_VALUES)
        layers = kept * (s.depths - 1) // s.depths + recomputed
        if s.depths > 1:
            layers += ATTENTION_CHUNK_COPIES * scores
        return max(kept + LOSS_CHUNK_COPIES * loss + loss // s.depths, layers)
    slots = s.anchors * s.depths
    loss = loss_chunk_values(s.batch * slots * s.head_vocab)
    mask = min(s.batch * slots * (s.seq_len + slots), ATTENTION_CHUNK_VALUES)
    return max(kept + LOSS_CHUNK_COPIES * loss, kept + recomputed + MASK_CHUNK_COPIES * mask)


def step_peak_parts(s: StepShape) -> dict[str, int]:
    """Bytes of each part of one step's peak (static, state, activations with the chunk on top) and their total."""
    b = s.bytes_per_value
    params = trained_params(s)
    tokens = s.batch * s.seq_len
    static = b * (params + 2 * s.vocab * s.hidden + (s.num_features + 1) * tokens * s.hidden) + 4 * 8 * tokens
    parts = {"static": static + RUNTIME_BYTES, "gradients + AdamW": 3 * b * params,
             "activations + chunk": b * peak_activation_values(s)}
    parts["total"] = sum(parts.values())
    return parts


def step_peak_bytes(s: StepShape) -> int:
    return step_peak_parts(s)["total"]


def step_shape(drafter, seq_len: int, batch: int, checkpointing: bool) -> StepShape | None:
    """The StepShape of a built drafter (its layer config, target widths, layer ids and trained parameter count) for
    micro-batches of batch x seq_len tokens; None for a kind whose config declares no step_shape."""
    if not hasattr(drafter.config, "step_shape"):
        return None
    layer = drafter.layer_config
    return StepShape.for_drafter(
        drafter.kind, drafter.config, hidden=layer["hidden_size"], heads=layer["num_attention_heads"],
        kv_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"], intermediate=layer["intermediate_size"],
        vocab=drafter.target_info.vocab_size, num_features=len(drafter.layer_ids), seq_len=seq_len, batch=batch,
        checkpointing=checkpointing, params=sum(p.numel() for p in drafter.parameters() if p.requires_grad))
