"""E. Real shapes with random weights: one training step per drafter kind on an 8B-shaped target.

The target: Llama-3.1-8B's widths (hidden 4096, MLP 14336, 32 / 8 heads, vocabulary 128,256) with a few decoder
layers, built on the device in bf16 with random weights (no download; its unused vocabulary rows leave DFlash a mask
token), plus one case on Qwen3-8B's widths. Each kind takes its GPU recipe's drafter section (recipes/llama3.1-8b/,
recipes/qwen3-8b/dspark.yaml; Medusa has none and takes its debug one) with layer ids that fit the few layers. Per
case (kind, sequence length, activation checkpointing): the target's features once, then one warm-up and a few timed
AdamW steps under bf16 autocast, as training runs them. Recorded: the step's seconds, the device's peak memory above
the target alone, and `draftsmith estimate`'s prediction for the same step (drafters/step_memory.py; fp32 model) with
their ratio. An out-of-memory error is caught and recorded per case; the next case runs.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.gpu_check.context import (OUT_OF_MEMORY, QWEN3_8B, TINY_SHAPE, CheckFailed, Context, drafter_config,
                                          finite, free_memory, gib, memory_allocated, memory_peak, memory_reset_peak,
                                          synchronize)
from benchmarks.gpu_check.summary import one_line

BLOCK_IDS = {"layer_ids": "auto", "mask_token_id": None}  # ids that fit a few layers; the mask row found unused
# (label, recipe, drafter overrides, sequence: 0 short / 1 long, activation checkpointing, qwen3 widths); the kind is
# the recipe's
CASES = [
    ("eagle3", "recipes/llama3.1-8b/eagle3.yaml", {}, 0, False, False),
    ("eagle3", "recipes/llama3.1-8b/eagle3.yaml", {}, 1, False, False),
    ("eagle3", "recipes/llama3.1-8b/eagle3.yaml", {}, 1, True, False),
    ("dflash", "recipes/llama3.1-8b/dflash.yaml", BLOCK_IDS, 1, False, False),
    ("dspark", "recipes/qwen3-8b/dspark.yaml", BLOCK_IDS, 1, False, False),
    ("mtp", "recipes/llama3.1-8b/mtp.yaml", {}, 0, False, False),
    ("mtp", "recipes/llama3.1-8b/mtp.yaml", {}, 1, False, False),
    # one module over 3 steps as servers run it: step k attends to k + 1 blocks of keys (mtp/layers.StepKeys)
    ("mtp-served", "recipes/llama3.1-8b/mtp.yaml", {"num_modules": 1, "reuse": True, "num_steps": 3}, 1, False, False),
    ("medusa", "recipes/debug/tiny_medusa.yaml", {}, 1, False, False),
    ("assistant", "recipes/llama3.1-8b/assistant.yaml", {}, 0, False, False),
    ("eagle3", "recipes/qwen3-8b/eagle3.yaml", {}, 0, False, True),
]
# the CPU dry run's drafters are as small as its target (a 1,024-token vocabulary, hidden 128)
CPU_OVERRIDES = {"eagle3": {"draft_vocab_size": 256}, "dflash": {"num_layers": 1}, "dspark": {"num_layers": 1},
                 "assistant": {"num_layers": 1, "hidden_size": 64, "intermediate_size": 128}}
TEXT_IDS = 256  # input ids drawn below this: byte tokens, never the reserved rows a drafter may take as its mask


def build_target(ctx: Context, layers: int, qwen3: bool = False):
    """A random bf16 target of the mode's widths (Llama-3.1-8B's, or Qwen3-8B's with `qwen3`) and `layers` layers,
    built on the device, with the debug targets' byte-level tokenizer (260 tokens: every other row is unused)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from inference.assets.debug_target import build_tokenizer
    from inference.engine.target import TargetModel

    tokenizer = build_tokenizer()
    shape = ctx.sizes.shape if not qwen3 else (QWEN3_8B if not ctx.cpu else {**TINY_SHAPE, "head_dim": 32})
    config = (Qwen3Config if qwen3 else LlamaConfig)(
        **shape, num_hidden_layers=layers, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return TargetModel(model, tokenizer, name_or_path=f"random-{'qwen3' if qwen3 else 'llama'}-{layers}-layers")


def random_batch(ctx: Context, seq_len: int) -> dict:
    """One row of random ids, the loss on its last three quarters (a prompt, then the answer)."""
    generator = torch.Generator().manual_seed(seq_len)
    input_ids = torch.randint(0, TEXT_IDS, (1, seq_len), generator=generator)
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[:, seq_len // 4:] = 1
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "loss_mask": loss_mask,
             "sample_index": torch.zeros(1, dtype=torch.long)}
    return {**{key: value.to(ctx.device) for key, value in batch.items()}, "epoch": 0, "seed": 0}


def prediction(drafter, seq_len: int, checkpointing: bool) -> float | str | None:
    """`draftsmith estimate`'s step peak in GiB (None: no model for this kind yet)."""
    from drafters.step_memory import step_peak_parts, step_shape

    try:
        shape = step_shape(drafter, seq_len, 1, checkpointing)
    except Exception as err:  # noqa: BLE001 - a kind the model cannot describe yet is reported, not fatal
        return f"{type(err).__name__}: {one_line(err)}"
    return None if shape is None else gib(step_peak_parts(shape)["total"])


def train_steps(ctx: Context, drafter, batch: dict) -> tuple[list[float], float]:
    """One warm-up and ctx.sizes.timed_steps timed AdamW steps; (seconds of each timed step, the last loss)."""
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-5)
    seconds, loss = [], float("nan")
    for index in range(1 + ctx.sizes.timed_steps):
        synchronize(ctx.device)
        started = time.perf_counter()
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            out = drafter(batch)
        value, _ = drafter.loss(out, batch)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(ctx.device)
        if index:
            seconds.append(time.perf_counter() - started)
        loss = float(value.detach())
        del out, value
    return seconds, loss


