#!/bin/bash
# Starting from a trained drafter (train.init_from) against starting from scratch, on a new domain at equal budget
# (docs/benchmarks.md, "Starting from a trained drafter"): the long EAGLE-3 (runs/smollm2_eagle3_long/final, from
# recipes/smollm2/eagle3_long.yaml) fine-tuned by recipes/smollm2/eagle3_gsm8k.yaml on SmolLM2's answers to 1,000 GSM8K
# train questions, beside the long recipe's drafter trained from scratch on the same data, optimizer as its recipe; 2
# processes on 2 cores, one thread each, 20 wall minutes each. Then one interleaved eval (2 threads) at k = 1, 3 of the
# two and of the drafter the fine-tune started from, on GSM8K test questions (the domain) and held-out ShareGPT ones.
#   bash benchmarks/training/warm_start.sh train; bash benchmarks/training/warm_start.sh eval
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 WANDB_MODE=offline
R=runs/bench; O=docs/results; BASE=runs/smollm2_eagle3_long/final
mkdir -p $R
if [ "$1" = train ]; then
  [ -f $BASE/config.json ] || { echo "train $BASE first: draftsmith train recipes/smollm2/eagle3_long.yaml"; exit 2; }
  export OMP_NUM_THREADS=1
  ( time python -m train recipes/smollm2/eagle3_gsm8k.yaml train.init_from=$BASE output.dir=$R/W_warm ) > $R/W_warm.log 2>&1 &
  ( time python -m train recipes/smollm2/eagle3_long.yaml data.path=recipes/smollm2/data/gsm8k_smollm2_1k.jsonl.gz \
      data.regenerated_path=null data.mix=[] train.max_time_minutes=20 train.save_every=100 train.keep_last=1 \
      train.eval_every=null eval.num_prompts=0 output.dir=$R/W_scratch ) > $R/W_scratch.log 2>&1 &
  wait
else  # each drafter under its own name in the reports (a drafter is named by its directory)
  L=$R/W_labels; rm -rf $L && mkdir -p $L && cp -r $BASE $L/long_base && cp -r $R/W_warm/final $L/gsm8k_finetuned &&
    cp -r $R/W_scratch/final $L/gsm8k_scratch || exit 1
  DRAFTERS=$L/long_base,$L/gsm8k_finetuned,$L/gsm8k_scratch
  draftsmith eval --target smollm2-135m-instruct --prompts gsm8k --num-prompts 16 --max-new-tokens 96 --temperature 0 \
    --threads 2 --drafter $DRAFTERS --num-draft-tokens 1,3 --out $O/warm_start.json > $R/warm_start_eval.log 2>&1 &&
  draftsmith eval --target smollm2-135m-instruct --prompts recipes/smollm2/data/sharegpt_smollm2_10k.heldout.jsonl \
    --num-prompts 16 --max-new-tokens 96 --temperature 0 --threads 2 --drafter $DRAFTERS --num-draft-tokens 1,3 \
    --append --out $O/warm_start.json >> $R/warm_start_eval.log 2>&1 &&
  gzip -9nf $O/warm_start.json && rm -f $O/warm_start_*.png
fi
