"""Where the frozen target lives in online training (`target.placement`).

- "replicated" (default): every process holds the whole target (docs/distributed.md explains why that is right
  while it fits: no collective in its forward).
- "served": the target runs in a serving engine (vLLM, `features.extractor: vllm`) that filled the offline cache;
  training loads only the embeddings, final norm and lm_head (train/vllm_features.head_target), which the drafter
  shares or reads. Offline or streamed features only; a warm start from target decoder layers is not available then.
- "sharded": torch FSDP2 (`fully_shard`) over all training processes, forward only. Every decoder layer is its own
  unit and the rest (embeddings, final norm, lm_head) the root's; a unit's weights are all-gathered for its forward
  and freed after it, so a process holds 1/W of the target plus one layer gathered at a time. Nothing is trained,
  so there are no gradients or optimizer state to shard; the all-gathers are the whole cost. The all-gathered
  weights are the stored ones bit for bit, so hidden states equal the replicated target's
  (tests/test_placement.py, 2 gloo processes on CPU, where accelerate's FSDP does not run but plain FSDP2 does).

Every process must run the target's forward the same number of times (each forward is a collective): online
training and evaluation do (the data order gives each process the same number of micro-batches); hybrid/offline
modes skip forwards per process and are refused, and the main process's speculative-decoding probe is skipped.
"""

from __future__ import annotations


import torch


def shard_target(target, world_size: int) -> None:
    """FSDP2-shard `target` (a TargetModel) across the `world_size` processes of the default process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = target.device
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in target.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(target.model, mesh=mesh, reshard_after_forward=True)
    target.declare_sharded()  # no process can run it alone (the speculative-decoding probe is skipped)


def release_gathered(target) -> None:
    """Free the root unit's all-gathered weights after a forward (FSDP2 keeps the root's gathered, expecting a
    backward that a frozen target never runs); the layers free their own."""
    if target.placement == "sharded":
        target.model.reshard()


def local_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters this process holds (its shard of each DTensor)."""
    total = 0
    for parameter in module.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return total


PLACEMENTS = ("replicated", "sharded", "served")


def target_bytes_per_gpu(placement: str, *, params: int, bytes_per_param: int, largest_layer: int, head: int,
                         world_size: int) -> int:
    """Peak bytes of the target's weights on one training GPU.

    replicated: all of it. sharded (FSDP2): 1/W of it, plus what is all-gathered at once: the root unit
    (embeddings, final norm, lm_head: gathered for the whole forward) and two decoder layers (the one running and
    the one FSDP2 prefetches). served: the head only (embeddings, final norm, lm_head); the decoder runs in vLLM
    on its own GPUs (`engine_bytes_per_gpu`)."""
    if placement == "replicated":
        return params * bytes_per_param
    if placement == "sharded":
        return -(-params * bytes_per_param // world_size) + (head + 2 * largest_layer) * bytes_per_param
    if placement == "served":
        return head * bytes_per_param
    raise ValueError(f"placement {placement!r}: choose one of {', '.join(PLACEMENTS)}")


def engine_bytes_per_gpu(*, params: int, bytes_per_param: int, tensor_parallel_size: int) -> int:
    """Weights per GPU of a vLLM engine tensor-parallel over tensor_parallel_size GPUs (its KV cache comes on top,
    up to features.vllm.gpu_memory_utilization of the GPU)."""
    return -(-params * bytes_per_param // tensor_parallel_size)


def fitting_placement(totals: dict[str, int], gpu_bytes: int) -> str | None:
    """The first placement, in the order of PLACEMENTS (fewest collectives first), whose per-GPU total fits."""
    return next((p for p in PLACEMENTS if totals[p] <= gpu_bytes), None)
