#!/usr/bin/env bash
# Issue 37's main-job re-choice: the README's main job (recipes/smollm2/eagle3.yaml, 13 minutes at most) as written,
# against the same recipe with the three EAGLE-3 levers the screen kept for the long recipe (docs/results/
# levers_screen.md: five taps, TTT from the first step, the fc started as the top tap). Both train one after the
# other on the same machine at THREADS threads (the main job's own conditions), then one `draftsmith eval` call
# decodes with both, interleaved, on the held-out slice (32 questions, every turn) and on MT-Bench (the README's
# 4 questions), T = 0, batch 1, k = 1, 2, 3 and auto. A variant replaces the recipe when it reads a higher held-out
# tau per training CPU-minute and is no slower at its best k.
#   THREADS=2 bash benchmarks/training/main_job_rechoice.sh        # ~2 x 13 min of training + ~15 min of decoding
#   SMOKE=1 bash benchmarks/training/main_job_rechoice.sh          # 2 steps each, 1 prompt x 8 tokens (minutes)
# Resumable: a finished training or evaluation pass is skipped. Output: $OUT (default runs/main_job_rechoice/) with
# train_seconds.json (each variant's steps and wall seconds) and eval.json / eval.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
. benchmarks/training/eval_passes.sh  # has FILE DATASET: that eval pass is in the file
export HF_HUB_OFFLINE=1
THREADS=${THREADS:-2}
OUT=${OUT:-runs/main_job_rechoice}
HELD=recipes/smollm2/data/sharegpt_smollm2_10k.heldout.jsonl
RECIPE=recipes/smollm2/eagle3.yaml
WINNERS=("drafter.layer_ids=[2, 9, 15, 21, 27]" "train.phases=[]" "drafter.fc_init=identity_high")
held_n=32 bench_n=4 tokens=96 small=()
if [ -n "${SMOKE:-}" ]; then
  held_n=1 bench_n=1 tokens=8
  small=(data.num_samples=4 data.num_eval_samples=2 train.epochs=null train.max_steps=2 eval.num_prompts=0
         eval.num_batches=1)
fi
mkdir -p "$OUT"

train() {  # $1 = variant name, the rest: overrides
  local name=$1; shift
  local dir="$OUT/$name"
  [ -f "$dir/final/config.json" ] && return 0
  local start end
  start=$(date +%s.%N)
  OMP_NUM_THREADS=$THREADS draftsmith train "$RECIPE" "output.dir=$dir" "features.cache_dir=$dir/features" \
    train.save_every=1000000 "${small[@]}" "$@"  # the one checkpoint, at the last step, records steps and seconds
  end=$(date +%s.%N)
  python - "$dir" "$start" "$end" "$OUT/train_seconds.json" "$THREADS" <<'EOF'
import json, os, sys
from train.fit.checkpoint import list_checkpoints
run, start, end, path, threads = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5])
state = json.load(open(os.path.join(list_checkpoints(run)[-1][1], "trainer_state.json")))
table = json.load(open(path)) if os.path.exists(path) else {}
table[os.path.basename(run)] = {"steps": state["step"], "train_seconds": round(state["elapsed_seconds"], 1),
                                "wall_seconds": round(end - start, 1), "threads": threads}
json.dump(table, open(path, "w"), indent=1)
EOF
}

train base
train winners "${WINNERS[@]}"
mkdir -p "$OUT/named"  # each drafter under its variant's name (eval names a drafter by its directory: eagle3:base)
ln -sfn ../base/final "$OUT/named/base"
ln -sfn ../winners/final "$OUT/named/winners"
common=(--target smollm2-135m-instruct --drafter "$OUT/named/base,$OUT/named/winners" --max-new-tokens "$tokens"
        --threads "$THREADS" --num-draft-tokens 1,2,3,auto --out "$OUT/eval.json")
has "$OUT/eval.json" sharegpt_smollm2_10k.heldout ||
  OMP_NUM_THREADS=$THREADS draftsmith eval "${common[@]}" --prompts "$HELD" --num-prompts "$held_n"
has "$OUT/eval.json" mt_bench ||
  OMP_NUM_THREADS=$THREADS draftsmith eval "${common[@]}" --append --prompts mt_bench --num-prompts "$bench_n"
cat "$OUT/train_seconds.json"
