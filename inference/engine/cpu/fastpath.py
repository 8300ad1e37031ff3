"""The target's linears run by the kernel that is fastest, on this machine, for the few rows a decode step or a
verify feeds (CPU, float32).

A batch-1 decode step multiplies 1 row by every weight, a verify of W drafts W + 1 rows. MKL's sgemm on HF's
[out, in] weights runs these sizes far below the memory roofline on some CPUs and near it on others, and each CPU
ranks the alternatives (the weight transposed, oneDNN's prepacked linear with or without padding, MKL's packed
GEMM) differently. So `enable` times them per weight shape and row count on the model's own weights
(inference/engine/cpu/kernels.py, cached per CPU model, torch and thread count) and each FastLinear runs the chosen
kernel for its row count; more than kernels.MAX_ROWS rows (a prefill, training features) run the model's own
F.linear. A FastLinear holds only the weight copies its plan uses. The weights stay the model's parameters (so
`state_dict`, tied embeddings and training are untouched). Outputs differ from F.linear's only by the summation
order of float32 dot products.

`enable(model, cache_dir)` swaps every nn.Linear of the model for a FastLinear in place and returns what it chose and
measured (a `KernelRecord`); `disable` puts nn.Linear back. Whether it applies (an accelerator, a dtype other than
float32, no oneDNN, no nn.Linear: not) is `unsupported_reason`; the CPU backend (backend.py) asks it first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from drafters.layers import FrozenTargetTensors
from inference.engine.cpu import kernels
from inference.engine.cpu.machine import cpu_model

FAST_PATH = "fast-cpu-linear"


@dataclass
class KernelRecord:
    """What `enable` chose for a model: the CPU, the threads, the seconds the choice took (about 0 when cached), per
    weight shape "OxI[+bias]" the kernel of each row count with the median milliseconds measured (`shapes`), whether
    each frozen target tensor a drafter multiplies by ran by the target's own FastLinear ("shared") or its own
    ("own"), and the stacked projections' shapes (`stacked`, where the lean forward stacked them)."""

    seconds: float
    threads: int
    cpu: str
    shapes: dict
    frozen: dict
    stacked: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The record as eval writes it (`stacked` only where there is one)."""
        record = {"seconds": self.seconds, "threads": self.threads, "cpu": self.cpu, "shapes": self.shapes,
                  "frozen": self.frozen}
        return {**record, "stacked": self.stacked} if self.stacked else record


class FastLinear(nn.Module):
    """nn.Linear's forward (y = x W^T + b), each row count up to kernels.MAX_ROWS run by the kernel `plan` names.
    `weight` and `bias` are the original module's parameters (shared, not copied); `copies` the layouts the plan
    reads (opaque oneDNN / MKL tensors among them: attributes, not buffers, as `.to` and state_dict cannot use them)."""

    def __init__(self, linear: nn.Linear, plan: list[str]):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.replan(plan)

    def replan(self, plan: list[str]) -> None:
        """Run each row count by the kernel `plan` names, holding the layouts it reads and no others."""
        self.plan = plan
        self.copies = {kernels.KERNELS[name].layout: None for name in plan}
        for layout in self.copies:
            self.copies[layout] = kernels.make_layout(layout, self.weight)
        self._runs = [(kernels.KERNELS[name].run, self.copies[kernels.KERNELS[name].layout]) for name in plan]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > kernels.MAX_ROWS or rows == 0 or torch.is_grad_enabled() and self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        run, copy = self._runs[rows]
        out = run(x.reshape(rows, self.in_features).contiguous(), copy, self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernels={sorted(set(self.plan[1:]))}")


def unsupported_reason(model) -> str | None:
    """Why the fast path does not apply to `model` (None when it does)."""
    parameter = next(model.parameters(), None)
    if parameter is None:
        return "the model has no parameters"
    if parameter.device.type != "cpu":
        return f"device {parameter.device.type} (the fast path is for CPU; accelerators run the model's own kernels)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return "the model has no nn.Linear"
    dtypes = {m.weight.dtype for m in linears}
    if dtypes != {torch.float32}:
        return f"linear weights in {sorted(str(d) for d in dtypes)} (the fast path is float32)"
    return None


def enable(model, cache_dir: str, share=None, frozen: list | None = None) -> KernelRecord:
    """Swap every nn.Linear of `model` for a FastLinear (in place; the caller checked `unsupported_reason`), and serve
    the `frozen` target tensors it multiplies by (drafters/layers.FrozenTargetTensors.HEADS of the holders the drafter
    declares, Drafter.frozen_tensors: e.g. a shared lm_head) by FastLinears too: the very FastLinear of module `share`
    (the target) that holds the same tensor where there is one, so no layout is held twice. Kernel choices are read
    from and written to `cache_dir` (kernels.choose). Returns what it chose."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    like = next(model.parameters())
    shared = {_storage(m.weight): m for m in share.modules() if isinstance(m, FastLinear)} if share is not None else {}
    served = []  # (holder, tensor name, storage key, tensor)
    for holder in frozen or ():
        for name in FrozenTargetTensors.HEADS:
            weight = holder.get(name, like)
            served.append((holder, name, _storage(weight), weight))
    own = {key: _frozen_linear(weight) for _, _, key, weight in served if key not in shared}
    started = time.perf_counter()
    choices = kernels.choose(by_shape([child for _, _, child in swaps] + list(own.values())), cache_dir)
    for parent, name, child in swaps:
        setattr(parent, name, FastLinear(child, choices[shape_of(child)]["plan"]))
    serving = {**{key: FastLinear(linear, choices[shape_of(linear)]["plan"]) for key, linear in own.items()}, **shared}
    for holder, name, key, _ in served:
        holder.serve(name, serving[key])
    return KernelRecord(seconds=time.perf_counter() - started, threads=torch.get_num_threads(), cpu=cpu_model(),
                        shapes=shape_record(choices),
                        frozen={name: "shared" if key in shared else "own" for _, name, key, _ in served})