def run_case(ctx: Context, target, case: tuple) -> dict:
    from drafters import DRAFTERS
    from train.features.cache import FeatureProvider

    label, recipe, overrides, length, checkpointing, _ = case
    seq_len = ctx.sizes.seq_lens[length]
    small = CPU_OVERRIDES.get(label, {}) if ctx.cpu else {}
    kind, config = drafter_config(ctx.repo_path(recipe), {**overrides, **small})
    free_memory(ctx.device)
    base = memory_allocated(ctx.device)
    memory_reset_peak(ctx.device)
    torch.manual_seed(0)
    drafter = DRAFTERS[kind](config, target.target_info()).to(ctx.device)
    drafter.activation_checkpointing = checkpointing
    batch = random_batch(ctx, seq_len)
    drafter.init_from_data(torch.bincount(batch["input_ids"].flatten().cpu(),
                                          minlength=target.target_info().vocab_size))
    synchronize(ctx.device)
    started = time.perf_counter()
    batch.update(FeatureProvider("online", target, drafter.feature_request()).online(batch))
    synchronize(ctx.device)
    forward_seconds = time.perf_counter() - started
    seconds, loss = train_steps(ctx, drafter, batch)
    peak = memory_peak(ctx.device)
    predicted = prediction(drafter, seq_len, checkpointing)
    measured = gib(None if peak is None else peak - base)
    return {"seq_len": seq_len, "step_s": round(statistics.median(seconds), 4),
            "target_forward_s": round(forward_seconds, 4), "loss": round(loss, 4), "peak_gib": measured,
            "predicted_gib": predicted,
            "measured_over_predicted": (round(measured / predicted, 3) if isinstance(predicted, float)
                                        and measured is not None else None)}


def run_cases(ctx: Context, target, cases: list[tuple], numbers: dict, failures: list[str]) -> None:
    for case in cases:
        label = (f"{case[0]}@{ctx.sizes.seq_lens[case[3]]}" + ("+ckpt" if case[4] else "")
                 + ("/qwen3" if case[5] else ""))
        if ctx.time_left() < (5 if ctx.cpu else 20):
            numbers[label] = "skipped: no time left"
            failures.append(f"{label}: skipped (time)")
            continue
        try:
            numbers[label] = result = run_case(ctx, target, case)
            if not finite([result["loss"]]):
                failures.append(f"{label}: non-finite loss")
        except OUT_OF_MEMORY as err:
            numbers[label] = f"out of memory: {one_line(err)[:200]}"
            failures.append(f"{label}: out of memory")
        except Exception as err:  # noqa: BLE001 - one case's error is recorded and the next case runs
            numbers[label] = f"{type(err).__name__}: {one_line(err)}"
            failures.append(f"{label}: {type(err).__name__}: {one_line(err)}")
        free_memory(ctx.device)


def run(ctx: Context) -> dict:
    numbers: dict = {"layers": ctx.sizes.shape_layers, "hidden": ctx.sizes.shape["hidden_size"],
                     "vocab": ctx.sizes.shape["vocab_size"]}
    failures: list[str] = []
    for qwen3 in (False, True):
        target = build_target(ctx, ctx.sizes.shape_layers, qwen3)
        numbers["qwen3_target_gib" if qwen3 else "target_gib"] = gib(memory_allocated(ctx.device))
        run_cases(ctx, target, [case for case in CASES if case[5] == qwen3], numbers, failures)
        del target
        free_memory(ctx.device)
    if failures:
        raise CheckFailed("; ".join(failures), numbers)
    return numbers
