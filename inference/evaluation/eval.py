"""`draftsmith eval`: speculative decoding against the real target over prompt sets, with a report.

    draftsmith eval --target smollm2-135m-instruct --drafter ngram,runs/eagle3/final \\
        --prompts mt_bench,gsm8k --num-prompts 20 --max-new-tokens 128 --num-draft-tokens auto,1,3,7 \\
        --batch-size 1,4 --out runs/eval/report.json --outputs runs/eval/outputs.jsonl

For each prompt set, temperature and batch size, the plain autoregressive baseline (k = 0, the same engine and batch
size) runs once; then every drafter x k runs over the same prompts. `auto` (the default) chooses k per round at run
time (inference/engine/adaptive.py) up to the drafter's longest proposal (inference/evaluation/methods.py
AUTO_MAX_DRAFT_TOKENS for unbounded drafters), from cost curves profiled at start-up for every drafter and batch
size; the same profile calibrates the predicted speedup of every k in the records. Questions are FastChat records;
turn t+1 is asked after the model's own answer to turn t, so turns run index by index, batched within a category.
`--tree-budget B,...` adds, per drafter, tree verification with B nodes per round (inference/engine/tree/rounds.py):
its records are the drafter's name + "@tree", num_draft_tokens B - 1 (the chain of equal verify budget) and
tree_budget B. Records (inference/evaluation/metrics.py) cover every dataset x category (plus "all") x method, the
baseline included as drafter "none", k = 0. The report (inference/evaluation/report.py) is the JSON at --out, a
Markdown table beside it (also printed) and PNG plots. Every input is checked before any generation starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from functools import partial

import torch
from tqdm import tqdm

from drafters import check_drafter_spec
from inference.assets.store import resolve_target, target_config
from inference.engine.costs import CostProfile
from inference.engine.cpu import CpuBackend
from inference.engine.generate import GenerateOutput
from inference.engine.roofline import stream_bandwidth, weight_bytes
from inference.engine.schedule import build_schedules, parse_schedule_specs
from inference.engine.target import TargetModel, default_device
from inference.engine.target_files import check_one_row
from inference.engine.tree.draft import check_budget
from inference.engine.verify import VERIFICATIONS
from inference.evaluation.chat_template import (check_chat_template, parse_template_kwargs, render_prompt,
                                                trained_mode_mismatch)
from inference.evaluation.environment import environment
from inference.evaluation.intervals import merge_counts, question_counts
from inference.evaluation.lossless import divergence_gaps, summarize
from inference.evaluation.methods import Method, generate, load_methods
from inference.evaluation.metrics import annotate_recommendations, build_record, merge_outputs
from inference.evaluation.profile import profile_costs
from inference.evaluation.prompts import load_questions, select_spread
from inference.evaluation.report import format_table, read_appendable, write_report
from inference.evaluation.settings import (DTYPE_CHOICES, TRUST_REMOTE_CODE_HELP, EvalSettings, check_at_least, numbers,
                                          split)

WARMUP_TOKENS = 4


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="target name (smollm2-135m-instruct) or HF model directory")
    parser.add_argument("--drafter", default="ngram",
                        help="comma-separated: none, ngram, a draft-model directory, a drafter checkpoint directory")
    parser.add_argument("--prompts", default="mt_bench",
                        help="comma-separated: FastChat question .jsonl paths or builtin names (mt_bench, gsm8k, ...)")
    parser.add_argument("--num-prompts", type=int, default=None, help="questions per prompt set (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per turn")
    parser.add_argument("--temperature", default="0", help="comma-separated temperatures; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling at temperature > 0 (1 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling at temperature > 0 (0 = off)")
    parser.add_argument("--verification", default="token", choices=VERIFICATIONS,
                        help="how a sampled chain is verified at temperature > 0: token by token (Leviathan et al.) "
                             "or as a block (Sun et al.; vLLM's rejection_sample_method block); chains only")
    parser.add_argument("--num-draft-tokens", default="auto",
                        help="comma-separated k values and/or auto (k chosen per round at run time), e.g. auto,3,7")
    parser.add_argument("--batch-size", default="1", help="comma-separated batch sizes, e.g. 1,4,8,16 (a load sweep)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--out", default="eval_report.json", help="JSON report; <stem>.md and PNG plots go beside it")
    parser.add_argument("--append", action="store_true",
                        help="add the records to the report at --out (refused unless it has this run's configuration)")
    parser.add_argument("--outputs", default=None, help="jsonl of generated answers, one line per prompt and turn")
    parser.add_argument("--no-chat-template", action="store_true", help="feed turns as plain text")
    parser.add_argument("--chat-template-kwargs", default=None, metavar="NAME=VALUE,...",
                        help="options the chat template reads, e.g. enable_thinking=false (give the drafter's "
                             "data.chat_template_kwargs: a drafter served in another mode than it was trained in "
                             "accepts far less)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--target-path", default="auto", choices=("auto", "hf"),
                        help="auto: the target's linears laid out for small row counts where supported "
                             "(inference/engine/cpu/fastpath.py); hf: the model's own modules")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="what the target and drafters compute in; auto: float32 on a CPU, bfloat16 on a GPU")
    parser.add_argument("--categories", default=None, help="comma-separated categories to keep")
    parser.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)
    parser.add_argument("--tree-budget", default=None,
                        help="comma-separated tree budgets B (nodes verified per round, root included): each drafter "
                             "is also run with draft trees of B nodes (EAGLE-2 for EAGLE-3, DDTree for the others)")
    parser.add_argument("--schedule", default="fixed",
                        help="comma-separated verification schedules for drafters with confidences (DSpark): fixed, "
                             "threshold:H (static threshold on calibrated prefix survival), scheduler (hardware-"
                             "aware prefix scheduler, verify cost profiled at start-up); inference/engine/schedule.py")
    return parser


def _draft_lengths(text: str) -> tuple:
    """"auto,3,7" -> ("auto", 3, 7): k values >= 0 and the word auto."""
    auto = ("auto",) if "auto" in split(text) else ()
    rest = ",".join(part for part in split(text) if part != "auto")
    return auto + (numbers(rest, "--num-draft-tokens", int) if rest or not auto else ())


def parse_settings(args: argparse.Namespace) -> EvalSettings:
    """The parsed command line, checked (a ValueError naming the flag for an impossible value)."""
    num_draft_tokens = _draft_lengths(args.num_draft_tokens)
    temperature = numbers(args.temperature, "--temperature", float)
    batch_size = numbers(args.batch_size, "--batch-size", int)
    schedule = tuple(parse_schedule_specs(args.schedule))
    tree_budget = numbers(args.tree_budget, "--tree-budget", int) if args.tree_budget else ()
    for budget in tree_budget:
        try:
            check_budget(budget)
        except ValueError as err:
            raise ValueError(f"--tree-budget: {err}") from None
    settings = EvalSettings(
        target=args.target, drafter=split(args.drafter) or ("none",), prompts=split(args.prompts),
        categories=split(args.categories) if args.categories else None, num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens, temperature=temperature, top_p=args.top_p, top_k=args.top_k,
        verification=args.verification, num_draft_tokens=num_draft_tokens, batch_size=batch_size, seed=args.seed,
        threads=args.threads,
        no_chat_template=args.no_chat_template, dtype=args.dtype, tree_budget=tree_budget, schedule=schedule,
        out=args.out, outputs=args.outputs, append=args.append, target_path=args.target_path,
        chat_template_kwargs=parse_template_kwargs(args.chat_template_kwargs), trust_remote_code=args.trust_remote_code)
    if settings.chat_template_kwargs and settings.no_chat_template:
        raise ValueError("--chat-template-kwargs: the prompts are plain text (--no-chat-template); drop one of them")
    check_at_least(("--max-new-tokens", settings.max_new_tokens, 1), ("--batch-size", min(settings.batch_size), 1),
                   ("--top-k", settings.top_k, 0), ("--threads", settings.threads, 1),
                   ("--num-prompts", settings.num_prompts, 1))
    if not 0.0 < settings.top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1], got {settings.top_p}")
    if settings.verification != "token" and settings.tree_budget:
        raise ValueError(f"--verification {settings.verification}: block verification tests a chain, and "
                         "--tree-budget decodes trees, which are verified token by token; drop one of them")
    if not settings.prompts:
        raise ValueError("--prompts: no prompt set given")
    for flag, path in (("--out", settings.out), ("--outputs", settings.outputs)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)))
            except OSError as err:
                raise ValueError(f"{flag}: cannot create the folder of {path} ({err.filename}: "
                                 f"{(err.strerror or str(err)).lower()}); choose another path") from None
    return settings


@dataclass
class RunResult:
    """One method over one prompt set: GenerateOutputs per category, token ids and the prompt they answer per
    (question index, turn)."""

    by_category: dict[str, list[GenerateOutput]] = field(default_factory=dict)
    tokens: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    prompts: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    counts: list[dict] = field(default_factory=list)  # per call: {question index: [rounds, accepted]}


def run_methods(target, methods: list[Method], questions: list, settings: EvalSettings, temperature: float,
                batch_size: int,
                progress, sinks: list) -> list[RunResult]:
    """Generate every turn of every question with every method, turn index by turn index, batched within each
    category. The methods take turns on each batch, so a change of machine load during the run hits the baseline and
    every drafter alike (a shared machine otherwise skews speedups measured minutes apart). Each method's second
    turn follows its own first answer."""
    results = [RunResult() for _ in methods]
    answers = [{index: [] for index in range(len(questions))} for _ in methods]
    eos = target.target_info().eos_token_ids
    categories = list(dict.fromkeys(question.category for question in questions))
    calls = 0
    for turn in range(max(len(question.turns) for question in questions)):
        for category in categories:
            active = [i for i, q in enumerate(questions) if q.category == category and len(q.turns) > turn]
            for start in range(0, len(active), batch_size):
                batch = active[start: start + batch_size]
                for method, result, history, sink in zip(methods, results, answers, sinks):
                    prompts = [render_prompt(target.tokenizer, questions[i].turns[: turn + 1], history[i],
                                             not settings.no_chat_template,
                                             settings.chat_template_kwargs) for i in batch]
                    out = generate(target, method, prompts, max_new_tokens=settings.max_new_tokens,
                                   temperature=temperature, top_p=settings.top_p, top_k=settings.top_k,
                                   verification=settings.verification,
                                   seed=settings.seed + calls, eos_token_ids=eos)
                    result.by_category.setdefault(category, []).append(out)
                    result.counts.append(question_counts(out, batch))
                    for index, prompt, tokens in zip(batch, prompts, out.tokens):
                        text = target.tokenizer.decode(tokens, skip_special_tokens=True)
                        history[index].append(text)
                        result.tokens[(index, turn)], result.prompts[(index, turn)] = tokens, prompt
                        sink(questions[index].question_id, turn, tokens, text)
                    progress.update(len(batch))
                calls += 1
    return results


def exact_match(run: RunResult, reference: RunResult, keys: list[tuple[int, int]]) -> float:
    """Share of (question, turn) outputs identical to the reference's."""
    return sum(run.tokens[key] == reference.tokens[key] for key in keys) / len(keys)


