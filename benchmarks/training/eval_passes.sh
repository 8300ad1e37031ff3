# Sourced by the training benchmarks that append several `draftsmith eval` passes to one JSON (long_eval.sh,
# levers.sh fr, main_job_rechoice.sh): a pass whose dataset already has records in the file is done, so an
# interrupted script resumes with its own command. One rule for all three, read from the file itself.
has() {  # $1 = eval JSON, $2 = dataset name (sharegpt_smollm2_10k.heldout, mt_bench, ...): true when it has records
  [ -f "$1" ] && python - "$1" "$2" <<'PY'
import json, sys
sys.exit(0 if any(r["dataset"] == sys.argv[2] for r in json.load(open(sys.argv[1]))["records"]) else 1)
PY
}
