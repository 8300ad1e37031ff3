#!/bin/bash
# One MTP module reused for 3 steps, trained on the steps the server runs (proposer "server", the default for one
# module) or on DeepSeek-V3's depths ("depths"), at equal data and CPU budget (docs/benchmarks.md, "MTP: the steps the
# server runs"): the data and overrides of benchmarks/training/equal_budget.sh's reused MTP, 2 processes on 2 cores, one
# thread each, 20 wall minutes. Then one interleaved eval at k = 1, 3 of: the server-trained drafter, the
# depths-trained one proposing as the server does (what vLLM would measure of it), and the depths-trained one proposing
# by depths (what the engine reported before it proposed as the server does).
#   bash benchmarks/training/mtp_proposer.sh train; bash benchmarks/training/mtp_proposer.sh eval
set -u
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 WANDB_MODE=offline
R=runs/bench; O=docs/results
mkdir -p $R
if [ "$1" = train ]; then
  D="data.regenerated_path=recipes/smollm2/data/sharegpt_smollm2_regenerated_320.jsonl data.regenerated_mode=replace data.num_samples=160 data.max_length=384 train.max_steps=null train.epochs=10 train.max_time_minutes=20"
  M="features.mode=hybrid features.dtype=bfloat16 drafter.reuse=true drafter.num_steps=3"
  for P in server depths; do
    ( time python -m train recipes/smollm2/mtp.yaml $D $M drafter.proposer=$P output.dir=$R/P_mtp_$P features.cache_dir=$R/P_mtp_$P/features ) > $R/P_mtp_$P.log 2>&1 &
  done
  wait
else
  rm -rf $R/P_mtp_depths_as_served && cp -r $R/P_mtp_depths/final $R/P_mtp_depths_as_served
  python - <<'PY'
import json
path = "runs/bench/P_mtp_depths_as_served/config.json"
config = json.load(open(path))
config["drafter_config"]["proposer"] = "server"  # the same weights, proposing as vLLM runs them
json.dump(config, open(path, "w"), indent=2)
PY
  draftsmith eval --target smollm2-135m-instruct --prompts mt_bench --num-prompts 8 --max-new-tokens 96 --temperature 0 \
    --threads 2 --drafter $R/P_mtp_server/final,$R/P_mtp_depths_as_served,$R/P_mtp_depths/final --num-draft-tokens 1,3 \
    --out $O/mtp_proposer.json > $R/mtp_proposer_eval.log 2>&1 && gzip -9nf $O/mtp_proposer.json && rm -f $O/mtp_proposer_*.png
fi
