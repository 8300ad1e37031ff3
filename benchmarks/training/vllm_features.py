"""vLLM-extracted features against HF-extracted ones, and drafters trained from each (run in the vLLM env).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 PYTHONPATH=. /work/envs/vllm/bin/python \
        benchmarks/training/vllm_features.py --out /tmp/vllm_features

1. `draftsmith prepare` twice on the same SmolLM2 data (recipes/smollm2/eagle3.yaml, 8 training conversations and 1
   held out, fp32 features): features.extractor=hf and features.extractor=vllm, each into its own cache.
2. Every sample of both caches: stored token ids equal to each other and to the dataset's, hidden states at every
   requested layer, the final normed hidden state and the argmax compared; the loss masks come from the dataset
   (a cache stores none), so both trainings read the same ones.
3. An EAGLE-3 drafter trained 50 steps from each cache (features.mode=offline, same seed and data order); the last
   logged training losses are compared. Prints one JSON summary and writes it to OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

RECIPE = "recipes/smollm2/eagle3.yaml"
DATA = ["data.num_samples=10", "data.num_eval_samples=3"]  # 8 training + 1 eval conversation (4 have no answer)
COMMON = DATA + ["features.mode=offline", "features.dtype=float32", "drafter.ttt_steps=1", "train.phases=[]"]


def run(args: list[str], log: str) -> None:
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "train.cli", *args], stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(args[:2])} failed (exit {done.returncode}); see {log}")


def open_cache(directory: str):
    from train.features.cache import FeatureCache

    with open(os.path.join(directory, "meta.json")) as f:
        meta = json.load(f)
    return FeatureCache(directory, {k: meta[k] for k in meta if k != "format"})


def compare(hf_dir: str, vllm_dir: str, dataset_ids: dict[int, list[int]]) -> dict:
    """Per-layer max |difference| and max |difference| / max |value| over all samples of one split."""
    hf, vl = open_cache(hf_dir), open_cache(vllm_dir)
    if sorted(hf.location) != sorted(vl.location):
        raise SystemExit(f"the caches hold different samples: {sorted(hf.location)} vs {sorted(vl.location)}")
    keys = [f"hidden.{i}" for i in hf.meta["layer_ids"]] + ["final_hidden"]
    worst = {key: [0.0, 0.0] for key in keys}
    tokens = argmax_equal = 0
    for index in sorted(hf.location):
        a, b = hf.read(index), vl.read(index)
        if not (torch.equal(a["input_ids"], b["input_ids"]) and a["input_ids"].tolist() == dataset_ids[index]):
            raise SystemExit(f"sample {index}: token ids differ between the caches or from the dataset")
        for key in keys:
            diff = (a[key].float() - b[key].float()).abs().max().item()
            scale = a[key].float().abs().max().item()
            worst[key] = [max(worst[key][0], diff), max(worst[key][1], diff / scale)]
        tokens += a["argmax"].numel()
        argmax_equal += int((a["argmax"] == b["argmax"]).sum())
    return {"samples": len(hf.location), "tokens": tokens, "argmax_equal": argmax_equal,
            "max_abs_diff": {k: v[0] for k, v in worst.items()}, "max_rel_diff": {k: v[1] for k, v in worst.items()}}


def dataset_token_ids(out: str) -> dict[str, dict[int, list[int]]]:
    from transformers import AutoTokenizer

    from inference.assets.store import resolve_target
    from train.config import load_recipe
    from train.data.dataset import build_dataset

    recipe = load_recipe(RECIPE, DATA + [f"output.dir={out}/unused"])
    data = build_dataset(AutoTokenizer.from_pretrained(resolve_target(recipe.target.name_or_path)), recipe.data)
    return {split: {i: list(ds[i]["input_ids"]) for i in range(len(ds))}
            for split, ds in (("train", data.train), ("eval", data.eval))}


def last_loss(run_dir: str) -> tuple[int, float]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    rows = [r for r in rows if "train/loss" in r]
    return rows[-1]["step"], rows[-1]["train/loss"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/vllm_features")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    caches = {name: os.path.join(args.out, f"features_{name}") for name in ("hf", "vllm")}
    for name, cache in caches.items():
        if not os.path.exists(os.path.join(cache, "train", "index-rank0.json")):
            run(["prepare", RECIPE, *COMMON, f"features.extractor={name}", f"features.cache_dir={cache}",
                 f"output.dir={args.out}/prepare_{name}"], os.path.join(args.out, f"prepare_{name}.log"))
    ids = dataset_token_ids(args.out)
    summary = {split: compare(os.path.join(caches["hf"], split), os.path.join(caches["vllm"], split), ids[split])
               for split in ("train", "eval")}
    losses = {}
    for name, cache in caches.items():
        out = os.path.join(args.out, f"train_{name}")
        run(["train", RECIPE, *COMMON, f"features.cache_dir={cache}", f"output.dir={out}", "train.epochs=null",
             f"train.max_steps={args.steps}", "train.max_time_minutes=null", "schedule.anneal_on=steps",
             "schedule.warmup_steps=5", "train.log_every=10", "eval.num_prompts=0", "train.save_every=null"],
            os.path.join(args.out, f"train_{name}.log"))
        losses[name] = last_loss(out)
    summary["final_train_loss"] = {name: {"step": s, "loss": loss} for name, (s, loss) in losses.items()}
    summary["loss_abs_diff"] = abs(losses["hf"][1] - losses["vllm"][1])
    summary["threads"] = torch.get_num_threads()
    summary["load"] = os.getloadavg()
    print(json.dumps(summary, indent=1))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
