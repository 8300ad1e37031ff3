#!/bin/bash
# MTP-3, reused MTP and the assistant at equal data and CPU budget (docs/benchmarks.md, "MTP, Medusa and the
# KV-sharing assistant"). MTP-3, one MTP module reused for 3 steps and
# the KV-sharing assistant trained together (3 processes on 2 cores, one thread each, 20 wall minutes: 13.2-13.4
# CPU-minutes each, measured with `time`), on the data and overrides of MTP-1 / Medusa-3 (same section); then one
# interleaved eval per k with every drafter beside them (the checkpoints of the drafter sections under runs/bench/).
#   bash benchmarks/training/equal_budget.sh train; bash benchmarks/training/equal_budget.sh eval
set -u
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 WANDB_MODE=offline
R=runs/bench; O=docs/results
if [ "$1" = train ]; then
  D="data.regenerated_path=recipes/smollm2/data/sharegpt_smollm2_regenerated_320.jsonl data.regenerated_mode=replace data.num_samples=160 data.max_length=384 train.max_steps=null train.epochs=10 train.max_time_minutes=20"
  ( time python -m train recipes/smollm2/mtp.yaml $D features.mode=hybrid features.dtype=bfloat16 drafter.num_modules=3 drafter.num_steps=3 output.dir=$R/I_mtp3 features.cache_dir=$R/I_mtp3/features ) > $R/I_mtp3.log 2>&1 &
  ( time python -m train recipes/smollm2/mtp.yaml $D features.mode=hybrid features.dtype=bfloat16 drafter.reuse=true drafter.num_steps=3 output.dir=$R/I_mtp_reuse features.cache_dir=$R/I_mtp_reuse/features ) > $R/I_mtp_reuse.log 2>&1 &
  ( time python -m train recipes/smollm2/assistant.yaml $D output.dir=$R/I_assistant ) > $R/I_assistant.log 2>&1 &
  wait
else
  C="--target smollm2-135m-instruct --prompts mt_bench --num-prompts 4 --max-new-tokens 96 --temperature 0 --threads 1"
  draftsmith eval $C --drafter $R/E_cold/final,$R/F_mtp/final,$R/F_medusa/final,$R/I_mtp3/final,$R/I_mtp_reuse/final,$R/I_assistant/final,$R/D_dflash/final --num-draft-tokens 1 --out $O/equal_budget_k1.json > $O/equal_budget_k1.log 2>&1 &
  draftsmith eval $C --drafter $R/E_cold/final,$R/F_medusa/final,$R/I_mtp3/final,$R/I_mtp_reuse/final,$R/I_assistant/final,$R/D_dflash/final --num-draft-tokens 3 --out $O/equal_budget_k3.json > $O/equal_budget_k3.log 2>&1 &
  wait
fi
