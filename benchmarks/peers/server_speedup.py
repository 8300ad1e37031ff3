"""The speedup a real server measures beside ours: vLLM's engine and draftsmith's on the same target, drafter export,
prompts, k and threads, interleaved.

    python benchmarks/peers/server_speedup.py --target DIR --drafter EXPORT_DIR --prompts FILE --num-prompts N \
        --max-new-tokens M --k 1,3 --out FILE.json [--threads 1] [--repeats 3] [--target-path auto|hf]

Run it with a Python that has vLLM and draftsmith (docs/distributed.md, "The vLLM environment"), e.g.
`PYTHONPATH=$PWD /work/envs/vllm/bin/python benchmarks/peers/server_speedup.py ...`. DIR: the target's HF directory (or
the embedded name smollm2-135m-instruct); EXPORT_DIR: an export vLLM serves (EAGLE-3 and DFlash measured here)
that our loader reads too, its method taken from its kind (train/serve_check.METHODS); FILE: FastChat question jsonl or a builtin
prompt set name (mt_bench, ...). A DFlash export is measured at its block's k (block_size - 1: `--k 7` for block 8).

Method. One vLLM engine per k (k = 0: plain decoding) lives in its own worker process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
enforce_eager, fp32, greedy, OMP threads = --threads, unbound; vLLM's C++ CPU kernels, the speed an eager CPU server
has, which compute an MLA target wrong: train/features/vllm_features.py eager_kwargs, so time Llama-like targets here),
at most two at once (k = 0 and the k being measured: each holds a model and its KV cache); our engine runs in this
process with the same thread count. Every request is the first turn of a question under the chat template, served alone
(batch 1 on both sides: vLLM gets one request per `generate` call), stopping at EOS or M tokens. For each k, after one
untimed warm-up pass, each repeat runs ours and vLLM at k = 0 and at k once over all prompts, taking turns so a drift of
the machine's load hits each alike (k = 0 is measured beside every k; its median pools all of them); tokens/s = new
tokens / wall seconds of the pass (prefill included on both sides), the median over repeats; speedup = a k's tokens/s /
the same engine's k = 0 tokens/s. Acceptance: tau = 1 + accepted / drafts from vLLM's spec-decode counters
(disable_log_stats=False) and from our engine's rounds, same definitions.

JSON: ar_tokens_per_s_ours, ar_tokens_per_s_vllm, rows [{k, speedup_ours, speedup_vllm, tokens_per_s_ours,
tokens_per_s_vllm, tau_ours, tau_vllm, acceptance_rate_ours, acceptance_rate_vllm, identical_outputs}], and the
configuration (threads, repeats, load, target_path, versions).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="server_speedup", description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True, help="an export vLLM serves (e.g. eagle3 or dflash format)")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", default="1,3")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target-path", default="auto", choices=("auto", "hf"))
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # internal: a vLLM worker's k
    parser.add_argument("--target-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--speculative", default='{"method": "eagle3"}',  # internal: vLLM's method and flags (JSON)
                        help=argparse.SUPPRESS)
    return parser


def check(args) -> list[int]:
    """The k list; raises ValueError naming the flag on bad input."""
    try:
        ks = [int(k) for k in args.k.split(",")]
    except ValueError:
        raise ValueError(f"--k {args.k!r}: give comma-separated integers >= 1, e.g. 1,3") from None
    if not ks or min(ks) < 1:
        raise ValueError(f"--k {args.k!r}: every k must be >= 1 (k = 0, plain decoding, always runs)")
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--threads", args.threads), ("--repeats", args.repeats)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1")
    if not os.path.isfile(os.path.join(args.drafter, "config.json")):
        raise ValueError(f"--drafter {args.drafter!r}: not an export directory (no config.json); export one with "
                         f"Drafter.save(DIR, 'eagle3')")
    return ks


# ---- the vLLM side: one engine per k in its own process, driven over stdin/stdout ---------------------------------
def vllm_worker(args) -> None:
    """Build one vLLM engine (k = args.worker, 0 = no drafter) and answer `run` lines with one pass over the prompts."""
    import torch

    torch.set_num_threads(args.threads)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None if args.worker == 0 else {**json.loads(args.speculative), "model": args.drafter,
                                          "num_speculative_tokens": args.worker}
    llm = LLM(model=args.target_dir, speculative_config=spec, enforce_eager=True, disable_log_stats=False,
              dtype="float32", max_model_len=2048, seed=0, gpu_memory_utilization=0.1)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    reply = {"ready": True, "threads": torch.get_num_threads()}
    print(json.dumps(reply), flush=True)
    for line in sys.stdin:
        prompts = json.loads(line)["prompts"]
        before = _spec_counters(llm)
        tokens, start = [], time.perf_counter()
        for prompt in prompts:  # one request at a time: batch 1, as our engine runs here
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            tokens.append(list(out[0].outputs[0].token_ids))
        seconds = time.perf_counter() - start
        after = _spec_counters(llm)
        print(json.dumps({"tokens": tokens, "seconds": seconds,
                          **{name: after[name] - before[name] for name in after}}), flush=True)


def _spec_counters(llm) -> dict:
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_accepted_tokens": "accepted",
             "vllm:spec_decode_num_draft_tokens": "draft_tokens"}
    found = {names[m.name]: m.value for m in llm.get_metrics() if m.name in names}
    return {name: found.get(name, 0) for name in names.values()}


class VllmWorker:
    def __init__(self, args, k: int, target_dir: str):
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
        command = [sys.executable, os.path.abspath(__file__), "--worker", str(k), "--target-dir", target_dir,
                   "--target", args.target, "--drafter", args.drafter, "--prompts", args.prompts, "--out", args.out,
                   "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads),
                   "--speculative", args.speculative]
        self.log = open(f"{args.out}.vllm_k{k}.log", "w")
        self.proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self.k = k
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:  # vLLM may print to stdout too: the reply is the line that parses
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the vLLM worker for k = {self.k} exited; its log: {self.log.name}")

    def run(self, prompts: list[list[int]]) -> dict:
        try:
            self.proc.stdin.write(json.dumps({"prompts": prompts}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"the vLLM worker for k = {self.k} exited; its log: {self.log.name}") from None
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:  # it already exited (its log says why)
            pass
        self.proc.wait(timeout=120)
        self.log.close()


# ---- our side -------------------------------------------------------------------------------------------------
def ours_pass(target, drafter, prompts: list[list[int]], k: int, max_new_tokens: int) -> dict:
    from inference.engine.api import speculative_generate
    from inference.evaluation.metrics import acceptance_counts

    eos = list(target.target_info().eos_token_ids)
    tokens, accepted, rounds, proposed = [], 0, 0, 0
    start = time.perf_counter()
    for prompt in prompts:
        out = speculative_generate(target, drafter if k else None, [prompt], num_draft_tokens=k,
                                   max_new_tokens=max_new_tokens, eos_token_ids=eos)
        tokens.append(out.tokens[0])
        counts = acceptance_counts(out)
        accepted, rounds, proposed = accepted + counts["accepted"], rounds + counts["rounds"], \
            proposed + counts["proposed"]
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "drafts": rounds, "accepted": accepted,
            "draft_tokens": proposed}


def summarise(passes: dict, ks: list[int]) -> dict:
    """passes[(engine, k)] = list of pass dicts -> the JSON result (tokens/s medians, speedups, acceptance)."""
    def rate(engine, k):
        return statistics.median(sum(len(t) for t in p["tokens"]) / p["seconds"] for p in passes[(engine, k)])

    def acceptance(engine, k):
        p = passes[(engine, k)][0]  # greedy: every pass proposes and accepts the same
        tau = 1 + p["accepted"] / p["drafts"] if p["drafts"] else None
        return tau, (p["accepted"] / p["draft_tokens"] if p["draft_tokens"] else None)

    ar = {engine: rate(engine, 0) for engine in ("ours", "vllm")}
    rows = []
    for k in ks:
        row = {"k": k}
        for engine in ("ours", "vllm"):
            tokens_per_s = rate(engine, k)
            tau, acceptance_rate = acceptance(engine, k)
            row.update({f"tokens_per_s_{engine}": tokens_per_s, f"speedup_{engine}": tokens_per_s / ar[engine],
                        f"tau_{engine}": tau, f"acceptance_rate_{engine}": acceptance_rate})
        ours, theirs = passes[("ours", k)][0]["tokens"], passes[("vllm", k)][0]["tokens"]
        row["identical_outputs"] = f"{sum(a == b for a, b in zip(ours, theirs))}/{len(ours)}"
        rows.append(row)
    return {"ar_tokens_per_s_ours": ar["ours"], "ar_tokens_per_s_vllm": ar["vllm"], "rows": rows}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        vllm_worker(args)
        return 0
    sys.path.insert(0, ROOT)
    try:
        ks = check(args)
        import torch

        from drafters import load_drafter
        from inference.engine.cpu import CpuBackend
        from inference.engine.target import TargetModel
        from inference.evaluation.eval import render_prompt
        from inference.evaluation.prompts import load_questions

        torch.set_num_threads(args.threads)
        target = TargetModel.from_pretrained(
            args.target, backend=CpuBackend() if args.target_path == "auto" else None)
        drafter = target.serve(load_drafter(args.drafter, target.target_info()).eval())
        from train.serve_check import METHODS, speculative_fields  # drafter kind -> vLLM's method, as doctor uses

        if drafter.kind not in METHODS:
            raise ValueError(f"--drafter {args.drafter!r}: a {drafter.kind} drafter; vLLM serves "
                             f"{', '.join(sorted(METHODS))} exports")
        args.speculative = json.dumps(speculative_fields(drafter.kind))
        _, questions = load_questions(args.prompts, num_prompts=args.num_prompts)
    except (ValueError, OSError) as err:
        print(f"server_speedup: error: {err}", file=sys.stderr)
        return 2
    prompts = [render_prompt(target.tokenizer, q.turns[:1], [], True) for q in questions]
    passes: dict = {}
    plain = VllmWorker(args, 0, target.name_or_path)
    try:
        for k in ks:  # at most two vLLM engines alive at once (k = 0 and this k): each holds its own model and cache
            speculative = VllmWorker(args, k, target.name_or_path)
            try:
                for attempt in range(args.repeats + 1):  # attempt 0 warms both engines up, untimed
                    for width, engine in ((0, "ours"), (0, "vllm"), (k, "ours"), (k, "vllm")):
                        worker = plain if width == 0 else speculative
                        result = (ours_pass(target, drafter, prompts, width, args.max_new_tokens) if engine == "ours"
                                  else worker.run(prompts))
                        if attempt:
                            passes.setdefault((engine, width), []).append(result)
                        print(f"k={k} pass {attempt} {engine} k={width}: "
                              f"{sum(map(len, result['tokens'])) / result['seconds']:.1f} tok/s", file=sys.stderr,
                              flush=True)
            finally:
                speculative.close()
    except (RuntimeError, BrokenPipeError) as err:
        print(f"server_speedup: error: a vLLM worker stopped ({err}); see the logs beside --out", file=sys.stderr)
        return 1
    finally:
        plain.close()
    import torch
    import transformers
    import vllm

    result = summarise(passes, ks)
    result.update({"target": target.name_or_path, "drafter": args.drafter, "prompts": args.prompts,
                   "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                   "vllm_threads": plain.info.get("threads"), "repeats": args.repeats,
                   "target_path": target.path, "speculative": json.loads(args.speculative),
                   "drafter_path": target.path if target.drafter_kernels(drafter) is not None else "hf",
                   "load_1min": os.getloadavg()[0], "torch": torch.__version__,
                   "transformers": transformers.__version__, "vllm": vllm.__version__})
    from benchmarks.measure import write_measurement

    write_measurement(args.out, result)
    print(f"AR tok/s: ours {result['ar_tokens_per_s_ours']:.1f}, vLLM {result['ar_tokens_per_s_vllm']:.1f}")
    print("| k | tok/s ours | tok/s vLLM | speedup ours | speedup vLLM | tau ours | tau vLLM | identical |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in result["rows"]:
        print(f"| {row['k']} | {row['tokens_per_s_ours']:.1f} | {row['tokens_per_s_vllm']:.1f} | "
              f"{row['speedup_ours']:.2f} | {row['speedup_vllm']:.2f} | {row['tau_ours']:.2f} | "
              f"{row['tau_vllm']:.2f} | {row['identical_outputs']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