def dataset_records(target, dataset: str, questions: list, runs: list[tuple[Method, RunResult]], ar: RunResult,
                    temperature: float, batch_size: int, env: dict, profiles: dict,
                    roofline: dict | None = None) -> list[dict]:
    """Records for one dataset and temperature: category "all" first, then each category; baseline first. At
    T = 0 each output that parts from the baseline's is checked for a near-tie of the target's logits (lossless.py)."""
    categories = list(ar.by_category)
    gaps = {id(run): divergence_gaps(target, run, ar) for _, run in runs} if temperature == 0 else {}
    records = []
    for category in ["all"] + categories:
        chosen = categories if category == "all" else [category]
        indices = {i for i, q in enumerate(questions) if q.category in chosen}
        keys = [key for key in ar.tokens if key[0] in indices]
        ar_out = merge_outputs([out for name in chosen for out in ar.by_category[name]])
        common = dict(dataset=dataset, category=category, temperature=temperature, batch_size=batch_size,
                      num_prompts=len(indices), env=env, roofline=roofline)
        records.append(build_record(ar_out, ar=ar_out, drafter_name="none", greedy_exact_match=None, **common))
        for method, run in runs:
            out = merge_outputs([o for name in chosen for o in run.by_category[name]])
            match = exact_match(run, ar, keys) if temperature == 0 else None
            divergence = summarize([g for k, g in gaps[id(run)].items() if k in keys]) if temperature == 0 else None
            per_question = {q: tuple(c) for q, c in merge_counts(run.counts).items() if q in indices}
            records.append(build_record(out, ar=ar_out, drafter_name=method.name, greedy_exact_match=match,
                                        max_draft_tokens=method.drafter.max_draft_tokens(), drafter=method.drafter,
                                        divergence=divergence, cost_profile=profiles.get(id(method.drafter)),
                                        per_question=per_question, **common))
            # which linears the drafter's steps ran (TargetModel.serve): the fast path's kernels or its own
            records[-1]["drafter_path"] = target.path if target.drafter_kernels(method.drafter) is not None else "hf"
            if method.tree_budget is not None:
                records[-1]["tree_budget"] = method.tree_budget
    return records


