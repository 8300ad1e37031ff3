"""What the launcher and the recipe settle together (train/fit/launch.py): the mixed precision, the collective
timeout, DeepSpeed's batch sizes and clipping, and which launches shard the drafter; plus (slow) what two gloo processes
must agree on: the process group's timeout, the stop flags and the run clock, and an FSDP2 gradient norm."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
from accelerate import DistributedType
from accelerate.utils import DeepSpeedPlugin

from train.config import load_recipe
from train.fit.launch import PRECISION_ENV, drafter_is_sharded, fill_deepspeed_config, resolve_mixed_precision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_RECIPE = os.path.join(ROOT, "recipes", "debug", "tiny_eagle3.yaml")


@pytest.mark.parametrize("setting,accelerator,launcher,expected", [
    ("auto", False, None, "no"), ("auto", True, None, "bf16"),  # no launcher setting: the recipe decides
    ("bf16", False, None, "bf16"), ("no", True, None, "no"), ("fp16", True, None, "fp16"),
    ("auto", True, "no", "no"), ("auto", False, "bf16", "bf16"),  # the launcher's setting wins
    ("bf16", True, "FP16", "fp16"), ("no", False, "", "no")])  # an empty variable is no setting
def test_mixed_precision_comes_from_the_launcher_else_the_recipe(setting, accelerator, launcher, expected):
    assert resolve_mixed_precision(setting, accelerator=accelerator, launcher=launcher) == expected


def test_fp16_on_a_cpu_is_refused_naming_where_it_came_from():
    with pytest.raises(ValueError, match="^train.mixed_precision: fp16 needs an accelerator .* set it to bf16 or no$"):
        resolve_mixed_precision("fp16", accelerator=False, launcher=None)
    with pytest.raises(ValueError, match=f"^{PRECISION_ENV}=fp16 \\(from the launcher\\): fp16 needs an accelerator"):
        resolve_mixed_precision("auto", accelerator=False, launcher="fp16")


def test_recipe_fields_for_precision_and_timeout():
    recipe = load_recipe(DEBUG_RECIPE)
    assert recipe.train.mixed_precision == "auto" and recipe.train.dist_timeout_minutes == 60.0
    assert load_recipe(DEBUG_RECIPE, ["train.mixed_precision=no"]).train.mixed_precision == "no"  # YAML's false
    with pytest.raises(ValueError, match=r"^train.mixed_precision: 'fp8' is not one of \['auto', 'no', 'bf16', "):
        load_recipe(DEBUG_RECIPE, ["train.mixed_precision=fp8"])
    with pytest.raises(ValueError, match="^train.dist_timeout_minutes must be > 0, got 0.0$"):
        load_recipe(DEBUG_RECIPE, ["train.dist_timeout_minutes=0"])
    streamed = ["features.mode=streamed", "features.cache_dir=/tmp/stream", "features.stream.timeout_s=900"]
    assert load_recipe(DEBUG_RECIPE, [*streamed, "train.dist_timeout_minutes=16"]).features.mode == "streamed"
    with pytest.raises(ValueError, match="^train.dist_timeout_minutes: 15.0 min is not longer than "
                                         r"features.stream.timeout_s \(900 s\); raise it above 15 min"):
        load_recipe(DEBUG_RECIPE, [*streamed, "train.dist_timeout_minutes=15"])


def test_deepspeed_config_gets_the_recipes_batch_sizes_and_clipping():
    """The config accelerate builds from an accelerate YAML (recipes/accelerate/8gpu_zero2.yaml: no JSON file) leaves
    the batch sizes to a dataloader; prepare gets none here, so they come from the recipe, consistently."""
    plugin = DeepSpeedPlugin(zero_stage=2)
    config = plugin.deepspeed_config
    assert plugin.is_auto("train_micro_batch_size_per_gpu")  # what made accelerate.prepare(drafter, optimizer) stop
    fill_deepspeed_config(config, batch_size=2, grad_accum=3, global_batch_size=2 * 3 * 8, grad_clip=0.5)
    assert not plugin.is_auto("train_micro_batch_size_per_gpu")
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"], config["gradient_clipping"]) == (2, 3, 48, 0.5)
    fill_deepspeed_config(config, batch_size=2, grad_accum=3, global_batch_size=48, grad_clip=0.5)  # agrees: kept
    unclipped = DeepSpeedPlugin(zero_stage=3).deepspeed_config
    fill_deepspeed_config(unclipped, batch_size=1, grad_accum=1, global_batch_size=8, grad_clip=None)
    assert unclipped["gradient_clipping"] == 0.0  # DeepSpeed's "off"
    with pytest.raises(ValueError, match="^the DeepSpeed config sets gradient_clipping: 0.5, but optim.grad_clip "
                                         "gives 1.0; remove it"):
        fill_deepspeed_config(config, batch_size=2, grad_accum=3, global_batch_size=48, grad_clip=1.0)


def test_fsdp_and_zero3_shard_the_drafter_ddp_and_zero2_do_not():
    assert drafter_is_sharded(DistributedType.FSDP, None)
    assert drafter_is_sharded(DistributedType.DEEPSPEED, DeepSpeedPlugin(zero_stage=3))
    assert not drafter_is_sharded(DistributedType.DEEPSPEED, DeepSpeedPlugin(zero_stage=2))
    assert not drafter_is_sharded(DistributedType.MULTI_GPU, None) and not drafter_is_sharded(DistributedType.NO, None)


DEEPSPEED_PREPARE = """
import os, sys
os.environ.update(ACCELERATE_USE_DEEPSPEED="true", LOCAL_RANK="0", RANK="0", WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from drafters import DRAFTERS
from inference.assets.debug_target import resolve_debug_target
from inference.engine.target import TargetModel
from train.config import load_recipe
from train.fit.launch import drafter_is_sharded, fill_deepspeed_config
from train.fit.optim import build_optimizer

recipe = load_recipe(sys.argv[3], ["train.batch_size=2"])
target = TargetModel.from_pretrained(resolve_debug_target("debug:tiny-llama"))
drafter = DRAFTERS[recipe.drafter_kind](recipe.drafter, target.target_info())
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=int(sys.argv[1])), gradient_accumulation_steps=2)
fill_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, batch_size=2, grad_accum=2,
                      global_batch_size=4, grad_clip=recipe.optim.grad_clip)
