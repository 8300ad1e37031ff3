"""Turn `GenerateOutput`s into the report record (docs/ARCHITECTURE.md; reference theory_and_metrics.md D.2, E).

Counting follows vLLM's spec-decode counters, per row:
- rounds: rounds summed over rows (vLLM `num_drafts`). Rounds where an n-gram drafter proposed nothing still count,
  so tau is the real mean number of tokens a row gains per target verify forward.
- tau = 1 + accepted / rounds (the bonus or correction token included); acceptance_rate = accepted / proposed.
- per-position acceptance, unconditional: p_j = share of rounds whose first j drafts were all accepted (vLLM's
  per-position vector), so tau = 1 + sum_j p_j.
- per-position acceptance, conditional: alpha_j = P(draft j accepted | drafts < j accepted and draft j proposed);
  equals p_j / p_{j-1} when every round proposes k drafts.

Costs are in units of one plain autoregressive (AR) target step of the same engine and batch size, measured by the
k = 0 run: d(k) = draft time per round / AR step (measured at each k: a chain drafter pays about k c, a block drafter
one forward for all k drafts, so k c would have the wrong shape), c = d(k) / k, v(k) = verify forward time / AR step,
and the theoretical speedup is tau / (d(k) + v(k)) (D.2, batched form: a batched round costs d(k) + v(k) AR steps
and each of its rows gains tau tokens on average). Prefill time is reported on its own (`time_s.prefill`) and is not
part of `time_s.other`.
"""

from __future__ import annotations

import torch

from inference.engine.generate import GenerateOutput
from inference.engine.roofline import achieved_gb_per_s
from inference.evaluation.intervals import accept_length_mean, tau_interval
from inference.evaluation.lossless import summarize

NO_DIVERGENCE_CHECK = dict.fromkeys(summarize([]))  # the baseline's fields, and every record's when T > 0


def merge_outputs(outputs: list[GenerateOutput]) -> GenerateOutput:
    """Concatenate rows and sum counters and timers of several calls made with the same k (batches, turns)."""
    if not outputs:
        raise ValueError("merge_outputs needs at least one GenerateOutput")
    ks = {out.num_draft_tokens for out in outputs}
    if len(ks) != 1:
        raise ValueError(f"cannot merge outputs with different num_draft_tokens {sorted(ks)}")
    if len({out.adaptive for out in outputs}) != 1:
        raise ValueError("cannot merge adaptive-k outputs with fixed-k outputs")
    merged = GenerateOutput(tokens=[], accept_lengths=[], proposed=[], num_draft_tokens=ks.pop(),
                            adaptive=outputs[0].adaptive)
    for out in outputs:
        merged.tokens += out.tokens
        merged.accept_lengths += out.accept_lengths
        merged.proposed += out.proposed
        merged.chosen += out.chosen
        merged.row_seconds += out.row_seconds
        for name in ("target_forwards", "verify_forwards", "time_draft", "time_verify", "time_prefill",
                     "time_other", "time_total"):
            setattr(merged, name, getattr(merged, name) + getattr(out, name))
    return merged


def acceptance_counts(out: GenerateOutput) -> dict:
    """Counters over every row and round of `out`.

    Returns:
        dict with rounds, accepted, proposed, accept_length_histogram (list, index = accept length 0..k, sums to
        rounds), survived (list of k: rounds whose first j+1 drafts were accepted) and offered (list of k: rounds
        whose first j drafts were accepted and that proposed a draft at position j+1).
    """
    k = out.num_draft_tokens
    histogram = [0] * (k + 1)
    survived = [0] * k
    offered = [0] * k
    rounds = accepted = proposed = 0
    for row_accepts, row_proposed in zip(out.accept_lengths, out.proposed, strict=True):
        if len(row_accepts) != len(row_proposed):
            raise ValueError("accept_lengths and proposed must have one entry per round for every row")
        for num_accepted, num_proposed in zip(row_accepts, row_proposed):
            if not 0 <= num_accepted <= num_proposed <= k:
                raise ValueError(f"round with {num_accepted} accepted of {num_proposed} proposed (k = {k})")
            rounds += 1
            accepted += num_accepted
            proposed += num_proposed
            histogram[num_accepted] += 1
            for j in range(num_accepted):
                survived[j] += 1
                offered[j] += 1
            if num_accepted < num_proposed:
                offered[num_accepted] += 1  # the first rejected position was offered and failed
    return {"rounds": rounds, "accepted": accepted, "proposed": proposed, "accept_length_histogram": histogram,
            "survived": survived, "offered": offered}


def ar_step_time(ar: GenerateOutput | None) -> float | None:
    """Seconds per batched AR decode step (prefill excluded), from a k = 0 run."""
    if ar is None or ar.verify_forwards == 0:
        return None
    return ar.time_verify / ar.verify_forwards


