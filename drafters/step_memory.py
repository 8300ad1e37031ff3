"""Peak memory of one training step (forward, backward, AdamW step) of every trained kind, from the shapes alone: what
`draftsmith estimate` prints as the drafter's step peak (`step_shape` reads them off a built drafter), checked for
EAGLE-3, DFlash and DSpark against measurement by benchmarks/training/long_sequence_memory.py (docs/benchmarks.md,
"Long sequences"); MTP, the assistant and Medusa are counted the same way, tensor by tensor, unmeasured so far.

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

Attention is counted as the kernel that runs it holds it. Masked SDPA runs a fused kernel on every device
(drafters/layers.attention), which keeps no [n, C] scores: the mask and its float copy, plus, off the CPU
(`kv_expanded`), K/V repeated to every query head (2 H d values per key). EAGLE-3's TTT steps run their own math
(layers.attention_with_diagonal), whose chunks hold H x scores (ATTENTION_CHUNK_COPIES).

Shapes: B batch, T sequence, D hidden, H / H_kv heads of d, I MLP width, V vocabulary, V_d draft vocabulary,
K depths (TTT steps), A anchors, S block size, n_f feature layers, P trained parameters, W a draft width.
"""

from __future__ import annotations

from dataclasses import dataclass

from drafters.chunked import ATTENTION_CHUNK_VALUES, LOSS_CHUNK_VALUES, LOSS_ONE_SHOT_VALUES
from drafters.layers import expands_kv_heads

RUNTIME_BYTES = 80 << 20  # torch's kernels and buffers first touched by a training step, measured on CPU
LOSS_CHUNK_COPIES = 2  # a loss chunk's recomputed logits and their gradient
ATTENTION_CHUNK_COPIES = 5  # EAGLE-3's score chunk: scores, masked scores, with the diagonal, softmax, gradient
MASK_CHUNK_COPIES = 2  # a DFlash block-mask chunk: the boolean mask and SDPA's float copy (1 + 4 bytes ~ 1.25 x 4)
CELL_LOSS_COPIES = 3  # losses.full_vocab_cross_entropy: a chunk's logits, its teacher gathered per cell, the gradient


@dataclass(frozen=True)
class StepShape:
    """One training step's shapes, as the drafter's config declares them (its `step_shape`). kind: a label. step:
    "ttt" (EAGLE-3's test-time-training steps over every position), "block" (DFlash / DSpark blocks at anchors),
    "chain" (MTP modules and assistant steps over every position, depth k reading depth k - 1) or "heads" (Medusa's
    heads on the target's last hidden state). depths: TTT steps, block size S, or K. anchors: A (block drafters).
    head_vocab: V_d of the trained or frozen head the loss runs through. markov_rank: r of a sequential head's Markov
    embedding (0 = none). slot_extra: values a block slot keeps beyond DFlash's (DSpark: its post-norm state and
    Markov embedding). num_features: n_f target layers. width: W of the draft layers where it differs from the
    target's hidden (the assistant; 0 = hidden). modules: distinct MTP modules (0 = one per depth). kv_features:
    target layers whose K/V the batch carries (the assistant's queries read them; its layers project none).
    kv_expanded: masked attention repeats K/V to every query head (layers.expands_kv_heads: off the CPU; MTP's HF
    layers always). step_keys: a chain's step k attends to k + 1 blocks of keys (MTP's served steps,
    mtp/layers.StepKeys), not one. params: P trained parameters (None = counted from the shapes)."""

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
    width: int = 0
    modules: int = 0
    kv_features: int = 0
    trained_head: bool = False  # MTP: a draft-vocabulary head is trained (whatever its rows)
    placeholder: bool = False  # P-EAGLE: a trained placeholder of the concatenated features (n_f x D values)
    kv_expanded: bool = False
    step_keys: bool = False
    checkpointing: bool = False
    bytes_per_value: int = 4
    params: int | None = None

    @classmethod
    def for_drafter(cls, kind: str, config, *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                    intermediate: int, vocab: int, num_features: int | None, seq_len: int, batch: int,
                    checkpointing: bool, params: int | None = None, kv_expanded: bool = False) -> "StepShape":
        """The shape of a drafter config (drafters/<kind>/config.py) on a target of the given widths: the config
        declares its own step (`config.step_shape`; num_layers, the draft layers per depth, is the config's unless
        it says); a config without one has no memory model here. kv_expanded: the device repeats K/V for masks."""
        if not hasattr(config, "step_shape"):
            raise ValueError(f"no memory model for drafter kind {kind!r} (its config declares no step_shape)")
        declared = config.step_shape(hidden=hidden, vocab=vocab, seq_len=seq_len)
        default_features = declared.pop("default_features")
        if "num_layers" not in declared:
            declared["num_layers"] = config.num_layers
        declared["kv_expanded"] = declared.get("kv_expanded", False) or kv_expanded
        return cls(kind=kind, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   intermediate=intermediate, vocab=vocab, num_features=num_features or default_features,
                   seq_len=seq_len, batch=batch, checkpointing=checkpointing, params=params, **declared)


