"""`draftsmith estimate`: the memory arithmetic against hand-computed numbers, the activation measurement against
tensors of known size, and the command on the debug target."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from train.estimate import activation_bytes, main, saved_tensor_storages, steps_per_hour
from train.memory_plan import RecipeSizes, drafter_state_bytes, memory_plan

RECIPE = str(Path(__file__).resolve().parent.parent / "recipes" / "debug" / "tiny_eagle3.yaml")
SIZES = RecipeSizes(target_params=1000, target_bytes_per_param=2, drafter_trainable=100, drafter_frozen_values=10,
                    target_copy_values=5, feature_values=50, logit_chunk_values=7, activation_bytes=1000)


def test_drafter_state_bytes_by_strategy():
    # 1,000,000 parameters, 8 GPUs: 16 bytes each unsharded; ZeRO-2 keeps the 2-byte bf16 weights replicated
    assert drafter_state_bytes(1_000_000, "ddp", 8) == 16_000_000
    assert drafter_state_bytes(1_000_000, "fsdp", 8) == 2_000_000
    assert drafter_state_bytes(1_000_000, "zero3", 8) == 2_000_000
    assert drafter_state_bytes(1_000_000, "zero2", 8) == 2_000_000 + 14_000_000 // 8  # 3,750,000
    assert drafter_state_bytes(1_000_000, "zero2", 8, param_bytes=4) == 4_000_000 + 12_000_000 // 8
    assert drafter_state_bytes(1_000_000, "fsdp", 1) == drafter_state_bytes(1_000_000, "ddp", 1)
    assert drafter_state_bytes(10, "fsdp", 3) == 54  # ceil(160 / 3): a shard is never rounded down
    with pytest.raises(ValueError, match="strategy 'zero1'"):
        drafter_state_bytes(1, "zero1", 8)
    with pytest.raises(ValueError, match="--world-size"):
        drafter_state_bytes(1, "ddp", 0)


def test_memory_plan_by_part():
    ddp = memory_plan(SIZES, "ddp", 4)
    assert ddp == {"target weights": 2000, "drafter weights + grads + AdamW": 1600,
                   "drafter frozen tensors (fp32)": 60, "served features + logit chunk": 214,
                   "drafter activations (measured, fp32)": 1000, "total": 4874}
    assert memory_plan(SIZES, "fsdp", 4)["drafter weights + grads + AdamW"] == 400
    assert memory_plan(SIZES, "zero2", 4)["drafter weights + grads + AdamW"] == 200 + 350
    # without mixed precision ZeRO-2's replicated working weights are fp32: 4 bytes, and 12 of the 16 sharded
    fp32_run = RecipeSizes(**{**SIZES.__dict__, "mixed_precision": "no", "measured_precision": "bf16"})
    assert memory_plan(fp32_run, "zero2", 4)["drafter weights + grads + AdamW"] == 400 + 300
    assert memory_plan(fp32_run, "ddp", 4)["drafter activations (measured, bf16)"] == 1000
    assert memory_plan(SIZES, "zero3", 4)["total"] == 4874 - 1600 + 400
    fp32_target = RecipeSizes(**{**SIZES.__dict__, "target_bytes_per_param": 4, "activation_bytes": None})
    plan = memory_plan(fp32_target, "ddp", 4)
    assert plan["drafter frozen tensors (fp32)"] == 40  # an fp32 target's tensors are used as they are, not copied
    assert "drafter activations (measured)" not in plan
    assert plan["total"] == 4000 + 1600 + 40 + 200 + 28


def test_saved_tensors_count_each_storage_once_and_activations_exclude_weights():
    x = torch.randn(10, 20, requires_grad=True)
    assert sum(saved_tensor_storages(lambda: (x * x).sum().backward()).values()) == 10 * 20 * 4  # x twice, once
    assert sum(saved_tensor_storages(lambda: (x.exp() * x).sum().backward()).values()) == 2 * 10 * 20 * 4
    with torch.no_grad():
        assert saved_tensor_storages(lambda: (x * x).sum()) == {}
    layer = torch.nn.Linear(20, 30)
    saved = saved_tensor_storages(lambda: torch.relu(layer(x)).sum().backward())
    # saved: x and the weight (for the matmul), the relu output [10, 30]; the weight is not an activation
    assert sum(saved.values()) == (10 * 20 + 30 * 20 + 10 * 30) * 4
    assert activation_bytes(saved, layer) == (10 * 20 + 10 * 30) * 4
    assert steps_per_hour(4.0) == 900.0


def _chats(path, num=16):
    with open(path, "w") as f:
        for i in range(num):
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"list {i} words"},
                {"role": "assistant", "content": " ".join(["word"] * (i + 4))}]}) + "\n")


def test_estimate_command_prints_memory_and_steps_per_hour(tmp_path, capsys):
    from inference.assets.debug_target import resolve_debug_target

    _chats(tmp_path / "chats.jsonl")
    overrides = [f"target.name_or_path={resolve_debug_target('debug:tiny-llama')}",
                 f"data.path={tmp_path / 'chats.jsonl'}", "data.num_samples=null", "data.num_eval_samples=2",
                 f"data.cache_dir={tmp_path / 'datasets'}", "data.max_length=64", "train.batch_size=2",
                 "train.epochs=null", "train.max_steps=10", "eval.num_prompts=0"]
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert main([RECIPE, *overrides, "--world-size", "4", "--probe-steps", "1"]) == 0
    printed = capsys.readouterr().out
    assert "memory per GPU at world size 4" in printed and "drafter activations (measured, fp32)" in printed
    # the CPU probe trains in fp32 (auto); the GPU plan is bf16 (auto on an accelerator)
    assert "trained parameters in mixed precision bf16" in printed and "per optimizer step in fp32" in printed
    assert "steps/hour; the recipe's 10 steps" in printed
    assert main([RECIPE, *overrides, "--no-probe"]) == 0
    printed = capsys.readouterr().out
    assert "activations not measured" in printed and "steps/hour" not in printed


@pytest.mark.parametrize("kind", ["assistant", "dflash", "dspark", "eagle3", "medusa", "mtp"])
def test_estimate_prints_a_step_peak_for_every_trained_kind(kind, tmp_path, capsys):
    """Every debug recipe's drafter has a step-memory model (drafters/step_memory.py), MTP, Medusa and the assistant
    included."""
    from inference.assets.debug_target import resolve_debug_target

    _chats(tmp_path / "chats.jsonl")
    recipe = str(Path(RECIPE).with_name(f"tiny_{kind}.yaml"))
    overrides = [f"target.name_or_path={resolve_debug_target('debug:tiny-llama')}",
                 f"data.path={tmp_path / 'chats.jsonl'}", "data.num_samples=null", "data.num_eval_samples=2",
                 f"data.cache_dir={tmp_path / 'datasets'}", "data.max_length=64", "train.batch_size=2",
                 "eval.num_prompts=0"]
    assert main([recipe, *overrides, "--no-probe"]) == 0
    assert "one training step of the drafter (model, fp32, micro-batch 2 x 64 tokens" in capsys.readouterr().out



@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_a_target_without_weights_is_planned_from_its_config(kind, tmp_path, capsys, monkeypatch):
    """A target directory holding config.json and the tokenizer only (what a planner downloads of a 671B model):
    `estimate` reads no weight (a tripwire on every weight load) and prints every size the loaded target gives, only
    the measured throughput missing; `--config-only` takes the same path where the weights are there."""
    import shutil

    from transformers import AutoModelForCausalLM

    from inference.assets.debug_target import resolve_debug_target
    from inference.engine.target import TargetModel

    weights = resolve_debug_target("debug:tiny-llama")
    bare = tmp_path / "config_only"
    shutil.copytree(weights, bare, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    _chats(tmp_path / "chats.jsonl")
    recipe = str(Path(RECIPE).with_name(f"tiny_{kind}.yaml"))
    common = [f"data.path={tmp_path / 'chats.jsonl'}", "data.num_samples=null", "data.num_eval_samples=2",
              f"data.cache_dir={tmp_path / 'datasets'}", "data.max_length=64", "train.batch_size=2",
              "eval.num_prompts=0"]

    def sizes(printed: str) -> list[str]:  # what does not depend on where the target was read from, or on time
        return [line for line in printed.splitlines()
                if line and not line.startswith(("config only:", "target ", "time:"))]

    def no_weights(*args, **kwargs):
        raise AssertionError("a weight was read")

    with monkeypatch.context() as patch:
        patch.setattr(TargetModel, "from_pretrained", no_weights)
        patch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
        assert main([recipe, f"target.name_or_path={bare}", *common, "--world-size", "8"]) == 0
        planned = capsys.readouterr().out
        assert main([recipe, f"target.name_or_path={weights}", *common, "--world-size", "8", "--config-only"]) == 0
        forced = capsys.readouterr().out
    assert main([recipe, f"target.name_or_path={weights}", *common, "--world-size", "8", "--no-probe"]) == 0
    loaded = capsys.readouterr().out
    assert planned.startswith(f"config only: {bare} read without its weights")
    assert "time: not measured (--config-only" in planned and "tokens/s measured" in loaded
    assert sizes(planned) == sizes(loaded) == sizes(forced)
    assert any(line.startswith("one training step of the drafter") for line in sizes(planned))


def test_a_checkpoint_in_fp8_is_served_at_one_byte_a_weight():
    """vLLM serves DeepSeek-V3's released fp8 weights as they are: the engine's weights per GPU count one byte each;
    any other checkpoint is served in the training dtype."""
    from train.features.placement import engine_bytes_per_gpu
    from train.memory_plan import served_bytes_per_param

    assert served_bytes_per_param("fp8") == 1 and served_bytes_per_param(None) is None
    assert served_bytes_per_param("compressed-tensors") is None  # sized from its files (the next test)
    assert engine_bytes_per_gpu(params=671_000, bytes_per_param=served_bytes_per_param("fp8"),
                                tensor_parallel_size=8) == 83_875


def test_a_quantized_checkpoint_is_served_as_its_files_store_it(tmp_path, capsys):
    """Kimi-K2.5 ships its experts in int4 (compressed-tensors) inside a vision-language config: vLLM serves those
    weights as stored, so the engine's weights per GPU are the checkpoint's files over tensor_parallel_size, not every
    weight at the target's dtype (before, 3.5x too many for such a release); without the files it says what it
    assumed."""
    import shutil

    from inference.assets.debug_target import resolve_debug_target
    from inference.engine.target_files import quantization_method, stored_bytes
    from train.estimate import human_bytes

    quantized = tmp_path / "quantized"
    shutil.copytree(resolve_debug_target("debug:tiny-llama"), quantized)
    with open(quantized / "config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    with open(quantized / "config.json", "w") as f:
        json.dump(config, f)
    on_disk = stored_bytes(str(quantized))
    assert quantization_method(str(quantized)) == "compressed-tensors" and on_disk > 0
    _chats(tmp_path / "chats.jsonl")
    common = [f"data.path={tmp_path / 'chats.jsonl'}", "data.num_samples=null", "data.num_eval_samples=2",
              f"data.cache_dir={tmp_path / 'datasets'}", "data.max_length=64", "eval.num_prompts=0",
              "features.vllm.tensor_parallel_size=4", "--world-size", "8", "--config-only"]
    assert main([RECIPE, f"target.name_or_path={quantized}", *common]) == 0
    engine = [line.strip() for line in capsys.readouterr().out.splitlines() if "vLLM engine" in line]
    assert engine == [f"vLLM engine: {human_bytes(-(-on_disk // 4))} of weights per GPU at "
                      "features.vllm.tensor_parallel_size 4 (the compressed-tensors checkpoint's files as stored), "
                      "plus its KV cache"]
    for name in os.listdir(quantized):  # the config alone: the weights at the target's dtype, and it says so
        if name.endswith(".safetensors"):
            os.remove(quantized / name)
    assert main([RECIPE, f"target.name_or_path={quantized}", *common]) == 0
    engine = [line for line in capsys.readouterr().out.splitlines() if "vLLM engine" in line]
    assert len(engine) == 1 and "its compressed-tensors weights counted at the target's dtype" in engine[0]