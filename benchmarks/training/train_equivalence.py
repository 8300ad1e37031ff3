"""A train/ refactor changes no byte: prepare (offline cache), train on that cache, resume and export every debug
recipe, and write the sha256 of every weight, feature shard and exported file.

    python benchmarks/training/train_equivalence.py --work /tmp/eq_before --out /tmp/before.json   # on the old tree
    python benchmarks/training/train_equivalence.py --work /tmp/eq_after --out /tmp/after.json     # on the new tree
    cmp /tmp/before.json /tmp/after.json

Run logs and timings are not hashed (they hold wall-clock times); everything a later step reads is. Run both trees
with the same thread count (OMP_NUM_THREADS): float sums in another order train other weights.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from train.fit.checkpoint import list_checkpoints  # noqa: E402

HASHED = ("*.safetensors", "*.pt", "*.bin", "config.json", "meta.json")
ONLINE_ONLY = {"tiny_assistant"}  # it reads the target's KV cache, which is never stored: no offline cache to hash


def run(*args: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")


def hashes(directory: str) -> dict[str, str]:
    found = {}
    for pattern in HASHED:
        for path in glob.glob(os.path.join(directory, "**", pattern), recursive=True):
            with open(path, "rb") as f:
                found[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return dict(sorted(found.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="scratch directory (emptied first)")
    parser.add_argument("--out", required=True, help="JSON of every hash")
    parser.add_argument("--recipes", default="recipes/debug/tiny_*.yaml")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    result = {}
    for recipe in sorted(glob.glob(os.path.join(ROOT, args.recipes))):
        name = os.path.splitext(os.path.basename(recipe))[0]
        work = os.path.join(args.work, name)
        common = [f"features.cache_dir={work}/features", f"output.dir={work}/run", "train.epochs=1",
                  "train.save_every=6", "train.keep_last=3", "eval.num_prompts=0"]
        mode = "features.mode=" + ("online" if name in ONLINE_ONLY else "offline")
        common.append(mode)
        if name not in ONLINE_ONLY:
            run("train.prepare", recipe, *common)
        run("train", recipe, *common)
        checkpoints = [path for _, path in list_checkpoints(f"{work}/run")]
        first = hashes(f"{work}/run/final")
        shutil.rmtree(f"{work}/run/final")
        for later in checkpoints[1:]:
            shutil.rmtree(later)
        run("train", recipe, *common, f"train.resume_from={checkpoints[0]}")
        run("train.export", f"{work}/run/final", "--format", "native", "--out", f"{work}/export")
        result[name] = {"features": hashes(f"{work}/features"), "final": first,
                        "resumed_final": hashes(f"{work}/run/final"), "export": hashes(f"{work}/export")}
        print(name, "resumed == uninterrupted:", first == result[name]["resumed_final"], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
