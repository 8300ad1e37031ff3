#!/usr/bin/env bash
# DFlash vs EAGLE-3 on SmolLM2-135M-Instruct at equal data and equal CPU budget (docs/benchmarks.md, "DFlash vs
# EAGLE-3"). Both train concurrently (one thread each, so a shared machine loads them alike) for 13 wall minutes on
# the same 160 conversations whose answers SmolLM2 regenerated (recipes/smollm2/data/, written by the `prepare` line),
# with features extracted in the first epoch and reused afterwards (hybrid cache); then one interleaved eval per
# temperature on held-out MT-Bench prompts at k = 1, 3, 7, 15.
#   bash benchmarks/training/bench_dflash.sh
set -euo pipefail
OUT=${OUT:-runs/bench}
DATA=recipes/smollm2/data/sharegpt_smollm2_regenerated_320.jsonl
if [ ! -f "$DATA" ]; then  # about 25 minutes on one core; the file is committed, so this normally does not run
  draftsmith prepare recipes/smollm2/eagle3_full.yaml data.regenerated_path=$DATA regenerate.num_conversations=320 \
    regenerate.max_new_tokens=192 features.mode=online output.dir=$OUT/regen
fi
COMMON=(data.regenerated_path=$DATA data.regenerated_mode=replace data.num_samples=160 data.max_length=384
        features.mode=hybrid features.dtype=bfloat16 train.max_steps=null train.epochs=10 train.max_time_minutes=13
        train.save_every=null eval.num_draft_tokens=7)
OMP_NUM_THREADS=1 draftsmith train recipes/smollm2/eagle3.yaml "${COMMON[@]}" features.cache_dir=$OUT/A_eagle3/features \
  output.dir=$OUT/A_eagle3 > $OUT/A_eagle3.log 2>&1 &
OMP_NUM_THREADS=1 draftsmith train recipes/smollm2/dflash.yaml "${COMMON[@]}" features.cache_dir=$OUT/A_dflash/features \
  output.dir=$OUT/A_dflash drafter.block_size=16 drafter.num_anchors=16 > $OUT/A_dflash.log 2>&1 &
wait
# The CPU-sized DFlash variant (block 8, one layer, 8k draft vocabulary, 48 anchors, lr 2e-3), same data and budget.
OMP_NUM_THREADS=1 draftsmith train recipes/smollm2/dflash.yaml "${COMMON[@]}" features.cache_dir=$OUT/B_dflash/features \
  output.dir=$OUT/B_dflash drafter.block_size=8 drafter.num_anchors=48 drafter.num_layers=1 drafter.draft_vocab_size=8192 \
  optim.lr=2e-3 > $OUT/B_dflash.log 2>&1
for T in 0 1; do
  OMP_NUM_THREADS=1 draftsmith eval --target smollm2-135m-instruct --drafter $OUT/A_eagle3/final,$OUT/A_dflash/final \
    --prompts mt_bench --num-prompts 4 --max-new-tokens 64 --num-draft-tokens 1,3,7,15 --temperature $T --threads 1 \
    --out $OUT/A_eval/t$T.json > $OUT/A_eval_t$T.log 2>&1 &
done
wait
