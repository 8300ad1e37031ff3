#!/usr/bin/env bash
# The GPU check's dry run against the library versions the GPU image holds (/work/.library/device/KINDS.md, "pip
# list": transformers 5.17.0, accelerate 1.15.0, huggingface_hub 1.33.0, tokenizers 0.23.2, safetensors 0.8.0),
# not this environment's: a code path that only the newer versions carry fails here, on CPU, instead of in the GPU
# machine's minutes. torch stays this environment's (the image's 2.11 is a CUDA build).
#
#   bash benchmarks/gpu_check/image_versions.sh [RESULTS_DIR [gpu_check.sh options]]   # ~2 min on 2 quiet cores
#
# The versions go to a --target folder (default /tmp/image_site, IMAGE_SITE) put first on PYTHONPATH for the run;
# httpx, which transformers 5.17 imports and the image has, comes with its own dependencies into a second folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
SITE=${IMAGE_SITE:-/tmp/image_site}
OUT=${1:-/tmp/gpu_check_image_versions}
[ $# -gt 0 ] && shift
if [ ! -f "$SITE/.done" ]; then
  rm -rf "$SITE" "$SITE.deps"
  "$PYTHON" -m pip install --quiet --no-deps --target "$SITE" transformers==5.17.0 accelerate==1.15.0 \
    huggingface_hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0 \
    $(grep -v "^#" benchmarks/gpu_check/staged_packages.txt)  # what stage_wheels.sh carries
  "$PYTHON" -m pip install --quiet --target "$SITE.deps" httpx
  touch "$SITE/.done"
fi
export PYTHONPATH="$SITE:$SITE.deps${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
"$PYTHON" -c "import transformers as t, accelerate as a, datasets as d; print('transformers', t.__version__, 'accelerate', \
  a.__version__, 'datasets', d.__version__)"
GPU_CHECK_TIMEOUT=${GPU_CHECK_TIMEOUT:-1200} bash benchmarks/gpu_check.sh --cpu --work "${WORK:-/tmp/gpu_check_image}" \
  "$@" "$OUT"   # summary.md / summary.json / logs.tgz in OUT
