#!/usr/bin/env bash
# The GPU check: a few minutes on one GPU machine (AMD with ROCm or NVIDIA with CUDA).
#   bash benchmarks/gpu_check.sh [--cpu] [RESULTS_DIR]
# RESULTS_DIR defaults to $OUT when it is set, else runs/gpu_check. It runs, in order:
#   1. every debug recipe (recipes/debug/tiny_*.yaml) under bf16 autocast (accelerate --mixed_precision bf16);
#   2. FSDP2 with one process (recipes/accelerate/8gpu_fsdp.yaml, --num_processes 1) on the EAGLE-3 debug recipe;
#   3. training tokens/s of EAGLE-3 and DFlash on SmolLM2 (draftsmith estimate's probe: real optimizer steps,
#      online features, the target in bf16 on a GPU);
#   4. a short EAGLE-3 training on SmolLM2 and the engine's speedup with it and with n-gram lookup
#      (draftsmith eval, k = 1 and 3, against autoregression through the same engine);
#   5. the target on a distributed engine: sharded == replicated features, a sharded training on 2 GPUs (when
#      there are 2), vLLM's features == HF's (when VLLM_PYTHON imports vllm);
#   6. streamed features against an offline cache (peak disk, tokens/s), with an HF and (when installed) a vLLM
#      producer.
# Every step writes its log under RESULTS_DIR; RESULTS_DIR/summary.md has one line per step (ok / FAILED, the number
# it measured) and the machine it ran on; copy its numbers into docs/benchmarks.md. A failing step does not stop the
# others; the exit status is the number of failed steps.
# --cpu: the same steps on CPU with tiny budgets (a dry run that proves the script works without a GPU). On CPU
# accelerate runs the FSDP config as a plain single process: the summary's "launch:" lines say what each launch
# became, so only a GPU run exercises FSDP itself.
set -uo pipefail
cd "$(dirname "$0")/.."

CPU_FLAG=()
if [[ "${1:-}" == "--cpu" ]]; then
    CPU_FLAG=(--cpu)
    shift
