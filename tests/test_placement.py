"""target.placement: sharded (train/features/placement.py): FSDP2 of the frozen target across 2 gloo processes on CPU.

For every debug recipe each process builds the target and drafter twice through train/build.py: replicated, and
sharded (loaded on the CPU, the drafter built on the whole target, then both placed). The sharded process holds
the head whole and half of every decoder layer, and nothing it built keeps the unsharded layer weights alive; its
drafter is the replicated one (warm starts read the whole target) and computes the same loss; the features (hidden
states, final normed state, argmax, top-k logits, K/V) are equal bit for bit (the all-gathered weights are the
stored ones and the forward is the same).
"""

from __future__ import annotations

import gc
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from train.config import load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes", "debug", "tiny_eagle3.yaml")
KINDS = ("eagle3", "dflash", "dspark", "mtp", "medusa", "assistant")
# a warm start that copies a whole decoder layer: it must still read the unsharded weights
WARM_STARTS = {"eagle3": ["drafter.init_layer_from_target=1"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _frozen_holders(drafter) -> list:
    from drafters.layers import FrozenTargetTensors

    return [v for module in drafter.modules() for v in vars(module).values() if isinstance(v, FrozenTargetTensors)]


def _held_parameter_bytes(target, drafter) -> int:
    """Bytes of the distinct storages behind the target's parameters (this process's shards), its TargetInfo, and
    every TargetInfo and frozen copy the drafter holds: what this process keeps alive of the target's weights."""
    infos = [target.target_info(), drafter.target_info]
    tensors = list(target.model.parameters())
    for holder in _frozen_holders(drafter):
        infos.append(holder.target_info)
        tensors += holder._copies.values()
    for info in infos:
        tensors += [t for t in (info.embed_weight, info.lm_head_weight, info.final_norm_weight) if t is not None]
        tensors += info.weights.values()
    storages = {}
    for tensor in tensors:
        storage = (tensor.to_local() if hasattr(tensor, "to_local") else tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _same(a, b) -> bool:
    """Nested dicts / tuples of tensors equal bit for bit."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _batch(rank: int) -> dict:
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0  # right padding, as training batches have
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": mask.clone(), "sample_index": torch.tensor([0, 1])}


def _compare(kind: str, state, rank: int) -> dict:
    """Replicated and sharded builds of tiny_<kind> on this process: what the slow test asserts."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from drafters.base import FeatureRequest
    from train.build import build_drafter, load_target, place_target
    from train.features.cache import FeatureProvider
    from train.features.placement import head_parameters, local_bytes

    path = os.path.join(ROOT, "recipes", "debug", f"tiny_{kind}.yaml")
    builds = {}
    for placement in ("replicated", "sharded"):
        recipe = load_recipe(path, [*WARM_STARTS.get(kind, []), f"target.placement={placement}"])
        target = load_target(recipe, state.device, num_processes=state.num_processes)
        torch.manual_seed(0)
        drafter = build_drafter(recipe, target)
        # weak references to the unsharded layer weights' storages: dead once nothing holds them
        unsharded = [StorageWeakRef(p.untyped_storage()) for p in target.layers.parameters()]
        drafter = place_target(recipe, target, drafter, state)
        gc.collect()
        builds[placement] = target, drafter, all(ref.expired() for ref in unsharded)
    (whole, whole_drafter, whole_freed), (target, drafter, freed) = builds["replicated"], builds["sharded"]
    head = sum(p.numel() * p.element_size() for p in head_parameters(whole))
    layers = sum(p.numel() * p.element_size() for p in whole.layers.parameters())
    rows = _batch(rank)
    same_features = all(
        _same(*(FeatureProvider("online", t, request).online(rows) for t in (whole, target)))
        for request in (drafter.feature_request(), FeatureRequest(layer_ids=(1, 2, whole.num_layers), top_k_logits=3)))
    losses = []
    counts = torch.bincount(rows["input_ids"][rows["loss_mask"].bool()], minlength=whole.target_info().vocab_size)
    for t, d in ((whole, whole_drafter), (target, drafter)):
        d.init_from_data(counts)
        batch = {**rows, **FeatureProvider("online", t, d.feature_request()).online(rows)}
        torch.manual_seed(1)  # drafters that sample positions in training draw the same ones
        losses.append(d.loss(d(batch), batch)[0])
    like = next(drafter.parameters())
    heads = [h.get("lm_head_weight", like) for h in _frozen_holders(drafter)]
    return {
        "root_is_head": local_bytes(whole.model) == head + layers,
        "whole": (_held_parameter_bytes(whole, whole_drafter), head + layers, whole_freed),
        "sharded": (local_bytes(target.model), _held_parameter_bytes(target, drafter), head + layers // 2, freed),
        "same_drafter": _same(whole_drafter.state_dict(), drafter.state_dict()),
        "same_features": same_features,
        "same_loss": bool(torch.equal(*losses)),
        "whole_heads": all(not hasattr(h, "to_local") and torch.equal(h, whole.target_info().lm_head_weight)
                           for h in heads),
    }


def _worker(rank: int, port: int, results) -> None:
    from accelerate import PartialState

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    state = PartialState(cpu=True)  # gloo on CPU on any machine, as `accelerate launch --cpu` would
    try:
        assert state.num_processes == 2
        results[rank] = {kind: _compare(kind, state, rank) for kind in KINDS}
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_sharded_target_holds_the_head_and_half_the_layers_and_gives_the_replicated_results():
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(_free_port(), results), nprocs=2)
    for rank in (0, 1):
        for kind, got in results[rank].items():
            where = (rank, kind, got)
            assert got["root_is_head"], where  # every parameter is the head's or a layer's: the sums below are all
            held, expected, freed = got["whole"]
            assert held == expected and not freed, where  # where the whole target is held, both checks see it
            local, held, expected, freed = got["sharded"]
            assert local == held == expected, where  # every dim 0 here splits evenly in two
            assert freed, where  # no reference anywhere keeps an unsharded layer weight alive
            assert got["same_drafter"] and got["same_features"] and got["same_loss"] and got["whole_heads"], where


@pytest.mark.slow
def test_two_process_training_on_a_sharded_target_equals_training_on_a_replicated_one(tmp_path):
    """`accelerate launch` of 2 gloo processes through train/build.py: the sharded target (loaded on the CPU,
    sharded after the drafter is built) serves the same features, so the losses and final weights are equal."""
    import json
    import subprocess
    import sys

    from inference.assets.debug_target import resolve_debug_target
    from tests.test_train import tiny_overrides, weights, write_chats

    target_dir = resolve_debug_target("debug:tiny-llama", cache_dir=str(tmp_path / "cache"))
    write_chats(str(tmp_path / "chats.jsonl"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    losses = {}
    for placement in ("replicated", "sharded"):
        out = tmp_path / placement
        overrides = tiny_overrides((tmp_path, target_dir), str(out), "train.max_steps=4", "train.log_every=1",
                                   "train.eval_every=2", f"target.placement={placement}")
        run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                              "-m", "train", TINY, *overrides],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        losses[placement] = [(r["step"], r.get("train/loss"), r.get("eval/loss")) for r in rows if "step" in r]
    assert len(losses["sharded"]) >= 6 and losses["sharded"] == losses["replicated"]
    expected, got = weights(str(tmp_path / "replicated" / "final")), weights(str(tmp_path / "sharded" / "final"))
    assert expected.keys() == got.keys() and all(torch.equal(got[key], expected[key]) for key in expected)


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
    assert target_bytes_per_gpu("sharded", **shape) == 200 + (200 + 2 * 100) * 2  # 1/8 of the layers + head + two
    assert target_bytes_per_gpu("served", **shape) == 400
    assert engine_bytes_per_gpu(params=1000, bytes_per_param=2, tensor_parallel_size=8) == 250
    assert fitting_placement({"replicated": 30, "sharded": 20, "served": 10}, 25) == "sharded"
    assert fitting_placement({"replicated": 30, "sharded": 20, "served": 10}, 5) is None
    # the drafter's state under FSDP comes before sharding the target, never before a replicated target that fits
    assert fitting_placement({"replicated": 30, "sharded": 20, "served": 10}, 25, replicated_fsdp=24) == \
        "replicated+fsdp"
    assert fitting_placement({"replicated": 30, "sharded": 20, "served": 10}, 25, replicated_fsdp=26) == "sharded"
    assert fitting_placement({"replicated": 30, "sharded": 20, "served": 10}, 35, replicated_fsdp=24) == \
        "replicated"


def test_estimate_names_the_placement_that_fits(capsys):
    import re

    from train.estimate import main

    def totals(budget_gib: float) -> tuple[dict[str, float], str]:
        assert main([TINY, "--world-size", "8", "--no-probe", "--gpu-memory-gib", str(budget_gib)]) == 0
        lines = capsys.readouterr().out.splitlines()
        found = {m[1] or "fsdp": float(m[2]) for m in (
            re.match(r"  (replicated|sharded|served)? .* total +([0-9.]+) MiB", line) for line in lines) if m}
        return found, lines[-1]

    # the tiny target is 708 KiB in fp32 on every process; a budget between the replicated target's total with the
    # drafter under FSDP and the one under DDP (each read from the table, so a change of the drafter's size moves
    # both) holds the first but not the second, and the drafter's state is sharded before the target is
    found, _ = totals(1.0)
    assert set(found) == {"replicated", "sharded", "served", "fsdp"} and found["fsdp"] < found["replicated"]
    budget = (found["fsdp"] + found["replicated"]) / 2
    _, last = totals(budget / 1024)
    assert last == (f"  fits {budget:.1f} MiB per GPU (--gpu-memory-gib): target.placement: replicated with the "
                    "drafter under FSDP (recipes/accelerate/8gpu_fsdp.yaml)")


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
