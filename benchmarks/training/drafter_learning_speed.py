"""How fast a drafter learns to use the target's features: drafter-only training on a fixed small set of SmolLM2
batches (features computed once), with held-out agreement every 20 steps. docs/benchmarks.md (DFlash) compares
EAGLE-3 and DFlash this way.

    python benchmarks/training/drafter_learning_speed.py eagle3 100 drafter.ttt_steps=1 drafter.init_head_from_target=true
    python benchmarks/training/drafter_learning_speed.py dflash 100 drafter.block_size=4 drafter.num_anchors=64 \
        drafter.num_layers=1 drafter.draft_vocab_size=8192

Arguments: the drafter kind (recipes/smollm2/<kind>.yaml), the number of steps, then recipe overrides. 20 training
batches of 2 conversations, 2 held-out batches, AdamW lr 2e-3, one thread.
"""

from __future__ import annotations

import os
import sys
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str]) -> None:
    from accelerate import PartialState

    from train.build import build_drafter, load_data, load_target
    from train.config import load_recipe
    from train.features.cache import FeatureProvider, make_batch
    from train.data.vocab import count_tokens

    torch.set_num_threads(1)
    kind, steps, overrides = argv[0], int(argv[1]), argv[2:]
    recipe = load_recipe(f"recipes/smollm2/{kind}.yaml", overrides)
    state = PartialState(cpu=True)
    target = load_target(recipe, "cpu")
    data = load_data(recipe, target, state)
    torch.manual_seed(0)
    drafter = build_drafter(recipe, target)
    drafter.init_from_data(count_tokens(data.train, target.target_info().vocab_size))
    provider = FeatureProvider("online", target, drafter.feature_request())
    batches = []
    for start in range(0, 44, 2):
        batch = make_batch(data.train, [start, start + 1], 0)
        batch.update(provider.online(batch), seed=0)
        batches.append(batch)
    train_batches, held_out = batches[:20], batches[20:]
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=2e-3, betas=(0.9, 0.95))
    started = time.time()
    for step in range(steps):
        batch = dict(train_batches[step % 20], epoch=step // 20)
        loss, metrics = drafter.loss(drafter(batch), batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        if step % 20 == 19:
            with torch.no_grad():
                scores = [drafter.loss(drafter(dict(b, epoch=0)), dict(b, epoch=0))[1] for b in held_out]
            held = {k: sum(s.get(f"acc_{k}", 0.0) for s in scores) / len(scores) for k in (0, 1)}
            print(f"step {step + 1}: train acc_0 {metrics['acc_0']:.2f}, held-out acc_0 {held[0]:.3f} "
                  f"acc_1 {held[1]:.3f}, {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
