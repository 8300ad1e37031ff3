#!/usr/bin/env bash
# The long recipes' table (docs/benchmarks.md "Long recipes"): each trained long drafter on the held-out ShareGPT
# slice and on MT-Bench, T = 0, batch 1, k = 1, 2, 3, 5, 7 and auto (MTP-3: 1, 2, 3 and auto, its three modules
# being its longest proposal), the baseline interleaved, through the fast path.
#   KINDS="eagle3" THREADS=2 bash benchmarks/training/long_eval.sh     # one JSON per kind in docs/results/
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
HELD=recipes/smollm2/data/sharegpt_smollm2_10k.heldout.jsonl
for kind in ${KINDS:-eagle3 dflash dspark mtp}; do
  final="runs/smollm2_${kind}_long/final"
  if [ ! -f "$final/config.json" ]; then echo "$kind: not trained ($final)"; continue; fi
  case "$kind" in mtp) ks=1,2,3,auto ;; *) ks=1,2,3,5,7,auto ;; esac
  OMP_NUM_THREADS=${THREADS:-2} draftsmith eval --target smollm2-135m-instruct --drafter "$final" \
    --prompts "$HELD,mt_bench" --num-prompts ${NUM_PROMPTS:-10} --max-new-tokens ${MAX_NEW_TOKENS:-96} \
    --num-draft-tokens "${KS:-$ks}" --threads ${THREADS:-2} --out "docs/results/long_${kind}_eval.json"
done
