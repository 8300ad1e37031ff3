#!/usr/bin/env bash
# EAGLE-3 on SmolLM2-135M-Instruct: the evaluation behind docs/benchmarks_archive.md, "EAGLE-3: the benchmark drafter
# on 427 conversations".
#   bash benchmarks/training/bench_eagle3.sh            # after the three commands below have produced the checkpoint
# Training (the benchmark recipe; regeneration and the feature cache come first):
#   draftsmith estimate recipes/smollm2/eagle3_full.yaml
#   draftsmith prepare  recipes/smollm2/eagle3_full.yaml
#   draftsmith train    recipes/smollm2/eagle3_full.yaml
# Sizes are small because 2 shared CPU cores decode SmolLM2 at about 8-14 tokens/s; raise --num-prompts for more.
set -euo pipefail
CKPT=${CKPT:-runs/smollm2_eagle3_full/final}
OUT=${OUT:-docs/results}
COMMON=(--target smollm2-135m-instruct --drafter "$CKPT" --prompts mt_bench,gsm8k,humaneval --num-prompts 2
        --num-draft-tokens 1,2,3,4,5,6,7,8 --threads 2)
# T = 0: greedy, every k from 1 to 8
draftsmith eval "${COMMON[@]}" --max-new-tokens 64 --temperature 0 --out "$OUT/eagle3_t0.json"
# T = 1: lossless rejection sampling (shorter answers to fit the same CPU time)
draftsmith eval "${COMMON[@]}" --max-new-tokens 48 --temperature 1 --out "$OUT/eagle3_t1.json"
