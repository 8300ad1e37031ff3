#!/usr/bin/env bash
# Fixed k vs adaptive k on SmolLM2-135M-Instruct with every trained drafter and a random-weights one, and a load
# sweep (issue 10 items 1, 2, 5; docs/benchmarks.md section "Adaptive proposal length"). Run from a detached worktree
# of the measured commit with RUNS pointing at the checkpoints:
#   RUNS=/work/main/runs/bench OMP_NUM_THREADS=1 bash benchmarks/bench_adaptive.sh
# Each eval interleaves its methods batch by batch (inference/eval.py); MTP-1 and Medusa-3 cannot propose 7 (3) so
# they get their own runs with the k they support. Sizes are small because the 2 CPU cores were shared by about 12
# processes when this ran (a SmolLM2 step took 0.5-1 s instead of 0.1 s); the four evals can run in parallel.
set -euo pipefail
RUNS=${RUNS:-runs/bench}
OUT=${OUT:-docs/results}
python benchmarks/random_drafter.py "$RUNS/E_cold/final" "$RUNS/random_eagle3" --target smollm2-135m-instruct
COMMON=(--target smollm2-135m-instruct --prompts mt_bench --num-prompts 2 --max-new-tokens 64 --temperature 0
        --batch-size 1 --threads 1)
draftsmith eval "${COMMON[@]}" --num-draft-tokens auto,1,3,7 --out "$OUT/adaptive_chain_block.json" \
    --drafter "$RUNS/E_cold/final,$RUNS/D_dflash/final,$RUNS/D_dspark/final,$RUNS/random_eagle3"
draftsmith eval "${COMMON[@]}" --num-draft-tokens auto,1,3 --drafter "$RUNS/F_medusa/final" \
    --out "$OUT/adaptive_medusa.json"
draftsmith eval "${COMMON[@]}" --num-draft-tokens auto,1 --drafter "$RUNS/F_mtp/final" --out "$OUT/adaptive_mtp.json"
# load: 16 single-turn questions of one category, batch 1, 4, 8, 16
draftsmith eval --target smollm2-135m-instruct --prompts spec_bench --categories qa --num-prompts 16 \
    --max-new-tokens 32 --temperature 0 --threads 1 --batch-size 1,4,8,16 --num-draft-tokens auto,3 \
    --drafter "$RUNS/E_cold/final" --out "$OUT/adaptive_load.json"
