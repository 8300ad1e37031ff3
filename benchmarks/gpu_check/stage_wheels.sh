#!/usr/bin/env bash
# Stage the wheels the GPU check needs on a bare GPU machine into .whl/ at the repo root, run on a machine with PyPI.
#
#   bash benchmarks/gpu_check/stage_wheels.sh
#
# A bare GPU image has torch, accelerate, transformers, pyarrow, pandas, fsspec, xxhash and huggingface-hub, but not
# `datasets` (the training data stage, train/data/dataset.py, keeps its Arrow cache with it) nor the two pure-Python
# packages datasets needs beyond those: dill and multiprocess. They travel as wheels (under 1 MB together) for
# Python 3.12 on x86-64, and are installed there with `pip install --no-index --no-deps --target` (the one-line
# command at the top of benchmarks/gpu_check.sh). datasets 4.8.5, not this environment's 5.x: 5.x asks pyarrow >= 24,
# 4.8.5 pyarrow >= 21 (July 2025), and the image's pyarrow is not listed; a pyarrow wheel (~40 MB) would not fit
# beside the tree in the 64 MiB a call carries. benchmarks/gpu_check/image_versions.sh runs the check with these.
# .whl/ is git-ignored through .git/info/exclude and never committed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2> /dev/null || echo '/.whl/' >> "$exclude"

mapfile -t PACKAGES < <(grep -v "^#" benchmarks/gpu_check/staged_packages.txt)  # the pins, with their reasons

rm -rf .whl
mkdir .whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "${PACKAGES[@]}"
ls -l .whl
