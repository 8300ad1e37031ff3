"""The drafter contract: what train/ and inference/ know about any drafter (docs/ARCHITECTURE.md, contract).

Shapes: B batch, T sequence, D hidden, V target vocab, V_d draft vocab, K draft depth / proposal length.

A drafter receives a frozen `TargetInfo` and its own config dataclass. It never holds the target model, the dataset
or a launcher config. Training calls `forward(batch)` and `loss(output, batch)`; inference drives the stateful
proposer `begin(context)` / `propose(k)` / `commit(num_accepted, context)`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar, Mapping

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from drafters.configs import from_dict, to_dict
from drafters.output import DraftOutput

NATIVE_KIND_KEY = "draftsmith_kind"


def text_config_of(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """An HF config dict's text model: the config itself, or a vision-language model's nested `text_config` (the
    one home of this unwrapping)."""
    nested = config.get("text_config")
    return nested if "hidden_size" not in config and isinstance(nested, Mapping) else config


EPS_FIELDS = ("rms_norm_eps", "norm_eps", "layer_norm_epsilon", "layer_norm_eps")  # Llama; LFM2; Nemotron-H; ...


def norm_eps(config) -> float:
    """The epsilon of a (transformers config object's) family's RMSNorm, under the name the family gives it."""
    return float(next((getattr(config, name) for name in EPS_FIELDS if getattr(config, name, None) is not None), 1e-6))


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter may know about its target. Tensors are shared references, never trained.

    `weights` maps the target's own parameter names to its tensors (for warm starts); `config` is the target's HF
    config as a dict (head counts, rope theta, eps...) so a drafter can mirror its layer shapes. `unused_token_ids`
    (from the tokenizer: rows past it, then reserved special tokens) are candidates for a mask token; None when the
    target came without a tokenizer.
    """

    name_or_path: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    embed_weight: torch.Tensor  # [V, D]
    lm_head_weight: torch.Tensor  # [V, D]
    final_norm_weight: torch.Tensor | None  # [D]
    rms_norm_eps: float
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    config: Mapping[str, Any] = field(default_factory=dict)
    weights: Mapping[str, torch.Tensor] = field(default_factory=dict)
    unused_token_ids: tuple[int, ...] | None = None  # vocab rows no text or chat template produces; None = unknown

    @property
    def text_config(self) -> Mapping[str, Any]:
        """The target's text-model HF config (`text_config_of` its config)."""
        return text_config_of(self.config)


# a DraftContext field indexed [B, S, ...] by this forward's positions: a catch-up commit of several forwards
# concatenates it along S (inference/engine/rounds.Deferred); every other field is the last forward's
PER_POSITION = {"per_position": True}


@dataclass
class DraftContext:
    """What the engine hands a proposer after each target forward.

    input_ids:  [B, S] the tokens that forward read (the padded prompt, or [last token, drafts...] when verifying).
    valid:      [B, S] bool, which of them are now part of the sequence (right-aligned padding and rejected drafts
                are False). Accepted positions always form a prefix of each row's block after its padding.
    position_ids: [B, S] the positions the target used for them.
    hidden:     {layer_id: [B, S, D]} the target hidden states the drafter asked for (vLLM layer-id convention).
    next_tokens: [B] the token the target emitted after the last valid position; it is not in any cache yet.
    generator:  the random stream a sampling drafter must draw from (independent of the verifier's stream, which a
                drafter using the global RNG could otherwise replay under the same seed and so bias the output).
    final_hidden: [B, S, D] the target's last hidden state after its final norm (FeatureRequest.final_hidden).
    top_k:      (values, ids) [B, S, k] the target's top-k logits at each position (FeatureRequest.top_k_logits).
    target_kv:  {layer index: (keys, values) [B, H_kv, L, d]} the target's own KV cache for the requested layers,
                read-only, with `target_kv_valid` [B, L] marking which of its slots belong to the sequence
                (FeatureRequest.kv_layers). The slots of this forward's tokens are the last S.
    temperature: the engine's sampling temperature (0 = greedy; None = not told). A drafter that follows it samples
                its drafts at it (returning their probs) and drafts the argmax at 0.
    """

    input_ids: torch.Tensor = field(metadata=PER_POSITION)
    valid: torch.Tensor = field(metadata=PER_POSITION)
    position_ids: torch.Tensor = field(metadata=PER_POSITION)
    hidden: dict[int, torch.Tensor] = field(metadata=PER_POSITION)
    next_tokens: torch.Tensor
    generator: torch.Generator | None = None
    final_hidden: torch.Tensor | None = field(default=None, metadata=PER_POSITION)
    top_k: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, metadata=PER_POSITION)
    target_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    target_kv_valid: torch.Tensor | None = None
    temperature: float | None = None