fi
RESULTS=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$RESULTS"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
if [[ ${#CPU_FLAG[@]} -gt 0 ]]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    DEBUG_STEPS=2; PROBE_STEPS=1; SMOLLM2_TRAIN=(train.max_steps=2 train.epochs=null); NUM_PROMPTS=1; NEW_TOKENS=12
else
    DEBUG_STEPS=20; PROBE_STEPS=10; SMOLLM2_TRAIN=(train.max_time_minutes=3); NUM_PROMPTS=8; NEW_TOKENS=128
fi
LAUNCH=(python -m accelerate.commands.launch "${CPU_FLAG[@]}")
SUMMARY="$RESULTS/summary.md"
FAILED=0

python - > "$SUMMARY" <<'EOF'
import platform, torch
name = "cpu"
if torch.accelerator.is_available():
    device = torch.accelerator.current_accelerator()
    name = getattr(torch, device.type).get_device_name(0)
hip = getattr(torch.version, "hip", None)
print(f"# GPU check\n\nmachine: {name}; torch {torch.__version__}" + (f", HIP {hip}" if hip else "")
      + f"; python {platform.python_version()}\n")
EOF

cat > "$RESULTS/launch_state.py" <<'EOF'
import torch
from accelerate import Accelerator

accelerator = Accelerator(cpu=not torch.accelerator.is_available())
print(f"    launch: {accelerator.distributed_type.value}, mixed precision {accelerator.mixed_precision}, "
      f"{accelerator.num_processes} process(es) on {accelerator.device}")
EOF
launch_state() {  # launch_state LAUNCH_FLAGS...: what accelerate makes of these flags here (a CPU run falls back)
    "${LAUNCH[@]}" "$@" "$RESULTS/launch_state.py" 2> /dev/null | grep "launch:" >> "$SUMMARY"
}

step() {  # step NAME LOG COMMAND...: run, log, and record ok / FAILED with the exit status
    local name=$1 log=$2
    shift 2
    local started=$SECONDS
    if "$@" > "$log" 2>&1; then
        echo "- ok     $name ($((SECONDS - started)) s)" >> "$SUMMARY"
    else
        echo "- FAILED $name (exit $?, $((SECONDS - started)) s; see $log)" >> "$SUMMARY"
        FAILED=$((FAILED + 1))
    fi
    tail -n 1 "$SUMMARY"
}

DEBUG_OVERRIDES=(train.max_steps=$DEBUG_STEPS train.epochs=null train.save_every=null train.eval_every=null
                 train.keep_last=null data.num_samples=16 eval.num_prompts=1 eval.max_new_tokens=8 eval.num_batches=1)
launch_state --num_processes 1 --mixed_precision bf16
for recipe in recipes/debug/tiny_*.yaml; do
    kind=$(basename "$recipe" .yaml)
    step "bf16 autocast: $kind" "$RESULTS/$kind.bf16.log" "${LAUNCH[@]}" --num_processes 1 --mixed_precision bf16 \
        -m train "$recipe" "${DEBUG_OVERRIDES[@]}" output.dir="$RESULTS/$kind"
done

step "FSDP2, one process: tiny_eagle3" "$RESULTS/fsdp.log" "${LAUNCH[@]}" \
    --config_file recipes/accelerate/8gpu_fsdp.yaml --num_processes 1 \
    -m train recipes/debug/tiny_eagle3.yaml "${DEBUG_OVERRIDES[@]}" output.dir="$RESULTS/fsdp"
launch_state --config_file recipes/accelerate/8gpu_fsdp.yaml --num_processes 1

for kind in eagle3 dflash; do
    step "training tokens/s: $kind on SmolLM2" "$RESULTS/tokens_$kind.log" "${LAUNCH[@]}" --num_processes 1 \
        --mixed_precision bf16 -m train.estimate recipes/smollm2/$kind.yaml target.dtype=auto \
        --probe-steps $PROBE_STEPS --world-size 8
    grep -h "^probe:" "$RESULTS/tokens_$kind.log" | sed 's/^/    /' >> "$SUMMARY"
done

step "train EAGLE-3 on SmolLM2 (short)" "$RESULTS/train_eagle3.log" "${LAUNCH[@]}" --num_processes 1 \
    --mixed_precision bf16 -m train recipes/smollm2/eagle3.yaml target.dtype=auto "${SMOLLM2_TRAIN[@]}" \
    features.mode=online features.cache_dir=null eval.num_prompts=0 output.dir="$RESULTS/smollm2_eagle3"
step "engine speedup on SmolLM2" "$RESULTS/eval.log" draftsmith eval --target smollm2-135m-instruct \
    --drafter "ngram,$RESULTS/smollm2_eagle3/final" --prompts mt_bench --num-prompts $NUM_PROMPTS \
    --max-new-tokens $NEW_TOKENS --num-draft-tokens 1,3 --out "$RESULTS/eval/report.json"
if [[ -f "$RESULTS/eval/report.md" ]]; then
    { echo; echo "engine (draftsmith eval, $RESULTS/eval/report.md):"; echo; cat "$RESULTS/eval/report.md"; } >> "$SUMMARY"
fi

# The target on a distributed engine (docs/distributed.md): the frozen target sharded across 2 processes (FSDP2,
# forward only) gives the replicated target's features; with 2 GPUs also a short sharded training; vLLM features
# equal HF features when vLLM is installed (VLLM_PYTHON: a python that imports vllm, e.g. /work/envs/vllm/bin/python).
step "target.placement sharded == replicated (2 gloo processes)" "$RESULTS/placement.log" \
    python -m pytest -q -p no:cacheprovider tests/test_placement.py
if python -c "import torch, sys; sys.exit(torch.accelerator.device_count() < 2)" 2> /dev/null; then
    step "target.placement sharded, 2 GPUs: tiny_eagle3" "$RESULTS/sharded.log" "${LAUNCH[@]}" --num_processes 2 \
        -m train recipes/debug/tiny_eagle3.yaml "${DEBUG_OVERRIDES[@]}" target.placement=sharded \
        output.dir="$RESULTS/sharded"
fi
VLLM_PYTHON=${VLLM_PYTHON:-python}
if "$VLLM_PYTHON" -c "import vllm" 2> /dev/null; then
    step "vLLM features == HF features, 50 steps from each (SmolLM2)" "$RESULTS/vllm_features.log" \
        env PYTHONPATH="$PWD" "$VLLM_PYTHON" benchmarks/training/vllm_features.py --out "$RESULTS/vllm_features"
    [[ -f "$RESULTS/vllm_features/summary.json" ]] && sed 's/^/    /' "$RESULTS/vllm_features/summary.json" >> "$SUMMARY"
else
    echo "- skipped vLLM features: $VLLM_PYTHON cannot import vllm (docs/distributed.md, 'The vLLM environment')" \
        >> "$SUMMARY"
fi

# Streamed features (docs/distributed.md, "Streamed features"): the producer (draftsmith prepare) beside the trainer,
# peak disk and tokens/s against an offline cache of the same data; with vLLM as the producer when it is installed.
STREAM_SAMPLES=48
[[ ${#CPU_FLAG[@]} -gt 0 ]] && STREAM_SAMPLES=8
step "streamed vs offline features (SmolLM2, hf producer)" "$RESULTS/stream.log" \
    python benchmarks/training/stream_features.py --out "$RESULTS/stream" --samples $STREAM_SAMPLES --repeats 1 \
    --result "$RESULTS/stream/stream_features.json"
if "$VLLM_PYTHON" -c "import vllm" 2> /dev/null; then
    step "streamed vs offline features (SmolLM2, vLLM producer)" "$RESULTS/stream_vllm.log" \
        python benchmarks/training/stream_features.py --out "$RESULTS/stream_vllm" --samples $STREAM_SAMPLES --repeats 1 \
        --extractor vllm --python "$VLLM_PYTHON" --result "$RESULTS/stream_vllm/stream_features.json"
fi

echo "failed steps: $FAILED" >> "$SUMMARY"
echo "summary: $SUMMARY"
exit "$FAILED"