def load_prompt_sets(settings: EvalSettings) -> list[tuple[str, list]]:
    """Every prompt set, filtered by --categories, then cut to --num-prompts spread over categories.

    With several prompt sets a category only needs to exist in one of them; a set left empty is an error.
    """
    sets = []
    for spec in settings.prompts:
        dataset, questions = load_questions(spec)
        if settings.categories:
            questions = [q for q in questions if q.category in settings.categories]
        if not questions:
            raise ValueError(f"--prompts {spec!r}: no question in categories {list(settings.categories)}")
        if settings.num_prompts is not None:
            questions = select_spread(questions, settings.num_prompts)
        sets.append((dataset, questions))
    return sets


def check_drafters(settings: EvalSettings, flag: str = "--drafter") -> None:
    """Each drafter against the target before either loads (a missing directory, a training run instead of its
    final/, a checkpoint trained for a target of other sizes): such a mistake costs no model load or kernel timing."""
    config = target_config(settings.target)
    for name in settings.drafter:
        try:
            check_drafter_spec(name, config, settings.target)
        except ValueError as err:
            raise ValueError(f"{flag} {name!r}: {err}") from None


def check_rows(settings: EvalSettings) -> None:
    """A batch or a tree the target's family cannot decode (MiniMax-M3, Llama 4), refused before it loads."""
    batch, trees = max(settings.batch_size), ",".join(map(str, settings.tree_budget))
    asked = [(f"--batch-size {batch}", "a batch of several rows", "use --batch-size 1"),
             (f"--tree-budget {trees}", "a tree's nodes", "drop --tree-budget")]
    check_one_row(resolve_target(settings.target), [a for a, on in zip(asked, (batch > 1, bool(trees))) if on])