def tokens_per_second(out: GenerateOutput) -> float | None:
    new_tokens = sum(len(row) for row in out.tokens)
    return new_tokens / out.time_total if out.time_total > 0 else None


def per_request_tokens_per_second(out: GenerateOutput) -> float | None:
    """Mean over requests (rows) of the row's tokens / the seconds from its call's start to its last token: what one
    user of a batched server sees, where `tokens_per_second` is the server's throughput."""
    rates = [len(row) / seconds for row, seconds in zip(out.tokens, out.row_seconds) if seconds > 0]
    return sum(rates) / len(rates) if rates and len(rates) == len(out.tokens) else None


def chosen_histogram(out: GenerateOutput) -> list[int]:
    """Row-rounds by the width they ran with, index 0..k (adaptive k: how often each proposal length was chosen)."""
    histogram = [0] * (out.num_draft_tokens + 1)
    for row in out.chosen:
        for width in row:
            histogram[width] += 1
    return histogram


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def cost_ratios(out: GenerateOutput, ar: GenerateOutput | None) -> tuple[float | None, float | None]:
    """(d(k), v(k)): draft cost and verify cost per round, both in AR steps (None if unknown; d is None at k = 0)."""
    step = ar_step_time(ar)
    k = out.num_draft_tokens
    if step is None or out.verify_forwards == 0:
        return None, None
    draft_per_round = out.time_draft / out.verify_forwards / step if k > 0 else None
    return draft_per_round, out.time_verify / out.verify_forwards / step


def drafter_placement(drafter) -> dict:
    """drafter_device and drafter_dtype: where the drafter's weights sit and their floating dtype, to read beside
    the target's (the record's env.device, env.dtype); None for no drafter or one without weights (n-gram)."""
    parameters = list(drafter.parameters()) if isinstance(drafter, torch.nn.Module) else []
    devices = sorted({str(p.device) for p in parameters})
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in parameters if p.is_floating_point()})
    return {"drafter_device": ",".join(devices) or None, "drafter_dtype": ",".join(dtypes) or None}


def build_record(out: GenerateOutput, *, ar: GenerateOutput | None, dataset: str, category: str, drafter_name: str,
                 temperature: float, batch_size: int, num_prompts: int, greedy_exact_match: float | None,
                 env: dict, max_draft_tokens: int | None = None, roofline: dict | None = None,
                 cost_profile: dict | None = None, drafter=None, divergence: dict | None = None,
                 per_question: dict[int, tuple[int, int]] | None = None) -> dict:
    """One report record (a JSON-ready dict) for one dataset x category x drafter x k x temperature.

    Args:
        out: the speculative run (all batches and turns merged, see `merge_outputs`).
        ar: the k = 0 run of the same engine over the same prompts, batch size and temperature; None leaves
            tokens_per_s_ar, speedup, c, v(k) and the theoretical speedup as None.
        greedy_exact_match: share of prompts whose output equals the plain greedy output (None when T > 0).
        drafter: the drafter that ran (None: the baseline), for drafter_device / drafter_dtype.
        divergence: at T = 0, inference/evaluation/lossless.summarize over the outputs that parted from plain
            greedy's: divergences, divergences_all_near_ties, divergence_max_gap_ulps, near_tie_ulps (in bf16 the
            outputs may part at near-ties of the target's logits; every other divergence is a bug). None: not
            checked (the baseline, T > 0), every field None.
        max_draft_tokens: the drafter's longest proposal (Drafter.max_draft_tokens), None when unbounded; the
            recommended k never exceeds it.
        roofline: {"target_path", "weight_bytes", "stream_gb_per_s"} of the target (see `roofline_keys`).
        cost_profile: the drafter's profiled costs (engine/costs.CostProfile.to_dict), kept in the record.
        per_question: {question index: (rounds, accepted)}, for tau_ci95 (`tau_interval`) and kept as
            tau_per_question ([[index, rounds, accepted], ...] by index: two drafters' records over the same
            questions compare question by question, `paired_tau_differences`); None leaves both None.
    """
    k = out.num_draft_tokens  # with adaptive k: the largest width it could choose
    counts = acceptance_counts(out)
    rounds = counts["rounds"]
    tau = 1.0 if k == 0 else accept_length_mean(rounds, counts["accepted"])
    d, v = cost_ratios(out, ar)
    theoretical = None
    if tau is not None and v is not None and (k == 0 or d is not None):
        theoretical = tau / ((d if k else 0.0) + v)
    tokens_per_s = tokens_per_second(out)
    tokens_per_s_ar = tokens_per_second(ar) if ar is not None else None
    per_request = per_request_tokens_per_second(out)
    per_request_ar = per_request_tokens_per_second(ar) if ar is not None else None
    return {
        "dataset": dataset, "category": category, "drafter": drafter_name, "temperature": temperature,
        "num_draft_tokens": "auto" if out.adaptive else k, "batch_size": batch_size, "num_prompts": num_prompts,
        "adaptive_max_draft_tokens": k if out.adaptive else None,
        "num_draft_tokens_histogram": chosen_histogram(out) if out.adaptive else None,
        "num_sequences": len(out.tokens), "new_tokens": sum(len(row) for row in out.tokens),
        "rounds": rounds, "accepted": counts["accepted"], "proposed": counts["proposed"],
        "tau": tau, "tau_ci95": tau_interval(list(per_question.values())) if k and per_question else None,
        "tau_per_question": [[q, *per_question[q]] for q in sorted(per_question)] if k and per_question else None,
        "acceptance_rate": _ratio(counts["accepted"], counts["proposed"]),
        "per_position_acceptance_conditional": [_ratio(s, o) for s, o in zip(counts["survived"], counts["offered"])],
        "per_position_acceptance_unconditional": [_ratio(s, rounds) for s in counts["survived"]],
        "accept_length_histogram": counts["accept_length_histogram"],
        "target_forwards": out.target_forwards, "verify_forwards": out.verify_forwards,
        "time_s": {"draft": out.time_draft, "verify": out.time_verify, "prefill": out.time_prefill,
                   "other": out.time_other, "total": out.time_total},
        "tokens_per_s": tokens_per_s, "tokens_per_s_ar": tokens_per_s_ar,
        "speedup": _ratio(tokens_per_s, tokens_per_s_ar),
        "per_request_tokens_per_s": per_request, "per_request_tokens_per_s_ar": per_request_ar,
        "per_request_speedup": _ratio(per_request, per_request_ar),
        "draft_cost_per_round": d, "draft_cost_ratio": _ratio(d, k) if k and not out.adaptive else None,
        "verify_cost_ratio": v, "theoretical_speedup": theoretical, "predicted_speedup": None,
        "cost_profile": cost_profile, "max_draft_tokens": max_draft_tokens,
        **roofline_keys(roofline, ar_step_time(ar), ar_step_time(out), cost_profile),
        "greedy_exact_match": greedy_exact_match, **(divergence or NO_DIVERGENCE_CHECK), **drafter_placement(drafter),
        "recommended_num_draft_tokens": None, "recommendation_basis": None,
        "env": env,
    }


