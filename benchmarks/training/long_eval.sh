#!/usr/bin/env bash
# The long recipes' table (docs/benchmarks.md "Long recipes", the README's long table): each trained long drafter,
# T = 0, batch 1, the baseline interleaved, through the fast path, in three passes appended to one file
# (docs/results/long_KIND_eval.json):
#   1. the held-out ShareGPT slice, 32 questions, every turn, at k = 1, 2, 3, 5, 7 and auto (MTP-3: 1, 2, 3 and auto,
#      its three modules being its longest proposal); each record carries tau's 95% interval over questions;
#   2. MT-Bench, 16 questions (two categories each), at the same k;
#   3. per category: HumanEval (code), GSM8K (math) and Spec-Bench's 13 categories (3 questions each) at the best k of
#      pass 1 (its fastest measured speedup) and at auto k.
# The passes append to runs/long_eval/long_KIND_eval.json (a pass whose records are there is skipped, so an interrupted
# run resumes with the same command); when all three are in, the file goes to docs/results gzipped (-9n, the archive's
# rule for files over 250 KB) with its table (.md).
#   KINDS="eagle3" THREADS=2 bash benchmarks/training/long_eval.sh     # about an hour per drafter on 2 quiet cores
#   HELD_N=2 BENCH_N=1 DOMAIN_N=1 SPEC_N=1 MAX_NEW_TOKENS=8 OUT_DIR=/tmp/le WORK_DIR=/tmp/le_work ...   # a smoke run
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
HELD=recipes/smollm2/data/sharegpt_smollm2_10k.heldout.jsonl
THREADS=${THREADS:-2}
OUT_DIR=${OUT_DIR:-docs/results}
mkdir -p "$OUT_DIR"
RUNS_DIR=${RUNS_DIR:-runs}
WORK_DIR=${WORK_DIR:-$RUNS_DIR/long_eval}

. benchmarks/training/eval_passes.sh  # has FILE DATASET: that pass is in the file

best_k() {  # $1 = eval JSON: the k (not auto) with the best measured speedup on the held-out slice, all categories
  python - "$1" <<'EOF'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["records"] if r["dataset"] == "sharegpt_smollm2_10k.heldout"
        and r["category"] == "all" and r["drafter"] != "none" and r["num_draft_tokens"] != "auto"]
if not rows:
    sys.exit(f"long_eval.sh: {sys.argv[1]} holds no held-out record at a fixed k (KS must name one)")
print(max(rows, key=lambda r: r["speedup"])["num_draft_tokens"])
EOF
}

for kind in ${KINDS:-eagle3 dflash dspark mtp}; do
  final="$RUNS_DIR/smollm2_${kind}_long/final"
  if [ ! -f "$final/config.json" ]; then echo "$kind: not trained ($final)"; continue; fi
  case "$kind" in mtp) ks=1,2,3,auto ;; *) ks=1,2,3,5,7,auto ;; esac
  mkdir -p "$WORK_DIR"
  out="$WORK_DIR/long_${kind}_eval.json"
  common=(--target smollm2-135m-instruct --drafter "$final" --max-new-tokens "${MAX_NEW_TOKENS:-96}"
          --threads "$THREADS" --out "$out")
  run() { OMP_NUM_THREADS=$THREADS draftsmith eval "${common[@]}" "$@"; }
  has "$out" sharegpt_smollm2_10k.heldout || run --prompts "$HELD" --num-prompts "${HELD_N:-32}" \
    --num-draft-tokens "${KS:-$ks}"
  has "$out" mt_bench || run --append --prompts mt_bench --num-prompts "${BENCH_N:-16}" --num-draft-tokens "${KS:-$ks}"
  best=$(best_k "$out")
  for set in humaneval gsm8k spec_bench; do
    case "$set" in spec_bench) n=${SPEC_N:-39} ;; *) n=${DOMAIN_N:-16} ;; esac
    has "$out" "$set" || run --append --prompts "$set" --num-prompts "$n" --num-draft-tokens "$best,auto"
  done
  gzip -9n -c "$out" > "$OUT_DIR/long_${kind}_eval.json.gz"
  cp "$WORK_DIR/long_${kind}_eval.md" "$OUT_DIR/long_${kind}_eval.md"
  echo "$kind: $OUT_DIR/long_${kind}_eval.json.gz and .md"
done
