"""target.placement: sharded (train/features/placement.py): FSDP2 of the frozen target across 2 gloo processes on CPU.

Each process feeds its own batch through the online FeatureProvider with the replicated target, shards it, and
feeds the same batch again: hidden states, the final normed hidden state, the argmax and top-k logits are equal
bit for bit (the all-gathered weights are the stored ones and the forward is the same), and after the forward each
process holds half of the target's parameter bytes.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from train.config import load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes", "debug", "tiny_eagle3.yaml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from drafters.base import FeatureRequest
    from inference.assets.store import resolve_target
    from inference.engine.target import TargetModel
    from train.features.cache import FeatureProvider
    from train.features.placement import local_bytes, shard_target

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        target = TargetModel.from_pretrained(resolve_target("debug:tiny-llama"))
        request = FeatureRequest(layer_ids=(1, 2, target.num_layers), top_k_logits=3)
        ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(rank))
        mask = torch.ones_like(ids)
        mask[1, 13:] = 0  # right padding, as training batches have
        batch = {"input_ids": ids, "attention_mask": mask, "sample_index": torch.tensor([0, 1])}
        replicated = FeatureProvider("online", target, request).online(batch)
        full_bytes = local_bytes(target.model)
        shard_target(target, 2)
        sharded = FeatureProvider("online", target, request).online(batch)
        same = all(torch.equal(replicated["target_hidden"][i], sharded["target_hidden"][i]) for i in request.layer_ids)
        same = same and all(torch.equal(replicated[key], sharded[key]) for key in (
            "target_last_hidden", "target_argmax", "target_top_k_values", "target_top_k_ids"))
        results[rank] = (same, local_bytes(target.model) / full_bytes)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_target_gives_the_replicated_features_holding_half_the_weights():
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(_free_port(), results), nprocs=2)
    for rank in (0, 1):
        same, fraction = results[rank]
        assert same, rank
        assert fraction == pytest.approx(0.5, abs=0.01), fraction  # every dim 0 here splits evenly in two


def test_placement_is_a_strict_field_and_sharding_needs_online_features():
    assert load_recipe(TINY).target.placement == "replicated"
    assert load_recipe(TINY, ["target.placement=sharded"]).target.placement == "sharded"
    with pytest.raises(ValueError, match=r"target.placement: 'fsdp' is not one of \['replicated', 'sharded', 'served'\]"):
        load_recipe(TINY, ["target.placement=fsdp"])
    with pytest.raises(ValueError, match="target.placement: sharded needs features.mode: online"):
        load_recipe(TINY, ["target.placement=sharded", "features.mode=hybrid", "features.cache_dir=/tmp/x"])
    with pytest.raises(ValueError, match="target.placement: served needs features.mode: offline"):
        load_recipe(TINY, ["target.placement=served"])


def test_target_memory_per_placement_by_hand():
    from train.features.placement import engine_bytes_per_gpu, fitting_placement, target_bytes_per_gpu

    shape = dict(params=1000, bytes_per_param=2, largest_layer=100, head=200, world_size=8)
    assert target_bytes_per_gpu("replicated", **shape) == 2000
    assert target_bytes_per_gpu("sharded", **shape) == 250 + (200 + 2 * 100) * 2  # 1/8 + root + two layers
    assert target_bytes_per_gpu("served", **shape) == 400
    assert engine_bytes_per_gpu(params=1000, bytes_per_param=2, tensor_parallel_size=8) == 250
    assert fitting_placement({"replicated": 30, "sharded": 20, "served": 10}, 25) == "sharded"
    assert fitting_placement({"replicated": 30, "sharded": 20, "served": 10}, 5) is None


def test_estimate_names_the_placement_that_fits(capsys):
    import re

    from train.estimate import main

    def totals(budget_gib: float) -> tuple[dict[str, float], str]:
        assert main([TINY, "--world-size", "8", "--no-probe", "--gpu-memory-gib", str(budget_gib)]) == 0
        lines = capsys.readouterr().out.splitlines()
        found = {m[1]: float(m[2]) for m in (re.match(r"  (replicated|sharded|served) .* total +([0-9.]+) MiB", line)
                                             for line in lines) if m}
        return found, lines[-1]

    # the tiny target is 708 KiB in fp32 on every process; a budget between the sharded and the replicated totals
    # (each read from the table, so a change of the drafter's size moves both) holds sharded but not replicated
    found, _ = totals(1.0)
    assert set(found) == {"replicated", "sharded", "served"} and found["sharded"] < found["replicated"]
    budget = (found["sharded"] + found["replicated"]) / 2
    _, last = totals(budget / 1024)
    assert last == f"  fits {budget:.1f} MiB per GPU (--gpu-memory-gib): target.placement: sharded"


@pytest.mark.slow
def test_training_on_a_served_target_equals_training_on_the_whole_one(tmp_path):
    """Offline training reads the same cache either way; the served target holds only the head, so the losses are
    the same step for step."""
    import json

    from train.__main__ import main as train
    from train.prepare import main as prepare

    common = [TINY, "features.mode=offline", f"features.cache_dir={tmp_path / 'features'}", "train.epochs=null",
              "train.max_steps=3", "eval.num_prompts=0", "data.num_samples=16", "train.log_every=1"]
    assert prepare([*common, f"output.dir={tmp_path / 'p'}"]) == 0
    losses = {}
    for placement in ("replicated", "served"):
        out = tmp_path / placement
        assert train([*common, f"target.placement={placement}", f"output.dir={out}"]) == 0
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        losses[placement] = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses["served"]) == 3 and losses["served"] == losses["replicated"]