def roofline_keys(roofline: dict | None, ar_step: float | None, verify_round: float | None,
                  cost_profile: dict | None = None) -> dict:
    """The record's roofline line: `achieved_gb_per_s` = weight bytes one forward reads / measured seconds, for the AR
    step (`ar`), for this record's verify round (`verify`: seconds per verify forward with its accept and rollback,
    the AR step itself at k = 0) and, with a cost profile, per verify width W = 0..K (`verify_by_width`), beside the
    machine's `stream_gb_per_s` (probed at start-up), the `target_path` that ran and, on the fast path, the kernel
    chosen per weight shape and row count with its timings (`target_kernels`, inference/engine/cpu/fastpath.py)."""
    roofline = roofline or {}
    nbytes = roofline.get("weight_bytes")
    by_width = None
    if cost_profile and cost_profile.get("verify_seconds"):
        by_width = [achieved_gb_per_s(nbytes, seconds) for seconds in cost_profile["verify_seconds"]]
    return {"target_path": roofline.get("target_path"), "target_kernels": roofline.get("target_kernels"),
            "weight_bytes_per_forward": nbytes,
            "stream_gb_per_s": roofline.get("stream_gb_per_s"),
            "achieved_gb_per_s": {"ar": achieved_gb_per_s(nbytes, ar_step),
                                  "verify": achieved_gb_per_s(nbytes, verify_round), "verify_by_width": by_width}}


def recommend_num_draft_tokens(per_position_unconditional: list[float], d_of_k: dict[int, float],
                               v_of_k: dict[int, float], max_draft_tokens: int | None = None) -> int:
    """The k maximising the expected speedup (1 + sum_{j<=k} p_j) / (d(k) + v(k)) (theory D.2, D.3).

    Args:
        per_position_unconditional: p_1..p_K, prefix-survival acceptance measured with the largest k.
        d_of_k, v_of_k: measured draft and verify cost per round in AR steps, keyed by k. k = 0 is plain AR (cost 1,
            gain 1) and always a candidate, so 0 means "do not speculate". A k between two measured ones uses the
            linear interpolation; a k below the smallest measured one uses that one's cost (an over-estimate, since
            both grow with k); k beyond the largest measured one, beyond len(p) or beyond max_draft_tokens is not
            considered.
    Returns:
        The recommended number of draft tokens.
    """
    best_k, best_speedup = 0, 1.0
    limit = len(per_position_unconditional) if max_draft_tokens is None else min(len(per_position_unconditional),
                                                                                   max_draft_tokens)
    for k in range(1, limit + 1):
        d, v = _interpolate(d_of_k, k), _interpolate(v_of_k, k)
        if d is None or v is None:
            continue
        speedup = (1.0 + sum(per_position_unconditional[:k])) / (d + v)
        if speedup > best_speedup:
            best_k, best_speedup = k, speedup
    return best_k