def layer_params(s: StepShape, input_width: int) -> int:
    """q/k/v/o, the SwiGLU MLP and two norms of one draft layer whose q/k/v read input_width features."""
    qkv = input_width * (s.heads + 2 * s.kv_heads) * s.head_dim
    return qkv + s.heads * s.head_dim * s.hidden + 3 * s.hidden * s.intermediate + 2 * s.hidden


def trained_params(s: StepShape) -> int:
    if s.params is not None:
        return s.params
    if s.step == "chain":
        return chain_params(s)
    if s.step == "heads":  # K heads of num_layers residual blocks (D x D and a bias); own lm_heads in extra_params
        return s.depths * s.num_layers * (s.hidden * s.hidden + s.hidden) + s.extra_params
    fc = s.num_features * s.hidden * s.hidden
    if s.step == "ttt":  # the first layer reads [embedding ; hidden], a trained draft head
        return fc + layer_params(s, 2 * s.hidden) + (s.num_layers - 1) * layer_params(s, s.hidden) \
            + s.head_vocab * s.hidden + 2 * s.hidden \
            + (s.num_features * s.hidden if s.placeholder else 0)  # + hidden_norm, the final norm, mask_hidden
    layers = s.num_layers * (layer_params(s, s.hidden) + 2 * s.head_dim)  # + q_norm / k_norm
    head = s.head_vocab * s.hidden if s.head_vocab != s.vocab else 0  # a reduced DFlash vocabulary is trained
    return fc + layers + head + 2 * s.vocab * s.markov_rank + s.extra_params + 2 * s.hidden


def chain_params(s: StepShape) -> int:
    """MTP: per module enorm, hnorm, eh_proj (2D -> D), the target's decoder layer (its q/k norms aside) and
    final_norm, and a draft-vocabulary head (V_d x D) where one is trained (trained_head). The assistant
    (kv_features): pre_projection (2D -> W), query-only layers (q, o, the SwiGLU MLP, two norms) that every step
    shares, the final norm, its own lm_head (V x W) and post_projection (W -> D)."""
    h, w, qd = s.hidden, s.width or s.hidden, s.heads * s.head_dim
    if s.kv_features:
        layer = 2 * w * qd + 3 * w * s.intermediate + 2 * w
        return 2 * h * w + s.num_layers * layer + w + s.head_vocab * w + w * h
    head = s.head_vocab * h if s.trained_head else 0  # MTP's draft-vocabulary head, shared by the modules
    return (s.modules or s.depths) * (3 * h + 2 * h * h + s.num_layers * layer_params(s, h)) + head


def expanded_kv_values(s: StepShape, keys: int) -> int:
    """K and V of `keys` positions per row repeated to every query head, where the device needs it (kv_expanded)."""
    return 2 * s.batch * s.heads * s.head_dim * keys if s.kv_expanded else 0


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


def block_mask_values(s: StepShape) -> int:
    """Values of the whole block mask [B, A S, T + A S] (one chunk holds it all up to ATTENTION_CHUNK_VALUES)."""
    slots = s.anchors * s.depths
    return s.batch * slots * (s.seq_len + slots)


