"""Per-row rollback of a linear-attention layer's state (drafters/ragged_state.py): a recorder wrapped around the
layer's mixer keeps the conv and recurrent state after every position of a verify block, and a row then takes the
state at its accepted count. The mixers are gated DeltaNet's (Qwen3.5 / 3.6, Qwen3-Next) and Mamba's (Nemotron-H and
the other hybrids transformers caches as `linear_attention`): both update the layer's two states in place through
the cache, one token at a time on their single-token path, which is all the recorder relies on.
"""

from __future__ import annotations

import inspect

import torch

CACHE_NAMES = ("cache", "cache_params", "past_key_values")


class LinearStateRecorder:
    """Wraps one linear-attention mixer's forward. Outside a recorded block it is the mixer itself.

    snapshot: every recorded position is fed alone through the mixer's single-token path (transformers' own
    causal_conv1d_update, then the recurrent gated delta rule or Mamba's selective state update) and the conv /
    recurrent state after it is kept.
    rerun: a block without invalid slots runs as one chunked call (one with invalid slots is stepped); the inputs are
    kept, and `select` restores the state before the blocks and steps the inputs again up to the furthest kept
    position.
    """

    def __init__(self, mixer, layer_idx: int):
        self.mixer, self.layer_idx, self.original = mixer, layer_idx, mixer.forward
        # the mixer's keyword for the cache: `cache`, or in transformers 5.17 and before `cache_params` (LFM2's:
        # `past_key_values`)
        names = inspect.signature(mixer.forward).parameters
        self.cache_name = next((name for name in CACHE_NAMES if name in names), "cache")
        self.mechanism, self.recording = "snapshot", False
        self.clear()
        mixer.forward = self.forward
        mixer._draftsmith_recorder = self

    def clear(self) -> None:
        # per position (0 = before): the layer's states, (conv [B, C, K], recurrent [B, H, d_k, d_v] or Mamba-2's
        # [B, H, head_dim, state]); a short convolution (LFM2) has the conv state alone
        self.records: list[tuple[torch.Tensor, ...]] = []
        self.inputs: list[torch.Tensor] = []  # rerun: the mixer's inputs [B, S, D] per block
        self.valids: list[torch.Tensor | None] = []
        self.valid = self.parents = None
        self.recording = False

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.records = [tuple(state[rows] for state in record) for record in self.records]
        self.inputs = [block[rows] for block in self.inputs]
        self.valids = [None if valid is None else valid[rows] for valid in self.valids]

    def _states(self, cache) -> tuple[torch.Tensor, ...]:
        layer = cache.layers[self.layer_idx]
        return tuple(state for state in (layer.conv_states[0], layer.recurrent_states[0]) if state is not None)

    def _keep(self, states: tuple[torch.Tensor, ...]) -> None:
        self.records.append(tuple(state.clone() for state in states))

    def begin(self, cache, valid, parents) -> None:
        # the prefill: nothing to roll back to (the layer's own flag: Cache.get_recurrent_state, which reads it,
        # is newer than transformers 5.17)
        if not cache.layers[self.layer_idx].has_previous_state[0]:
            return
        if not self.records:
            self._keep(self._states(cache))
        self.valid, self.parents, self.recording = valid, parents, True

    def call(self, hidden_states, cache, attention_mask, kwargs):
        """The mixer's own forward."""
        return self.original(hidden_states=hidden_states, attention_mask=attention_mask, **{self.cache_name: cache},
                             **kwargs)

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        for name in CACHE_NAMES[1:]:
            cache = kwargs.pop(name, cache)
        if not self.recording or cache is None:
            return self.call(hidden_states, cache, attention_mask, kwargs)
        if self.mechanism == "rerun" and self.parents is None:
            self.inputs.append(hidden_states)
            self.valids.append(self.valid)
            if self.valid is None:  # a chunked call advances every slot, so only a block without invalid slots
                return self.call(hidden_states, cache, attention_mask, kwargs)
        return self._step(hidden_states, cache, self.valid, kwargs)

    def _step(self, hidden_states, cache, valid, kwargs, upto: int | None = None):
        """Feed positions one at a time through the mixer's single-token path, appending the states after each."""
        states = self._states(cache)
        outputs = []
        for j in range(hidden_states.shape[1] if upto is None else upto):
            if self.parents is not None:  # tree: start from the parent's state (record 0 = before the block)
                self._load(cache, [row[j] + len(self.records) - j for row in self.parents])
            before = tuple(state.clone() for state in states) if valid is not None else None
            outputs.append(self.call(hidden_states[:, j:j + 1], cache, None, kwargs))
            if before is not None:  # an invalid slot leaves the row's state as it was
                keep = valid[:, j].to(states[0].device)
                for state, old in zip(states, before):
                    state.copy_(torch.where(keep.view(-1, *[1] * (state.dim() - 1)), state, old))
            self._keep(states)
        return torch.cat(outputs, dim=1)

    def _load(self, cache, index: list[int]) -> None:
        """Row b's states := record index[b] (one row copied per row, never the whole record stack)."""
        for k, state in enumerate(self._states(cache)):
            state.copy_(torch.stack([self.records[i][k][b] for b, i in enumerate(index)]))

    def select(self, cache, index: list[int]) -> None:
        """Row b's states := record index[b]; then the records are dropped."""
        if not self.records:
            return
        if self.inputs:
            self._rerun(cache, index)
        self._load(cache, index)
        self.clear()

    def _rerun(self, cache, index: list[int]) -> None:
        """Restore the states before the blocks and step their inputs again up to the furthest kept position."""
        for state, saved in zip(self._states(cache), self.records[0]):
            state.copy_(saved)
        self.records = self.records[:1]
        inputs = torch.cat(self.inputs, dim=1)
        valid = None if all(v is None for v in self.valids) else torch.cat(
            [torch.ones(b.shape[:2], dtype=torch.bool, device=b.device) if v is None else v
             for b, v in zip(self.inputs, self.valids)], dim=1)
        self.inputs, self.valid = [], None
        upto = max(index)
        if upto > 0:
            self._step(inputs, cache, valid, {}, upto=upto)
