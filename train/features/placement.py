"""Where the frozen target lives in online training (`target.placement`).

- "replicated" (default): every process holds the whole target (docs/distributed.md explains why that is right
  while it fits: no collective in its forward).
- "served": the target runs in a serving engine (vLLM, `features.extractor: vllm`) that filled the offline cache;
  training loads only the embeddings, final norm and lm_head (inference/engine/target.head_target), which the drafter
  shares or reads. Offline or streamed features only; a warm start from target decoder layers is not available then.
- "sharded": torch FSDP2 (`fully_shard`) over all training processes, forward only. Every decoder layer is its own
  unit, all-gathered for its forward and freed after it, so a process holds 1/W of the decoder plus one layer
  gathered at a time. The head (embeddings, final norm, lm_head) stays whole on every process, outside FSDP
  (`ignored_params`): the drafter computes with full embedding and lm_head tensors (FrozenTargetTensors), so a
  sharded head would cost its own full copy on top of the shard, and the replicated head is never gathered.
  The target is loaded on the CPU and moved to the device one layer at a time as it is sharded, so no process
  ever holds the whole target on the device (the host still loads all of it, once per process). Nothing is
  trained, so there are no gradients or optimizer state to shard; the all-gathers are the whole cost. The
  all-gathered weights are the stored ones bit for bit, so hidden states equal the replicated target's
  (tests/test_placement.py, 2 gloo processes on CPU, where accelerate's FSDP does not run but plain FSDP2 does).

Every process must run the target's forward the same number of times (each forward is a collective): online
training and evaluation do (the data order gives each process the same number of micro-batches); hybrid/offline
modes skip forwards per process and are refused, and the main process's speculative-decoding probe is skipped.
"""

from __future__ import annotations

import inspect

import torch


def check_sharding_supported() -> None:
    """ValueError before the target loads when this torch's FSDP2 cannot leave the head whole (`ignored_params`
    arrived in torch 2.7)."""
    from torch.distributed.fsdp import fully_shard

    if "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise ValueError(f"target.placement: sharded needs torch >= 2.7 (FSDP2 ignored_params), this is "
                         f"{torch.__version__}; upgrade torch or use target.placement: replicated")


def head_parameters(target) -> list[torch.nn.Parameter]:
    """The parameters of the embeddings, final norm and lm_head (tied ones once): the tensors TargetInfo hands a
    drafter, which stay whole under sharding."""
    modules = (target.model.get_input_embeddings(), target.final_norm, target.model.get_output_embeddings())
    return list({id(p): p for module in modules for p in module.parameters()}.values())


def adopt_target_info(drafter: torch.nn.Module, info) -> None:
    """Point the drafter at `info`: its `target_info` and the frozen tensors it declares (Drafter.adopt_target_info).
    They start afresh: a copy made so far may alias a weight that is about to be sharded, and training serves no
    head through another module (FrozenTargetTensors.serve is the engine's)."""
    drafter.adopt_target_info(info)


def shard_target(target, world_size: int, device, drafter: torch.nn.Module | None = None) -> None:
    """FSDP2-shard `target` (a TargetModel, best loaded on the CPU) across the `world_size` processes of the default
    process group onto `device`; the head stays whole there (module docstring).

    FSDP2 moves a parameter to the device in place and then keeps only its shard: any other reference to the
    unsharded weights would keep the whole layer alive (on the device, once moved). So the TargetInfo first drops
    its map of every weight (`declare_sharded`: warm starts are done by now), and `drafter`, built on the unsharded
    target, is pointed at that TargetInfo before a single layer is sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device(device)
    target.declare_sharded()  # no process can run it alone (the speculative-decoding probe is skipped)
    if drafter is not None:
        adopt_target_info(drafter, target.target_info())
    head = head_parameters(target)
    with torch.no_grad():
        for parameter in head:  # in place: TargetInfo holds these very Parameters
            parameter.data = parameter.data.to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in target.layers:  # each moved to the device whole, split, and its unsharded storage freed
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    # the root unit: whatever is neither a layer nor the head (buffers such as rotary frequencies, a family's extras)
    fully_shard(target.model, mesh=mesh, reshard_after_forward=True, ignored_params=set(head))


def release_gathered(target) -> None:
    """Free the root unit's all-gathered weights after a forward (FSDP2 keeps the root's gathered, expecting a
    backward that a frozen target never runs); the layers free their own. The head is not FSDP's, so this frees
    only what a family keeps at the root besides it (often nothing)."""
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

    replicated: all of it. sharded (FSDP2): the head (embeddings, final norm, lm_head) whole, 1/W of the rest, and
    two decoder layers all-gathered at once (the one running and the one FSDP2 prefetches). served: the head only;
    the decoder runs in vLLM on its own GPUs (`engine_bytes_per_gpu`)."""
    if placement == "replicated":
        return params * bytes_per_param
    if placement == "sharded":
        return -(-(params - head) * bytes_per_param // world_size) + (head + 2 * largest_layer) * bytes_per_param
    if placement == "served":
        return head * bytes_per_param
    raise ValueError(f"placement {placement!r}: choose one of {', '.join(PLACEMENTS)}")


def engine_bytes_per_gpu(*, params: int, bytes_per_param: int, tensor_parallel_size: int) -> int:
    """Weights per GPU of a vLLM engine tensor-parallel over tensor_parallel_size GPUs (its KV cache comes on top,
    up to features.vllm.gpu_memory_utilization of the GPU)."""
    return -(-params * bytes_per_param // tensor_parallel_size)


def fitting_placement(totals: dict[str, int], gpu_bytes: int, replicated_fsdp: int | None = None) -> str | None:
    """The first placement, in the order of PLACEMENTS (fewest collectives first), whose per-GPU total fits; with
    `replicated_fsdp` (the replicated target's total with the drafter's state under FSDP), "replicated+fsdp" when
    only that fits of the two replicated totals: sharding the drafter gathers its own shards only, before sharding
    the target gathers its layers every forward."""
    fits = next((p for p in PLACEMENTS if totals[p] <= gpu_bytes), None)
    if fits != "replicated" and replicated_fsdp is not None and replicated_fsdp <= gpu_bytes:
        return "replicated+fsdp"
    return fits
