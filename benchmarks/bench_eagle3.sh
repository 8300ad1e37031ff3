#!/usr/bin/env bash
# EAGLE-3 on SmolLM2-135M-Instruct: the runs behind docs/benchmarks.md section 2.
#   bash benchmarks/bench_eagle3.sh            # after the three commands below have produced the checkpoint
# Training (the benchmark recipe; regeneration and the feature cache come first):
#   draftsmith estimate recipes/smollm2/eagle3_full.yaml
#   draftsmith prepare  recipes/smollm2/eagle3_full.yaml
#   draftsmith train    recipes/smollm2/eagle3_full.yaml
set -euo pipefail
CKPT=${CKPT:-runs/smollm2_eagle3_full/final}
OUT=${OUT:-docs/results}
COMMON=(--target smollm2-135m-instruct --drafter "$CKPT" --num-prompts 3 --max-new-tokens 96 --threads 2)
# T = 0, every k on MT-Bench (both turns), odd k on GSM8K and HumanEval
draftsmith eval "${COMMON[@]}" --prompts mt_bench --num-draft-tokens 1,2,3,4,5,6,7,8 --temperature 0 \
  --out "$OUT/eagle3_mt_bench_t0.json"
draftsmith eval "${COMMON[@]}" --prompts gsm8k,humaneval --num-draft-tokens 1,3,5,7 --temperature 0 \
  --out "$OUT/eagle3_gsm8k_humaneval_t0.json"
# T = 1 (lossless rejection sampling), all three sets
draftsmith eval "${COMMON[@]}" --prompts mt_bench,gsm8k,humaneval --num-draft-tokens 3,5,7 --temperature 1 \
  --out "$OUT/eagle3_all_t1.json"