@dataclass(frozen=True)
class FeatureRequest:
    """What a drafter asks of the target. Training serves it online, offline and hybrid alike (train/features/cache.py);
    the engine serves it after every target forward (DraftContext).

    layer_ids:     hidden states by vLLM layer id (id k = input of decoder layer k, id N = final pre-norm output).
    final_hidden:  the last hidden state after the target's final norm (an MTP head's input; in training it is
                   always served as `final_hidden`, since every loss derives the teacher from it).
    top_k_logits:  k > 0 asks for the target's k largest logits and their ids at every position (distillation
                   without storing V logits per token); 0 = none.
    kv_layers:     target decoder layer indices whose KV cache the drafter reads (a Gemma-4-style assistant).
    """

    layer_ids: tuple[int, ...] = ()
    final_hidden: bool = False
    top_k_logits: int = 0
    kv_layers: tuple[int, ...] = ()

    def check(self, num_layers: int, vocab_size: int) -> None:
        """Raise ValueError naming the field when the request does not fit a target of this shape."""
        bad = [i for i in self.layer_ids if not 0 <= int(i) <= num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} are out of range 0..{num_layers} for this target")
        bad = [i for i in self.kv_layers if not 0 <= int(i) < num_layers]
        if bad:
            raise ValueError(f"kv_layers {bad} are out of range 0..{num_layers - 1} for this target")
        if not 0 <= self.top_k_logits <= vocab_size:
            raise ValueError(f"top_k_logits {self.top_k_logits} must be in [0, {vocab_size}]")