def chain_values_per_token(s: StepShape) -> int:
    """Values autograd keeps per position of a chain drafter, every depth (nothing is checkpointed), as its saved
    tensors were counted on CPU:
    - per layer: the two norms' outputs and normed inputs, the residual and the output (6 W), q after RoPE and SDPA's
      output, which o_proj reads (2 H d), the MLP's gate, up, SiLU and product (4 I), and the keys and values SDPA
      keeps: its own (2 H_kv d), repeated to every head (2 H d, kv_expanded), or none (the assistant's are the
      batch's), once per key block it reads (`key_blocks`);
    - per depth: an MTP module's embedding, enorm / hnorm outputs and normed inputs, [e ; h] and final norm (6 D); an
      assistant step's [e ; h], pre-projection output and final norm (2 D + 3 W); the head's input (one row of D or
      W) and cos / sin (2 d)."""
    h, w = s.hidden, s.width or s.hidden
    qd, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    kv = 2 * qd if s.kv_expanded else 0 if s.kv_features else 2 * kvd
    layer = 6 * w + 2 * qd + 4 * s.intermediate
    step = 2 * h + 4 * w if s.kv_features else 7 * h
    return s.depths * (s.num_layers * layer + step + 2 * s.head_dim) + s.num_layers * kv * key_blocks(s)


def key_blocks(s: StepShape) -> int:
    """Blocks of T keys a chain's depths attend to in all: one each, or k + 1 at step k with step_keys."""
    return s.depths * (s.depths + 1) // 2 if s.step_keys else s.depths


def activation_values(s: StepShape) -> int:
    """All values autograd keeps at the end of the forward pass. Off the CPU, attention that runs in one piece
    keeps its repeated K/V for the backward pass: a block drafter's whole-mask attention in every layer, and
    EAGLE-3's step 0 when a padded batch (batch > 1) sends it through a mask (chunked.causal_attention)."""
    tokens = s.batch * s.seq_len
    if s.step == "ttt":
        padded = s.batch > 1 and not s.checkpointing and s.batch * s.heads * s.seq_len ** 2 <= ATTENTION_CHUNK_VALUES
        return tokens * eagle3_values_per_token(s) + (s.num_layers * expanded_kv_values(s, s.seq_len) if padded else 0)
    if s.step == "chain":  # + the float mask SDPA keeps per layer and depth ([1 or B, 1, T, T])
        mask_rows = s.batch if s.kv_features else 1
        return tokens * chain_values_per_token(s) + key_blocks(s) * s.num_layers * mask_rows * s.seq_len ** 2
    if s.step == "heads":  # the gathered hidden state; in one shot also each residual block's linear output and
        # output (2 D; the last one's output is not kept by a frozen head, whose product keeps only its weight)
        one_shot = tokens * s.depths * s.head_vocab <= LOSS_ONE_SHOT_VALUES
        per_head = max(0, 2 * s.num_layers - (0 if s.extra_params else 1))
        return tokens * s.hidden * (1 + (s.depths * per_head if one_shot else 0))
    context, slot = block_values(s)
    kept = tokens * context + s.batch * s.anchors * s.depths * slot
    if not s.checkpointing and block_mask_values(s) <= ATTENTION_CHUNK_VALUES:
        kept += s.num_layers * expanded_kv_values(s, s.seq_len + s.anchors * s.depths)
    return kept


def recomputed_values(s: StepShape) -> int:
    """With activation checkpointing, the values of the one layer (and TTT step) the backward pass recomputes."""
    if not s.checkpointing or s.step in ("chain", "heads"):
        return 0
    if s.step == "ttt":
        return s.batch * s.seq_len * eagle3_layer_values(s, False)
    context, slot = block_layer_values(s, False)
    whole = block_mask_values(s) <= ATTENTION_CHUNK_VALUES
    expanded = expanded_kv_values(s, s.seq_len + s.anchors * s.depths) if whole else 0
    return s.batch * s.seq_len * context + s.batch * s.anchors * s.depths * slot + expanded


def loss_chunk_values(cells: int) -> int:
    """Logits values one loss computation holds at once (drafters/chunked.chunked_rows): all of them up to the
    one-shot limit, else one chunk."""
    return cells if cells <= LOSS_ONE_SHOT_VALUES else LOSS_CHUNK_VALUES


