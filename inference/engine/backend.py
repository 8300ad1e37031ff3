"""The seam between the target and the code that runs its forward: a backend prepares a model and says what it changed.

`TargetModel(model, tokenizer, backend=...)` refuses a family the engine cannot roll back, then calls
`backend.prepare(model)` once and keeps the `Prepared` it returns: which linears run (`path`), the forward that runs the
blocks after the prefill (`block_forward`, handed to the ragged cache when it is built; None: the model's own), the
kernel record as data, how a drafter the target serves is run alike (`serve`), and `undo`. `HfBackend` (the default)
changes nothing; the CPU fast path is inference/engine/cpu/ (`CpuBackend`); an accelerator backend (a compiled decode,
graphs) is a sibling of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

HF_PATH = "hf"  # the model's own modules run every linear
OFF = "the lean forward is off"  # why no block forward, where the backend builds none


@dataclass
class Taps:
    """The features one target forward records, whichever forward runs: the input hidden state of each layer id in
    `ids` (vLLM's convention: id = number of layers is the final norm's input) and, when `last`, the normed final
    hidden state. The model's own forward fills it through hooks (TargetModel.capture); a backend's block forward,
    which calls no layer module, fills it through its `taps` argument. One record, one reader (TargetModel)."""

    ids: frozenset
    last: bool = False
    values: dict = field(default_factory=dict)

    def layer_input(self, layer_id: int, hidden) -> None:
        if layer_id in self.ids:
            self.values[layer_id] = hidden

    def final(self, hidden) -> None:
        if self.last:
            self.values["last"] = hidden

    @property
    def records(self) -> bool:
        return bool(self.ids) or self.last


@dataclass
class Prepared:
    """What a backend changed on a model; this base changed nothing (the model's own forward runs everything).

    path: which linears run ("hf", or the backend's name). block_forward: the forward of a block after the prefill,
    `forward(input_ids, position_ids, slot_mask, cache, logits_to_keep=0, mask=None, taps=None) -> logits`, filling
    `taps` (a `Taps`) as it goes (inference/engine/cpu/lean.py), or None. block_refused: why there is none (None
    when there is one). kernels: the backend's record of what it chose, as data (None: nothing chosen)."""

    path: str = HF_PATH
    block_forward: Any = None
    block_refused: str | None = OFF
    kernels: Any = None

    def serve(self, drafter: nn.Module) -> None:
        """Run `drafter`'s linears the way the target's run, where the backend does that (here: nothing to do)."""

    def drafter_kernels(self, drafter: nn.Module) -> Any:
        """The kernel record of a drafter `serve` prepared (None: its own linears run)."""
        return None

    def undo(self) -> None:
        """Give the model (and every drafter served) back as it was before `prepare`."""


class HfBackend:
    """The model's own forward, untouched: the default, and what runs on an accelerator today."""

    name = HF_PATH

    def prepare(self, model: nn.Module) -> Prepared:
        return Prepared()
