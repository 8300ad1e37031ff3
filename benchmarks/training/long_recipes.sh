#!/usr/bin/env bash
# The four long SmolLM2 recipes (recipes/smollm2/*_long.yaml, docs/benchmarks.md "Long recipes"), one after the
# other, every part resumable: run it again after an interruption and nothing finished is redone
# (train.resume_from=latest continues from the newest checkpoint, exactly). The recipes read online features (their
# pricing: benchmarks/training/levers.sh), so there is no cache to prepare.
#   bash benchmarks/training/long_recipes.sh            # all four;  KINDS="eagle3 dflash" for some
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
for kind in ${KINDS:-eagle3 dflash dspark mtp}; do
  if [ -f "runs/smollm2_${kind}_long/final/config.json" ]; then echo "$kind: trained (runs/smollm2_${kind}_long/final)"; continue; fi
  draftsmith train "recipes/smollm2/${kind}_long.yaml" train.resume_from=latest
done
