"""vLLM CPU at temperature > 0: the target probabilities its rejection sampler receives, and the acceptance it reaches.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 VLLM_ENV/bin/python benchmarks/peers/vllm_cpu_sampling_probe.py \
        --target DIR --export EAGLE3_EXPORT --prompts-file PROMPTS.json --k 3 --max-new-tokens 64

Runs inside the vLLM environment with this checkout on PYTHONPATH. PROMPTS.json: a list of token-id lists (the prompts
as our engine renders them). For T = 0 and T = 1 it serves the EAGLE-3 export (method eagle3, the engine arguments every
CPU engine of ours takes: train/features/vllm_features.eager_kwargs, fp32) and prints tau = 1 + accepted / drafts from
vLLM's spec-decode counters; at T = 1 it also wraps vllm-cpu's rejection kernel to count the rows of target
probabilities that hold a NaN (vllm-cpu 0.32: most of them, so nearly every draft is rejected; docs/distributed.md,
"vllm-cpu at temperature > 0").
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--export", required=True)
    parser.add_argument("--prompts-file", required=True)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    import torch
    import vllm.utils.cpu_triton_utils as cpu_kernels

    rows = {"nan": 0, "all": 0}
    kernel = cpu_kernels._rejection_random_sample_kernel_impl

    def counted(output, cu, draft_ids, draft_probs, target_probs, *rest, **options):
        rows["nan"] += int(torch.isnan(target_probs).any(-1).sum())
        rows["all"] += target_probs.shape[0]
        return kernel(output, cu, draft_ids, draft_probs, target_probs, *rest, **options)

    cpu_kernels._rejection_random_sample_kernel_impl = counted  # platforms/cpu.py maps the Triton kernel to it
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    from train.features.vllm_features import eager_kwargs

    with open(args.prompts_file) as f:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in json.load(f)]
    for temperature in (0.0, 1.0):
        llm = LLM(model=args.target, speculative_config={"method": "eagle3", "model": args.export,
                                                          "num_speculative_tokens": args.k},
                  **eager_kwargs(True), disable_log_stats=False, dtype="float32", max_model_len=2048, seed=0,
                  gpu_memory_utilization=0.1)
        llm.generate(prompts, SamplingParams(temperature=temperature, max_tokens=args.max_new_tokens, seed=0),
                     use_tqdm=False)
        metrics = {m.name: m for m in llm.get_metrics()}
        drafts = metrics["vllm:spec_decode_num_drafts"].value
        accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
        print(json.dumps({"temperature": temperature, "tau": round(1 + accepted / drafts, 4), "rounds": drafts,
                          "target_prob_rows_with_nan": rows["nan"], "target_prob_rows": rows["all"]}), flush=True)
        del llm
        cleanup_dist_env_and_memory()


if __name__ == "__main__":
    main()