@dataclass
class Proposal:
    """tokens [B, K] in target ids; probs [B, K, V] draft distribution in target vocab, or None for deterministic
    (argmax / lookup) drafts, which verification treats as one-hot q. `num_valid` [B] lets a row propose fewer than K
    (an n-gram miss); positions past it are never accepted.
    confidence_logits [B, K]: the drafter's logit that draft j is accepted given that drafts < j were (DSpark's
    confidence head), computed before draft j is drawn; confidence_temperature [K]: the calibration that makes
    sigmoid(logit / temperature) honest, None = uncalibrated. The engine schedules verification from them
    (inference/engine/schedule.py).
    log_probs [B, K, V]: the log-distribution each draft was chosen from, in target vocab (-inf outside a reduced
    draft vocabulary), or None; tree verification builds its trees from these per-depth marginals (DDTree,
    inference/engine/tree/draft.py)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    num_valid: torch.Tensor | None = None
    confidence_logits: torch.Tensor | None = None
    confidence_temperature: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None


def full_vocab_log_probs(logits: torch.Tensor, draft_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft logits [..., V_d] -> float32 log-probabilities [..., V] in target ids (-inf outside the draft vocab;
    draft_ids None means V_d is the target vocab). Proposal.log_probs is built with it."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    if draft_ids is None:
        return log_probs
    full = log_probs.new_full((*log_probs.shape[:-1], vocab_size), float("-inf"))
    full[..., draft_ids] = log_probs
    return full


class Drafter(nn.Module):
    """Base class. Subclasses set `kind`, `Config` (and `export_module` when they export), and implement the methods
    below."""

    kind: ClassVar[str] = ""
    Config: ClassVar[type] = object
    # Recompute each draft layer's activations in the backward pass (train.activation_checkpointing; the trainer
    # sets it): less memory for one more forward of the layers. Drafters that support it read it in `forward`.
    activation_checkpointing: bool = False
    supports_activation_checkpointing: ClassVar[bool] = False

    def __init__(self, config: Any, target_info: TargetInfo):
        super().__init__()
        self.config = config
        self.target_info = target_info

    # ---- what the drafter needs from the target -------------------------------------------------------------
    def target_layer_ids(self) -> tuple[int, ...]:
        """Hidden states to capture, by vLLM layer id (id k = input of decoder layer k, id N = final pre-norm)."""
        return ()

    def feature_request(self) -> FeatureRequest:
        """Everything the drafter reads from the target; by default the hidden states of `target_layer_ids`."""
        return FeatureRequest(layer_ids=tuple(self.target_layer_ids()))

    def max_draft_tokens(self) -> int | None:
        """The longest proposal this drafter can make in one round (a block drafter: block size - 1), or None."""
        return None

    # The target's frozen tensors a drafter computes with (drafters/layers.FrozenTargetTensors): a server may run
    # their products its own way (the CPU backend serves the head by the target's own kernels) and training points
    # them at a sharded target's TargetInfo. Each kind keeps them as `_frozen` on the module that computes with them;
    # a drafter holding them elsewhere overrides `frozen_tensors`.
    frozen_attribute: ClassVar[str] = "_frozen"

    def frozen_tensors(self) -> list:
        """The FrozenTargetTensors this drafter and its submodules hold, each once."""
        held = (getattr(module, self.frozen_attribute, None) for module in self.modules())
        return list({id(frozen): frozen for frozen in held if frozen is not None}.values())

    def adopt_target_info(self, target_info: TargetInfo) -> None:
        """Compute with `target_info` from now on (the same target's, e.g. without its map of every weight once it
        is sharded): the frozen tensors start afresh, as a copy made so far may alias a weight about to be sharded."""
        self.target_info = target_info
        for frozen in self.frozen_tensors():
            frozen.reset(target_info)

    # ---- training ----------------------------------------------------------------------------------------
    def init_from_data(self, token_counts: torch.Tensor) -> None:
        """Called once before training from scratch. token_counts [V]: how often each target token appears at
        loss-masked positions of the training data. A drafter with a reduced vocabulary picks it here."""

    def forward(self, batch: Mapping[str, torch.Tensor]) -> DraftOutput:
        """batch: input_ids [B, T], attention_mask [B, T], loss_mask [B, T], hidden {id: [B, T, D]}, final_hidden
        [B, T, D] (after the target's final norm), target_argmax [B, T], and when asked for, top_k (values, ids)
        [B, T, k]: the engine's names (drafters/served.py `Served`). In training it also carries sample_index [B],
        `epoch` and `seed` (ints: a drafter redraws random choices per epoch from (seed, epoch, sample index)) and,
        with several processes, `sum_over_processes` (a callable summing a tensor over all training processes) and
        `num_processes`, for losses normalised globally (drafters/losses.global_mean)."""
        raise NotImplementedError(f"drafter {self.kind!r} is not trainable")

    def loss(self, output: DraftOutput, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError(f"drafter {self.kind!r} is not trainable")

    # ---- inference: a stateful proposer ------------------------------------------------------------------
    def begin(self, context: DraftContext) -> None:
        raise NotImplementedError

    def propose(self, num_tokens: int) -> Proposal:
        raise NotImplementedError

    def commit(self, num_accepted: torch.Tensor, context: DraftContext) -> None:
        """num_accepted [B]: drafts accepted per row in the last round; context covers the verify forward.

        A commit may also follow another commit (or `begin`) with no `propose` in between: a catch-up, when the
        engine ran rounds without drafts (adaptive k = 0) and hands their verified tokens over at once, as a block
        [t_0, t_1..t_n-1] whose n - 1 "drafts" were all accepted (inference/engine/rounds.py `Deferred`)."""
        raise NotImplementedError

    # ---- inference: dropping finished rows ------------------------------------------------------------------------
    # The engine removes rows that finished from the batch (target KV cache and drafter state alike), so later rounds
    # cost what the rows still running cost. `row_state` names the attributes holding per-row inference state (dim 0
    # = batch, inside lists, dicts, dataclasses or objects with their own keep_rows); a drafter whose state is
    # elsewhere overrides keep_rows. A drafter declaring neither keeps every row to the end (never wrong, only slower).
    row_state: ClassVar[tuple[str, ...]] = ()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` [B'] (long, increasing) of the inference state, in that order."""
        for name in self.row_state:
            setattr(self, name, select_rows(getattr(self, name), rows))

    def drops_rows(self) -> bool:
        """Whether keep_rows is implemented (row_state declared or keep_rows overridden)."""
        return bool(self.row_state) or type(self).keep_rows is not Drafter.keep_rows

    # ---- inference: draft trees (optional; inference/engine/tree/draft.py) -----------------------------------------------------
    # A sequential drafter that can score several branches sets `expands_trees` and implements `expand_tree`, the
    # engine then grows EAGLE-2 dynamic trees with it; other drafters get DDTree trees over Proposal.log_probs.
    expands_trees: ClassVar[bool] = False

    def expand_tree(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Feed M tree nodes per row and return the log-distribution of each node's next token.

        Within one round, nodes are numbered in the order they are fed: node 0 is the root (the token the target
        just emitted), fed alone by the round's first call (tokens = next tokens [B, 1], parents = -1), which also
        drops the previous round's speculative state. Later calls feed nodes 1, 2, ...; parents [B, M] index nodes
        fed by earlier calls of the round. Each node sees the committed context and its own ancestors only.
        Args: tokens [B, M] target ids; parents [B, M] long. Returns: log-probabilities [B, M, V] (target vocab).
        """
        raise NotImplementedError(f"drafter {self.kind!r} does not expand trees")

    # ---- persistence: native (config.json + model.safetensors) here, serving layouts in the kind's export module ----
    # `export_module` is a kind's export.py, or None for a native-only kind. It provides EXPORT_FORMATS (the layouts
    # it writes besides native), detect_format(header) -> one of them or None, write(drafter, directory, fmt) and
    # read(directory, header, fmt, target_info) -> (config, state dict); save / load / detect_format dispatch to it.
    # Two more members, each None where the kind has none: export_checks(directory, target_info) -> the
    # `draftsmith doctor` rows (drafters/readers.Check) for a checkpoint in any of its formats, and
    # store_confidence_temperatures(directory, temperatures) writes `draftsmith calibrate`'s fit into one.
    export_module: ClassVar[ModuleType | None] = None

    @classmethod
    def formats(cls) -> tuple[str, ...]:
        """Every format `save` writes: "native" first, then the export layouts."""
        return ("native",) + (cls.export_module.EXPORT_FORMATS if cls.export_module else ())

    @classmethod
    def detect_format(cls, config: Mapping[str, Any]) -> str | None:
        """The format of a checkpoint's config.json dict: "native" for our header naming this kind, else the export
        layout the kind's export module recognises, else None."""
        if config.get(NATIVE_KIND_KEY) == cls.kind:
            return "native"
        return cls.export_module.detect_format(config) if cls.export_module else None

    def save(self, directory: str, fmt: str = "native") -> None:
        """Write `fmt`: "native" (config + state dict) or a serving layout of the kind's export module."""
        if fmt not in self.formats():
            raise ValueError(f"{self.kind} cannot export format {fmt!r}; it writes: {', '.join(self.formats())}")
        if fmt != "native":
            self.export_module.write(self, directory, fmt)
            return
        os.makedirs(directory, exist_ok=True)
        header = {
            NATIVE_KIND_KEY: self.kind,
            "drafter_config": to_dict(self.checkpoint_config()),
            "target": {
                "name_or_path": self.target_info.name_or_path,
                "hidden_size": self.target_info.hidden_size,
                "vocab_size": self.target_info.vocab_size,
                "num_layers": self.target_info.num_layers,
            },
            "target_layer_ids": list(self.target_layer_ids()),
        }
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(header, f, indent=2)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, os.path.join(directory, "model.safetensors"))

    def checkpoint_config(self) -> Any:
        """The config a native checkpoint records (a kind that resolves defaults at build time writes them here)."""
        return self.config

    @classmethod
    def load(cls, directory: str, target_info: TargetInfo) -> "Drafter":
        """Load any format `detect_format` recognises in directory/config.json, for `target_info`."""
        config, state = cls.read(directory, target_info)
        drafter = cls(config, target_info)
        drafter.load_state_dict(state, strict=True)
        return drafter

    @classmethod
    def read(cls, directory: str, target_info: TargetInfo) -> tuple[Any, dict]:
        """(config, state dict) of any format `detect_format` recognises in directory/config.json, for `target_info`,
        without building the drafter."""
        with open(os.path.join(directory, "config.json")) as f:
            header = json.load(f)
        fmt = cls.detect_format(header)
        if fmt is None:
            raise ValueError(f"{directory}: config.json is not a checkpoint of drafter kind {cls.kind!r} (neither its "
                             "native header nor an export layout it reads)")
        if fmt == "native":
            return cls.read_native(directory, header, target_info)
        return cls.export_module.read(directory, header, fmt, target_info)

    @classmethod
    def read_native(cls, directory: str, header: Mapping[str, Any], target_info: TargetInfo) -> tuple[Any, dict]:
        """(config, state dict) of the native checkpoint at `directory` whose config.json is `header`."""
        target = header.get("target", {})
        check_target_match(target_info, target.get("hidden_size"), target.get("vocab_size"), directory)
        config = from_dict(cls.Config, header["drafter_config"], "drafter")
        return config, load_file(os.path.join(directory, "model.safetensors"))


def select_rows(value, rows: torch.Tensor):
    """`value` with only batch rows `rows` [B'] kept (dim 0): tensors are indexed; lists, tuples, dicts and dataclass
    instances are rebuilt from their selected parts; an object with a `keep_rows` method selects itself in place;
    anything else (ints, floats, generators, None, 0-dim tensors) is not per row and stays as it is."""
    if isinstance(value, torch.Tensor):
        return value if value.dim() == 0 else value[rows.to(value.device)]
    if isinstance(value, (list, tuple)):
        return type(value)(select_rows(item, rows) for item in value)
    if isinstance(value, dict):
        return {key: select_rows(item, rows) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: select_rows(getattr(value, f.name), rows)
                                             for f in dataclasses.fields(value) if f.init})
    if hasattr(value, "keep_rows"):
        value.keep_rows(rows)
    return value


def check_target_match(target_info: TargetInfo, hidden_size: int, vocab_size: int, source: str) -> None:
    """Raise a ValueError naming the field when a drafter was built for another target."""
    if hidden_size != target_info.hidden_size:
        raise ValueError(
            f"{source}: hidden_size {hidden_size} does not match the target's hidden_size {target_info.hidden_size}"
        )
    if vocab_size != target_info.vocab_size:
        raise ValueError(
            f"{source}: vocab_size {vocab_size} does not match the target's vocab_size {target_info.vocab_size}"
        )
