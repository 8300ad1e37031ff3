"""Peak memory of ONE training step (forward, backward, AdamW step) per drafter and sequence length, on CPU.

    OMP_NUM_THREADS=1 python benchmarks/training/long_sequence_memory.py --label after [--lengths 2048 4096 8192 16384]
        [--variants eagle3_ttt3 eagle3_ttt7 dflash dspark] [--cap-gib 7] [--out docs/results/long_sequence_memory.json]

Each point runs in a fresh, nice'd, single-threaded subprocess so that nothing of an earlier point stays resident.
The child imports torch, reads its resident set (VmRSS), builds the drafter, a batch of batch size 1 and the optimizer,
resets the kernel's high-water mark (writing 5 to /proc/self/clear_refs), runs the step and reads VmHWM. Reported:
`measured_bytes` = VmHWM - VmRSS after the imports (everything the step holds at its peak: drafter weights, the
target tensors it computes with, the batch, gradients, AdamW state, activations and temporaries) and `step_bytes` =
VmHWM - VmRSS just before the step. glibc is told to serve every allocation of 64 KiB or more by mmap
(MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set and the high-water mark is the live peak, not the
allocator's hoard. The parent polls the child's VmRSS and stops it past --cap-gib (recorded as "over_cap").

No target runs: the batch carries random target features of the right shapes (hidden states of the drafter's layer
ids, the final hidden state, the target argmax), as an offline feature cache would. Every position is a loss position
and every target argmax lies in the draft vocabulary (the most loss cells a sequence can have). Shapes: hidden 256, 4
query heads of 64 and 2 KV heads, MLP 768, 1 draft layer, target vocabulary 49,152 (SmolLM2's); EAGLE-3 with a 8,192
draft vocabulary and TTT 3 or 7; DFlash and DSpark at their published block shapes (block 16 / 7, 512 anchors,
DFlash through the full vocabulary, DSpark's vanilla Markov head of rank 256 and its confidence head). `predicted_bytes`
is `draftsmith estimate`'s analytic model (drafters.step_memory.py) for the same point.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, TARGET_LAYERS = 256, 4, 2, 64, 768, 49152, 8
VARIANTS = {
    "eagle3_ttt3": ("eagle3", {"ttt_steps": 3, "draft_vocab_size": 8192}),
    "eagle3_ttt7": ("eagle3", {"ttt_steps": 7, "draft_vocab_size": 8192}),
    "dflash": ("dflash", {"block_size": 16, "num_anchors": 512, "mask_token_id": 3}),
    "dspark": ("dspark", {"block_size": 7, "num_anchors": 512, "mask_token_id": 3, "markov_rank": 256}),
}
LENGTHS = (2048, 4096, 8192, 16384)


def status_bytes(field: str, pid: str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def target_info(torch):
    from drafters.base import TargetInfo

    generator = torch.Generator().manual_seed(0)
    config = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "head_dim": HEAD_DIM, "intermediate_size": MLP, "num_hidden_layers": TARGET_LAYERS,
              "rope_theta": 100000.0, "max_position_embeddings": 32768, "vocab_size": VOCAB}
    return TargetInfo(name_or_path="synthetic", hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=TARGET_LAYERS,
                      embed_weight=torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02,
                      lm_head_weight=torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02,
                      final_norm_weight=torch.ones(HIDDEN), rms_norm_eps=1e-5, eos_token_ids=(2,), pad_token_id=2,
                      config=config, unused_token_ids=(3,))


def drafter_config(kind: str, fields: dict):
    from drafters import DRAFTERS

    return DRAFTERS[kind].Config(num_layers=1, **fields)


def make_batch(torch, drafter, length: int, draft_vocab: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    request = drafter.feature_request()
    batch = {"input_ids": torch.randint(4, draft_vocab, (1, length), generator=generator),
             "attention_mask": torch.ones(1, length, dtype=torch.long),
             "loss_mask": torch.ones(1, length, dtype=torch.long),
             "target_argmax": torch.randint(4, draft_vocab, (1, length), generator=generator),
             "hidden": {i: torch.randn(1, length, HIDDEN, generator=generator) for i in request.layer_ids},
             "final_hidden": torch.randn(1, length, HIDDEN, generator=generator),
             "sample_index": torch.tensor([0]), "epoch": 0, "seed": 0}
    return batch


def child(spec: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    from drafters import DRAFTERS
    from train.config import OptimConfig
    from train.fit.optim import build_optimizer

    imported = status_bytes("VmRSS")
    kind, fields = VARIANTS[spec["variant"]]
    info = target_info(torch)
    torch.manual_seed(0)
    drafter = DRAFTERS[kind](drafter_config(kind, fields), info)
    if spec["checkpointing"]:
        drafter.activation_checkpointing = True
    draft_vocab = fields.get("draft_vocab_size") or VOCAB
    batch = make_batch(torch, drafter, spec["length"], draft_vocab)
    optimizer = build_optimizer(drafter, OptimConfig(lr=1e-4))
    drafter.train()
    before = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    started = time.perf_counter()
    output = drafter(batch)
    loss, _ = drafter.loss(output, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - started
    peak = status_bytes("VmHWM")
    return {"measured_bytes": peak - imported, "step_bytes": peak - before, "seconds": round(seconds, 2),
            "loss": float(loss), "cells": int(output.depth_valid.sum())}


def run_point(spec: dict, cap_bytes: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               MALLOC_TRIM_THRESHOLD_="65536")
    command = ["nice", "-n", "10", sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    highest = 0
    while process.poll() is None:
        try:
            highest = max(highest, status_bytes("VmRSS", str(process.pid)))
        except (OSError, RuntimeError):
            pass
        if highest > cap_bytes:
            process.kill()
            process.wait()
            return {"over_cap": True, "cap_bytes": cap_bytes, "rss_when_stopped": highest}
        time.sleep(0.02)
    out, err = process.communicate()
    if process.returncode:
        return {"error": err.strip().splitlines()[-1] if err.strip() else f"exit {process.returncode}"}
    return json.loads(out.strip().splitlines()[-1])


def predicted(spec: dict) -> int | None:
    try:
        from drafters.step_memory import StepShape, step_peak_bytes
    except ImportError:  # the model did not exist yet (the "before" run)
        return None
    kind, fields = VARIANTS[spec["variant"]]
    config = drafter_config(kind, fields)
    shape = StepShape.for_drafter(kind, config, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                  intermediate=MLP, vocab=VOCAB, num_features=None, seq_len=spec["length"], batch=1,
                                  checkpointing=spec["checkpointing"])
    return step_peak_bytes(shape)


def mib(value) -> str:
    return f"{value / (1 << 20):,.0f}"


def table(results: dict) -> str:
    """The Markdown table of docs/benchmarks.md: before / after measured, predicted, ratio, per variant and length."""
    lines = ["| drafter | T | before (MiB) | after (MiB) | after / before | predicted (MiB) | predicted / measured |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    after = results.get("after", {})
    for key in sorted(after, key=lambda k: (k.split("@")[0], int(k.split("@")[1].split("+")[0]), k)):
        variant, _, rest = key.partition("@")
        point, before = after[key], results.get("before", {}).get(key, {})
        if "over_cap" in before:
            old = f"> {mib(before['cap_bytes'])} (stopped)"
        else:
            old = mib(before["measured_bytes"]) if "measured_bytes" in before else "-"
        new = mib(point["measured_bytes"]) if "measured_bytes" in point else "-"
        gain = (f"{point['measured_bytes'] / before['measured_bytes']:.2f}"
                if "measured_bytes" in point and "measured_bytes" in before else "-")
        name = variant + (" + checkpointing" if rest.endswith("+checkpointing") else "")
        lines.append(f"| {name} | {rest.split('+')[0]} | {old} | {new} | {gain} | "
                     f"{mib(point.get('predicted_bytes', 0))} | {point.get('predicted_over_measured', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--label", default="after", help="the results key this run writes (before / after / ...)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--checkpointing", action="store_true", help="train.activation_checkpointing: true")
    parser.add_argument("--cap-gib", type=float, default=7.0, help="stop a point whose resident set passes this")
    parser.add_argument("--out", default="docs/results/long_sequence_memory.json")
    parser.add_argument("--table", action="store_true", help="print the Markdown table of --out and exit")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.out) as f:
            print(table(json.load(f)))
        return 0
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    points = results.setdefault(args.label, {})
    for variant in args.variants:
        for length in args.lengths:
            spec = {"variant": variant, "length": length, "checkpointing": args.checkpointing}
            point = run_point(spec, int(args.cap_gib * (1 << 30)))
            guess = predicted(spec)
            if guess is not None:
                point["predicted_bytes"] = guess
                if "measured_bytes" in point:
                    point["predicted_over_measured"] = round(guess / point["measured_bytes"], 3)
            point["load_1min"] = os.getloadavg()[0]
            points[f"{variant}@{length}" + ("+checkpointing" if args.checkpointing else "")] = point
            print(variant, length, json.dumps(point), flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, sort_keys=True)
    results["setup"] = {"hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "mlp": MLP,
                        "vocab": VOCAB, "draft_layers": 1, "batch": 1, "threads": 1, "variants": VARIANTS}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