def warm_up(target, methods: list[Method], questions: list, settings: EvalSettings) -> None:
    """One short untimed generation per drafter so one-time costs do not land in the first timed run."""
    prompt = [render_prompt(target.tokenizer, questions[0].turns[:1], [], not settings.no_chat_template,
                            settings.chat_template_kwargs)]
    eos = target.target_info().eos_token_ids
    seen = set()
    for method in [Method("none", None, 0)] + methods:
        if id(method.drafter) not in seen:
            seen.add(id(method.drafter))
            generate(target, method.unprofiled(), prompt, max_new_tokens=min(WARMUP_TOKENS, settings.max_new_tokens),
                     eos_token_ids=eos)


def profile_drafters(target, methods: list[Method], questions: list, settings: EvalSettings,
                     batch_size: int) -> dict[int, CostProfile]:
    """Cost profile of every drafter at this batch size (inference/evaluation/profile.profile_costs, on the first
    question repeated batch_size times) up to its widest chain method: {id(drafter): profile}."""
    prompt = render_prompt(target.tokenizer, questions[0].turns[:1], [], not settings.no_chat_template,
                           settings.chat_template_kwargs)
    widest: dict[int, tuple] = {}
    for method in (m for m in methods if m.tree_budget is None):  # trees need no chain profile
        previous = widest.get(id(method.drafter), (method.drafter, 0))[1]
        widest[id(method.drafter)] = (method.drafter, max(previous, method.num_draft_tokens))
    return {key: profile_costs(target, drafter, [prompt] * batch_size, width)
            for key, (drafter, width) in widest.items()}


