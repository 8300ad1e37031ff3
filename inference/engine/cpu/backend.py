"""The CPU backend: the target's linears by the kernels fastest on this machine (fastpath.py, kernels.py) and the lean
block forward over its weights (lean.py), where they apply; elsewhere the model's own forward, with the reason.

`CpuBackend(cache_dir).prepare(model)` changes the model in place (its nn.Linear modules become FastLinears sharing
their parameters; the lean forward stacks q/k/v and gate/up) and returns a `CpuPrepared` that says what it changed and
can `undo` it. The kernel timings are read from and written to `cache_dir` (users: kernels.CACHE_DIR; tests: a
temporary directory), so where they live is the caller's choice.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from torch import nn

from inference.engine.backend import HF_PATH, OFF, Prepared
from inference.engine.cpu import fastpath, kernels
from inference.engine.cpu.lean import LeanDecoder


@dataclass
class CpuPrepared(Prepared):
    """What CpuBackend changed; `serve` runs a drafter's linears by this machine's kernels too."""

    model: nn.Module | None = None
    cache_dir: str = kernels.CACHE_DIR
    served: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    def serve(self, drafter: nn.Module) -> None:
        """Where the target's linears run the fast path, `drafter`'s own nn.Linear layers and the frozen target
        tensors it declares (Drafter.frozen_tensors: its shared lm_head runs by the target's very FastLinear) run by
        the chosen kernels too: a draft step is a few small-row linears, the sizes of a decode step. FastLinear
        still runs F.linear where gradients are asked for. Once per drafter; a drafter the fast path does not apply
        to keeps its own linears."""
        if self.path != fastpath.FAST_PATH or drafter in self.served or fastpath.unsupported_reason(drafter):
            return
        self.served[drafter] = fastpath.enable(drafter, self.cache_dir, share=self.model, frozen=_frozen(drafter))

    def drafter_kernels(self, drafter: nn.Module) -> fastpath.KernelRecord | None:
        return self.served.get(drafter)

    def undo(self) -> None:
        """nn.Linear back in the model and every drafter served (the same parameters), the stacked projections'
        weights in storages of their own again, and no block forward."""
        for drafter in list(self.served.keys()):
            fastpath.disable(drafter, _frozen(drafter))
        self.served.clear()
        if self.block_forward is not None:
            fastpath.unstack(self.block_forward.stacked_groups)
        fastpath.disable(self.model)
        self.path, self.block_forward, self.block_refused, self.kernels = HF_PATH, None, OFF, None


class CpuBackend:
    """The CPU fast path. cache_dir: where kernel timings are kept (read back by later runs on this machine).
    lean: build the lean block forward (the default; False keeps HF's forward over the fast linears)."""

    name = fastpath.FAST_PATH

    def __init__(self, cache_dir: str | None = None, lean: bool = True):
        self.cache_dir, self.lean = kernels.CACHE_DIR if cache_dir is None else cache_dir, lean  # read when built

    def prepare(self, model: nn.Module) -> CpuPrepared:
        """The fast linears where `fastpath.unsupported_reason` allows (CPU, float32, oneDNN), then the lean
        forward where the model is on the CPU and its structure and probe allow (lean.py); the reasons otherwise."""
        prepared = CpuPrepared(model=model, cache_dir=self.cache_dir)
        if fastpath.unsupported_reason(model) is None:
            prepared.kernels = fastpath.enable(model, self.cache_dir)
            prepared.path = fastpath.FAST_PATH
        device = next(model.parameters()).device
        if not self.lean:
            return prepared
        if device.type != "cpu":  # CPU-tuned code whose probe bounds float32's sums: neither built nor probed
            prepared.block_refused = f"the lean forward is CPU code; the target is on {device.type}"
            return prepared
        prepared.block_forward, prepared.block_refused = LeanDecoder.build(model, self.cache_dir)
        if prepared.block_forward is not None and prepared.kernels is not None:
            prepared.kernels.stacked = prepared.block_forward.stacked_kernels
        return prepared


def _frozen(drafter: nn.Module) -> list:
    """The frozen target tensors `drafter` declares (drafters/base.Drafter.frozen_tensors; none for other modules)."""
    declared = getattr(drafter, "frozen_tensors", None)
    return declared() if declared is not None else []
