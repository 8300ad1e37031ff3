"""The speculative decoding loop: draft, verify in one target forward, accept left to right, roll back.

    out = speculative_generate(target, drafter, prompts, num_draft_tokens=7, max_new_tokens=128)

Batch size >= 1 with per-row acceptance (ragged KV cache, see drafters/ragged_lm.py), EOS and max-new-tokens per row,
greedy and lossless sampling (inference/engine/verify.py). `drafter=None` or `num_draft_tokens=0` is plain autoregression
through the same code: one target forward per token, the fair baseline for speedup. `schedule` (inference/engine/schedule.py)
cuts each row's proposal by the drafter's confidences (a static threshold or the prefix scheduler); drafters without
confidences propose as usual. `adaptive` (inference/engine/adaptive.py) chooses each round's width in 0..num_draft_tokens
before the round's drafts exist; while rounds propose nothing the drafter's catch-up is deferred and handed over in
one `commit` before its next proposal (`_Deferred`). Rows that finished leave the batch (`drop_finished_rows`): the
target's KV cache and the drafter's state keep only the running rows (drafters/base.py keep_rows), so a batch whose
rows end early costs what its remaining rows cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from drafters.base import DraftContext, Drafter, FeatureRequest, select_rows
from inference.engine.schedule import scheduled_num_valid
from inference.engine.target import synchronize
from inference.engine.verify import greedy_verify, sample_verify, sampling_probs


@dataclass
class GenerateOutput:
    """What one `speculative_generate` call returns; inference/evaluation/metrics.py turns it into the report record.

    tokens:          per row, the new token ids (prompt excluded, EOS included when emitted, cut at max_new_tokens).
    accept_lengths:  per row, per round that row took part in: drafts accepted (0..k). Empty lists when k = 0.
    proposed:        per row, per round: drafts actually proposed (k, or fewer on an n-gram miss or when scheduled).
    confidence_logits: per row, per round: the drafter's confidence logits of the drafts it proposed (empty lists
                     when the drafter returns none); `draftsmith calibrate` fits its temperatures on them.
    num_draft_tokens: k (with `adaptive`: the largest width it may choose).
    chosen:          per row, per round that row took part in: the width the round was run with (k, or the adaptive
                     choice; 0 = a plain AR round).
    adaptive:        True when the widths were chosen at run time.
    row_seconds:     per row, wall seconds from the call's start to the row's last token (its request latency).
    target_forwards: batched target forwards, prefill included.
    verify_forwards: batched target forwards after prefill (one per round; for k = 0 one per AR step).
    time_draft / time_verify / time_prefill / time_other / time_total: seconds (wall clock, this call).
    time_draft counts the drafter's propose and commit (its catch-up forward); time_prefill the target prefill and
    the drafter's begin; time_verify the target verify forwards and the accept/reject decision.
    """

    tokens: list[list[int]]
    accept_lengths: list[list[int]]
    proposed: list[list[int]]
    num_draft_tokens: int
    target_forwards: int = 0
    verify_forwards: int = 0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_prefill: float = 0.0
    time_other: float = 0.0
    time_total: float = 0.0
    confidence_logits: list[list[list[float]]] = field(default_factory=list)
    chosen: list[list[int]] = field(default_factory=list)
    adaptive: bool = False
    row_seconds: list[float] = field(default_factory=list)


class _Clock:
    """Accumulates wall time per phase; synchronises an accelerator so device work lands in the right phase."""

    def __init__(self, device: torch.device):
        self.device = device
        self.totals = {"draft": 0.0, "verify": 0.0, "prefill": 0.0}

    def run(self, phase: str, fn, *args, **kwargs):
        synchronize(self.device)
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        synchronize(self.device)
        self.totals[phase] += time.perf_counter() - start
        return result


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts -> input_ids [B, S], attention_mask [B, S] with left padding."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {row} is empty")
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return input_ids, mask


@torch.no_grad()
def speculative_generate(
    target,
    drafter: Drafter | None,
    prompts: list[list[int]],
    *,
    num_draft_tokens: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    eos_token_ids=None,
    schedule=None,
    adaptive=None,
    drop_finished_rows: bool = True,
) -> GenerateOutput:
    """Generate up to max_new_tokens per prompt. See the module docstring; target is an inference.engine.target.TargetModel,
    adaptive an inference.engine.adaptive.AdaptiveK whose widths go up to num_draft_tokens (None = k every round).
    drop_finished_rows=False keeps finished rows in the batch to the end (masked out), as a reference."""
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if adaptive is not None and adaptive.max_width < num_draft_tokens:
        raise ValueError(f"adaptive k: its cost curves stop at width {adaptive.max_width}, num_draft_tokens is "
                         f"{num_draft_tokens}")
    num_draft = num_draft_tokens if drafter is not None else 0
    device = target.device
    request = drafter.feature_request() if num_draft > 0 else FeatureRequest()
    clock = _Clock(device)
    start = time.perf_counter()

    def pick(logits):  # the target's own sampling rule, also used for the k = 0 path
        return sampling_probs(logits, temperature, top_k, top_p)

    eos, generator, draft_generator = _eos_ids(target, eos_token_ids), *_generators(device, seed)
    first = _prefill(target, prompts, request, clock, pick, temperature, generator, eos)
    next_tokens = first.next_tokens
    batch = len(prompts)
    out = GenerateOutput([[] for _ in range(batch)], [[] for _ in range(batch)], [[] for _ in range(batch)], num_draft,
                         adaptive=adaptive is not None and num_draft > 0)
    out.target_forwards = 1
    out.confidence_logits = [[] for _ in range(batch)]
    out.chosen = [[] for _ in range(batch)]
    active = torch.ones(batch, dtype=torch.bool, device=device)
    no_drafts = next_tokens.new_zeros((batch, 0))
    active = _emit(out, active, no_drafts, torch.zeros_like(next_tokens), next_tokens, eos, max_new_tokens)
    out.row_seconds = [0.0] * batch
    _stamp_finished(out, torch.ones_like(active), active, start)
    if num_draft > 0:
        clock.run("prefill", drafter.begin, first.context(draft_generator, temperature))
        if out.adaptive:
            adaptive.start(batch)
    deferred = _Deferred()
    index = list(range(batch))  # the original row of each row of the running batch
    drops = drop_finished_rows and (num_draft == 0 or drafter.drops_rows())

    while bool(active.any()):
        round_k = adaptive.choose(active) if out.adaptive else num_draft
        proposal = None
        if drops and not bool(active.all()):
            keep = active.nonzero().flatten()
            target.runner.keep_rows(keep)
            if num_draft > 0:
                drafter.keep_rows(keep)
                deferred.keep_rows(keep)
            if out.adaptive:
                adaptive.keep_rows(keep)
            next_tokens, active = next_tokens[keep], active[keep]
            index = [index[row] for row in keep.tolist()]
        if round_k > 0:
            if deferred:  # rounds that proposed nothing: the drafter catches up on them in one commit
                clock.run("draft", drafter.commit, *deferred.merged())
            proposal = clock.run("draft", drafter.propose, round_k)
            num_valid = _num_valid(proposal, active, round_k)
            if schedule is not None:
                draft_seconds = clock.totals["draft"] / max(out.verify_forwards, 1)
                num_valid = clock.run("draft", scheduled_num_valid, schedule, proposal, num_valid, active,
                                      draft_seconds)
            width = int(num_valid.max())
            drafts = proposal.tokens[:, :width].to(device)
            draft_probs = None if proposal.probs is None else proposal.probs[:, :width].to(device)
        else:
            width, drafts, draft_probs = 0, next_tokens.new_zeros((len(index), 0)), None
            num_valid = torch.zeros(len(index), dtype=torch.long, device=device)
        block = torch.cat([next_tokens[:, None], drafts], dim=1)  # [B, width + 1]
        num_accepted, new_tokens, served = clock.run(
            "verify", _verify_block, target, block, drafts, draft_probs, num_valid, request, pick,
            temperature, generator, active,
        )
        out.target_forwards += 1
        out.verify_forwards += 1
        if num_draft > 0:
            _record_round(out, active, round_k, num_valid, num_accepted, proposal, adaptive, index)
        was_active = active.clone()
        active = _emit(out, active, drafts, num_accepted, new_tokens, eos, max_new_tokens, index)
        _stamp_finished(out, was_active, active, start, index)
        next_tokens = new_tokens
        if num_draft > 0:
            valid = (torch.arange(width + 1, device=device)[None, :] <= num_accepted[:, None]) & was_active[:, None]
            offsets = torch.arange(width + 1, device=device)
            positions = target.runner.lengths[:, None] - valid.long().sum(-1, keepdim=True) + offsets
            context = DraftContext(block, valid, positions, next_tokens=next_tokens, generator=draft_generator,
                                   temperature=temperature, **served)
            if round_k > 0:
                clock.run("draft", drafter.commit, num_accepted, context)
            else:
                deferred.add(context)

    out.time_total = time.perf_counter() - start
    out.time_draft, out.time_verify = clock.totals["draft"], clock.totals["verify"]
    out.time_prefill = clock.totals["prefill"]
    out.time_other = max(out.time_total - out.time_draft - out.time_verify - out.time_prefill, 0.0)
    return out


def _record_round(out: GenerateOutput, active, round_k: int, num_valid, num_accepted, proposal, adaptive,
                  index: list[int]) -> None:
    """Per active row: accepted and proposed drafts, the round's width and the confidences; feed `adaptive`."""
    rows = active.nonzero().flatten().tolist()
    accepted, proposed = num_accepted.tolist(), num_valid.tolist()
    for row in rows:
        original = index[row]
        out.accept_lengths[original].append(accepted[row])
        out.proposed[original].append(proposed[row])
        out.chosen[original].append(round_k)
        if proposal is not None and proposal.confidence_logits is not None:
            out.confidence_logits[original].append(proposal.confidence_logits[row, : proposed[row]].tolist())
    if out.adaptive:
        adaptive.observe([p if row in rows else 0 for row, p in enumerate(proposed)], accepted)


