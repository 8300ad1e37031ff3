"""EAGLE-3 drafter (Li et al. 2025; reference algorithms_eagle3_mtp.md section A).

One (or more) Llama decoder layers over [RMSNorm(token embedding) ; RMSNorm(hidden)], where the hidden input is
fc(concat of low/mid/high target features) at the first draft step and the drafter's own pre-norm output after
that. A new LM head over a reduced draft vocabulary (d2t / t2d, drafters/vocab.py) maps back to target ids.

- Training: `forward` unrolls the training-time test (TTT, section A.4) for `config.ttt_steps` steps; `loss` is
  the soft cross-entropy against the target distribution renormalised on the draft vocab, weighted step_decay**k.
  `ttt_steps` is read from `self.config` at every forward, so a trainer may change it between steps
  (e.g. `drafter.config.ttt_steps = 1` for a cheap first phase, then 7).
- Inference: a stateful chain proposer with its own per-row KV cache (`begin` / `propose` / `commit`).
- Config: drafters/eagle3/config.py; building blocks (decoder layer, warm starts): drafters/eagle3/layers.py.
- Export: native, "speculators" (vLLM speculators config), "eagle3" (plain LlamaForCausalLMEagle3, for vLLM) and
  "sglang" (SGLang / SpecForge), see drafters/eagle3/export.py; `Eagle3Drafter.load` reads all four, and
  its `export_checks` says which servers read a checkpoint right (drafters/eagle3/readers.py, `draftsmith doctor`).

Parameter names follow the speculators checkpoint (fc, layers.0.self_attn.q_proj, ..., norm, lm_head, d2t, t2d).
The target's embedding is used directly from TargetInfo and is never a parameter or a persistent buffer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import DraftContext, Drafter, Proposal, TargetInfo, full_vocab_log_probs
from drafters.output import DraftOutput
from drafters.chunked import causal_attention, chunked_rows, maybe_checkpoint, with_autocast_of_now
from drafters.eagle3 import export as export_eagle3
from drafters.eagle3.config import Eagle3Config
from drafters.eagle3.layers import (
    Eagle3DecoderLayer,
    copy_target_layer,
    default_layer_ids,
    draft_layer_config,
    fold_fc_columns,
    init_fc_identity_high,
    resolve_layer_ids,
)
from drafters.eagle3.tree import ExpansionTree
from drafters.layer_ids import is_auto
from drafters.layers import (
    FrozenTargetTensors,
    KVCache,
    RMSNorm,
    RotaryEmbedding,
    attention,
    draw_drafts,
    rope_inverse_frequencies,
)
from drafters.losses import (
    LK_LOSSES,
    acceptance_metric,
    check_lk_eta,
    decayed_sum,
    lk_cell_loss,
    output_metrics,
    soft_cross_entropy,
)
from drafters.vocab import DraftHead



class Eagle3Drafter(DraftHead, Drafter):
    """EAGLE-3 drafter. See the module docstring for the training, inference and export contracts."""

    kind = "eagle3"
    supports_activation_checkpointing = True
    row_state = ("_caches", "_state")  # per-row inference state (drafters/base.py keep_rows)
    Config = Eagle3Config
    export_module = export_eagle3  # the serving layouts speculators, eagle3, sglang (save / load in drafters/base.py)

    def __init__(self, config: Eagle3Config, target_info: TargetInfo):
        super().__init__(config, target_info)
        vocab_size, hidden = target_info.vocab_size, target_info.hidden_size
        if not 0 < config.draft_vocab_size <= vocab_size:
            raise ValueError(f"drafter.draft_vocab_size {config.draft_vocab_size} must be in [1, {vocab_size}]")
        if config.num_layers < 1 or config.ttt_steps < 1:
            raise ValueError("drafter.num_layers and drafter.ttt_steps must be >= 1")
        check_lk_eta(config.lk_eta)
        self.layer_ids = resolve_layer_ids(config, target_info)
        self.layer_config = draft_layer_config(config, target_info)
        self.fc = nn.Linear(len(self.layer_ids) * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            Eagle3DecoderLayer(self.layer_config, i == 0, config.norm_before_residual) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(hidden, self.layer_config["rms_norm_eps"])
        self.add_draft_head(hidden, config.draft_vocab_size)  # until init_from_data / load: the first V_d target ids
        self.rotary = RotaryEmbedding(*rope_inverse_frequencies(self.layer_config))
        self._frozen = FrozenTargetTensors(target_info)
        self._caches: list[KVCache] = []
        self._state: dict[str, torch.Tensor] = {}
        source_layer = config.init_layer_from_target
        if source_layer is not None and not 0 <= source_layer < target_info.num_layers:
            raise ValueError(f"drafter.init_layer_from_target {source_layer} is outside [0, {target_info.num_layers})")
        if not self.fc.weight.is_meta:  # a meta-device build (shape checks) has nothing to initialise
            if config.fc_init == "identity_high":
                init_fc_identity_high(self.fc.weight, self.layer_ids, hidden)
            if source_layer is not None:
                copy_target_layer(self.layers[0], target_info.weights, source_layer, hidden)
            self._init_head()

    def target_layer_ids(self) -> tuple[int, ...]:
        return self.layer_ids

    # ---- vocabulary and warm starts ------------------------------------------------------------------------
    def init_from_data(self, token_counts: torch.Tensor) -> None:
        """Pick the draft vocab (top draft_vocab_size by count, ties to the smaller id) and warm-start the head."""
        self.pick_draft_vocab(token_counts)
        self._init_head()

    @torch.no_grad()
    def _init_head(self) -> None:
        if not self.config.init_head_from_target:
            return
        self.copy_target_rows()
        if self.target_info.final_norm_weight is not None:
            self.norm.weight.copy_(self.target_info.final_norm_weight)

    def _target_tensor(self, name: str) -> torch.Tensor:
        """A frozen TargetInfo tensor on this drafter's device, in the target's dtype (layers.FrozenTargetTensors)."""
        return self._frozen.on_device(name, self.fc.weight)

    # ---- training: the training-time test (reference A.4) ---------------------------------------------------
    def forward(self, batch: Mapping[str, Any]) -> DraftOutput:
        """Unroll `self.config.ttt_steps` TTT steps over the whole batch.

        Drafter position t (0 <= t < T-1) reads (fc(target features at t), token x_{t+1}) at step 0. Step k reads
        the step k-1 pre-norm output at t (gradient flows through it), the ground-truth token x_{t+1+k} and RoPE
        position t+k; it attends to step-0 keys at real positions <= t and to its own keys of steps 1..k at t.
        The head runs only on loss positions: target position s (1 <= s <= T-2) is kept when token x_{s+1} is
        in loss_mask and the target argmax at s is in the draft vocab; depth k predicts x_{s+1} from t = s-1-k.

        Returns:
            DraftOutput with logits [N, K, V_d] (through its head, when read): row n is the kept target position s
            (all K depths predict x_{s+1}, so label_position is s + 1 in every column), depth_valid [N, K] False
            where t = s-1-k < 0.
        """
        input_ids = batch["input_ids"]
        batch_size, seq_len = input_ids.shape
        steps = self.config.ttt_steps
        if seq_len < 3:
            raise ValueError(f"EAGLE-3 training needs sequences of at least 3 tokens, got {seq_len}")
        length = seq_len - 1  # drafter positions: the last token has no next token to read
        real = batch["attention_mask"].bool()
        pair_valid = real[:, :-1] & real[:, 1:]  # [B, L]
        batch_index, target_position = self._loss_positions(batch)

        tokens = F.pad(input_ids[:, 1:], (0, steps - 1))  # step k at t reads tokens[t + k] = x_{t+1+k}
        embeds = self._frozen.embedding("embed_weight", tokens, self.fc.weight)  # [B, L + K - 1, D]
        features = torch.cat([batch["hidden"][i][:, :length] for i in self.layer_ids], dim=-1)
        hidden = self.fc(features.to(self.fc.weight.dtype))  # [B, L, D]
        positions = torch.arange(length, device=input_ids.device).expand(batch_size, length)
        key_valid = None if bool(pair_valid.all()) else pair_valid  # None: plain causal attention (one host sync)
        step_keys: list[dict[str, Any]] = [{"diag_k": [], "diag_v": []} for _ in self.layers]
        normed = []
        for step in range(steps):
            cos, sin = self.rotary(positions + step, hidden.dtype)
            step_embeds, hidden = self._step_inputs(step, embeds[:, step : step + length], hidden)
            hidden = self._ttt_layers(step_embeds, hidden, cos, sin, key_valid, step_keys, step)
            rows = (target_position - 1 - step).clamp(min=0)
            normed.append(self.norm(hidden[batch_index, rows]))
        head_input = torch.stack(normed, dim=1)  # [N, K, D]; the head runs on it when the loss asks (chunks of N)
        depth = torch.arange(steps, device=input_ids.device)
        depth_valid = target_position.unsqueeze(1) - 1 - depth >= 0
        label_position = (target_position + 1).unsqueeze(1).expand(-1, steps)
        head = with_autocast_of_now(lambda rows: self.lm_head(head_input[rows]), head_input.device)
        return DraftOutput(batch_index=batch_index, label_position=label_position, depth_valid=depth_valid,
                           draft_ids=self.draft_ids(), head=head)

    def _step_inputs(self, step: int, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What TTT step `step` reads at every position: (token embeddings, hidden input), each [B, L, D]. EAGLE-3:
        the ground-truth tokens and the previous step's output (fc of the target features at step 0). P-EAGLE
        replaces both after step 0 (drafters/peagle/model.py)."""
        return embeds, hidden

    def _ttt_layers(self, embeds, hidden, cos, sin, key_valid, step_keys, step: int) -> torch.Tensor:
        """One TTT step through every draft layer. step_keys[i] keeps layer i's step-0 keys and diagonal keys.

        Each query t attends to the step-0 keys at t' <= t where key_valid holds (None: all; always its own), plus
        its own keys of steps 1..step (drafters/chunked.causal_attention: no [L, L] tensor at long L)."""
        x = hidden
        for layer, keys in zip(self.layers, step_keys):
            x, k, v = maybe_checkpoint(self.activation_checkpointing, self._ttt_layer, layer, embeds, x, cos, sin,
                                       key_valid, keys.get("k"), keys.get("v"), tuple(keys["diag_k"]),
                                       tuple(keys["diag_v"]))
            if step == 0:
                keys["k"], keys["v"] = k, v
            else:
                keys["diag_k"].append(k)
                keys["diag_v"].append(v)
        return x

    @staticmethod
    def _ttt_layer(layer, embeds, x, cos, sin, key_valid, step0_k, step0_v, diag_k, diag_v):
        """One draft layer of one TTT step: (output [B, L, D], this step's keys and values)."""
        attention_in, residual = layer.attention_input(embeds, x)
        q, k, v = layer.self_attn.project(attention_in, cos, sin)
        if step0_k is None:
            attended = causal_attention(q, k, v, key_valid)
        else:
            attended = causal_attention(q, step0_k, step0_v, key_valid, (*diag_k, k), (*diag_v, v))
        return layer.finish(attended, residual), k, v

    def _loss_positions(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch index [N], target position s [N]) of the positions that carry a loss (see `forward`)."""
        predicted = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        in_vocab = self.t2d[batch["target_argmax"]]
        keep = torch.zeros_like(predicted)
        keep[:, 1:-1] = predicted[:, 2:] & in_vocab[:, 1:-1]
        return keep.nonzero(as_tuple=True)

    def loss(self, output: DraftOutput, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """sum_k step_decay**k * L_k, L_k = mean soft CE at depth k over its valid positions (EAGLE-3 averages over
        all B*T positions instead; a per-depth mean keeps loss_k comparable across batches and padding).

        The teacher is softmax(final_hidden @ lm_head[draft ids].T), i.e. the target distribution
        renormalised on the draft vocab (config.loss "hard": its argmax, one-hot); "lk" / "lk_hybrid" replace the CE
        by the LK loss against that teacher (losses.lk_cell_loss). acc_k is top-1 agreement with the target's own
        argmax (losses.output_metrics).
        """
        batch_index, target_position = output.batch_index, output.label_position[:, 0] - 1
        head = self._target_tensor("lm_head_weight").index_select(0, self.draft_ids())  # [V_d, D]
        teacher_hidden = batch["final_hidden"][batch_index, target_position].to(head.dtype)  # [N, D]

        lk = self.config.loss in LK_LOSSES

        def cells(rows):  # one chunk of rows: its logits [n, K, V_d] and teacher [n, V_d] exist only here
            logits = output.logits_of(rows)
            with torch.no_grad():
                teacher_logits = (teacher_hidden[rows] @ head.T).to(torch.promote_types(head.dtype, torch.float32))
                teacher = (torch.softmax(teacher_logits, dim=-1) if self.config.loss != "hard" else
                           F.one_hot(teacher_logits.argmax(dim=-1), head.shape[0]).to(teacher_logits.dtype))
            if lk:  # the acceptance against the same renormalised teacher (losses.distilled_cells says why)
                cell_loss, alpha = lk_cell_loss(logits, teacher, self.config.loss, self.config.lk_eta)
                return cell_loss, logits.detach().argmax(dim=-1), alpha
            return soft_cross_entropy(logits, teacher), logits.detach().argmax(dim=-1)

        depths, vocab = output.depth_valid.shape[1], head.shape[0]
        cell_loss, predicted, *alpha = chunked_rows(cells, output.num_rows, depths * vocab)
        per_depth, metrics = output_metrics(output, batch, cell_loss, predicted)
        if lk:
            metrics.update(acceptance_metric(alpha[0], output.depth_valid))
        return decayed_sum(per_depth, self.config.step_decay), metrics

    # ---- inference: a stateful chain proposer ----------------------------------------------------------------
    @torch.no_grad()
    def begin(self, context: DraftContext) -> None:
        """Absorb the (left-padded) prompt. The input at position j is (features at j, token j+1), with the
        target's next token as the last one; the output at the last position gives the first draft."""
        batch, seq_len = context.input_ids.shape
        weight = self.fc.weight
        self._caches = [
            KVCache(batch, layer.self_attn.num_kv_heads, layer.self_attn.head_dim, weight.device, weight.dtype,
                    capacity=seq_len + 64)
            for layer in self.layers
        ]
        self._state = {}
        self._generator = context.generator  # sampled drafts draw from the engine's draft stream
        tokens = torch.cat([context.input_ids[:, 1:], context.next_tokens.view(-1, 1)], dim=1)
        last = torch.full((batch,), seq_len - 1, dtype=torch.long, device=tokens.device)
        self._absorb(context, tokens, last, active=torch.ones(batch, dtype=torch.bool, device=tokens.device))

    @torch.no_grad()
    def commit(self, num_accepted: torch.Tensor, context: DraftContext) -> None:
        """Drop the last proposal's speculative entries and absorb the verified block [next token, drafts...];
        row b keeps its first num_accepted[b] + 1 positions (all of them invalid for a finished row)."""
        for cache in self._caches:
            cache.rewind()
        batch, block = context.input_ids.shape
        num_valid = context.valid.sum(dim=1)
        active = num_valid > 0
        if bool((active & (num_valid != num_accepted.to(num_valid.device) + 1)).any()):
            raise ValueError("commit: context.valid must mark exactly num_accepted + 1 positions of each active row")
        last = (num_valid - 1).clamp(min=0)
        tokens = torch.cat([context.input_ids[:, 1:], context.input_ids[:, :1]], dim=1).clone()
        tokens[torch.arange(batch, device=tokens.device), last] = context.next_tokens
        self._absorb(context, tokens, last, active)

    def _absorb(self, context: DraftContext, tokens: torch.Tensor, last: torch.Tensor, active: torch.Tensor) -> None:
        """Run verified positions through the layers into the caches; keep row b's output at index last[b]."""
        embeds = self._frozen.embedding("embed_weight", tokens, self.fc.weight)
        features = torch.cat([context.hidden[i] for i in self.layer_ids], dim=-1).to(self.fc.weight.dtype)
        out = self._cached_layers(embeds, self.fc(features), context.position_ids, context.valid)
        for cache in self._caches:
            cache.mark()
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        new = {"hidden": out[rows, last], "position": context.position_ids[rows, last]}
        new["logits"] = self.lm_head(self.norm(new["hidden"]))
        for name, value in new.items():
            keep = active.view(-1, *([1] * (value.dim() - 1)))
            self._state[name] = torch.where(keep, value, self._state[name]) if name in self._state else value

    def _cached_layers(self, embeds, hidden, position_ids, valid, mask=None) -> torch.Tensor:
        """embeds, hidden [B, n, D], position_ids [B, n], valid [B, n] -> pre-norm output [B, n, D]; appends K/V.
        mask [B, 1, n, C] replaces the cache's causal block mask (a tree's ancestor mask, `expand_tree`)."""
        cos, sin = self.rotary(position_ids, hidden.dtype)
        x = hidden
        for layer, cache in zip(self.layers, self._caches):
            attention_in, residual = layer.attention_input(embeds, x)
            q, k, v = layer.self_attn.project(attention_in, cos, sin)
            keys, values, block_mask = cache.append(k, v, valid)
            x = layer.finish(attention(q, keys, values, block_mask if mask is None else mask), residual)
        return x

    # ---- inference: EAGLE-2 dynamic trees (reference A.6; the engine's loop is inference/engine/tree/draft.py) ----------------
    expands_trees = True

    @torch.no_grad()
    def expand_tree(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Feed tree nodes (drafters/base.Drafter.expand_tree): node m reads (its token, the pre-norm output of its
        parent) at position root + depth, and attends to the committed cache, its fed ancestors and itself
        (drafters/eagle3/tree.py keeps the round's nodes). The root's output is the committed state, so the round's
        first call runs nothing. Args: tokens, parents [B, M]. Returns: log-probabilities [B, M, V].
        """
        if not self._state:
            raise ValueError("expand_tree() called before begin()")
        vocab_size = self.t2d.numel()
        if bool((parents < 0).all()):  # the root
            for cache in self._caches:
                cache.rewind()
            self._tree = ExpansionTree.root(self._state["hidden"], self._caches[0].lengths)
            return full_vocab_log_probs(self._state["logits"][:, None], self.draft_ids(), vocab_size)
        tree = self._tree
        parent_hidden = tree.parent_hidden(parents)
        ancestors, depth = tree.add(parents)
        mask = tree.cache_mask(ancestors, self._caches[0].valid)
        embeds = self._frozen.embedding("embed_weight", tokens, self.fc.weight)
        positions = self._state["position"][:, None] + depth
        valid = torch.ones_like(tokens, dtype=torch.bool)
        hidden = self._cached_layers(embeds, parent_hidden, positions, valid, mask)
        tree.append_hidden(hidden)
        return full_vocab_log_probs(self.lm_head(self.norm(hidden)), self.draft_ids(), vocab_size)

    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        """Draft a chain of num_tokens per row (target ids). probs [B, K, V] (float32, zero outside the draft
        vocab) only when config.sample_drafts; otherwise argmax drafts and probs None."""
        if not self._state:
            raise ValueError("propose() called before begin()")
        for cache in self._caches:
            cache.rewind()
        hidden, logits = self._state["hidden"], self._state["logits"]
        batch = hidden.shape[0]
        draft_ids = self.draft_ids()
        tokens, probs, depth_logits = [], [], []
        for j in range(num_tokens):
            draft, q = draw_drafts(logits, self.config.sample_drafts, self._generator)
            tokens.append(draft_ids[draft])
            probs.append(q)
            depth_logits.append(logits)
            if j + 1 == num_tokens:
                break
            embeds = self._frozen.embedding("embed_weight", tokens[-1].view(-1, 1), self.fc.weight)
            positions = (self._state["position"] + j + 1).view(-1, 1)
            valid = torch.ones(batch, 1, dtype=torch.bool, device=hidden.device)
            hidden = self._cached_layers(embeds, hidden.unsqueeze(1), positions, valid)[:, 0]
            logits = self.lm_head(self.norm(hidden))
        if num_tokens == 0:
            return Proposal(tokens=torch.zeros(batch, 0, dtype=torch.long, device=hidden.device))
        log_probs = full_vocab_log_probs(torch.stack(depth_logits, dim=1), draft_ids, self.t2d.numel())
        if not self.config.sample_drafts:
            return Proposal(tokens=torch.stack(tokens, dim=1), log_probs=log_probs)
        q = torch.stack(probs, dim=1).float()  # [B, K, V_d]; float32 like the engine's target probabilities
        full = q.new_zeros(batch, num_tokens, self.t2d.numel())
        full[:, :, draft_ids] = q
        return Proposal(tokens=torch.stack(tokens, dim=1), probs=full, log_probs=log_probs)

    # ---- persistence (save / load / detect_format: drafters/base.py, through export_module) ----------------------
    def checkpoint_config(self) -> Eagle3Config:
        """The native header names the resolved (sorted, unique) ids: the order of the fc input blocks."""
        return dataclasses.replace(self.config, layer_ids=self.layer_ids)

    @classmethod
    def read_native(cls, directory: str, header: Mapping[str, Any], target_info: TargetInfo):
        """(config, state dict) of a native checkpoint. One written before ids were sorted and de-duplicated has its
        fc blocks in the configured order (the default (2, N//2, N-3) included): they are folded into sorted unique
        order, which computes exactly the same function."""
        config, state = super().read_native(directory, header, target_info)
        listed = default_layer_ids(target_info.num_layers) if is_auto(config.layer_ids) else tuple(config.layer_ids)
        if "fc.weight" in state and state["fc.weight"].shape[1] == len(listed) * target_info.hidden_size:
            layer_ids, state["fc.weight"] = fold_fc_columns(state["fc.weight"], listed, target_info.hidden_size)
            config = dataclasses.replace(config, layer_ids=layer_ids)
        return config, state


def detect_format(config: Mapping[str, Any]) -> str | None:
    """"native", "speculators", "eagle3" or "sglang" for an EAGLE-3 checkpoint's config.json dict, else None."""
    return Eagle3Drafter.detect_format(config)
