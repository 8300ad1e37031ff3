"""D. Lossless decoding on the device with the drafters B trained, loaded from disk.

1. `python -m train.cli eval` as users run it (the n-gram drafter and B's final drafters, greedy, k = 2), twice:
   --dtype float32, where every output must equal plain greedy's exactly; and --dtype bfloat16, where the report's
   match rate is recorded and every divergence must be a near-tie of the target's logits (the report's
   divergences_all_near_ties, inference/evaluation/lossless.py). Where the report says where the drafter ran
   (drafter_device / drafter_dtype) it must be the target's device and dtype.
2. In this process, bf16, all prompts in one batch (left padding, rows finishing apart): each drafter loaded as eval
   loads it (`TargetModel.serve`) against plain greedy through the same engine, every divergence a near-tie; plain
   greedy through the engine against HF `generate`, likewise; and one sampled run (temperature 1) per drafter, which
   must run and emit every token (the CPU tests prove the sampling law).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch

from benchmarks.gpu_check.context import KINDS, CheckFailed, Context, each_case, free_memory

TARGET = "debug:tiny-llama"
NUM_DRAFTS = 2  # every debug recipe drafts at least 2 (tiny_mtp: 2 modules)


def trained_drafters(ctx: Context) -> dict[str, str]:
    """{kind: B's final directory} for the kinds B finished."""
    from benchmarks.gpu_check.b_train import final_dir

    return {kind: final_dir(ctx, kind) for kind in KINDS
            if os.path.isfile(os.path.join(final_dir(ctx, kind), "config.json"))}


def eval_cli(ctx: Context, dtype: str, drafters: list[str]) -> tuple[dict, list[str]]:
    """One `eval` run from the command line; {method: its numbers} and the failures."""
    out = ctx.path("runs", "d", dtype, "report.json")
    s = ctx.sizes
    # on CPU the default target path times its kernels first (~20 s of the dry run's budget); a GPU runs the model's
    # own modules either way, which is what "hf" names
    cpu_path = ["--target-path", "hf"] if ctx.cpu else []
    rc, why = ctx.run(f"d_eval_{dtype}", ctx.python(
        "-m", "train.cli", "eval", "--target", TARGET, "--drafter", ",".join(["ngram", *drafters]),
        "--prompts", "mt_bench", "--num-prompts", str(s.eval_prompts), "--max-new-tokens", str(s.eval_tokens),
        "--num-draft-tokens", str(NUM_DRAFTS), "--dtype", dtype, "--out", out, *cpu_path))
    if rc:
        return {}, [f"eval --dtype {dtype} exited {rc}: {why}"]
    shutil.copy(out.removesuffix(".json") + ".md", os.path.join(ctx.log_dir, f"d_eval_{dtype}_report.md"))
    with open(out) as f:
        report = json.load(f)
    numbers, failures = {}, []
    for record in report["records"]:
        if record["category"] != "all" or record["drafter"] == "none":
            continue
        name = record["drafter"]
        numbers[name] = {key: record.get(key) for key in ("greedy_exact_match", "divergences",
                                                          "divergences_all_near_ties", "divergence_max_gap_ulps",
                                                          "tau", "drafter_device", "drafter_dtype")}
        if dtype == "float32" and record["greedy_exact_match"] != 1.0:  # a GPU's 1-row and k+1-row GEMMs may part
            ties = record.get("divergences_all_near_ties")  # at a near-tie: the cause is named either way
            failures.append(f"eval fp32 {name}: greedy exact match {record['greedy_exact_match']} (divergences "
                            f"{'all near-ties' if ties else 'not all near-ties'}, max "
                            f"{record.get('divergence_max_gap_ulps')} ulps)")
        if dtype != "float32" and record.get("divergences_all_near_ties", True) is False:
            failures.append(f"eval bf16 {name}: a divergence that is not a near-tie "
                            f"({record.get('divergence_max_gap_ulps')} ulps)")
        env = record["env"]
        placed = (record.get("drafter_device") or env["device"], record.get("drafter_dtype") or env["dtype"])
        if placed != (env["device"], env["dtype"]):
            failures.append(f"eval {dtype} {name}: the drafter ran on {placed}, the target on "
                            f"{(env['device'], env['dtype'])}")
    if not numbers:
        failures.append(f"eval --dtype {dtype}: the report holds no drafter record")
    return numbers, failures


def gaps(target, prompts: list[list[int]], plain: list[list[int]], other: list[list[int]]) -> list[float]:
    """The near-tie gap (ulps, lossless.divergence_gap) of every row of `other` that parts from `plain`."""
    from inference.evaluation.lossless import divergence_gap

    return [divergence_gap(target, prompt, a, b) for prompt, a, b in zip(prompts, plain, other) if a != b]


def hf_greedy(target, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF `generate`, greedy, one prompt at a time (no padding), never stopping early: no EOS at all, as the engine
    runs here (`min_new_tokens` would instead mask the EOS logit, and generate would pick another token wherever
    the target's argmax is EOS)."""
    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=target.device)
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=target.pad_token_id)
        rows.append(out[0, len(prompt):].tolist())
    return rows


def in_process(ctx: Context, drafters: dict[str, str]) -> tuple[dict, list[str]]:
    """bf16, batched: each drafter against plain greedy, plain greedy against HF generate, one sampled run each."""
    from drafters import load_drafter
    from inference.engine.api import speculative_generate
    from inference.engine.target import TargetModel
    from inference.evaluation.lossless import NEAR_TIE_ULPS
    from train.fit.metrics import load_eval_prompts

    target = TargetModel.from_pretrained(TARGET, dtype=torch.bfloat16, device=ctx.device)
    s = ctx.sizes
    prompts = load_eval_prompts(target.tokenizer, "mt_bench", max(2, s.eval_prompts))
    plain = speculative_generate(target, None, prompts, num_draft_tokens=0, max_new_tokens=s.eval_tokens,
                                 eos_token_ids=[]).tokens
    hf = gaps(target, prompts, plain, hf_greedy(target, prompts, s.eval_tokens))
    numbers: dict = {"near_tie_ulps": NEAR_TIE_ULPS, "rows": len(prompts),
                     "engine_vs_hf_generate": {"divergences": len(hf), "max_gap_ulps": max(hf, default=None)}}
    failures = []
    if max(hf, default=0) > NEAR_TIE_ULPS:
        failures.append(f"engine greedy vs HF generate: a divergence of {max(hf):.3g} ulps")

    def check(kind: str) -> tuple[dict, list[str]]:
        drafter = target.serve(load_drafter(drafters[kind], target.target_info()))
        spec = speculative_generate(target, drafter, prompts, num_draft_tokens=NUM_DRAFTS,
                                    max_new_tokens=s.eval_tokens, eos_token_ids=[])
        found = gaps(target, prompts, plain, spec.tokens)
        sampled = speculative_generate(target, drafter, prompts, num_draft_tokens=NUM_DRAFTS,
                                       max_new_tokens=s.eval_tokens, temperature=1.0, seed=0, eos_token_ids=[])
        failed = []
        if max(found, default=0) > NEAR_TIE_ULPS:
            failed.append(f"{kind} bf16 batched: a divergence of {max(found):.3g} ulps")
        if any(len(row) != s.eval_tokens for row in sampled.tokens):
            failed.append(f"{kind}: the sampled run stopped short")
        return {"match_rate": round(1 - len(found) / len(prompts), 3), "divergences": len(found),
                "max_gap_ulps": max(found, default=None), "sampled_tokens": sum(map(len, sampled.tokens))}, failed

    each_case(ctx, list(drafters), check, numbers, failures)
    target = None  # the device's copy goes before free_memory
    free_memory(ctx.device)
    return numbers, failures


def run(ctx: Context) -> dict:
    drafters = trained_drafters(ctx)
    made = [os.path.getmtime(os.path.join(d, "config.json")) for d in drafters.values()]
    # B of this call, or of an earlier one on the same machine (`--sections D` alone): the age says which
    numbers: dict = {"drafters_from_b": sorted(drafters),
                     "b_drafters_age_s": round(time.time() - min(made)) if made else None}
    missing = sorted(set(KINDS) - set(drafters))
    failures = [f"B left no trained drafter for {missing}"] if missing else []
    for dtype in ("float32", "bfloat16"):
        numbers[f"eval_{dtype}"], failed = eval_cli(ctx, dtype, list(drafters.values()))
        failures += failed
    numbers["in_process_bf16"], failed = in_process(ctx, drafters)
    failures += failed
    if failures:
        raise CheckFailed("; ".join(failures), numbers)
    return numbers