def _stamp_finished(out: GenerateOutput, was_active, active, start: float, index: list[int] | None = None) -> None:
    """Record the latency of the rows that finished in this round."""
    now = time.perf_counter() - start
    for row in (was_active & ~active).nonzero().flatten().tolist():
        out.row_seconds[row if index is None else index[row]] = now


class _Deferred:
    """The verify contexts of rounds that proposed nothing, merged into one catch-up `commit`.

    A run of n such rounds verified the tokens t_0, t_1, ..., t_{n-1} one by one ([previous token] each time) and
    emitted t_n: exactly what a verify of [t_0, t_1..t_{n-1}] accepting all n - 1 drafts would have produced. So the
    drafter receives one block of n positions, `valid` a prefix per row (a row that finished during the run stops
    being valid there), num_accepted = valid positions - 1, the features of every position concatenated, the KV
    view of the last forward (its last n slots are this block's) and next_tokens t_n.
    """

    def __init__(self):
        self.contexts: list[DraftContext] = []

    def __bool__(self) -> bool:
        return bool(self.contexts)

    def add(self, context: DraftContext) -> None:
        self.contexts.append(context)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` of every deferred context (the engine dropped the others)."""
        self.contexts = [select_rows(context, rows) for context in self.contexts]

    def merged(self) -> tuple[torch.Tensor, DraftContext]:
        """(num_accepted [B], context [B, n]) of the deferred rounds; empties the queue."""
        contexts, self.contexts = self.contexts, []
        last = contexts[-1]

        def cat(name):
            values = [getattr(c, name) for c in contexts]
            return None if values[0] is None else torch.cat(values, dim=1)

        valid = cat("valid")
        top_k = None if last.top_k is None else tuple(torch.cat([c.top_k[i] for c in contexts], dim=1)
                                                      for i in range(2))
        merged = DraftContext(
            cat("input_ids"), valid, cat("position_ids"),
            hidden={i: torch.cat([c.hidden[i] for c in contexts], dim=1) for i in last.hidden},
            next_tokens=last.next_tokens, generator=last.generator, final_hidden=cat("final_hidden"), top_k=top_k,
            target_kv=last.target_kv, target_kv_valid=last.target_kv_valid, temperature=last.temperature,
        )
        return (valid.long().sum(-1) - 1).clamp(min=0), merged


def _eos_ids(target, eos_token_ids) -> set[int]:
    """The ids that end a row: the caller's, else the target's."""
    return {int(e) for e in (eos_token_ids if eos_token_ids is not None else target.target_info().eos_token_ids)}


def _generators(device, seed: int) -> tuple[torch.Generator, torch.Generator]:
    """The target's sampling stream and the drafter's, independent of each other, both from one seed."""
    return (torch.Generator(device=device).manual_seed(seed),
            torch.Generator(device=device).manual_seed(seed + 1_000_003))


@dataclass
class _Prefilled:
    """What the prefill of a generation leaves for the loop: the left-padded prompts input_ids, attention_mask
    [B, S], the features the target served for them and the first token of every row next_tokens [B]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    served: dict
    next_tokens: torch.Tensor

    def context(self, draft_generator, temperature: float) -> DraftContext:
        """The drafter's `begin` context: the prompts, their positions and features, and the first token."""
        return DraftContext(self.input_ids, self.attention_mask.bool(), _positions(self.attention_mask),
                            next_tokens=self.next_tokens, generator=draft_generator, temperature=temperature,
                            **self.served)


def _prefill(target, prompts, request, clock, pick, temperature, generator, eos) -> _Prefilled:
    """Left-pad the prompts (with an EOS id), run the target's prefill under the clock and sample each row's first
    token with the target's own rule `pick`. Every engine loop (chain and tree) starts here."""
    input_ids, attention_mask = left_pad(prompts, min(eos) if eos else 0)
    input_ids, attention_mask = input_ids.to(target.device), attention_mask.to(target.device)
    logits, served = clock.run("prefill", target.prefill, input_ids, attention_mask, request)
    return _Prefilled(input_ids, attention_mask, served, _sample(pick(logits[:, -1]), temperature, generator))


def _verify_block(target, block, drafts, draft_probs, num_valid, request, pick, temperature, generator, active):
    """One target forward over [next token, drafts], the accept decision, and the KV rollback."""
    mark = target.mark()
    logits, served = target.extend(block, request)
    if temperature == 0:
        num_accepted, new_tokens = greedy_verify(drafts, logits, num_valid)
    else:
        num_accepted, new_tokens = sample_verify(drafts, draft_probs, pick(logits), num_valid, generator)
    # Row b keeps its last emitted token and the accepted drafts; finished rows keep nothing.
    target.keep_after(mark, torch.where(active, num_accepted + 1, torch.zeros_like(num_accepted)))
    if request.kv_layers:  # the rollback changed the cache the drafter reads
        served.update(target.kv_view(request.kv_layers))
    return num_accepted, new_tokens, served


def _sample(probs: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    if temperature == 0:
        return probs.argmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _num_valid(proposal, active: torch.Tensor, num_draft: int) -> torch.Tensor:
    if proposal.tokens.shape[1] < num_draft and proposal.num_valid is None:
        raise ValueError(f"drafter proposed {proposal.tokens.shape[1]} tokens, {num_draft} were asked for")
    num_valid = torch.full_like(active, num_draft, dtype=torch.long)
    if proposal.num_valid is not None:
        num_valid = proposal.num_valid.to(active.device).clamp(max=num_draft)
    return torch.where(active, num_valid, torch.zeros_like(num_valid))


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _emit(out: GenerateOutput, active, drafts, num_accepted, new_tokens, eos, max_new_tokens,
          index: list[int] | None = None) -> torch.Tensor:
    """Append drafts[b, :num_accepted[b]] and new_tokens[b] to active rows, stopping at EOS or max_new_tokens.
    index[b]: the row of `out` that batch row b is (None: the same). Returns the new active mask [B]."""
    still = active.clone()
    # One device-to-host copy per tensor per round (not one per row): each is a synchronisation on an accelerator.
    accepted, emitted, drafted = num_accepted.tolist(), new_tokens.tolist(), drafts.tolist()
    for row in active.nonzero().flatten().tolist():
        tokens = out.tokens[row if index is None else index[row]]
        for token in drafted[row][: accepted[row]] + [emitted[row]]:
            tokens.append(token)
            if token in eos or len(tokens) >= max_new_tokens:  # eos: a set of ids
                still[row] = False
                break
    return still
