"""Equal-batch trainer parity for the block drafters: draftsmith's DFlash / DSpark against SpecForge, Model Optimizer
and speculators, trained on exactly the same batches from the same initial weights (docs/benchmarks.md, "Trainer
parity").

    python benchmarks/peers/peer_train_parity.py setup DIR
    python benchmarks/peers/peer_train_parity.py run --envs DIR --drafter dflash|dspark \
        --peers specforge,modelopt,speculators --steps N --out FILE.json \
        [--variant dpace:loss_weighting=dpace] [--eagle3] [--recipe-override key=value ...]

- setup: one throwaway venv per peer under DIR (torch==2.13.0 first and pinned by a constraints file, then the peer
  --no-deps and the few packages its model classes import) and a `plot` venv with matplotlib. Nothing here is a
  draftsmith dependency.
- run: (1) the batches: recipes/smollm2/<drafter>.yaml's data and drafter (overridable), our loader, SmolLM2 run once
  over `--num-batches` batches of 2 (target features at the drafter's layer ids, final hidden state, greedy tokens),
  and the anchors of every step from our sampler (seed, epoch = step // num_batches, sample index), all in DIR/work;
  (2) the initial weights: our drafter built once (seed 0) and written native, in the z-lab layout (DFlash) and in
  DeepSpec's (DSpark), so every trainer starts from the same tensors; (3) every trainer (`ours` and each peer) as
  its own nice'd process with one thread in its venv (benchmarks/peers/parity_trainers.py), `--parallel` at a time; (4)
  one evaluator for all: each trained drafter is read back through our readers (drafters/*/export.py) and decodes
  the held-out prompts (`--prompts`, greedy, k = the drafter's longest proposal) with our engine; heldout_tau =
  1 + accepted / rounds. FILE.json gets one row per trainer: trainer, steps, loss, accuracy (curves every 10
  steps; accuracy = top-1 agreement with the data token, one definition for all), accuracy_per_depth, tokens_per_s,
  tokens_per_cpu_s, heldout_tau; FILE.png the curves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
TORCH = "torch==2.13.0"
COMMON = ["safetensors", "pydantic", "pyyaml", "huggingface-hub", "numpy", "tqdm", "psutil"]
ENVS = {
    "specforge": {"no_deps": ["specforge==0.2.0"], "deps": COMMON + ["accelerate", "transformers==5.8.1"],
                  "check": "specforge.algorithms.common.dflash_family_model"},
    "modelopt": {"no_deps": ["nvidia-modelopt==0.47.0"],
                 "deps": COMMON + ["accelerate", "scipy", "rich", "packaging", "ninja", "nvidia-ml-py", "omegaconf",
                          "requests", "pulp", "transformers>=4.57,<5.15"],
                 "check": "modelopt.torch.speculative.plugins.hf_dflash"},
    "speculators": {"no_deps": ["speculators==0.9.0", "hs-connectors==0.9.0"],
                    "deps": COMMON + ["transformers==5.19.0", "pydantic-settings", "loguru<=0.7.3",
                                      "datasets>=4.0.0,<=5.1.0", "click", "typer", "rich", "protobuf", "httpx",
                                      "aiohttp", "openai>=2.0.0"],
                    "check": "speculators.models.dflash"},
    "plot": {"deps": ["matplotlib"], "check": "matplotlib"},
}


def fail(message: str) -> None:
    print(f"peer_train_parity: {message}", file=sys.stderr)
    raise SystemExit(2)


def python_of(envs: str, name: str) -> str:
    return os.path.join(envs, name, "bin", "python")


def imports(envs: str, name: str) -> bool:
    return subprocess.run([python_of(envs, name), "-c", f"import {ENVS[name]['check']}"],
                          capture_output=True).returncode == 0


def setup(envs: str) -> None:
    """Build (or keep, when its check import works) one venv per peer and the plotting venv."""
    os.makedirs(envs, exist_ok=True)
    pin = os.path.join(envs, "torch_pin.txt")
    with open(pin, "w") as f:
        f.write(TORCH + "\n")
    for name, spec in ENVS.items():
        if os.path.exists(python_of(envs, name)) and imports(envs, name):
            print(f"{name}: ready")
            continue
        started = time.time()
        subprocess.run([sys.executable, "-m", "venv", os.path.join(envs, name)], check=True)
        pip = [python_of(envs, name), "-m", "pip", "install", "-q", "-c", pin]
        if name != "plot":
            subprocess.run(pip + [TORCH], check=True)
        if spec.get("no_deps"):
            subprocess.run(pip + ["--no-deps", *spec["no_deps"]], check=True)
        subprocess.run(pip + spec["deps"], check=True)
        print(f"{name}: built in {time.time() - started:.0f} s, import ok: {imports(envs, name)}")


def finished(work: str, trainer: str, steps: int) -> bool:
    """A trainer whose curve reached `steps` and whose weights were written is not trained again."""
    curve = os.path.join(work, trainer, "curve.json")
    if not os.path.exists(os.path.join(work, trainer, "weights", f"step_{steps}", "config.json")) or \
            not os.path.exists(curve):
        return False
    with open(curve) as f:
        return (json.load(f).get("steps") or [0])[-1] >= steps


def parse_variant(text: str) -> tuple[str, list[str]]:
    """"dpace:loss_weighting=dpace,dpace_alpha=0.5" -> ("dpace", ["loss_weighting=dpace", "dpace_alpha=0.5"])."""
    name, sep, settings = text.partition(":")
    items = [item for item in settings.split(",") if item]
    if not sep or not name or not items or any("=" not in item for item in items):
        fail(f"--variant {text!r}: write NAME:key=value[,key=value] (e.g. dpace:loss_weighting=dpace)")
    return name, items


def run(args) -> None:
    from benchmarks.peers.parity_prepare import dump_batches, evaluate, plot

    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in ("specforge", "modelopt", "speculators")]
    if unknown:
        fail(f"--peers: unknown peer {unknown[0]!r}; choose from specforge, modelopt, speculators")
    if args.steps < 1:
        fail("--steps: must be >= 1")
    missing = [p for p in peers if not os.path.exists(python_of(args.envs, p))]
    if missing:
        fail(f"--envs: no venv for {missing[0]} under {args.envs}; run `peer_train_parity.py setup {args.envs}`")
    work = os.path.join(args.envs, "work", f"{args.drafter}_{args.steps}x{args.num_batches}")
    dump, init = dump_batches(args, work)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    variants = dict(parse_variant(v) for v in args.variant)
    trainers = ["ours", *[f"ours-{name}" for name in variants], *(["eagle3"] if args.eagle3 else []), *peers]
    only = [t for t in args.only.split(",") if t] or trainers
    pending = [] if args.eval_only else [t for t in trainers if t in only and not finished(work, t, args.steps)]
    running = {}
    while pending or running:
        while pending and len(running) < args.parallel:
            name = pending.pop(0)
            python = sys.executable if name.split("-")[0] in ("ours", "eagle3") else python_of(args.envs, name)
            out = os.path.join(work, name)
            os.makedirs(out, exist_ok=True)
            log = open(os.path.join(out, "log.txt"), "w")
            command = ["nice", "-n", str(args.nice), python, os.path.join(ROOT, "benchmarks", "parity_trainers.py"),
                       name, "--dump", dump, "--init", init, "--steps", str(args.steps), "--out", out]
            for setting in variants.get(name.removeprefix("ours-"), []) if name.startswith("ours-") else []:
                command += ["--set", setting]
            running[name] = (subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log)
        time.sleep(5)
        for name, (proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                print(f"{name}: exit {proc.returncode}", flush=True)
                del running[name]
    rows = evaluate(args, work, [t for t in trainers if t in only] if args.eval_only else trainers)
    with open(args.out, "w") as f:
        json.dump({"drafter": args.drafter, "steps": args.steps, "rows": rows}, f, indent=1)
    plot(args, rows, os.path.splitext(args.out)[0] + ".png")
    print(markdown_table(args.drafter, rows))


def markdown_table(drafter: str, rows: list[dict]) -> str:
    """drafter x trainer x held-out tau x tokens/s x steps, with loss and accuracy at the evaluated step."""
    lines = ["| drafter | trainer | steps reached | evaluated at step | held-out tau | training loss / accuracy there "
             "| tokens per s (per CPU-s) |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        if not row.get("steps"):
            lines.append(f"| {drafter} | {row['trainer']} | 0 | - | - | {row.get('error', '')[:80]} | - |")
            continue
        step = row.get("heldout_step")
        at = row["steps"].index(step) if step in row["steps"] else -1
        lines.append(f"| {drafter} | {row['trainer']} | {row['steps_reached']} | {step or '-'} | "
                     f"{row.get('heldout_tau', '-')} | {row['loss'][at]:.3f} / {row['accuracy'][at]:.3f} | "
                     f"{row['tokens_per_s']:.0f} ({row['tokens_per_cpu_s']:.0f}) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_setup = sub.add_parser("setup", help="build the peer venvs under DIR")
    p_setup.add_argument("dir")
    p_run = sub.add_parser("run", help="train every trainer on the same batches and evaluate them")
    p_run.add_argument("--envs", required=True)
    p_run.add_argument("--drafter", required=True, choices=["dflash", "dspark"])
    p_run.add_argument("--peers", default="specforge,modelopt,speculators")
    p_run.add_argument("--steps", type=int, default=300)
    p_run.add_argument("--out", required=True)
    p_run.add_argument("--num-batches", type=int, default=80, help="distinct batches of 2, cycled with new anchors")
    p_run.add_argument("--parallel", type=int, default=2, help="trainers at once (one thread each)")
    p_run.add_argument("--nice", type=int, default=10)
    p_run.add_argument("--prompts", default="mt_bench")
    p_run.add_argument("--num-prompts", type=int, default=8)
    p_run.add_argument("--max-new-tokens", type=int, default=48)
    p_run.add_argument("--recipe-override", action="append", default=[], metavar="key=value",
                       help="override recipes/smollm2/<drafter>.yaml (e.g. drafter.num_layers=2)")
    p_run.add_argument("--variant", action="append", default=[], metavar="NAME:key=value,...",
                       help="also train ours with these drafter settings as trainer ours-NAME")
    p_run.add_argument("--eagle3", action="store_true",
                       help="also train draftsmith's EAGLE-3 (recipes/smollm2/eagle3.yaml's drafter) on the same batches")
    p_run.add_argument("--eval-k", type=int, default=None,
                       help="proposal length of the held-out decoding (default: the block drafter's longest)")
    p_run.add_argument("--eval-step", type=int, default=None,
                       help="evaluate every trainer's weights at this step (default: the last step all saved)")
    p_run.add_argument("--only", default="", help="train only these trainers (comma-separated); evaluate all (with --eval-only: evaluate only these)")
    p_run.add_argument("--eval-only", action="store_true", help="reuse the trained weights under DIR/work")
    args = parser.parse_args(argv)
    if args.command == "setup":
        setup(args.dir)
    else:
        run(args)


if __name__ == "__main__":
    main()
