#!/usr/bin/env bash
# The GPU check: under nine minutes on one GPU (NVIDIA with CUDA or AMD with ROCm) of a bare machine whose Python
# has torch, accelerate, transformers and pytest, with no network and no `pip install -e .`.
#
#   bash benchmarks/gpu_check.sh [--cpu] [--work DIR] [--deadline S] [--sections ABCDEFGH] [--slack F] [RESULTS_DIR]
#
# On a lent GPU machine (the device tool; carry .whl, staged beforehand by benchmarks/gpu_check/stage_wheels.sh,
# which downloads `datasets` and the pure-Python packages it needs that such an image lacks), the one command is:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; bash benchmarks/gpu_check.sh "$OUT"
#
# RESULTS_DIR (default $OUT, else runs/gpu_check) receives three files and nothing else: summary.md, summary.json
# (one entry per section: ok / failed with a one-line cause / skipped, the seconds and the numbers measured) and
# logs.tgz (every log; training runs stay in --work, default /tmp/gpu_check, and a new run clears only those of the
# sections it runs: `--sections D` on the same machine decodes what an earlier call's B trained). Sections, in order of
# value:
#   A. environment; masked SDPA of each backend against an fp32 reference (pytorch#147460 on ROCm);
#   B. every drafter kind's debug recipe against a bf16 tiny target on the shipped regenerated data: finite losses,
#      the in-training probe, resume from a checkpoint;
#   C. loss and gradient parity, bf16 on the GPU against fp32 on the CPU, same weights and batch;
#   D. lossless decoding: `eval` from disk for B's drafters as users run it, exact in fp32; in bf16 the match rate
#      with every divergence shown to be a near-tie; one sampled run each;
#   E. 8B-shaped random targets (a few layers) built on the GPU: each kind's step peak memory and time at 2k-4k tokens
#      against `draftsmith estimate`'s model, an OOM caught per case;
#   F. the engine at 8B shape: plain decoding tokens/s against HF `generate`, and the cost curve v(k) / d(k);
#   G. `accelerate launch` with recipes/accelerate/8gpu_fsdp.yaml and one process: FSDP2 save and resume; DeepSpeed
#      ZeRO-2 when it imports;
#   H. the study's target families (gated DeltaNet, sliding windows, Gemma 4's MoE, sinks, MLA) in bf16: plain greedy
#      against HF generate, a draft model's chains and trees against plain greedy, every divergence a near-tie.
# A global deadline (--deadline, default 510 s; --cpu 280 s) skips what does not fit and the summary is rewritten
# after every section, so it is there even when the run is killed. The exit status is the number of sections that
# did not pass. --cpu runs every section on CPU with tiny sizes (a few minutes; tests/test_gpu_check.py runs it, so the
# script cannot rot between GPU runs).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the harness keeps its own deadline; this outer limit only catches a harness that could not stop
exec timeout --signal=TERM --kill-after=20 "${GPU_CHECK_TIMEOUT:-560}" "$PYTHON" -m benchmarks.gpu_check "$@"
