"""The arithmetic behind `draftsmith estimate` (train/estimate.py), from sizes alone: bytes per token of an offline
feature cache, and bytes per GPU of a recipe's parts (the frozen target, the drafter's weights, gradients and AdamW
state, its frozen tensors, the served features) under DDP, FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3 (`memory_plan`).
Nothing here loads a model; estimate measures the sizes and prints the plans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

STRATEGIES = ("ddp", "fsdp", "zero2", "zero3")
ADAM_BYTES_PER_PARAM = 16  # fp32 weights (or bf16 weights + fp32 master), fp32 gradients, two fp32 Adam moments


def cache_bytes_per_token(num_hidden: int, hidden_size: int, dtype: torch.dtype, top_k: int = 0) -> int:
    """(num_hidden + 1) hidden vectors of hidden_size values, + int32 argmax + int32 token id, + top-k values/ids."""
    size = torch.empty((), dtype=dtype).element_size()
    return (num_hidden + 1) * hidden_size * size + 8 + top_k * (size + 4)


def drafter_state_bytes(num_params: int, strategy: str, world_size: int, param_bytes: int = 2) -> int:
    """Bytes per GPU of the drafter's weights, gradients and AdamW state: 16 per parameter in all (ZeRO paper,
    section 3.1, K = 12 for mixed-precision Adam), of which a strategy shards some over world_size processes.

    ddp: nothing sharded, 16 P. fsdp (FSDP2 full shard) and zero3: everything sharded, 16 P / W. zero2: the
    param_bytes-byte working weights stay replicated (2 under bf16, 4 in fp32), the rest is sharded:
    param_bytes P + (16 - param_bytes) P / W.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    total = ADAM_BYTES_PER_PARAM * num_params
    if strategy == "ddp":
        return total
    if strategy == "zero2":
        return param_bytes * num_params + math.ceil((total - param_bytes * num_params) / world_size)
    return math.ceil(total / world_size)


@dataclass(frozen=True)
class RecipeSizes:
    """What the memory of one recipe is made of, in parameters, values or bytes (see memory_plan)."""

    target_params: int
    target_bytes_per_param: int  # the target's dtype on a GPU (bf16 for target.dtype auto)
    drafter_trainable: int
    drafter_frozen_values: int  # drafter parameters that are not trained, and buffers
    target_copy_values: int  # copies of target tensors in the drafter's dtype (FrozenTargetTensors; measured)
    feature_values: int  # served features of one micro-batch at data.max_length, fp32
    logit_chunk_values: int  # the bounded chunk of logits the target's argmax is computed through
    activation_bytes: int | None  # measured for one micro-batch (None = not measured)
    largest_layer_params: int = 0  # the target's largest decoder layer (what FSDP2 gathers at once)
    head_params: int = 0  # the target's embeddings, final norm and lm_head (tied ones once)
    engine_bytes_per_param: int | None = None  # the checkpoint's own when quantized (fp8: 1), as vLLM serves it
    engine_quantization: str | None = None  # the checkpoint's quant_method; vLLM serves its weights as stored
    engine_stored_bytes: int | None = None  # those weights' bytes on disk, when the directory holds them
    undecodable_layers: tuple[str, ...] = ()  # layer types the engine cannot run: only vLLM computes its features
    mixed_precision: str = "bf16"  # the run's on a GPU (launch.resolve_mixed_precision)
    measured_precision: str = "no"  # the probe's, which activation_bytes were measured under


def memory_plan(sizes: RecipeSizes, strategy: str, world_size: int) -> dict[str, int]:
    """Bytes per GPU, by part. The frozen target is on every GPU in its dtype whatever the strategy (never wrapped
    for training: no all-gather in its forward). Frozen tensors: the drafter's own frozen parameters and buffers plus
    the fp32 copies of target tensors (FrozenTargetTensors) the probe measured, made only by an fp32 drafter without
    autocast beside a 16-bit target. ZeRO-2's replicated working weights: the mixed precision's 16 bits, else fp32."""
    copies = sizes.target_copy_values if sizes.target_bytes_per_param != 4 else 0
    working_bytes = 2 if sizes.mixed_precision in ("bf16", "fp16") else 4
    plan = {"target weights": sizes.target_params * sizes.target_bytes_per_param,
            "drafter weights + grads + AdamW": drafter_state_bytes(
                sizes.drafter_trainable, strategy, world_size, working_bytes),
            "drafter frozen tensors (fp32)": 4 * (sizes.drafter_frozen_values + copies),
            "served features + logit chunk": 4 * sizes.feature_values
            + sizes.target_bytes_per_param * sizes.logit_chunk_values}
    if sizes.activation_bytes is not None:  # autocast keeps 16-bit inputs for its matmuls, fp32 keeps 32-bit ones
        plan[f"drafter activations (measured, {precision_name(sizes.measured_precision)})"] = sizes.activation_bytes
    plan["total"] = sum(plan.values())
    return plan


def precision_name(mixed_precision: str) -> str:  # accelerate's "no" is fp32
    return "fp32" if mixed_precision == "no" else mixed_precision


def served_bytes_per_param(quant_method: str | None) -> int | None:
    """1 for a checkpoint whose config.json declares fp8 weights (DeepSeek-V3 as released), which vLLM serves as
    they are; None (the training dtype) otherwise: another quantization is sized by its files when they are there."""
    return 1 if quant_method == "fp8" else None