def peak_activation_values(s: StepShape) -> int:
    """Kept activations plus the largest computation on top of them, the larger of two moments:
    - the backward pass starts at the loss: every activation is kept while a loss chunk's logits and their gradient
      (LOSS_CHUNK_COPIES chunks; EAGLE-3 also its teacher, 1 / K of them; a chain or heads loss CELL_LOSS_COPIES,
      its teacher rows freed by then) are live;
    - then the layers: EAGLE-3 reaches the attention of its last TTT step once that step's other tensors are freed
      (about 1 / K of the activations) with a score chunk and its softmax and gradient (ATTENTION_CHUNK_COPIES)
      live; a block drafter's attention chunk holds the boolean block mask and SDPA's float copy of it
      (MASK_CHUNK_COPIES), and off the CPU the chunk's repeated K/V; with checkpointing, the recomputed layer's
      activations are live too.
    A short sequence's loss holds all its logits at once (chunked.LOSS_ONE_SHOT_VALUES), and attention that fits one
    chunk holds that chunk, the whole tensor, as the one-shot paths do."""
    kept, recomputed = activation_values(s), recomputed_values(s)
    if s.step in ("chain", "heads"):  # every position is a row (the most a sequence has)
        return kept + CELL_LOSS_COPIES * loss_chunk_values(s.batch * s.seq_len * s.depths * s.head_vocab)
    if s.step == "ttt":
        loss = loss_chunk_values(s.batch * s.seq_len * s.depths * s.head_vocab)
        scores = min(s.batch * s.heads * s.seq_len * (s.seq_len + s.depths), ATTENTION_CHUNK_VALUES)
        layers = kept * (s.depths - 1) // s.depths + recomputed
        if s.depths > 1:
            layers += ATTENTION_CHUNK_COPIES * scores
        return max(kept + LOSS_CHUNK_COPIES * loss + loss // s.depths, layers)
    slots = s.anchors * s.depths
    loss = loss_chunk_values(s.batch * slots * s.head_vocab)
    mask = min(block_mask_values(s), ATTENTION_CHUNK_VALUES)
    chunk_kv = 0  # a chunk of anchors (dflash/layers.block_attention) sees the context and its own slots
    if block_mask_values(s) > ATTENTION_CHUNK_VALUES:
        chunk_slots = min(slots, max(s.depths, ATTENTION_CHUNK_VALUES // (s.batch * s.seq_len)))
        chunk_kv = expanded_kv_values(s, s.seq_len + chunk_slots)
    return max(kept + LOSS_CHUNK_COPIES * loss, kept + recomputed + MASK_CHUNK_COPIES * mask + chunk_kv)


def step_peak_parts(s: StepShape) -> dict[str, int]:
    """Bytes of each part of one step's peak (static, state, activations with the chunk on top) and their total."""
    b = s.bytes_per_value
    params = trained_params(s)
    tokens = s.batch * s.seq_len
    features = (s.num_features + 1) * tokens * s.hidden + s.kv_features * 2 * tokens * s.kv_heads * s.head_dim
    static = b * (params + 2 * s.vocab * s.hidden + features) + 4 * 8 * tokens
    parts = {"static": static + RUNTIME_BYTES, "gradients + AdamW": 3 * b * params,
             "activations + chunk": b * peak_activation_values(s)}
    parts["total"] = sum(parts.values())
    return parts


def step_peak_bytes(s: StepShape) -> int:
    return step_peak_parts(s)["total"]


def step_shape(drafter, seq_len: int, batch: int, checkpointing: bool,
               device: torch.device | None = None) -> StepShape | None:
    """The StepShape of a built drafter (its layers' widths, `layer_config`, or none for a drafter without attention
    layers; the target's widths, layer ids and trained parameter count; whether the device it trains on, by default
    the one it sits on, repeats K/V) for micro-batches of batch x seq_len tokens; None for a kind whose config
    declares no step_shape."""
    if not hasattr(drafter.config, "step_shape"):
        return None
    info = drafter.target_info
    layer = getattr(drafter, "layer_config", None) or {"num_attention_heads": 0, "num_key_value_heads": 0,
                                                       "head_dim": 0, "intermediate_size": 0}
    return StepShape.for_drafter(
        drafter.kind, drafter.config, hidden=info.hidden_size, heads=layer["num_attention_heads"],
        kv_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"], intermediate=layer["intermediate_size"],
        vocab=info.vocab_size, num_features=len(drafter.target_layer_ids()), seq_len=seq_len, batch=batch,
        checkpointing=checkpointing, params=sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        kv_expanded=expands_kv_heads(device if device is not None else next(drafter.parameters()).device))
