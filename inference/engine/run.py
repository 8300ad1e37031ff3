"""One generation's state and the steps every round shares: start, drop finished rows, record, emit, finish.

The loop (inference/engine/generate.py) owns the order; a round strategy (inference/engine/rounds.py, tree/rounds.py)
reads and writes this state: the target and drafter, the feature request, the clock, the target's sampling
settings (`sampling`) and the two random streams, the running rows (`active`, `next_tokens`, `index`) and the output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from drafters.base import DraftContext, FeatureRequest
from drafters.served import Served
from inference.engine.target import synchronize
from inference.engine.verify import Sampling


@dataclass
class GenerateOutput:
    """What one engine call returns; inference/evaluation/metrics.py turns it into the report record.

    tokens:          per row, the new token ids (prompt excluded, EOS included when emitted, cut at max_new_tokens).
    accept_lengths:  per row, per round that row took part in: drafts accepted (0..k; a tree: the accepted path's
                     depth). Empty lists when k = 0.
    proposed:        per row, per round: drafts actually proposed (k, or fewer on an n-gram miss or when scheduled;
                     a tree: its valid drafted nodes).
    confidence_logits: per row, per round: the drafter's confidence logits of the drafts it proposed (empty lists
                     when the drafter returns none); `draftsmith calibrate` fits its temperatures on them.
    num_draft_tokens: k (with `adaptive`: the largest width it may choose; a tree: its budget - 1).
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

    @classmethod
    def one_after_another(cls, outputs: list["GenerateOutput"]) -> "GenerateOutput":
        """The outputs of calls run one after another as one call's: rows in order, forwards and seconds summed, and
        each row's latency counted from the first call's start."""
        merged = cls([], [], [], outputs[0].num_draft_tokens, adaptive=any(out.adaptive for out in outputs))
        for out in outputs:
            merged.row_seconds += [merged.time_total + seconds for seconds in out.row_seconds]
            for name in ("tokens", "accept_lengths", "proposed", "confidence_logits", "chosen"):
                getattr(merged, name).extend(getattr(out, name))
            for name in ("target_forwards", "verify_forwards", "time_draft", "time_verify", "time_prefill",
                         "time_other", "time_total"):
                setattr(merged, name, getattr(merged, name) + getattr(out, name))
        return merged


class Clock:
    """Accumulates wall time per phase; synchronises an accelerator so device work lands in the right phase. An
    untimed clock (`timed=False`) only runs the phases: no synchronisation, every total 0."""

    def __init__(self, device: torch.device, timed: bool = True):
        self.device, self.timed = device, timed
        self.totals = {"draft": 0.0, "verify": 0.0, "prefill": 0.0}

    def run(self, phase: str, fn, *args, **kwargs):
        if not self.timed:
            return fn(*args, **kwargs)
        synchronize(self.device)
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        synchronize(self.device)
        self.totals[phase] += time.perf_counter() - start
        return result


@dataclass
class Draft:
    """What a round sends to the target. width: the policy's choice; tokens [B, W] the drafts (a chain; for a tree
    the node tokens); num_valid [B] drafts each row offers; probs [B, W, V] or None (deterministic drafts);
    confidence_logits [B, W] or None; tree: the DraftTree of a tree round."""

    width: int
    tokens: torch.Tensor
    num_valid: torch.Tensor
    probs: torch.Tensor | None = None
    confidence_logits: torch.Tensor | None = None
    tree: object = None


@dataclass
class Verdict:
    """The target's answer: num_accepted [B]; new_tokens [B] (correction or bonus); drafts [B, W] the accepted
    drafts in order (a tree: along the accepted path); block [B, W + 1] what the target now holds of the round (the
    last token, then `drafts`); served: the target's features of `block` (drafters/served.py `Served`)."""

    num_accepted: torch.Tensor
    new_tokens: torch.Tensor
    drafts: torch.Tensor
    block: torch.Tensor
    served: Served


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


def check_drafter_device(drafter, device: torch.device) -> None:
    """One line, before the prefill, for a drafter whose weights sit on another device than the target (a drafter
    read from disk and never served: it would stop in its first forward with a device mismatch). A drafter without
    parameters (n-gram lookup) runs wherever its inputs are."""
    parameters = drafter.parameters() if isinstance(drafter, torch.nn.Module) else ()
    elsewhere = sorted({str(parameter.device) for parameter in parameters if parameter.device != device})
    if elsewhere:
        raise ValueError(f"drafter {getattr(drafter, 'kind', type(drafter).__name__)!r}: its parameters are on "
                         f"{', '.join(elsewhere)} but the target is on {device}; place it with "
                         "TargetModel.serve(drafter) (the target's device and dtype)")


