"""target.placement: sharded (train/placement.py): FSDP2 of the frozen target across 2 gloo processes on CPU.

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
    from train.features import FeatureProvider
    from train.placement import local_bytes, shard_target

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
    with pytest.raises(ValueError, match=r"target.placement: 'fsdp' is not one of \['replicated', 'sharded'\]"):
        load_recipe(TINY, ["target.placement=fsdp"])
    with pytest.raises(ValueError, match="target.placement: sharded needs features.mode: online"):
        load_recipe(TINY, ["target.placement=sharded", "features.mode=hybrid", "features.cache_dir=/tmp/x"])
