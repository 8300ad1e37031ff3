"""C. Loss and gradient parity: each kind's training step in bf16 on the device against fp32 on the CPU.

The same drafter weights (built once on the CPU, loaded into the device copy, which computes with the bf16 target's
embedding and head as training does), the same batch (the first conversations of the shipped regenerated file,
tokenised for the tiny target) and the same features (the fp32 target's). The device step runs as training runs it,
the forward under bf16 autocast and the loss outside it. Compared: the loss (relative difference) and the gradient
(cosine over all trained parameters). Also reported, not checked: the same with the bf16 target's own features, which
flip a few per cent of the target's argmax labels on the tiny target (a property of bf16, not of the drafter).
"""

from __future__ import annotations

import copy

import torch

from benchmarks.gpu_check.context import (BF16_EPS, DATA_FILE, KINDS, CheckFailed, Context, drafter_config, each_case,
                                          free_memory)

# Bounds from the bf16 unit roundoff: under autocast every GEMM input and output carries a relative error of at most
# eps/2, and the loss and the gradient sum such errors over many terms of either sign, so the loss moves by well under
# eps and the gradient's direction by less. A wrong dtype path, a lost mask or a device mismatch moves them by O(1).
LOSS_RTOL = 2 * BF16_EPS  # 1.6%
GRAD_MIN_COSINE = 1 - BF16_EPS  # 0.992


def tokenised_batch(ctx: Context, target, rows: int, length: int) -> tuple[dict, list[dict]]:
    """Right-padded batch of the first `rows` conversations with an assistant token; the samples for init."""
    from train.data.chat import tokenize_conversation
    from train.data.conversations import iter_conversations
    from train.data.dataset import collate

    samples = []
    for record in iter_conversations(ctx.repo_path(DATA_FILE)):
        if record["skip_reason"]:
            continue
        sample = tokenize_conversation(target.tokenizer, record["messages"], length)
        if sample is not None and any(sample["loss_mask"]):
            samples.append(sample)
        if len(samples) == rows:
            break
    batch = collate(samples, pad_token_id=target.pad_token_id)
    batch.update(sample_index=torch.arange(len(samples)), epoch=0, seed=0)
    return batch, samples


def features(target, drafter, batch: dict) -> dict:
    from train.features.cache import FeatureProvider

    return FeatureProvider("online", target, drafter.feature_request()).online(batch)


def on(device: torch.device, value):
    """`value` (a tensor, or dicts / tuples of them) on `device`; anything else as it is."""
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, dict):
        return {key: on(device, item) for key, item in value.items()}
    return tuple(on(device, item) for item in value) if isinstance(value, tuple) else value


def step(drafter, batch: dict, autocast: bool) -> tuple[float, torch.Tensor]:
    """One forward / backward as the training loop runs it (forward under autocast, loss outside); returns the loss
    and the flat fp64 gradient."""
    device = next(drafter.parameters()).device
    drafter.train()
    drafter.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        out = drafter(batch)
    loss, _ = drafter.loss(out, batch)
    loss.backward()
    grads = [p.grad.double().flatten().cpu() if p.grad is not None else torch.zeros(p.numel(), dtype=torch.float64)
             for p in drafter.parameters() if p.requires_grad]
    return float(loss.detach()), torch.cat(grads)


def agreement(reference: tuple[float, torch.Tensor], other: tuple[float, torch.Tensor]) -> dict:
    (loss_ref, grad_ref), (loss, grad) = reference, other
    return {"loss": round(loss, 5), "loss_rel_diff": round(abs(loss - loss_ref) / max(abs(loss_ref), 1e-12), 5),
            "grad_cosine": round(float(torch.nn.functional.cosine_similarity(grad_ref, grad, dim=0)), 5),
            "grad_norm_ratio": round(float(grad.norm() / grad_ref.norm()), 4)}


def compare_kind(ctx: Context, kind: str, targets: tuple, batch: dict, samples: list[dict]) -> dict:
    """fp32 on the CPU, then bf16 autocast on the device with the same features (the check) and with the bf16
    target's own features (reported only: the bf16 target moves some argmax labels, which is not the drafter's
    doing)."""
    from drafters import DRAFTERS
    from train.data.vocab import count_tokens

    reference_target, device_target = targets
    _, config = drafter_config(ctx.repo_path(f"recipes/debug/tiny_{kind}.yaml"))
    torch.manual_seed(0)
    reference = DRAFTERS[kind](copy.deepcopy(config), reference_target.target_info())
    reference.init_from_data(count_tokens(samples, reference_target.target_info().vocab_size))
    on_device = DRAFTERS[kind](copy.deepcopy(config), device_target.target_info()).to(device_target.device)
    on_device.load_state_dict(reference.state_dict())
    shared = features(reference_target, reference, batch)
    fp32 = step(reference, {**batch, **shared}, autocast=False)
    device_batch = on(device_target.device, batch)
    result = agreement(fp32, step(on_device, {**device_batch, **on(device_target.device, shared)}, autocast=True))
    own = step(on_device, {**device_batch, **features(device_target, on_device, device_batch)}, autocast=True)
    return {"loss_fp32_cpu": round(fp32[0], 5), **result, "with_bf16_target_features": agreement(fp32, own)}


def run(ctx: Context) -> dict:
    from inference.engine.target import TargetModel

    reference_target = TargetModel.from_pretrained("debug:tiny-llama", dtype=torch.float32, device="cpu")
    device_target = TargetModel.from_pretrained("debug:tiny-llama", dtype=torch.bfloat16, device=ctx.device)
    batch, samples = tokenised_batch(ctx, reference_target, ctx.sizes.parity_rows, ctx.sizes.parity_length)
    numbers: dict = {"bounds": {"loss_rel_diff": round(LOSS_RTOL, 4), "grad_cosine": round(GRAD_MIN_COSINE, 4)},
                     "batch": list(batch["input_ids"].shape)}
    failures: list[str] = []

    def check(kind: str) -> tuple[dict, list[str]]:
        result = compare_kind(ctx, kind, (reference_target, device_target), batch, samples)
        failed = []
        if not result["loss_rel_diff"] <= LOSS_RTOL:
            failed.append(f"{kind}: loss differs by {result['loss_rel_diff']:.2%}")
        if not result["grad_cosine"] >= GRAD_MIN_COSINE:
            failed.append(f"{kind}: gradient cosine {result['grad_cosine']:.4f}")
        return result, failed

    each_case(ctx, KINDS, check, numbers, failures)
    reference_target = device_target = None  # the device's copy goes before free_memory
    free_memory(ctx.device)
    if failures:
        raise CheckFailed("; ".join(failures), numbers)
    return numbers
