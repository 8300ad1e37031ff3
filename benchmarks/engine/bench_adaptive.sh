#!/usr/bin/env bash
# Fixed k vs adaptive k on SmolLM2-135M-Instruct with every trained drafter and a random-weights one, a load sweep,
# the broken-drafter check and the engine's overhead (docs/benchmarks.md, "Adaptive k"). Run from a detached
# worktree of the measured commit with RUNS pointing at the checkpoints:
#   RUNS=/work/main/runs/bench OMP_NUM_THREADS=1 bash benchmarks/engine/bench_adaptive.sh
# Each eval interleaves its methods batch by batch (inference/evaluation/eval.py); each drafter has its own run (and AR
# baseline) so the runs can go in parallel, and MTP-1 / Medusa-3 get the k they support. Sizes are small because the
# 2 CPU cores were shared by about 15 processes when this ran (a SmolLM2 step took 1-1.6 s instead of 0.1 s).
set -euo pipefail
RUNS=${RUNS:-runs/bench}
OUT=${OUT:-docs/results}
python benchmarks/engine/random_drafter.py "$RUNS/E_cold/final" "$RUNS/random_eagle3" --target smollm2-135m-instruct
COMMON=(--target smollm2-135m-instruct --prompts mt_bench --num-prompts 2 --max-new-tokens 64 --temperature 0
        --batch-size 1 --threads 1)
for drafter in E_cold/final D_dflash/final D_dspark/final random_eagle3; do
    draftsmith eval "${COMMON[@]}" --num-draft-tokens auto,1,3,7 --drafter "$RUNS/$drafter" \
        --out "$OUT/adaptive_$(dirname "$drafter/x" | cut -d/ -f1).json" &
done
draftsmith eval "${COMMON[@]}" --num-draft-tokens auto,1,3 --drafter "$RUNS/F_medusa/final" \
    --out "$OUT/adaptive_medusa.json" &
draftsmith eval "${COMMON[@]}" --num-draft-tokens auto,1 --drafter "$RUNS/F_mtp/final" --out "$OUT/adaptive_mtp.json" &
# load: 16 single-turn questions of one category at batch 1, 4, 8, 16 (k = 3; the profile per batch size is the
# expensive part of auto at batch 16 on this CPU)
draftsmith eval --target smollm2-135m-instruct --prompts spec_bench --categories qa --num-prompts 16 \
    --max-new-tokens 16 --temperature 0 --threads 1 --batch-size 1,4,8,16 --num-draft-tokens 3 \
    --drafter "$RUNS/E_cold/final" --out "$OUT/adaptive_load.json" &
# the broken drafter against AR, call by call; the engine's verify against the bare forward
python benchmarks/engine/adaptive_vs_ar.py --drafter "$RUNS/random_eagle3" --max-new-tokens 32 --repeats 7 \
    --out "$OUT/adaptive_vs_ar.json" &
python benchmarks/engine/engine_overhead.py --max-k 15 --repeats 5 --context 300 --out "$OUT/engine_overhead.json" &
wait
