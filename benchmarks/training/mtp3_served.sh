#!/bin/bash
# MTP-3 (3 distinct modules, trained on DeepSeek-V3's depths: recipes/smollm2/mtp.yaml drafter.num_modules=3
# drafter.num_steps=3, 13 wall minutes at one thread) read two ways on the same weights (docs/benchmarks.md, "MTP:
# the steps the server runs"): by depths, as the engine proposes a native checkpoint of several modules, and as vLLM
# 0.32 and SGLang run an export of it (MTPConfig.proposer "server": the first module at every step, the others never:
# vLLM's proposer passes its MTP model no step index). One interleaved eval at k = 1, 3, 2 threads.
#   bash benchmarks/training/mtp3_served.sh train; bash benchmarks/training/mtp3_served.sh eval
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 WANDB_MODE=offline
R=runs/bench; O=docs/results
mkdir -p $R
if [ "$1" = train ]; then
  OMP_NUM_THREADS=1 python -m train recipes/smollm2/mtp.yaml drafter.num_modules=3 drafter.num_steps=3 \
    output.dir=$R/M3 > $R/M3.log 2>&1
else
  L=$R/M3_labels; rm -rf $L && mkdir -p $L && cp -r $R/M3/final $L/mtp3_depths && cp -r $R/M3/final $L/mtp3_as_served
  python - <<'PY'
import json
path = "runs/bench/M3_labels/mtp3_as_served/config.json"
config = json.load(open(path))
config["drafter_config"]["proposer"] = "server"  # the same weights, as vLLM runs an export of them
json.dump(config, open(path, "w"), indent=2)
PY
  draftsmith eval --target smollm2-135m-instruct --prompts mt_bench --num-prompts 8 --max-new-tokens 96 --temperature 0 \
    --threads 2 --drafter $L/mtp3_depths,$L/mtp3_as_served --num-draft-tokens 1,3 \
    --out $O/mtp3_served.json > $R/mtp3_served_eval.log 2>&1 && gzip -9nf $O/mtp3_served.json && rm -f $O/mtp3_served_*.png
fi
