"""The equal-batch training loop of benchmarks/peers/peer_train_parity.py, shared by every trainer: plain torch only, so it
runs unchanged inside each peer's throwaway venv (draftsmith's checkout on PYTHONPATH, none of its dependencies).

A trainer is an adapter with `parameters()`, `step(batch, anchors, anchor_valid) -> (loss, draft_ids)` and
`save(directory)`; draft_ids [B, A, K] are the argmax draft tokens of every block cell, depth d predicting the token
at anchor + d + `first_label` (1 for DFlash, whose slot d + 1 drafts position a + d + 1; the same for DSpark, whose
slot d does). The loop is the same for all: AdamW, warm-up + cosine to min_lr_ratio, gradient clipping, the dumped
batches in order with the dumped anchors, one thread. Accuracy is computed here, in one way for every trainer: top-1
agreement of the draft with the data token at each supervised cell (the data are the target's own greedy answers).

Dump layout (torch.save, written by peer_train_parity.py `run`): meta {kind, block_size, mask_token_id, layer_ids,
hparams}, embed [V, D], lm_head [V, D], batches [{input_ids, attention_mask, loss_mask [B, T], features [B, T, m*D]
(target layers in layer_ids order), last_hidden [B, T, D] (after the target's final norm), target_argmax [B, T]}],
anchors [(anchors [B, A], anchor_valid [B, A])] per step.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine to min_ratio at the last step (train/fit/optim.py's rule)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup - 1))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def cell_labels(batch: dict, anchors: torch.Tensor, anchor_valid: torch.Tensor,
                depths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [B, A, K] = the data token at anchor + 1 + d, and valid [B, A, K]: a kept anchor, the label inside the
    sequence and a loss token."""
    input_ids, seq_len = batch["input_ids"], batch["input_ids"].shape[1]
    positions = anchors.unsqueeze(-1) + 1 + torch.arange(depths)  # [B, A, K]
    inside = positions < seq_len
    safe = positions.clamp(max=seq_len - 1)
    rows = torch.arange(input_ids.shape[0]).view(-1, 1, 1).expand_as(safe)
    supervised = (batch["loss_mask"].bool() & batch["attention_mask"].bool())[rows, safe]
    return input_ids[rows, safe], anchor_valid.unsqueeze(-1) & inside & supervised


def depth_accuracy(draft_ids: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> list[float]:
    """Per-depth top-1 agreement over the valid cells ([B, A, K] each)."""
    hits = ((draft_ids == labels) & valid).sum(dim=(0, 1)).float()
    return (hits / valid.sum(dim=(0, 1)).clamp(min=1).float()).tolist()


def train(adapter, dump: dict, steps: int, out_json: str, name: str, log_every: int = 10, save_every: int = 25,
          weights_dir: str | None = None) -> dict:
    """Run `steps` optimizer steps of `adapter` on the dumped batches; the curve JSON is rewritten every log_every
    steps and the weights every save_every steps (weights_dir/step_N, listed in curve["weights_steps"]), so a run
    stopped early still reports the steps it reached and every trainer can be evaluated at the same step."""
    torch.set_num_threads(1)
    hp = dump["meta"]["hparams"]
    params = [p for p in adapter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=hp["lr"], betas=tuple(hp["betas"]), eps=1e-8, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, steps, hp["warmup_steps"], hp["min_lr_ratio"]))
    depths = dump["meta"]["num_depths"]
    curve = {"trainer": name, "steps": [], "loss": [], "accuracy": [], "accuracy_per_depth": [], "tokens": 0,
             "wall_s": 0.0, "cpu_s": 0.0}
    meter = {"loss": 0.0, "acc": torch.zeros(depths), "n": 0}
    wall, cpu = 0.0, 0.0
    for step in range(steps):
        batch = dump["batches"][step % len(dump["batches"])]
        anchors, anchor_valid = dump["anchors"][step]
        started, started_cpu = time.perf_counter(), time.process_time()
        loss, draft_ids = adapter.step(batch, anchors, anchor_valid)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, hp["grad_clip"])
        optimizer.step()
        schedule.step()
        wall += time.perf_counter() - started
        cpu += time.process_time() - started_cpu
        curve["tokens"] += int(batch["attention_mask"].sum())
        labels, valid = cell_labels(batch, anchors, anchor_valid, depths)
        meter["loss"] += float(loss.detach())
        meter["acc"] += torch.tensor(depth_accuracy(draft_ids.detach(), labels, valid))
        meter["n"] += 1
        if weights_dir and ((step + 1) % save_every == 0 or step + 1 == steps):
            adapter.save(os.path.join(weights_dir, f"step_{step + 1}"))  # every one kept: equal-step evaluation
            curve.setdefault("weights_steps", []).append(step + 1)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            per_depth = (meter["acc"] / meter["n"]).tolist()
            curve["steps"].append(step + 1)
            curve["loss"].append(meter["loss"] / meter["n"])
            curve["accuracy_per_depth"].append([round(a, 4) for a in per_depth])
            curve["accuracy"].append(sum(per_depth) / len(per_depth))
            curve.update(wall_s=wall, cpu_s=cpu, tokens_per_s=curve["tokens"] / max(wall, 1e-9),
                         tokens_per_cpu_s=curve["tokens"] / max(cpu, 1e-9))
            meter = {"loss": 0.0, "acc": torch.zeros(depths), "n": 0}
            write_json(out_json, curve)
            print(f"{name} step {step + 1}: loss {curve['loss'][-1]:.3f} acc {curve['accuracy'][-1]:.3f} "
                  f"({curve['tokens_per_cpu_s']:.0f} tokens per CPU-s)", flush=True)
    return curve


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def frozen_modules(dump: dict) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    """The target's embedding and lm_head as frozen modules (what the peers' wrappers take)."""
    embed = torch.nn.Embedding.from_pretrained(dump["embed"].float(), freeze=True)
    head = torch.nn.Linear(dump["lm_head"].shape[1], dump["lm_head"].shape[0], bias=False)
    head.weight = torch.nn.Parameter(dump["lm_head"].float(), requires_grad=False)
    return embed, head


class Capture(torch.nn.Module):
    """Wraps a module and keeps its first output since `reset` (a peer computes its logits inside its loss; the
    second call of a checkpointed recomputation is ignored)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.first = None

    def reset(self) -> None:
        self.first = None

    def forward(self, x):
        out = self.inner(x)
        if self.first is None:
            self.first = out.detach()
        return out
