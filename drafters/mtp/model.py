"""MTP drafter: DeepSeek-V3-style multi-token-prediction modules on a frozen target (reference B.1-B.4).

The design notes behind this module: docs/decisions.md, "drafters/mtp/model.py".
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import DraftContext, Drafter, FeatureRequest, Proposal, TargetInfo, full_vocab_log_probs
from drafters.layers import FrozenTargetTensors, draw_drafts
from drafters.losses import chained_depths, check_lk_eta, listed_depth_weights, target_distilled_loss
from drafters.mtp import export as mtp_export
from drafters.mtp.config import MTPConfig
from drafters.mtp.layers import (
    LAYOUTS,
    BlockCache,
    MTPModule,
    StepKeys,
    block_config,
    causal_mask,
    convention_of,
    family_classes,
    init_module_,
    resolve_num_steps,
    step_blocks,
    target_text_config,
)
from drafters.output import DraftOutput
from drafters.vocab import DraftHead


@dataclass
class _Depth:
    """Proposer state of one depth: its cache, how many positions of each row it has committed, and its fed-back
    outputs at those positions ([B, P, D], the next depth's hidden input)."""

    cache: BlockCache
    done: torch.Tensor
    out: torch.Tensor


class MTPDrafter(DraftHead, Drafter):
    """MTP heads. See the module docstring for the training, inference and persistence contracts."""

    kind = "mtp"
    row_state = ("_tokens", "_target", "_known", "_depths")  # per-row inference state (drafters/base.py keep_rows)
    Config = MTPConfig
    export_module = mtp_export  # "speculators" and the target-checkpoint layouts (save / load in drafters/base.py)

    def __init__(self, config: MTPConfig, target_info: TargetInfo):
        super().__init__(config, target_info)
        resolve_num_steps(config)
        check_lk_eta(config.lk_eta)
        vocab_size = target_info.vocab_size
        if config.draft_vocab_size is not None and not 0 < config.draft_vocab_size <= vocab_size:
            raise ValueError(f"drafter.draft_vocab_size {config.draft_vocab_size} must be in [1, {vocab_size}] or null")
        if config.layout not in LAYOUTS:
            raise ValueError(f"drafter.layout {config.layout!r} is not one of {sorted(LAYOUTS)}")
        self._model_type = target_text_config(target_info).get("model_type")
        num_layers = target_info.num_layers
        classes = family_classes(self._model_type or "llama")
        self.block_config = block_config(target_info, config.num_modules)
        if self.block_config.hidden_size != target_info.hidden_size:
            raise ValueError(f"the target config's hidden_size {self.block_config.hidden_size} differs from the "
                             f"target's {target_info.hidden_size}")
        first, blocks = self.convention.embedding_first, len(step_blocks(target_info) or ())
        self.layers = nn.ModuleList(MTPModule(self.block_config, num_layers + k * max(blocks, 1), classes, first,
                                              blocks) for k in range(config.num_modules))
        self.rotary = classes.rotary(self.block_config) if classes.rotary else None
        # Families with one RoPE per attention type (Gemma 4) take the type: the MTP block is full attention.
        self._rope_kind = (("full_attention",) if self.rotary is not None and
                           "layer_type" in inspect.signature(self.rotary.forward).parameters else ())
        self._frozen = FrozenTargetTensors(target_info)
        self._depths: list[_Depth] = []
        self._generator = None
        self.lm_head = None  # the target's frozen head, unless a draft vocabulary is asked for (below)
        materialised = not self.layers[0].eh_proj.weight.is_meta  # a meta-device build has nothing to initialise
        # Native modules are imported before use (init_from_data / load), so random init would be wasted work.
        if materialised and not config.init_from_native:
            self._init_weights()
        if config.draft_vocab_size is not None:  # built after the modules' init: it leaves their seeded draws alone
            self.add_draft_head(target_info.hidden_size, config.draft_vocab_size)
            if materialised:  # the target's rows of the first V_d ids until init_from_data picks the vocabulary
                self.copy_target_rows()

    def rope(self, x: torch.Tensor, position_ids: torch.Tensor):
        """cos, sin of the family's rotary at position_ids [B, T]. A multimodal-RoPE family (Qwen3.5: text, height
        and width sections) takes the text positions once per section, [3, B, T]: transformers 5.17 did not
        broadcast them itself."""
        if self.rotary is None:  # a family without RoPE (Nemotron-H)
            return None
        if hasattr(self.rotary, "mrope_section"):
            position_ids = position_ids.expand(3, *position_ids.shape)
        return self.rotary(x, position_ids, *self._rope_kind)

    @property
    def num_steps(self) -> int:
        return resolve_num_steps(self.config)

    @property
    def layer_config(self) -> dict[str, int]:
        """The widths of the MTP block's decoder layer (drafters/step_memory.step_shape); an MoE block's MLP width
        is the one a token passes through (its routed experts and any shared expert)."""
        config = self.block_config
        heads = config.num_attention_heads
        experts = getattr(config, "num_experts_per_tok", None) or 0
        routed = (getattr(config, "moe_intermediate_size", None) or 0) * experts
        shared = (getattr(config, "shared_expert_intermediate_size", None)
                  or getattr(config, "moe_shared_expert_intermediate_size", None) or 0)  # Nemotron-H's name
        return {"hidden_size": config.hidden_size, "num_attention_heads": heads,
                "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
                "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
                "intermediate_size": routed + shared if routed else int(config.intermediate_size)}

    def feature_request(self) -> FeatureRequest:
        return FeatureRequest(layer_ids=tuple(self.target_layer_ids()), final_hidden=True)

    def max_draft_tokens(self) -> int | None:
        return None if self.config.reuse or self.served_steps else self.config.num_modules

    @property
    def convention(self):
        """The layout's conventions, with the fed-back state of the steps this drafter's proposer runs."""
        return convention_of(self.config.layout, self._model_type, self.config.served_steps)

    @property
    def served_steps(self) -> bool:
        """Steps after the first run as servers run them (MTPConfig.proposer)."""
        return self.config.served_steps

    def _module_index(self, depth: int) -> int:
        return depth % self.config.num_modules if self.config.reuse else depth

    # ---- initialisation -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _init_weights(self) -> None:
        std = float(getattr(self.block_config, "initializer_range", None) or 0.02)
        for module in self.layers:
            init_module_(module, std)

    def init_from_data(self, token_counts: torch.Tensor) -> None:
        """With init_from_native: import the target checkpoint's own MTP modules. With a draft vocabulary: pick its
        draft_vocab_size most frequent tokens (ties to the smaller id) and warm-start the head from the target's
        rows."""
        if self.config.init_from_native:
            self.import_native()
        if self.lm_head is not None:
            self.pick_draft_vocab(token_counts)
            self.copy_target_rows()

    def import_native(self, directory: str | None = None, state: dict | None = None) -> None:
        """Load the MTP modules shipped in the target's checkpoint (`directory`, default TargetInfo.name_or_path: an
        export of the target into its layout holds the same trunk) into this drafter; `state`: their tensors as
        export.read_native already read them."""
        directory = directory or self.target_info.name_or_path
        found = mtp_export.find_native(directory, self.target_info.num_layers, self._model_type)
        if found.layout != self.config.layout:
            raise ValueError(f"drafter.layout is {self.config.layout!r}, but the target checkpoint {directory} holds "
                             f"its MTP weights in the {found.layout} layout")
        if found.num_modules != self.config.num_modules:
            raise ValueError(f"drafter.num_modules is {self.config.num_modules}, but the target checkpoint {directory}"
                             f" has {found.num_modules} MTP module(s)")
        if state is None:
            state = mtp_export.read_native(directory, self.target_info, found.layout, found.num_modules)
        try:
            self.layers.load_state_dict({name.removeprefix("layers."): t for name, t in state.items()}, strict=True)
        except RuntimeError as err:
            raise ValueError(f"{directory}: its {found.layout} MTP modules do not fit a block built from the target's "
                             f"config: {err}") from None

    @classmethod
    def from_target(cls, target_info: TargetInfo, directory: str | None = None,
                    state: dict | None = None) -> "MTPDrafter":
        """The target's own MTP modules (`--drafter native-mtp`), or those of `directory` (a target checkpoint with
        MTP weights: `draftsmith doctor`, which passes the `state` its checks read): layout and count read from the
        checkpoint, proposing as vLLM and SGLang run them (MTPConfig.proposer "server": the first module at every
        step)."""
        model_type = target_text_config(target_info).get("model_type")
        directory = directory or target_info.name_or_path
        found = mtp_export.find_native(directory, target_info.num_layers, model_type)
        config = MTPConfig(num_modules=found.num_modules, reuse=True, layout=found.layout, init_from_native=True,
                           proposer="server")
        drafter = cls(config, target_info)
        drafter.import_native(directory, state)
        return drafter.to(target_info.embed_weight.device, target_info.embed_weight.dtype).eval()

    def _target_tensor(self, name: str) -> torch.Tensor:
        """A frozen TargetInfo tensor on this drafter's device, in the target's dtype (layers.FrozenTargetTensors)."""
        return self._frozen.on_device(name, self.layers[0].eh_proj.weight)

    # ---- one depth over a block of positions --------------------------------------------------------------------
    def _step(self, depth: int, tokens, hidden, position_ids, mask, cache=None, position_embeddings=None):
        """tokens [B, n], hidden [B, n, D] (depth - 1's fed-back output, or the target's), position_ids [B, n]
        -> (fed-back output, normed output) [B, n, D]."""
        module = self.layers[self._module_index(depth)]
        embeds = self._frozen.embedding("embed_weight", tokens, self.layers[0].eh_proj.weight)
        if self.convention.mask_first_position:
            embeds = embeds.masked_fill((position_ids == 0).unsqueeze(-1), 0.0)
        if position_embeddings is None:
            position_embeddings = self.rope(embeds, position_ids)
        pre = module(embeds, hidden.to(embeds.dtype), mask, position_ids, position_embeddings, cache)
        normed = module.final_norm(pre)
        return (normed if self.convention.feed_back_normed else pre), normed

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [..., D] -> logits [..., V_d] (the target's frozen head unless the vocabulary is reduced)."""
        if self.lm_head is not None:
            return self.lm_head(normed)
        return self._frozen.linear("lm_head_weight", normed, self.layers[0].eh_proj.weight)

    # ---- training ---------------------------------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Any]) -> DraftOutput:
        """Teacher-forced depths over the batch (right padding): DeepSeek-V3's, or the steps as servers run one module
        (MTPConfig.proposer; layers.StepKeys).

        Returns:
            DraftOutput: row n = (batch_index, position i = anchor - 1) for every i where some depth has a loss;
            logits [N, K, V_d] of depth k at i; label_position [N, K] = i + k + 2 (clamped to T - 1 past the end);
            depth_valid [N, K] = label inside the sequence and in loss_mask (and, with a draft vocabulary, the cell's
            token in it: see MTPConfig.draft_vocab_size); draft_ids.
        """
        self.config.check_recipe()  # the served steps train one module
        batch_size, seq_len = batch["input_ids"].shape
        device = batch["input_ids"].device
        positions = torch.arange(seq_len, device=device).expand(batch_size, seq_len)
        if self.served_steps:  # step k of anchor i at position i + k over StepKeys (MTPConfig.proposer)
            keys = StepKeys(seq_len, device)
            output = chained_depths(batch, self.num_steps, lambda depth, tokens, hidden: self._step(
                depth, tokens, hidden, positions + depth, keys.mask(depth), keys), self._logits)
        else:
            position_embeddings = self.rope(batch["final_hidden"].to(self.layers[0].eh_proj.weight.dtype), positions)
            mask = causal_mask(seq_len, device)
            output = chained_depths(batch, self.num_steps, lambda depth, tokens, hidden: self._step(
                depth, tokens, hidden, positions, mask, position_embeddings=position_embeddings), self._logits)
        if self.lm_head is not None:
            rows = output.batch_index.unsqueeze(1).expand_as(output.label_position)
            token = (batch["input_ids"][rows, output.label_position] if self.config.loss == "hard" else
                     batch["target_argmax"][rows, output.label_position - 1])
            output.depth_valid = output.depth_valid & self.t2d[token]
            output.draft_ids = self.draft_ids()
        return output

    def loss(self, output: DraftOutput, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """sum_k w_k * mean CE at depth k over its valid cells of all processes (see MTPConfig.loss)."""
        weights = listed_depth_weights(self.config.loss_weights, output.depth_valid.shape[1])
        return target_distilled_loss(output, batch, self._target_tensor("lm_head_weight"), self.config.loss, weights,
                                     self.config.lk_eta)

    # ---- inference: a stateful chain proposer -------------------------------------------------------------------
    @torch.no_grad()
    def begin(self, context: DraftContext) -> None:
        """Absorb the (left-padded) prompt and the target's next token, then catch up depth 0."""
        if context.final_hidden is None:
            raise ValueError("mtp: the engine served no final_hidden (FeatureRequest.final_hidden)")
        batch, _ = context.input_ids.shape
        device = context.input_ids.device
        known = context.valid.long().sum(dim=1) + 1  # prompt tokens + the next token
        capacity = int(known.max()) + 64
        weight = self.layers[0].eh_proj.weight
        self._tokens = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self._target = torch.zeros(batch, capacity, weight.shape[0], dtype=weight.dtype, device=device)
        self._known = torch.zeros(batch, dtype=torch.long, device=device)
        self._depths = []
        self._generator = context.generator
        self._absorb(context, torch.ones(batch, dtype=torch.bool, device=device))
        self._grow_to(1)

    @torch.no_grad()
    def commit(self, num_accepted: torch.Tensor, context: DraftContext) -> None:
        """Drop the last proposal's speculative entries, record the verified block [previous token, accepted
        drafts] and the new next token, and advance every depth over the positions that became computable."""
        if not self._depths:
            raise ValueError("commit() called before begin()")
        num_valid = context.valid.sum(dim=1)
        active = num_valid > 0
        if bool((active & (num_valid != num_accepted.to(num_valid.device) + 1)).any()):
            raise ValueError("commit: context.valid must mark exactly num_accepted + 1 positions of each active row")
        for state in self._depths:
            state.cache.rewind()
        self._absorb(context, active)
        for depth, state in enumerate(self._depths):
            self._advance(depth)
            state.cache.mark()

    def _absorb(self, context: DraftContext, active: torch.Tensor) -> None:
        """Store the valid tokens and final hidden states at their positions; the next token after them."""
        self._reserve(int(context.position_ids.max()) + 2 + len(self._depths) + 2)
        rows = torch.arange(context.input_ids.shape[0], device=active.device)
        valid, positions = context.valid, context.position_ids
        row_index = rows.unsqueeze(1).expand_as(positions)[valid]
        self._tokens[row_index, positions[valid]] = context.input_ids[valid]
        self._target[row_index, positions[valid]] = context.final_hidden[valid].to(self._target.dtype)
        known = torch.where(active, positions.masked_fill(~valid, -1).amax(dim=1) + 2, self._known)
        self._tokens[rows[active], known[active] - 1] = context.next_tokens.to(self._tokens.device)[active]
        self._known = known

    def _reserve(self, needed: int) -> None:
        """Grow the per-position histories to hold `needed` positions (plus room)."""
        capacity = self._tokens.shape[1]
        if needed <= capacity:
            return
        grow = max(needed, 2 * capacity) - capacity
        self._tokens = F.pad(self._tokens, (0, grow))
        self._target = F.pad(self._target, (0, 0, 0, grow))
        for state in self._depths:
            state.out = F.pad(state.out, (0, 0, 0, grow))

    def _grow_to(self, num_depths: int) -> None:
        """Create depths up to num_depths, each caught up over every computable committed position."""
        self._reserve(int(self._known.max()) + num_depths + 2)
        while len(self._depths) < num_depths:
            batch, device = self._target.shape[0], self._target.device
            zeros = torch.zeros(batch, dtype=torch.long, device=device)
            self._depths.append(_Depth(BlockCache(batch, device), zeros, torch.zeros_like(self._target)))
            self._advance(len(self._depths) - 1)
            self._depths[-1].cache.mark()

    def _advance(self, depth: int) -> None:
        """Run `depth` over its newly computable positions: start = done .. known - 2 - depth of each row."""
        state = self._depths[depth]
        source = self._target if depth == 0 else self._depths[depth - 1].out
        count = (self._known - 1 - depth - state.done).clamp(min=0)
        width = int(count.max())
        if width == 0:
            return
        offsets = torch.arange(width, device=count.device)
        valid = offsets < count.unsqueeze(1)
        positions = torch.where(valid, state.done.unsqueeze(1) + offsets, 0)  # [B, w]; padding entries read 0
        rows = torch.arange(positions.shape[0], device=count.device).unsqueeze(1).expand_as(positions)
        tokens = self._tokens[rows, positions + depth + 1]
        fed, _ = self._step(depth, tokens, source[rows, positions], positions, state.cache.plan(valid), state.cache)
        state.out[rows[valid], positions[valid]] = fed[valid].to(state.out.dtype)
        state.done = state.done + count

    @torch.no_grad()
    def propose(self, num_tokens: int) -> Proposal:
        """A chain of num_tokens drafts per row (see the module docstring); probs [B, K, V] when sample_drafts."""
        limit = self.max_draft_tokens()
        if limit is not None and num_tokens > limit:
            raise ValueError(f"propose: {num_tokens} tokens asked for, but {limit} MTP module(s) without "
                             f"drafter.reuse draft at most {limit}")
        if not self._depths:
            raise ValueError("propose() called before begin()")
        batch = self._known.shape[0]
        if num_tokens <= 0:
            return Proposal(tokens=self._tokens.new_zeros(batch, 0))
        for state in self._depths:
            state.cache.rewind()
        self._grow_to(1 if self.served_steps else num_tokens)
        anchor = self._known - 1  # position of the token the target emitted last
        rows = torch.arange(batch, device=anchor.device)
        fed = self._depths[0].out[rows, anchor - 1]
        normed = fed if self.convention.feed_back_normed else self.layers[self._module_index(0)].final_norm(fed)
        logits = self._logits(normed)
        draft_ids = self.draft_ids()
        draft, q = draw_drafts(logits, self.config.sample_drafts, self._generator)
        draft = draft if draft_ids is None else draft_ids[draft]  # target ids: the next depth embeds them
        tokens, probs, depth_logits, speculative = [draft], [q], [logits], None
        for depth in range(1, num_tokens):
            if self.served_steps:
                # the step at the next position over the previous step's output and draft `depth`, in depth 0's
                # cache after its committed entries (the next rewind drops the steps)
                position, cache = (anchor - 1 + depth).unsqueeze(1), self._depths[0].cache
                fed, normed = self._step(0, tokens[-1].unsqueeze(1), fed.unsqueeze(1), position,
                                         cache.plan(torch.ones_like(position, dtype=torch.bool)), cache)
                fed = fed[:, -1]
            else:
                # depth runs over positions anchor-depth .. anchor-1: the first has depth-1's committed output, the
                # rest depth-1's speculative outputs; their tokens are the drafts d_1..d_depth.
                committed = self._depths[depth - 1].out[rows, (anchor - depth).clamp(min=0)].unsqueeze(1)
                hidden = committed if speculative is None else torch.cat([committed, speculative], dim=1)
                positions = (anchor - depth).unsqueeze(1) + torch.arange(depth, device=anchor.device)
                cache = self._depths[depth].cache
                speculative, normed = self._step(depth, torch.stack(tokens, dim=1), hidden, positions.clamp(min=0),
                                                 cache.plan(positions >= 0), cache)
            logits = self._logits(normed[:, -1])
            draft, q = draw_drafts(logits, self.config.sample_drafts, self._generator)
            tokens.append(draft if draft_ids is None else draft_ids[draft])
            probs.append(q)
            depth_logits.append(logits)
        vocab_size = self.target_info.vocab_size
        log_probs = full_vocab_log_probs(torch.stack(depth_logits, dim=1), draft_ids, vocab_size)
        if not self.config.sample_drafts:
            return Proposal(tokens=torch.stack(tokens, dim=1), log_probs=log_probs)
        q = torch.stack(probs, dim=1).float()  # [B, K, V_d]; zero outside the draft vocabulary in target ids
        if draft_ids is not None:
            q = q.new_zeros(*q.shape[:2], vocab_size).index_copy_(-1, draft_ids, q)
        return Proposal(tokens=torch.stack(tokens, dim=1), probs=q, log_probs=log_probs)