def _interpolate(v_of_k: dict[int, float], k: int) -> float | None:
    measured = sorted(key for key in v_of_k if key > 0)
    if not measured or k > measured[-1]:
        return None
    if k <= measured[0]:
        return v_of_k[measured[0]]
    upper = next(key for key in measured if key >= k)
    lower = max(key for key in measured if key <= k)
    if upper == lower:
        return v_of_k[k]
    weight = (k - lower) / (upper - lower)
    return v_of_k[lower] * (1 - weight) + v_of_k[upper] * weight


def predicted_speedup(per_position_unconditional: list[float], d_of_k: dict[int, float], v_of_k: dict[int, float],
                      k: int) -> float | None:
    """(1 + sum_{j<=k} p_j) / (d(k) + v(k)) (theory D.2), None when p or the costs do not reach k."""
    d, v = _interpolate(d_of_k, k), _interpolate(v_of_k, k)
    if k > len(per_position_unconditional) or d is None or v is None:
        return None
    return (1.0 + sum(per_position_unconditional[:k])) / (d + v)


def annotate_recommendations(records: list[dict]) -> None:
    """Set recommended_num_draft_tokens / recommendation_basis / predicted_speedup on speculative records, in place.

    Records are grouped by (dataset, category, drafter, temperature, batch size); each group uses p from its fixed-k
    record with the largest k, and d(k), v(k) from the drafter's cost profile (measured on this machine at every
    width at this batch size, `cost_profile`, inference/evaluation/profile.profile_costs) when the records carry
    one, else from the group's own records. predicted_speedup is the calibration's prediction for the record's k,
    to set beside the measured speedup; an adaptive record gets the prediction of the recommended k (the best fixed
    k, 1.0 for k = 0).
    """
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        if record["num_draft_tokens"] != 0 and record.get("tree_budget") is None:  # the k recommended is a chain's
            key = tuple(record[name] for name in ("dataset", "category", "drafter", "temperature", "batch_size"))
            groups.setdefault(key, []).append(record)
    for group in groups.values():
        fixed = [r for r in group if isinstance(r["num_draft_tokens"], int)]
        if not fixed:
            continue
        largest = max(fixed, key=lambda record: record["num_draft_tokens"])
        p = largest["per_position_acceptance_unconditional"]
        d_of_k, v_of_k, basis = _costs_of(largest, fixed)
        if not v_of_k or any(value is None for value in p):
            continue
        recommended = recommend_num_draft_tokens(p, d_of_k, v_of_k, largest.get("max_draft_tokens"))
        for record in group:
            record["recommended_num_draft_tokens"] = recommended
            record["recommendation_basis"] = f"p_j from k={largest['num_draft_tokens']}; {basis}"
            k = recommended if record["num_draft_tokens"] == "auto" else record["num_draft_tokens"]
            record["predicted_speedup"] = 1.0 if k == 0 else predicted_speedup(p, d_of_k, v_of_k, k)


def _costs_of(largest: dict, fixed: list[dict]) -> tuple[dict, dict, str]:
    """d(k), v(k) in AR steps and a sentence saying where they come from."""
    profile = largest.get("cost_profile")
    if profile:
        widths = range(1, len(profile["v"]))
        return ({k: profile["d"][k] for k in widths}, {k: profile["v"][k] for k in widths},
                f"d(k) and v(k) profiled on this machine at k=1..{len(profile['v']) - 1} (cost_profile)")
    measured_records = [r for r in fixed
                        if r["verify_cost_ratio"] is not None and r["draft_cost_per_round"] is not None]
    d_of_k = {r["num_draft_tokens"]: r["draft_cost_per_round"] for r in measured_records}
    v_of_k = {r["num_draft_tokens"]: r["verify_cost_ratio"] for r in measured_records}
    measured = sorted(v_of_k)
    if len(measured) == 1:
        return d_of_k, v_of_k, (f"d(k) and v(k) measured only at k={measured[0]} and used for every smaller k "
                                f"(approximation: both grow with k)")
    return d_of_k, v_of_k, f"d(k) and v(k) measured at k={measured}, linearly interpolated between them"
