"""F. The engine at 8B shape: plain decoding against HF `generate`, and the engine's cost curve v(k) / d(k).

A random bf16 target of Llama-3.1-8B's full shape (32 layers, 16 GB; built on the device as in E), prompts of random
byte ids, no EOS. Plain greedy decoding (k = 0) through the engine against HF `generate` (greedy, same prompts, same
number of new tokens) at batch 1 and 8: tokens/s of each after one warm-up. Then `profile_costs` with an untrained
EAGLE-3 (the GPU recipe's: 32,000-token draft vocabulary), as `draftsmith eval` profiles a drafter: v(W) and d(W) in
AR steps for W = 0..8, the numbers AdaptiveK and every speedup claim on this machine rest on.
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpu_check.context import CheckFailed, Context, drafter_config, finite, free_memory, synchronize
from benchmarks.gpu_check.e_shapes import CPU_OVERRIDES, TEXT_IDS, build_target
from benchmarks.gpu_check.summary import one_line


def prompts(ctx: Context, rows: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(rows)
    return torch.randint(0, TEXT_IDS, (rows, ctx.sizes.engine_prompt), generator=generator).tolist()


def hf_tokens_per_s(ctx: Context, target, rows: list[list[int]]) -> float:
    """HF `generate`, greedy, every row the same length (no padding), exactly engine_tokens new tokens."""
    ids = torch.tensor(rows, device=ctx.device)

    def generate(new_tokens: int):
        return target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     pad_token_id=target.pad_token_id)

    generate(2)  # warm-up
    synchronize(ctx.device)
    started = time.perf_counter()
    generate(ctx.sizes.engine_tokens)
    synchronize(ctx.device)
    return len(rows) * ctx.sizes.engine_tokens / (time.perf_counter() - started)


def engine_tokens_per_s(ctx: Context, target, rows: list[list[int]]) -> float:
    """Plain greedy decoding (k = 0) through the engine: the baseline of every speedup."""
    from inference.engine.api import speculative_generate

    speculative_generate(target, None, rows, num_draft_tokens=0, max_new_tokens=2, eos_token_ids=[])  # warm-up
    synchronize(ctx.device)
    started = time.perf_counter()
    out = speculative_generate(target, None, rows, num_draft_tokens=0, max_new_tokens=ctx.sizes.engine_tokens,
                               eos_token_ids=[])
    synchronize(ctx.device)
    return sum(map(len, out.tokens)) / (time.perf_counter() - started)


def cost_curve(ctx: Context, target) -> dict:
    """profile_costs with an untrained EAGLE-3 placed as eval places a drafter (TargetModel.serve)."""
    from drafters import DRAFTERS
    from inference.evaluation.profile import profile_costs

    kind, config = drafter_config(ctx.repo_path("recipes/llama3.1-8b/eagle3.yaml"),
                                  CPU_OVERRIDES["eagle3"] if ctx.cpu else None)
    torch.manual_seed(0)
    drafter = DRAFTERS[kind](config, target.target_info())
    drafter.init_from_data(torch.ones(target.target_info().vocab_size, dtype=torch.long))
    drafter = target.serve(drafter)
    profile = profile_costs(target, drafter, prompts(ctx, 1), ctx.sizes.profile_width,
                            repeats=ctx.sizes.profile_repeats)
    steps = profile.in_ar_steps()
    return {"max_width": ctx.sizes.profile_width, "v_in_ar_steps": [round(x, 3) for x in steps["v"]],
            "d_in_ar_steps": [round(x, 3) for x in steps["d"]],
            "ar_step_ms": round(1000 * profile.verify_seconds[0], 3)}


def run(ctx: Context) -> dict:
    target = build_target(ctx, ctx.sizes.engine_layers)
    numbers: dict = {"layers": ctx.sizes.engine_layers, "prompt_tokens": ctx.sizes.engine_prompt,
                     "new_tokens": ctx.sizes.engine_tokens, "engine_decode": target.decode}
    failures = []
    for batch in ctx.sizes.engine_batches:
        rows = prompts(ctx, batch)
        hf, engine = hf_tokens_per_s(ctx, target, rows), engine_tokens_per_s(ctx, target, rows)
        numbers[f"batch_{batch}"] = {"hf_generate_tokens_per_s": round(hf, 1), "engine_tokens_per_s": round(engine, 1),
                                     "engine_over_hf": round(engine / hf, 3)}
        if not (finite([hf, engine]) and hf > 0 and engine > 0):
            failures.append(f"batch {batch}: no throughput measured")
    try:
        numbers["cost_curve"] = cost_curve(ctx, target)
    except Exception as err:  # noqa: BLE001 - recorded with the throughput numbers measured above
        failures.append(f"cost curve: {type(err).__name__}: {one_line(err)}")
    del target
    free_memory(ctx.device)
    if failures:
        raise CheckFailed("; ".join(failures), numbers)
    return numbers
