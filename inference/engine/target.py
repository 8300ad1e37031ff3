"""TargetModel: the target LLM behind one interface for the engine and for training (docs/ARCHITECTURE.md).

Wraps any HF `AutoModelForCausalLM` whose decoder exposes `.layers` and `.norm` (Llama, Qwen2/3, Mistral, Gemma...);
of a vision-language checkpoint, its text model alone (target_files.language_model).
Hidden states are captured with forward hooks by the vLLM layer-id convention: id k < N is the residual
stream entering decoder layer k (= HF `hidden_states[k]`), id N is the final pre-norm output. Only the layers asked
for are captured; nothing else is materialised.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from drafters.base import FeatureRequest, TargetInfo, norm_eps
from drafters.ragged_lm import RaggedLM
from drafters.ragged_state import FamilyState, config_dict, decoder_of
from drafters.served import Served
from inference.assets.store import resolve_target
from inference.engine.backend import HfBackend, Prepared, Taps
from inference.engine.target_files import final_norm, load_head, load_model, load_tokenizer, meta_model

LOGIT_CHUNK_VALUES = 1 << 26  # logits `features` holds at once without return_logits: 256 MiB in fp32


def synchronize(device: torch.device) -> None:
    """Wait for queued accelerator work (CUDA or ROCm alike) so that wall-clock timings are honest; no-op on CPU."""
    if device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


@dataclass
class TargetFeatures:
    """One training forward's features, under the engine's names (drafters/served.py `Served`): hidden {id: [B, T, D]};
    final_hidden [B, T, D] after the final norm; argmax [B, T]; logits [B, T, V] or None; kv: the K/V the requested
    layers computed (RoPE applied, as a cache holds them), or None."""

    hidden: dict[int, torch.Tensor]
    final_hidden: torch.Tensor
    argmax: torch.Tensor
    logits: torch.Tensor | None = None
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # {layer: (keys, values) [B, H_kv, T, d]}


def unused_token_ids(tokenizer, vocab_size: int) -> tuple[int, ...] | None:
    """Vocabulary rows that no text and no chat-template rendering produces: rows past the tokenizer (padding of
    the embedding matrix) first, then added special tokens that are not bos/eos/pad/unk and do not appear in the
    chat template (reserved tokens such as a <|MASK|> row). None without a tokenizer (nothing can be checked)."""
    if tokenizer is None:
        return None
    rows = list(range(len(tokenizer), vocab_size))
    named = {getattr(tokenizer, f"{role}_token_id", None) for role in ("bos", "eos", "pad", "unk")}
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
    for token_id, token in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items()):
        if token.special and token_id < vocab_size and token_id not in named and token.content not in template:
            rows.append(token_id)
    return tuple(rows)


def default_device() -> torch.device:
    """The accelerator when there is one (CUDA, ROCm, XPU, MPS alike), else the CPU: where eval, calibrate and
    doctor load the target."""
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")


def resolve_dtype(name: str, device) -> torch.dtype:
    """A dtype name, or "auto": float32 on a CPU (bf16 matmuls are ~100x slower there), bfloat16 on an accelerator.
    The one reading of "auto" for recipes (target.dtype) and for eval, calibrate and doctor (--dtype)."""
    if name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return getattr(torch, name)


# "replicated": every weight in this process; "sharded": FSDP2 units across processes, the forward collective;
# "head": only the embeddings, final norm and lm_head (the decoder runs in vLLM, or features come from a cache)
TARGET_PLACEMENTS = ("replicated", "sharded", "head")


class TargetModel:
    """The frozen target. `runner` holds the engine's KV cache (one generation at a time).

    The engine's seam (all it calls; a target family with other state, such as recurrent layers or sliding windows,
    implements these and the loop does not change): `prefill` starts a generation, `extend` verifies a block after
    each row's sequence, `mark` / `keep_after` roll a row back to a prefix of what was fed since the mark,
    `keep_rows` drops finished rows, `lengths` / `block_positions` say where each row's sequence stands. Training
    uses `features`; tree verification (inference/engine/tree/target.py) calls `extend_tree` and `keep_path`.

    backend: what runs the forward (inference/engine/backend.py): the model's own by default; `CpuBackend`
    (inference/engine/cpu/) the CPU fast path. `prepared` says what it changed (`path`, `decode`, `lean_refused`).
    """

    def __init__(self, model, tokenizer=None, name_or_path: str = "", backend=None,
                 placement: str = "replicated"):
        if placement not in TARGET_PLACEMENTS:
            raise ValueError(f"placement {placement!r}: choose one of {', '.join(TARGET_PLACEMENTS)}")
        # where the weights are (TARGET_PLACEMENTS); `whole` says whether this process can run the forward alone
        self.placement = placement
        # first: it refuses a family the engine cannot roll back, in one line, where the decoder can run at all (not
        # for the head-only placements and config-only plans, whose layers stay on the meta device)
        family = FamilyState(model, decodes=not any(p.is_meta for p in decoder_of(model).layers.parameters()))
        self.one_row = family.anchored  # decoded one row at a time, in chains (ragged_state.one_row_refusal)
        self.model = model.eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.prepared: Prepared = (backend or HfBackend()).prepare(self.model)
        self.tokenizer = tokenizer
        self.name_or_path = name_or_path or getattr(model.config, "_name_or_path", "")
        self.runner = RaggedLM(model, block_forward=self.prepared.block_forward, family=family)
        decoder = decoder_of(model)
        self.layers = decoder.layers
        self.final_norm = final_norm(decoder)
        self.num_layers = len(self.layers)
        self._info: TargetInfo | None = None

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype=torch.float32, device="cpu", backend=None,
                        trust_remote_code: bool = False) -> "TargetModel":
        """Load a target by name (the embedded default) or HF directory; never downloads. backend: what runs its
        forward (the model's own by default; `path` and `decode` say what runs). trust_remote_code: run the tokenizer
        code the model ships (target_files.load_tokenizer); the model is always built from transformers' classes."""
        path = resolve_target(name_or_path)
        tokenizer = load_tokenizer(path, trust_remote_code)  # first: a refused tokenizer loads no weights
        model = load_model(path, dtype).to(device)
        return cls(model, tokenizer, name_or_path=path, backend=backend)

    @classmethod
    def from_config(cls, name_or_path: str, *, dtype=torch.float32, trust_remote_code: bool = False) -> "TargetModel":
        """The target's modules on the meta device, built from its config.json, with its tokenizer: every parameter's
        shape and dtype and no weight read or allocated (`draftsmith estimate --config-only` plans a target too
        large for this machine from its config and tokenizer files alone). It cannot run a forward."""
        path = resolve_target(name_or_path)
        return cls(meta_model(path, dtype), load_tokenizer(path, trust_remote_code), name_or_path=path)

    def serve(self, drafter):
        """`drafter` as this target serves it at inference (eval, doctor, calibrate; None passes through): in eval
        mode, on the target's device, its floating parameters in the target's dtype (a drafter read from disk is
        built on the CPU in float32: `place_like`), and its linears run as the backend runs the target's
        (`Prepared.serve`: on the CPU fast path, by this machine's chosen kernels). Training never calls this: it
        keeps float32 master weights (train/build.py). Returns the drafter; `drafter_kernels(drafter)` says what
        runs (None: its own linears)."""
        if not isinstance(drafter, torch.nn.Module):
            return drafter
        embed = self.target_info().embed_weight
        self.place_like(drafter, embed.device, embed.dtype).eval()
        self.prepared.serve(drafter)
        return drafter

    def drafter_kernels(self, drafter):
        """The kernel record of a drafter `serve` ran by the backend's kernels (None: its own linears run)."""
        return self.prepared.drafter_kernels(drafter) if isinstance(drafter, torch.nn.Module) else None

    @staticmethod
    def place_like(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        """`module`, in place, on `device` with its floating parameters in `dtype`. Buffers move but keep their
        dtype, as transformers keeps them when it loads a model in bf16: integer and bool ones (a draft vocabulary's
        d2t, t2d) must stay what they are, and a float one (a rotary inv_freq) would lose precision in bf16. A no-op
        where the module already sits there."""
        module.to(device)
        for parameter in module.parameters():
            if parameter.is_floating_point() and parameter.dtype != dtype:
                parameter.data = parameter.data.to(dtype)  # the same Parameter object: tied weights stay tied
        return module

    @property
    def path(self) -> str:
        """Which linears run: "hf" (the model's own modules) or the backend's ("fast-cpu-linear")."""
        return self.prepared.path

    @property
    def decode(self) -> str:
        """Which forward runs the blocks after the prefill: "lean" (the backend's) or "hf"."""
        return "lean" if self.prepared.block_forward is not None else "hf"

    @property
    def lean_refused(self) -> str | None:
        """Why the backend runs no block forward of its own (None where it does)."""
        return self.prepared.block_refused

    @property
    def whole(self) -> bool:
        """True when this process holds every weight and can run the whole forward alone."""
        return self.placement == "replicated"

    def declare_sharded(self) -> None:
        """The decoder's modules are about to be sharded across processes (train/features/placement.shard_target
        calls this first): no process runs the forward alone, and the TargetInfo drops its map of every weight
        (used by warm starts at drafter init only), which would keep the unsharded tensors alive. The head's
        tensors (embed_weight, lm_head_weight, final_norm_weight) stay: sharding leaves them whole."""
        self.placement = "sharded"
        self._info = dataclasses.replace(self.target_info(), weights={})

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad id, else 0: padded positions are masked out of attention and loss, so any id works."""
        pad = getattr(self.tokenizer, "pad_token_id", None) if self.tokenizer is not None else None
        return 0 if pad is None else int(pad)

    def feature_dtype(self, name: str) -> torch.dtype:
        """A recipe's features.dtype: "auto" stores features in the dtype the target computes in, else that dtype."""
        return self.model.dtype if name == "auto" else getattr(torch, name)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def target_info(self) -> TargetInfo:
        """Built once: the tensors are shared references, so this costs nothing after the first call."""
        if self._info is None:
            self._info = self._build_info()
        return self._info

    def _build_info(self) -> TargetInfo:
        config = self.model.config
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return TargetInfo(
            name_or_path=self.name_or_path,
            hidden_size=config.hidden_size,
            vocab_size=self.model.get_output_embeddings().weight.shape[0],
            num_layers=self.num_layers,
            embed_weight=self.model.get_input_embeddings().weight,
            lm_head_weight=self.model.get_output_embeddings().weight,
            final_norm_weight=getattr(self.final_norm, "weight", None),
            rms_norm_eps=norm_eps(config),
            eos_token_ids=eos_ids,
            pad_token_id=getattr(config, "pad_token_id", None),
            config=config_dict(config),
            weights=dict(self.model.state_dict(keep_vars=False)),
            unused_token_ids=unused_token_ids(self.tokenizer, self.model.get_output_embeddings().weight.shape[0]),
        )

    def check_request(self, request: FeatureRequest) -> None:
        """Raise ValueError naming the field when a drafter asks for what this target does not have."""
        request.check(self.num_layers, self.target_info().vocab_size)
        self.runner.family.check_kv_layers(request.kv_layers)

    def check_layer_ids(self, layer_ids) -> None:
        self.check_request(FeatureRequest(layer_ids=tuple(layer_ids)))

    @contextmanager
    def capture(self, layer_ids, want_last_hidden: bool = False):
        """Yield the Taps (inference/engine/backend.py) of the forwards in the block: {id: [B, S, D]} and, with
        want_last_hidden, "last" -> the normed output. The model's own modules fill it through hooks; a block
        forward, which calls none of them, is handed it by the caller (`extend`, `extend_tree`)."""
        self.check_layer_ids(layer_ids)
        taps = Taps(frozenset(int(i) for i in layer_ids), want_last_hidden)
        handles = []

        def grab(layer_id):
            def hook(module, args, kwargs):
                taps.layer_input(layer_id, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

            return hook

        for layer_id in layer_ids:
            module = self.layers[layer_id] if layer_id < self.num_layers else self.final_norm
            handles.append(module.register_forward_pre_hook(grab(int(layer_id)), with_kwargs=True))
        if want_last_hidden:
            handles.append(self.final_norm.register_forward_hook(lambda m, a, out: taps.final(out)))
        try:
            yield taps
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def features(self, input_ids, attention_mask, layer_ids, return_logits: bool = False,
                 kv_layers=()) -> TargetFeatures:
        """One forward for training. input_ids, attention_mask [B, T] (right padding). With kv_layers, the forward
        fills a fresh full-length DynamicCache (no sliding-window trimming) and the K/V of those decoder layers are
        returned from it: the same forward gives the features and the K/V, as the engine's cache holds them.

        Without return_logits the [B, T, V] logits are never materialised: the model computes the last position's
        only, and the argmax comes from the lm_head applied to LOGIT_CHUNK_VALUES / V positions at a time (a
        Llama-3 8B batch of 8 x 4k tokens would otherwise hold 8 GB of bf16 logits). Softcapping and logit scales
        are monotonic, so this is the model's own argmax. The forward always runs to the end: training serves the
        final hidden state (the teacher) and the argmax with every batch."""
        self.check_request(FeatureRequest(layer_ids=tuple(layer_ids), kv_layers=tuple(kv_layers)))
        cache = {self.runner.cache_arg: self.runner.family.new_cache()} if kv_layers else {}  # every slot kept
        keep = {} if return_logits else {"logits_to_keep": self.runner.family.logits_to_keep(1, True)}
        with self.capture(layer_ids, want_last_hidden=True) as taps:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=bool(kv_layers),
                                **cache, **keep).logits
        captured = taps.values
        hidden = {layer_id: captured[layer_id] for layer_id in layer_ids}
        kv = None
        if kv_layers:
            layers = cache[self.runner.cache_arg].layers
            kv = {int(i): (layers[i].keys, layers[i].values) for i in kv_layers}
        if not return_logits:
            return TargetFeatures(hidden, captured["last"], self.chunked_argmax(captured["last"]), None, kv)
        return TargetFeatures(hidden, captured["last"], logits.argmax(-1), logits, kv)

    def chunked_argmax(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """argmax of lm_head(last_hidden [B, T, D]) -> [B, T], holding at most LOGIT_CHUNK_VALUES logits at once."""
        head = self.model.get_output_embeddings()
        flat = last_hidden.reshape(-1, last_hidden.shape[-1])  # [B*T, D]
        rows = max(1, LOGIT_CHUNK_VALUES // head.weight.shape[0])
        argmax = torch.cat([head(flat[i:i + rows]).argmax(-1) for i in range(0, flat.shape[0], rows)])
        return argmax.view(last_hidden.shape[:-1])

    # ---- engine: KV-cached forwards ------------------------------------------------------------------------
    def prefill(self, input_ids, attention_mask,
                request: FeatureRequest | None = None) -> tuple[torch.Tensor, Served]:
        """Start a generation: input_ids [B, S] left-padded, attention_mask [B, S].
        Returns logits [B, 1, V] at the last position (the only ones a generation needs) and the served features
        (see `extend`)."""
        self.runner.reset()
        request = request or FeatureRequest()
        keep = 0 if request.top_k_logits else 1  # top-k features need every position's logits
        logits, served = self.extend(input_ids, request, valid=attention_mask.bool(), logits_to_keep=keep)
        return logits[:, -1:], served

    def extend(self, input_ids, request: FeatureRequest | None = None, valid=None,
               logits_to_keep=0) -> tuple[torch.Tensor, Served]:
        """Verify forward over a block [B, S] appended after each row's sequence.

        Returns:
            logits [B, S, V] and the features `request` asks for (drafters/served.py `Served`: hidden {id: [B, S,
            D]}, final_hidden [B, S, D], top_k (values, ids) [B, S, k], target_kv {layer: (keys, values)} with
            target_kv_valid [B, L]). The KV tensors are the live cache: read them before the next forward.
        """
        request = request or FeatureRequest()
        with self.capture(request.layer_ids, want_last_hidden=request.final_hidden) as taps:
            logits = self.runner.extend(input_ids, valid, logits_to_keep, taps=taps)
        served = self._served(request, taps.values, logits)
        if request.kv_layers:
            served = served.with_kv(self.kv_view(request.kv_layers))
        return logits, served

    def extend_tree(self, input_ids, ancestors, depth, parents,
                    request: FeatureRequest | None = None) -> tuple[torch.Tensor, Served]:
        """Verify forward over the N nodes of a tree [B, N] after each row's sequence (RaggedLM.extend_tree: node i
        sees its ancestors, at position length + depth). Returns logits [B, N, V] (row i: the target's distribution
        after the root-to-i path) and the features `request` asks for over the nodes, as `extend` serves them (no
        KV view: a tree's slots are not a sequence until `keep_path`)."""
        request = request or FeatureRequest()
        with self.capture(request.layer_ids, want_last_hidden=request.final_hidden) as taps:
            logits = self.runner.extend_tree(input_ids, ancestors, depth, parents, taps=taps)
        return logits, self._served(request, taps.values, logits)

    @staticmethod
    def _served(request: FeatureRequest, captured: dict, logits: torch.Tensor) -> Served:
        return Served({layer_id: captured[layer_id] for layer_id in request.layer_ids},
                      captured["last"] if request.final_hidden else None,
                      tuple(logits.topk(request.top_k_logits, dim=-1)) if request.top_k_logits else None)

    def kv_view(self, kv_layers) -> dict:
        """The live KV cache of decoder layers `kv_layers`: target_kv {layer: (keys, values) [B, H_kv, L, d]} and
        target_kv_valid [B, L] (which slots belong to each row's sequence)."""
        layers = self.runner.cache.layers
        return {"target_kv": {i: (layers[i].keys, layers[i].values) for i in kv_layers},
                "target_kv_valid": self.runner.slot_mask.bool()}

    def mark(self) -> int:
        """A point to roll back to with `keep_after` (taken before a verify forward)."""
        return self.runner.mark()

    def keep_after(self, mark: int, keep: torch.Tensor) -> None:
        """Roll back: row b keeps the first keep[b] tokens fed since `mark` (crop on rejection)."""
        self.runner.keep_after(mark, keep)

    def keep_path(self, mark: int, path: torch.Tensor, keep: torch.Tensor) -> None:
        """Roll a tree block fed since `mark` back to a path: row b keeps its first keep[b] nodes of path[b] [B, W]
        (RaggedLM.keep_path); afterwards the cache is the path's, fed as a chain."""
        self.runner.keep_path(mark, path, keep)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` [B'] (long, increasing) of the generation: finished rows leave the batch."""
        self.runner.keep_rows(rows)

    @property
    def lengths(self) -> torch.Tensor:
        """[B] tokens of each row's sequence the target holds (= the position id of its next token)."""
        return self.runner.lengths

    def block_positions(self, valid: torch.Tensor) -> torch.Tensor:
        """Position ids [B, W] of a block just verified and rolled back, valid [B, W] a prefix per row of what each
        row kept: its kept tokens are the last ones of its sequence, so position j is length - kept + j."""
        steps = torch.arange(valid.shape[1], device=valid.device)
        return self.lengths[:, None] - valid.long().sum(-1, keepdim=True) + steps


def head_target(path: str, dtype: torch.dtype, device, trust_remote_code: bool = False):
    """The target with only its input embeddings, final norm and lm_head loaded (on `device`) from its safetensors
    files; every other weight stays on the meta device, so this process never holds the decoder layers (the served
    placement, the vLLM feature extractor, `draftsmith export`)."""
    tokenizer = load_tokenizer(path, trust_remote_code)
    model = meta_model(path, dtype)
    load_head(model, path, dtype, device)
    return TargetModel(model, tokenizer, name_or_path=path, placement="head")
