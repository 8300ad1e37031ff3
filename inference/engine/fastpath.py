"""The target's linears laid out for the few rows a decode step or a verify feeds (CPU, float32).

A batch-1 decode step multiplies 1 row by every weight, a verify of W drafts W + 1 rows. Plain MKL sgemm on HF's
[out, in] weights runs these sizes far below the memory roofline, and worse at 2-8 rows than at 1 (measured with
benchmarks/linear_layouts.py: about 2.3x the M = 1 time at M = 2..8), so a verify cost nearly two decode steps. Kept
after measuring every candidate there, interleaved:
- 1 row: the weight stored transposed, [in, out] contiguous, as a vector-matrix product (the fastest at M = 1);
- 2..MAX_PACKED_ROWS rows: oneDNN's prepacked linear (the weight reordered once, at start-up, into its blocked
  layout; the flattest in M of all: measured in CPU seconds at 1 thread, 4 rows cost 1.09x and 8 rows 1.32x the
  1-row product, where F.linear costs 1.9x and 2.2x), with 2 and 3 rows padded to 4 (oneDNN's 2-row kernel is slow);
- more rows (a prefill, training features): the model's own F.linear, unchanged.
MKL's packed GEMM and fusing q|k|v and gate|up measured no better. The weights stay the model's parameters (so
`state_dict`, tied embeddings and training are untouched); the two layouts are extra copies (2x the linear weights in
memory). Outputs differ from F.linear's only by the summation order of float32 dot products.

`enable(model)` swaps every nn.Linear of the model for a FastLinear in place and returns the path that runs
("fast-cpu-linear"), or returns "hf" and changes nothing where it does not apply (an accelerator, a dtype other than
float32, no oneDNN, no nn.Linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_PACKED_ROWS = 64  # beyond this, MKL's large-M GEMM on the [out, in] weight is already near the compute roofline
PACK_HINT_ROWS = 8  # oneDNN's reorder hint; measured the same layout (and speed) for hints 2..16
MIN_PACKED_ROWS = 4  # oneDNN's kernel for 2 and 3 rows is slower than for 4 (1.3x at 2 rows): pad them to 4
HF_PATH, FAST_PATH = "hf", "fast-cpu-linear"


class FastLinear(nn.Module):
    """nn.Linear's forward (y = x W^T + b) with the weight also held in the layouts small row counts run fastest in.
    `weight` and `bias` are the original module's parameters (shared, not copied)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            self.register_buffer("weight_t", linear.weight.detach().t().contiguous(), persistent=False)
            # an opaque oneDNN tensor: an attribute, not a buffer (it has no storage that `.to` or state_dict can use)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_HINT_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > MAX_PACKED_ROWS or torch.is_grad_enabled() and self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        if rows == 1:
            out = flat @ self.weight_t
            if self.bias is not None:
                out = out + self.bias
        else:
            if rows < MIN_PACKED_ROWS:  # zero rows below the real ones; each output row depends on its input row only
                flat = torch.cat([flat, flat.new_zeros(MIN_PACKED_ROWS - rows, self.in_features)])
            out = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), self.packed, self.bias, "none", [], "")[:rows]
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def unsupported_reason(model) -> str | None:
    """Why the fast path does not apply to `model` (None when it does)."""
    parameter = next(model.parameters())
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


def enable(model) -> str:
    """Swap every nn.Linear of `model` for a FastLinear (in place); returns FAST_PATH, or HF_PATH when the fast path
    does not apply (the model is then left as it was)."""
    if unsupported_reason(model) is not None:
        return HF_PATH
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, FastLinear(child))
    return FAST_PATH


def disable(model) -> None:
    """Put nn.Linear modules back (sharing the same parameters), undoing `enable`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FastLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                   device="meta")
                linear.weight, linear.bias = child.weight, child.bias
                setattr(parent, name, linear)