def by_shape(linears: list[nn.Linear]) -> dict[tuple[int, int, bool], list[nn.Linear]]:
    """`linears` grouped by weight shape (kernels are timed and chosen per shape)."""
    grouped: dict[tuple[int, int, bool], list[nn.Linear]] = {}
    for linear in linears:
        grouped.setdefault(shape_of(linear), []).append(linear)
    return grouped


def shape_record(choices: dict) -> dict:
    return {f"{o}x{i}{'+bias' if b else ''}": choice for (o, i, b), choice in choices.items()}


def stack(groups: list[list[FastLinear]], cache_dir: str) -> tuple[list[FastLinear], dict]:
    """One FastLinear per group of FastLinears that read the same input (a layer's q, k and v projections; its gate
    and up): x times the members' weights stacked [sum of outs, in], so a decode step makes one call and one pass
    over the weights where it made three (what vLLM's merged projections do). The members' parameters become views
    into the stacked weight (one copy of the weights, state_dict unchanged; `unstack` gives each its own storage back)
    and keep only F.linear (no layout): whoever calls the stacked module (the lean forward) no longer calls them, and
    the model's own forward then runs them at a prefill's row counts. Each stacked shape's kernels are chosen as
    `enable` chooses them; a missing bias in a group with biases is zeros. Returns the stacked modules in the order
    of `groups` and the choices per stacked shape (KernelRecord.stacked)."""
    stacked = []
    with torch.no_grad():
        for group in groups:
            weight = torch.cat([member.weight for member in group])
            biases = [member.bias for member in group]
            bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else member.weight.new_zeros(member.out_features)
                 for b, member in zip(biases, group)])
            start = 0
            for member in group:
                stop = start + member.out_features
                member.weight.data = weight[start:stop]
                if member.bias is not None:
                    member.bias.data = bias[start:stop]
                member.replan([kernels.DEFAULT] * (kernels.MAX_ROWS + 1))
                start = stop
            linear = _frozen_linear(weight)
            linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
            stacked.append(linear)
    choices = kernels.choose(by_shape(stacked), cache_dir)
    return [FastLinear(linear, choices[shape_of(linear)]["plan"]) for linear in stacked], shape_record(choices)


def unstack(groups: list[list[FastLinear]]) -> None:
    """Undo `stack` for its members: each parameter holds its own storage again (the same values)."""
    with torch.no_grad():
        for member in (member for group in groups for member in group):
            member.weight.data = member.weight.data.clone()
            if member.bias is not None:
                member.bias.data = member.bias.data.clone()


def _storage(weight: torch.Tensor) -> tuple:
    """What makes two tensors the same weight (a detached view of a parameter is a different object)."""
    return weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype


def _frozen_linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear over frozen `weight` [out, in] itself (shared, not copied, no gradient)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def shape_of(linear: nn.Linear) -> tuple[int, int, bool]:
    return linear.out_features, linear.in_features, linear.bias is not None


def disable(model, frozen: list | None = None) -> None:
    """Put nn.Linear modules back (sharing the same parameters) and F.linear for the `frozen` holders' tensors,
    undoing `enable`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FastLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                   device="meta")
                linear.weight, linear.bias = child.weight, child.bias
                setattr(parent, name, linear)
    for holder in frozen or ():
        for name in FrozenTargetTensors.HEADS:
            holder.serve(name, None)