engine, optimizer = accelerator.prepare(drafter, build_optimizer(drafter, recipe.optim))
print(type(engine).__name__, accelerator.deepspeed_config["train_batch_size"],
      drafter_is_sharded(accelerator.distributed_type, accelerator.state.deepspeed_plugin))
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_prepares_a_drafter_without_a_dataloader(stage):
    """DeepSpeed's CPU accelerator runs ZeRO-2 and ZeRO-3 in one gloo process: `prepare` of a real drafter and its
    optimizer goes through once the recipe filled the batch sizes (without them accelerate raises)."""
    pytest.importorskip("deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", DEEPSPEED_PREPARE, str(stage), str(free_port()), DEBUG_RECIPE],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == f"DeepSpeedEngine 4 {stage == 3}"


def two_process_worker(rank: int, port: int, results) -> None:
    """One of two gloo processes: the group's timeout from the recipe, one agreement on stop flags and clock, and a
    gradient norm under FSDP2 and of a partial DTensor."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, init_device_mesh

    from train.build import process_state
    from train.fit.metrics import agree_on_step, full_norm

    state = process_state(load_recipe(DEBUG_RECIPE, ["train.dist_timeout_minutes=45"]))
    timeout = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
    # rank 1 saw a non-finite loss and its clock runs 2 s ahead: both must stop, and both go by rank 0's clock
    counts, clock = agree_on_step(state, torch.tensor([float(rank == 1), 0.0]), preempted=False, now=5.0 + 2 * rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    fully_shard(model)
    model(torch.randn(4, 16)).pow(2).sum().backward()
    fsdp_norm = float(full_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
    partial = DTensor.from_local(torch.tensor(3.0 + rank), init_device_mesh("cpu", (2,)), [Partial()])
    results[rank] = (timeout, counts, clock, fsdp_norm, float(full_norm(partial)))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_share_the_timeout_the_stop_and_the_clock_and_log_the_whole_norm():
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(two_process_worker, args=(free_port(), results), nprocs=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    model(torch.randn(4, 16)).pow(2).sum().backward()
    whole = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    for rank in (0, 1):
        timeout, counts, clock, fsdp_norm, partial = results[rank]
        assert timeout == timedelta(minutes=45)
        assert counts == [1.0, 0.0, 0.0] and clock == 5.0
        # fp32 sums of squares over two shards instead of one: a few ulps apart
        assert fsdp_norm == pytest.approx(whole, rel=4 * torch.finfo(torch.float32).eps)
        assert partial == 7.0  # 3 + 4: the sum over both processes, not this one's share
