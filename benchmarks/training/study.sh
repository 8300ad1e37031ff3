#!/bin/bash
# The study's figure in kind (docs/benchmarks.md, "All drafters in one run"): every SmolLM2 drafter, fixed k vs
# auto vs trees, MT-Bench 2 questions x 2 turns, 64 new tokens, T = 0, one thread per call; the two halves run side
# by side:
#   bash benchmarks/training/study.sh A & bash benchmarks/training/study.sh B; wait
# The checkpoints under runs/bench/ are the ones trained in docs/benchmarks.md's drafter sections (E_cold = the README
# main job's recipe, D_* DSpark, F_* and G_* MTP / Medusa / assistant, G_* being the archived starved run;
# random_eagle3 = benchmarks/engine/random_drafter.py).
set -u
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
B=runs/bench; O=docs/results; mkdir -p $O
C="--target smollm2-135m-instruct --prompts mt_bench --num-prompts 2 --max-new-tokens 64 --temperature 0 --threads 1"
if [ "$1" = A ]; then
  draftsmith eval $C --drafter $B/E_cold/final,$B/D_dflash/final,$B/D_dspark/final,$B/random_eagle3 \
    --num-draft-tokens auto,1,3,7 --tree-budget 4,8 --out $O/study_A.json > $O/study_A.log 2>&1
else
  draftsmith eval $C --drafter $B/F_medusa/final,$B/G_mtp3/final,$B/G_assistant/final \
    --num-draft-tokens auto,1,3 --tree-budget 4,8 --out $O/study_B.json > $O/study_B.log 2>&1
  draftsmith eval $C --drafter $B/F_mtp/final,ngram --num-draft-tokens auto,1 --tree-budget 4 \
    --out $O/study_C.json > $O/study_C.log 2>&1
fi