class Run:
    """One generation: `start` prefills, samples every row's first token and begins the drafter; the loop then
    calls `drop_finished`, `record` and `emit` once per round and `finish` at the end."""

    def __init__(self, target, drafter, policy, sampling: Sampling, *, eos_token_ids, max_new_tokens: int,
                 timed: bool = True):
        self.target, self.policy, self.device = target, policy, target.device
        self.drafting = drafter is not None and policy.max_width > 0
        self.drafter = drafter if self.drafting else None
        self.request = drafter.feature_request() if self.drafting else FeatureRequest()
        self.sampling = sampling
        self.max_new_tokens = max_new_tokens
        self.eos = {int(e) for e in (eos_token_ids if eos_token_ids is not None
                                     else target.target_info().eos_token_ids)}
        # The target's sampling stream and the drafter's: independent of each other, both from one seed.
        self.generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        self.draft_generator = torch.Generator(device=self.device).manual_seed(sampling.seed + 1_000_003)
        self.clock = Clock(self.device, timed=timed or policy.needs_timing)
        self.started = time.perf_counter()

    def start(self, prompts: list[list[int]], rounds) -> None:
        """Left-pad the prompts (with an EOS id), prefill, sample and emit every row's first token, begin the
        drafter, the policy and the round strategy."""
        if self.drafting:
            check_drafter_device(self.drafter, self.device)
        input_ids, attention_mask = left_pad(prompts, min(self.eos) if self.eos else 0)
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        logits, served = self.clock.run("prefill", self.target.prefill, input_ids, attention_mask, self.request)
        probs = self.sampling.probs(logits[:, -1])  # the target's own rule, also the k = 0 path's
        self.next_tokens = probs.argmax(-1) if self.sampling.greedy else torch.multinomial(
            probs, 1, generator=self.generator).squeeze(-1)
        batch = len(prompts)
        self.out = GenerateOutput([[] for _ in range(batch)], [[] for _ in range(batch)], [[] for _ in range(batch)],
                                  self.policy.max_width, target_forwards=1,
                                  adaptive=self.policy.adaptive and self.drafting)
        self.out.confidence_logits = [[] for _ in range(batch)]
        self.out.chosen = [[] for _ in range(batch)]
        self.out.row_seconds = [0.0] * batch
        self.index = list(range(batch))  # the original row of each row of the running batch
        self.active = torch.ones(batch, dtype=torch.bool, device=self.device)
        self.running = [True] * batch  # `active` on the host, kept by emit: the loop reads it without a sync
        self.emit(self.next_tokens.new_zeros((batch, 0)), torch.zeros_like(self.next_tokens), self.next_tokens)
        if self.drafting:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            context = DraftContext(input_ids, attention_mask.bool(), positions, next_tokens=self.next_tokens,
                                   generator=self.draft_generator, temperature=self.sampling.temperature,
                                   **served.context())
            self.clock.run("prefill", self.drafter.begin, context)
            self.policy.start(batch)
        rounds.begin(self)

    def drop_finished(self, rounds, allowed: bool) -> None:
        """Rows that finished leave the batch: the target's state, the drafter's, the strategy's and the policy's
        keep the running rows only, so a batch whose rows end early costs what its remaining rows cost."""
        drops = allowed and rounds.drops_rows and (not self.drafting or self.drafter.drops_rows())
        if not drops or all(self.running):
            return
        rows = [row for row, running in enumerate(self.running) if running]
        keep = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.target.keep_rows(keep)
        if self.drafting:
            self.drafter.keep_rows(keep)
        rounds.keep_rows(keep)
        self.policy.keep_rows(keep)
        self.next_tokens, self.active = self.next_tokens[keep], self.active[keep]
        self.index = [self.index[row] for row in rows]
        self.running = [True] * len(rows)

    def draft_seconds(self) -> float:
        """The drafter's mean seconds per round so far (a schedule weighs verify seconds against it)."""
        return self.clock.totals["draft"] / max(self.out.verify_forwards, 1)

    def record(self, draft: Draft, verdict: Verdict) -> None:
        """Per active row: accepted and proposed drafts, the round's width and the confidences; feed the policy."""
        rows = [row for row, running in enumerate(self.running) if running]
        accepted, proposed = torch.stack([verdict.num_accepted, draft.num_valid.to(verdict.num_accepted)]).tolist()
        confidences = None if draft.confidence_logits is None else draft.confidence_logits.tolist()
        for row in rows:
            original = self.index[row]
            self.out.accept_lengths[original].append(accepted[row])
            self.out.proposed[original].append(proposed[row])
            self.out.chosen[original].append(draft.width)
            if confidences is not None:
                self.out.confidence_logits[original].append(confidences[row][: proposed[row]])
        self.policy.observe([p if row in rows else 0 for row, p in enumerate(proposed)], accepted)

    def emit(self, drafts: torch.Tensor, num_accepted: torch.Tensor, new_tokens: torch.Tensor) -> None:
        """Append drafts[b, :num_accepted[b]] and new_tokens[b] to the active rows, stopping at EOS or
        max_new_tokens; rows that stop leave `active` and get their latency stamped."""
        # One device-to-host copy per round (not one per row or per tensor): each is a synchronisation on an
        # accelerator. Row b of `host`: num_accepted, the new token, then its drafts.
        host = torch.cat([num_accepted[:, None], new_tokens[:, None], drafts.to(new_tokens)], dim=1).tolist()
        now, still = None, list(self.running)
        for row in (row for row, running in enumerate(self.running) if running):
            tokens = self.out.tokens[self.index[row]]
            for token in host[row][2: 2 + host[row][0]] + [host[row][1]]:
                tokens.append(token)
                if token in self.eos or len(tokens) >= self.max_new_tokens:  # eos: a set of ids
                    still[row] = False
                    now = time.perf_counter() - self.started if now is None else now
                    self.out.row_seconds[self.index[row]] = now
                    break
        if still != self.running:
            self.running = still
            self.active = torch.tensor(still, dtype=torch.bool, device=self.device)

    def finish(self) -> GenerateOutput:
        out, totals = self.out, self.clock.totals
        out.time_total = time.perf_counter() - self.started
        out.time_draft, out.time_verify, out.time_prefill = totals["draft"], totals["verify"], totals["prefill"]
        out.time_other = max(out.time_total - out.time_draft - out.time_verify - out.time_prefill, 0.0)
        return out
