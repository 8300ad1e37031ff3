"""H. The study's target families on the device, in bf16: each family's debug target (docs/support.md; Qwen3-Next,
Qwen3.5 and Qwen3.5-MoE with gated DeltaNet, whose states the engine records and rolls back itself; Gemma 4 with and
without its MoE block and with E2B / E4B's KV-shared tail, windows of 16 applied by position in 4-D masks; gpt-oss
with sinks; DeepSeek-V3 with MLA), Nemotron-H (Mamba-2 layers, recorded like gated DeltaNet, beside attention and
MoE blocks), Falcon-H1 (attention and Mamba-2 side by side in every layer) and Llama 4's chunked attention (chunks
of 8 applied by position). Three prompts of 7-20 tokens and 24 new ones, so every row outgrows the windows:
plain greedy through the engine at batch 3 against HF `generate`; a draft model of the family (the target with noisy
weights, so drafts are accepted and rejected) in chains of 3 at batch 3 and in a tree of 5 nodes, against plain
greedy. Every divergence must be a near-tie of the target's logits (inference/evaluation/lossless.py); the CPU tests
prove the same exact in float64 (tests/test_families.py). A family's error is recorded and the next one runs.
"""

from __future__ import annotations

import copy
import os

import torch

from benchmarks.gpu_check.context import CheckFailed, Context, each_case
from benchmarks.gpu_check.d_lossless import gaps, hf_greedy

FAMILIES = ("tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-gemma4", "tiny-gemma4-moe", "tiny-gemma4-e",
            "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-nemotron-h", "tiny-falcon-h1", "tiny-llama4-chunked")
NEW_TOKENS = 24  # past the windows of 16
NUM_DRAFTS, TREE_BUDGET = 3, 5


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (12, 20, 7)]


def noisy_copy(model: torch.nn.Module, noise: float) -> torch.nn.Module:
    """The target with every weight moved by noise x its tensor's std: a draft model that agrees often, not always."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in draft.parameters():
            if parameter.numel() > 1:
                step = torch.randn(parameter.shape, generator=generator) * noise * parameter.float().std().item()
                parameter.add_(step.to(parameter.device, parameter.dtype))
    return draft


def family(ctx: Context, name: str) -> tuple[dict, list[str]]:
    from drafters import DraftModelDrafter
    from drafters.draft_model import DraftModelConfig
    from inference.engine.api import speculative_generate, tree_speculative_generate
    from inference.engine.target import TargetModel
    from inference.evaluation.lossless import NEAR_TIE_ULPS

    target = TargetModel.from_pretrained("debug:" + name, dtype=torch.bfloat16, device=ctx.device)
    rows = prompts()
    plain = speculative_generate(target, None, rows, num_draft_tokens=0, max_new_tokens=NEW_TOKENS,
                                 eos_token_ids=[]).tokens
    noise = 0.03 if name.startswith("tiny-gemma4") else 0.1  # Gemma 4 is the more sensitive (as in the CPU tests)
    drafter = DraftModelDrafter(DraftModelConfig(path=name), target.target_info(),
                                model=noisy_copy(target.model, noise))
    chain = speculative_generate(target, drafter, rows, num_draft_tokens=NUM_DRAFTS, max_new_tokens=NEW_TOKENS,
                                 eos_token_ids=[])
    tree = tree_speculative_generate(target, drafter, rows, tree_budget=TREE_BUDGET, max_new_tokens=NEW_TOKENS,
                                     eos_token_ids=[])
    found = {"hf_generate": gaps(target, rows, plain, hf_greedy(target, rows, NEW_TOKENS)),
             "chain": gaps(target, rows, plain, chain.tokens), "tree": gaps(target, rows, plain, tree.tokens)}
    accepted = sum(map(sum, chain.accept_lengths))
    numbers = {way: {"divergences": len(gap), "max_gap_ulps": max(gap, default=None)} for way, gap in found.items()}
    numbers["chain_accepted_of_proposed"] = [accepted, sum(map(sum, chain.proposed))]
    failures = [f"{name} {way}: a divergence of {max(gap):.3g} ulps" for way, gap in found.items()
                if max(gap, default=0) > NEAR_TIE_ULPS]
    return numbers, failures


def chosen() -> tuple[str, ...]:
    """FAMILIES, or the comma-separated subset GPU_CHECK_H_FAMILIES names (the test suite's CPU dry run: there the
    families' own tests run in float64)."""
    names = tuple(n for n in os.environ.get("GPU_CHECK_H_FAMILIES", "").split(",") if n)
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        raise CheckFailed(f"GPU_CHECK_H_FAMILIES: {unknown} are not among {list(FAMILIES)}", {})
    return names or FAMILIES


def run(ctx: Context) -> dict:
    numbers: dict = {"new_tokens": NEW_TOKENS, "rows": len(prompts())}
    failures: list[str] = []
    each_case(ctx, chosen(), lambda name: family(ctx, name), numbers, failures)
    if failures:
        raise CheckFailed("; ".join(failures), numbers)
    return numbers