def evaluate(settings: EvalSettings, target, methods: list[Method], prompt_sets: list, sink) -> list[dict]:
    """Run the baseline and every method over every prompt set, temperature and batch size; return all records."""
    env = environment(target.device, settings.torch_dtype(target.device))
    roofline = {"target_path": target.path, "target_decode": target.decode, "lean_refused": target.lean_refused,
                "weight_bytes": weight_bytes(target.model),
                "stream_gb_per_s": stream_bandwidth(device=target.device),
                "target_kernels": None if target.prepared.kernels is None else target.prepared.kernels.as_dict()}
    total = sum(len(q.turns) for _, questions in prompt_sets for q in questions)
    total *= len(settings.temperature) * len(settings.batch_size) * (1 + len(methods))
    warm_up(target, methods, prompt_sets[0][1], settings)
    records = []
    with tqdm(total=total, desc="draftsmith eval", unit="turn", file=sys.stderr) as progress:
        for batch_size in settings.batch_size:
            curves = profile_drafters(target, methods, prompt_sets[0][1], settings, batch_size) if methods else {}
            profiles = {key: curve.to_dict() for key, curve in curves.items()}  # for the records
            runnable = [m.profiled(curves[id(m.drafter)]) if m.needs_costs else m for m in methods]
            for dataset, questions in prompt_sets:
                for temperature in settings.temperature:
                    every = [Method("none", None, 0)] + runnable
                    results = run_methods(target, every, questions, settings, temperature, batch_size, progress,
                                          [partial(sink, dataset, method, temperature) for method in every])
                    runs = list(zip(runnable, results[1:]))
                    records += dataset_records(target, dataset, questions, runs, results[0], temperature,
                                               batch_size, env, profiles, roofline)
    annotate_recommendations(records)
    return records


def run_config(settings: EvalSettings, device) -> dict:
    """What must be equal for records to sit in one report: the target and everything that changes what it emits or
    how fast. The records themselves say dataset, category, number of questions, drafter, k, temperature and batch
    size, so one report can hold 32 questions of one set and 16 of another (--append with another --num-prompts); a
    category filter stays (its "all" rows mean the kept categories)."""
    return {"target": settings.target, "max_new_tokens": settings.max_new_tokens, "top_p": settings.top_p,
            "top_k": settings.top_k, "seed": settings.seed, "chat_template": not settings.no_chat_template,
            "target_path": settings.target_path, "chat_template_kwargs": settings.chat_template_kwargs or None,
            "categories": list(settings.categories) if settings.categories else settings.categories,
            **({"verification": settings.verification} if settings.verification != "token" else {}),
            "environment": environment(torch.device(device), settings.torch_dtype(device))}


def _outputs_sink(handle):
    def sink(dataset, method, temperature, question_id, turn, tokens, text):
        if handle is not None:
            line = {"dataset": dataset, "drafter": method.name, "num_draft_tokens": method.label,
                    "temperature": temperature, "question_id": question_id, "turn": turn, "token_ids": tokens,
                    "text": text}
            handle.write(json.dumps(line) + "\n")
    return sink


def main(argv: list[str] | None = None) -> int:
    """Entry point of `draftsmith eval`; returns the exit status (2 on bad input, with the cause on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        settings = parse_settings(args)
        if settings.threads:
            torch.set_num_threads(settings.threads)
        prompt_sets = load_prompt_sets(settings)
        check_drafters(settings)
        check_rows(settings)
        device = default_device()
        config = run_config(settings, device)
        previous = read_appendable(settings.out, config) if settings.append else []  # checked before anything loads
        target = TargetModel.from_pretrained(settings.target, dtype=settings.torch_dtype(device), device=device,
                                             backend=CpuBackend() if settings.target_path == "auto" else None,
                                             trust_remote_code=settings.trust_remote_code)
        check_chat_template(target.tokenizer, not settings.no_chat_template, settings.target,
                            settings.chat_template_kwargs)
        methods = load_methods(settings.drafter, target, settings.num_draft_tokens, settings.tree_budget)
        for name in settings.drafter:
            mismatch = os.path.isdir(name) and trained_mode_mismatch(name, settings.chat_template_kwargs)
            if mismatch:
                print(f"draftsmith eval: warning: {mismatch}", file=sys.stderr)
        chains = [m for m in methods if m.tree_budget is None]  # schedules cut chains; trees ignore them
        if settings.schedule != ("fixed",) and chains:
            schedules = build_schedules(list(settings.schedule))
            methods = [Method(m.name if s is None else f"{m.name}@{name}", m.drafter, m.num_draft_tokens, s, m.auto)
                       for m in chains for name, s in schedules] + [m for m in methods if m.tree_budget is not None]
    except (ValueError, OSError) as err:
        print(f"draftsmith eval: error: {err}", file=sys.stderr)
        return 2
    handle = open(settings.outputs, "w") if settings.outputs else None
    try:
        records = evaluate(settings, target, methods, prompt_sets, _outputs_sink(handle))
    finally:
        if handle is not None:
            handle.close()
    written = write_report(previous + records, settings.out, config)
    print(format_table(records))
    print("wrote " + ", ".join(written))
    return 0
