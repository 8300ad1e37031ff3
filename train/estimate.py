"""`draftsmith estimate RECIPE [key=value ...]`: what a recipe will cost before it runs.

1. Disk and time of an offline feature cache. Disk: per token, (number of hidden ids + 1) x D values in the cache
   dtype (the requested hidden states plus the final-norm hidden state) plus 8 bytes (the target argmax and the token
   id, int32), plus k values and k int32 ids when the drafter asks for top-k logits, summed over the train and eval
   splits. Time: the target's feature throughput measured on a few real batches of the recipe's data, on this
   machine, after one warm-up batch.
2. Memory per GPU for a world size (--world-size) under each strategy of recipes/accelerate: DDP, FSDP (FSDP2, full
   shard), DeepSpeed ZeRO-2 and ZeRO-3 (train/memory_plan.py).
3. Peak memory of one training step of the drafter (every trained kind) at data.max_length, from its shapes alone
   (drafters/step_memory.py; EAGLE-3, DFlash and DSpark within 20% of the peak measured on CPU at 2k-16k tokens,
   docs/benchmarks.md "Long sequences"; MTP, Medusa and the assistant counted alike, not yet measured).
4. Steps per hour from a short probe (--probe-steps real optimizer steps of the recipe on this machine, online
   features, the drafter's full config; --no-probe skips it). The probe also measures the drafter's activation memory:
   the bytes autograd saves for backward on one micro-batch of the longest training samples, weights excluded.

Without the target's weights (`--config-only`, or a target directory holding none: config.json and the tokenizer
suffice) the target and the drafter are built on the meta device: every size above as with the weights, no feature
throughput and no probe.

    draftsmith estimate recipes/smollm2/eagle3_full.yaml --world-size 8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from drafters.base import Drafter
from drafters.ragged_state import unsupported_layer_types
from drafters.step_memory import step_peak_parts, step_shape
from inference.assets.store import resolve_target
from inference.engine.target import LOGIT_CHUNK_VALUES, TargetModel, resolve_dtype, synchronize
from inference.engine.target_files import holds_weights, quantization_method, stored_bytes
from train.build import build_drafter, build_trainer, load_data, load_target, process_state
from train.config import Recipe, load_recipe, recipe_parser
from train.data.dataset import check_sources
from train.features.cache import FeatureProvider, make_batch, sample_lengths
from train.features.placement import PLACEMENTS, engine_bytes_per_gpu, fitting_placement, target_bytes_per_gpu
from train.fit.launch import PRECISION_ENV, resolve_mixed_precision
from train.memory_plan import (STRATEGIES, RecipeSizes, cache_bytes_per_token, drafter_state_bytes, memory_plan,
                               precision_name, served_bytes_per_param)
from train.warm_start import check_init_from, warm_recipe

NUM_TIMED_BATCHES = 2


def steps_per_hour(seconds_per_step: float) -> float:
    return 3600.0 / seconds_per_step


def measure_throughput(target, dataset, request, batch_size: int, pad_token_id: int) -> float:
    """Feature tokens per second of the target on the first batches of `dataset` (one warm-up batch untimed)."""
    provider = FeatureProvider("online", target, request)
    num_batches = min(NUM_TIMED_BATCHES + 1, max(1, len(dataset) // batch_size))
    tokens, seconds = 0, 0.0
    for b in range(num_batches):
        indices = [i % len(dataset) for i in range(b * batch_size, (b + 1) * batch_size)]
        batch = make_batch(dataset, indices, pad_token_id)
        synchronize(target.device)
        started = time.perf_counter()
        provider.online(batch)
        synchronize(target.device)
        if b > 0 or num_batches == 1:
            tokens += int(batch["attention_mask"].sum())
            seconds += time.perf_counter() - started
    return tokens / max(seconds, 1e-9)


def saved_tensor_storages(run) -> dict[int, int]:
    """{storage address: bytes} of every tensor autograd saves for backward while `run()` executes."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return storages


def activation_bytes(saved: dict[int, int], *modules: torch.nn.Module) -> int:
    """Bytes of the saved storages that are activations: not the parameters or buffers of `modules`, nor the target
    tensors a drafter keeps copies of (memory_plan counts those as weights)."""
    weights = {t.untyped_storage().data_ptr() for module in modules
               for t in (*module.parameters(), *module.buffers())}
    weights |= {t.untyped_storage().data_ptr() for module in modules for t in frozen_copies(module)}
    return sum(size for address, size in saved.items() if address not in weights)


def frozen_copies(module: torch.nn.Module) -> list[torch.Tensor]:
    """The copies of target tensors the drafters in `module` (itself, or one a launcher wrapped) made in their own
    dtype or device: the FrozenTargetTensors each declares (Drafter.frozen_tensors); none in the target."""
    declared = {id(frozen): frozen for sub in module.modules() if isinstance(sub, Drafter)
                for frozen in sub.frozen_tensors()}
    return [t for frozen in declared.values() for t in frozen.copies()]


def target_copy_values(drafter: torch.nn.Module) -> int:
    """Values of target tensors the drafter copied into its own dtype (none under autocast or beside a target of its
    dtype; 0 before the first forward, i.e. the probe)."""
    return sum(t.numel() for t in frozen_copies(drafter))


@dataclass(frozen=True)
class Probe:
    seconds_per_step: float
    tokens_per_step: float
    activation_bytes: int
    num_steps: int
    precision: str  # the Accelerator's mixed precision the steps ran in


def probe(recipe_path: str, overrides: list[str], num_steps: int, output_dir: str):
    """Build the run as `train` would (online features, no trackers, no resume, outputs in output_dir), train one
    micro-batch of the longest samples (warm-up, and the activation measurement), then time num_steps optimizer
    steps with the drafter's full config (the last phase). Returns (Probe, trainer)."""
    recipe = load_recipe(recipe_path, [*overrides, "features.mode=online", "features.cache_dir=null",
                                       "target.placement=replicated",
                                       "logging.trackers=[]", "train.resume_from=null", f"output.dir={output_dir}"])
    trainer = build_trainer(recipe)
    trainer.set_drafter_config(trainer.base_config)
    lengths = sample_lengths(trainer.data.train)
    longest = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:recipe.train.batch_size]
    batch = trainer.to_device(make_batch(trainer.data.train, longest, trainer.pad_token_id))
    saved = saved_tensor_storages(lambda: trainer.train_step([batch]))
    activations = activation_bytes(saved, trainer.model, trainer.target.model)
    seconds, tokens = 0.0, 0.0
    for step in range(num_steps):
        micro_batches = trainer.micro_batches(step)
        synchronize(trainer.target.device)
        started = time.perf_counter()
        metrics = trainer.train_step(micro_batches).pop()  # reads the step's metrics: it has run to its end
        synchronize(trainer.target.device)
        seconds += time.perf_counter() - started
        tokens += metrics["tokens"] * len(micro_batches)
    return Probe(seconds / num_steps, tokens / num_steps, activations, num_steps,
                 trainer.accelerator.mixed_precision), trainer


def human_seconds(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def human_bytes(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num < 1024 or unit == "TiB":
            return f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} TiB"


def build_parser() -> argparse.ArgumentParser:
    parser = recipe_parser("draftsmith estimate", __doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes (GPUs) to plan the memory for (default: this launch's)")
    parser.add_argument("--probe-steps", type=int, default=3, help="optimizer steps the probe times (default 3)")
    parser.add_argument("--no-probe", action="store_true", help="skip the probe (no steps/hour, no activations)")
    parser.add_argument("--config-only", action="store_true",
                        help="read only the target's config.json and tokenizer, no weights (a target too large for "
                             "this machine; implies --no-probe, and the feature throughput is not measured); chosen "
                             "by itself when the target directory holds no weight files")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="memory of one GPU for naming the target placement that fits (default: this machine's "
                             "accelerator, else 192, an MI300X)")
    return parser


def print_cache_estimate(recipe: Recipe, target, data, request, num_processes: int, device) -> None:
    layer_ids = request.layer_ids
    dtype = target.feature_dtype(recipe.features.dtype)
    info = target.target_info()
    lengths = {split: sum(sample_lengths(dataset)) for split, dataset in (("train", data.train), ("eval", data.eval))}
    total_tokens = sum(lengths.values())
    per_token = cache_bytes_per_token(len(layer_ids), info.hidden_size, dtype, request.top_k_logits)
    print(f"target {info.name_or_path}: D={info.hidden_size}, layer ids {list(layer_ids)} + final norm, "
          f"cache dtype {str(dtype).removeprefix('torch.')}")
    print(f"data: {len(data.train)} train + {len(data.eval)} eval samples, {lengths['train']:,} + "
          f"{lengths['eval']:,} = {total_tokens:,} tokens")
    print(f"disk: {per_token:,} bytes/token x {total_tokens:,} tokens = {human_bytes(per_token * total_tokens)}")
    if is_meta(target):
        print("time: not measured (--config-only: the target's weights were not read)")
        return
    rate = measure_throughput(target, data.train, request, recipe.train.batch_size, target.pad_token_id)
    seconds = total_tokens / rate
    print(f"time: {rate:,.0f} tokens/s measured on {device} (batch {recipe.train.batch_size}) -> "
          f"{human_seconds(seconds)} on one process, {human_seconds(seconds / num_processes)} with "
          f"{num_processes} process(es)")


def is_meta(target) -> bool:
    return next(target.model.parameters()).device.type == "meta"


def config_only_target(recipe: Recipe, device) -> TargetModel:
    """The target from its config.json and tokenizer only, on the meta device (TargetModel.from_config), and a note
    saying so; its sizes are those of the loaded model."""
    target = TargetModel.from_config(recipe.target.name_or_path, dtype=resolve_dtype(recipe.target.dtype, device),
                                     trust_remote_code=recipe.target.trust_remote_code)
    print(f"config only: {target.name_or_path} read without its weights (sizes from config.json; no probe, no "
          "throughput)")
    return target


def recipe_sizes(recipe: Recipe, target, drafter: torch.nn.Module, activation_bytes: int | None,
                 measured_precision: str) -> RecipeSizes:
    """The sizes memory_plan needs, read off the loaded target and drafter (the target's dtype and the mixed
    precision as on a GPU; activation_bytes were measured under `measured_precision`)."""
    info = target.target_info()
    request = drafter.feature_request()
    gpu_dtype = torch.bfloat16 if recipe.target.dtype == "auto" else getattr(torch, recipe.target.dtype)
    tokens = recipe.train.batch_size * recipe.data.max_length
    quantized = quantization_method(target.name_or_path)
    return RecipeSizes(target_params=sum(p.numel() for p in target.model.parameters()),
                       target_bytes_per_param=torch.empty((), dtype=gpu_dtype).element_size(),
                       drafter_trainable=sum(p.numel() for p in drafter.parameters() if p.requires_grad),
                       drafter_frozen_values=sum(p.numel() for p in drafter.parameters() if not p.requires_grad)
                       + sum(b.numel() for b in drafter.buffers()),
                       target_copy_values=target_copy_values(drafter),
                       feature_values=(len(request.layer_ids) + 1) * tokens * info.hidden_size,
                       logit_chunk_values=min(info.vocab_size * tokens, LOGIT_CHUNK_VALUES),
                       activation_bytes=activation_bytes,
                       largest_layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in target.layers),
                       head_params=sum({id(p): p.numel() for module in (
                           target.model.get_input_embeddings(), target.final_norm,
                           target.model.get_output_embeddings()) for p in module.parameters()}.values()),
                       engine_bytes_per_param=served_bytes_per_param(quantized),
                       engine_quantization=quantized,
                       engine_stored_bytes=stored_bytes(target.name_or_path) if quantized else None,
                       undecodable_layers=tuple(unsupported_layer_types(target.model.config)),
                       mixed_precision=resolve_mixed_precision(recipe.train.mixed_precision, accelerator=True,
                                                               launcher=os.environ.get(PRECISION_ENV)),
                       measured_precision=measured_precision)


def print_memory(sizes: RecipeSizes, world_size: int, recipe: Recipe) -> None:
    plans = {strategy: memory_plan(sizes, strategy, world_size) for strategy in STRATEGIES}
    target_dtype = {2: "bf16", 4: "fp32"}.get(sizes.target_bytes_per_param, f"{sizes.target_bytes_per_param} B")
    print(f"memory per GPU at world size {world_size} (target in {target_dtype} on every GPU; drafter "
          f"{sizes.drafter_trainable:,} trained parameters in mixed precision {precision_name(sizes.mixed_precision)}; "
          f"micro-batch {recipe.train.batch_size} x {recipe.data.max_length} tokens):")
    print(f"  {'':34}" + "".join(f"{strategy:>12}" for strategy in STRATEGIES))
    for part in plans["ddp"]:
        print(f"  {part:34}" + "".join(f"{human_bytes(plans[s][part]):>12}" for s in STRATEGIES))
    if sizes.activation_bytes is None:
        print("  (drafter activations not measured: --no-probe)")


def print_step_peak(recipe: Recipe, drafter: torch.nn.Module, device) -> int | None:
    """One training step's peak (drafters/step_memory.py) for the recipe's micro-batch at data.max_length on
    `device` (this launch's: the drafter may have been built elsewhere, on the CPU or the meta device); None for a
    drafter the model does not cover."""
    shape = step_shape(drafter, recipe.data.max_length, recipe.train.batch_size, recipe.train.activation_checkpointing,
                       device)
    if shape is None:
        return None
    parts = step_peak_parts(shape)
    detail = ", ".join(f"{part} {human_bytes(size)}" for part, size in parts.items() if part != "total")
    print(f"one training step of the drafter (model, fp32, micro-batch {shape.batch} x {shape.seq_len} tokens, "
          f"activation checkpointing {'on' if shape.checkpointing else 'off'}): peak {human_bytes(parts['total'])} "
          f"({detail})")
    return parts["total"]


def engine_line(sizes: RecipeSizes, tensor_parallel_size: int) -> str:
    """A vLLM engine's weights per GPU: a quantized checkpoint's as stored (its files' bytes, or one byte a weight
    for fp8 from the config alone), else every weight in the target's dtype."""
    where = f"per GPU at features.vllm.tensor_parallel_size {tensor_parallel_size}"
    method = sizes.engine_quantization
    if sizes.engine_stored_bytes is not None:
        engine = -(-sizes.engine_stored_bytes // tensor_parallel_size)
        return f"{human_bytes(engine)} of weights {where} (the {method} checkpoint's files as stored)"
    engine = engine_bytes_per_gpu(params=sizes.target_params,
                                  bytes_per_param=sizes.engine_bytes_per_param or sizes.target_bytes_per_param,
                                  tensor_parallel_size=tensor_parallel_size)
    note = (" (the checkpoint's fp8)" if sizes.engine_bytes_per_param == 1 else
            f" (its {method} weights counted at the target's dtype: sized from their files when they are there)"
            if method else "")
    return f"{human_bytes(engine)} of weights {where}{note}"


def print_placements(sizes: RecipeSizes, world_size: int, recipe: Recipe, gpu_bytes: int,
                     gpu_source: str) -> str | None:
    """Target memory per GPU under each target.placement, the DDP total with it (and the replicated target's with the
    drafter under FSDP), and the first that fits in gpu_bytes (returned: a placement, or "replicated+fsdp")."""
    rest, fsdp = memory_plan(sizes, "ddp", world_size), memory_plan(sizes, "fsdp", world_size)
    rest, fsdp_rest = rest["total"] - rest["target weights"], fsdp["total"] - fsdp["target weights"]
    shape = dict(params=sizes.target_params, bytes_per_param=sizes.target_bytes_per_param,
                 largest_layer=sizes.largest_layer_params, head=sizes.head_params, world_size=world_size)
    target = {p: target_bytes_per_gpu(p, **shape) for p in PLACEMENTS}
    totals = {p: target[p] + rest for p in PLACEMENTS}
    replicated_fsdp = target["replicated"] + fsdp_rest
    print(f"target placement per GPU at world size {world_size} (target.placement; totals with DDP drafter state):")
    gathered = (sizes.target_params - sizes.head_params) * sizes.target_bytes_per_param * (world_size - 1) // world_size
    for placement, note in (("replicated", "every process holds all of it"),
                            ("sharded", "FSDP2, the head whole + 1/W of the layers + two gathered; online features; "
                                        f"each GPU receives {human_bytes(gathered)} of layers every forward"),
                            ("served", "head only; vLLM holds the decoder, offline features")):
        print(f"  {placement:11} target {human_bytes(target[placement]):>11}  total "
              f"{human_bytes(totals[placement]):>11}  ({note})")
        if placement == "replicated":
            print(f"  {'':11} {'':18}  total {human_bytes(replicated_fsdp):>11}  (the drafter under FSDP: "
                  "recipes/accelerate/8gpu_fsdp.yaml; only its own shards are gathered)")
    tp = recipe.features.vllm.tensor_parallel_size
    print(f"  vLLM engine: {engine_line(sizes, tp)}, plus its KV cache")
    if sizes.undecodable_layers:  # no process here runs its decoder: vLLM computes the features
        fits = "served" if totals["served"] <= gpu_bytes else None
        print(f"  (its {', '.join(sizes.undecodable_layers)} layers run in vLLM only: target.placement served)")
    else:
        fits = fitting_placement(totals, gpu_bytes, replicated_fsdp)
    print(f"  fits {human_bytes(gpu_bytes)} per GPU ({gpu_source}): "
          + ("target.placement: replicated with the drafter under FSDP (recipes/accelerate/8gpu_fsdp.yaml)"
             if fits == "replicated+fsdp" else f"target.placement: {fits}" if fits
             else "none; shard the drafter (fsdp/zero3) or use more GPUs")
          + (" (the first that fits; weigh the layers it gathers every forward against served's vLLM GPUs)"
             if fits == "sharded" else ""))
    return fits


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    recipe = load_recipe(args.recipe, args.overrides)
    check_sources(recipe.data)  # as every recipe command does before it loads a model
    check_init_from(recipe)
    if args.probe_steps < 1:
        raise ValueError(f"--probe-steps must be >= 1, got {args.probe_steps}")
    gpu = gpu_memory(args.gpu_memory_gib)
    state = process_state(recipe)
    world_size = state.num_processes if args.world_size is None else args.world_size
    drafter_state_bytes(0, "ddp", world_size)  # checks --world-size before anything is loaded
    config_only = args.config_only or not holds_weights(resolve_target(recipe.target.name_or_path))
    with tempfile.TemporaryDirectory(prefix="draftsmith-estimate-") as scratch:
        result = None
        if config_only:
            target = config_only_target(recipe, state.device)
            data = load_data(recipe, target, state)
            recipe = warm_recipe(recipe, target.target_info())
            with torch.device("meta"):  # shapes only: a drafter that copies target weights copies nothing
                drafter = build_drafter(recipe, target)
        elif args.no_probe:
            target = load_target(recipe, state.device, whole=True)
            data = load_data(recipe, target, state)
            recipe = warm_recipe(recipe, target.target_info())
            drafter = build_drafter(recipe, target)
        else:
            result, trainer = probe(args.recipe, args.overrides, args.probe_steps, scratch)
            target, data, drafter, recipe = trainer.target, trainer.data, trainer.model, trainer.recipe
        request = drafter.feature_request()
        print_cache_estimate(recipe, target, data, request, state.num_processes, state.device)
        sizes = recipe_sizes(recipe, target, drafter, *((None, "no") if result is None else
                                                        (result.activation_bytes, result.precision)))
        print_memory(sizes, world_size, recipe)
        print_step_peak(recipe, drafter, state.device)
        print_placements(sizes, world_size, recipe, *gpu)
        if result is not None:
            print_probe(result, recipe, trainer.derived, state.device)
    return 0


def gpu_memory(gib: float | None) -> tuple[int, str]:
    """(bytes, where the number came from) of one GPU."""
    if gib is not None:
        if gib <= 0:
            raise ValueError(f"--gpu-memory-gib must be > 0, got {gib}")
        return int(gib * (1 << 30)), "--gpu-memory-gib"
    if torch.accelerator.is_available():
        index = torch.accelerator.current_device_index()
        # get_memory_info is newer than some torch >= 2.7 builds (ROCm's); the device module's is (free, total) too
        memory_info = getattr(torch.accelerator, "get_memory_info", None) or getattr(
            torch, torch.accelerator.current_accelerator().type).mem_get_info
        return memory_info(index)[1], "this machine's accelerator"
    return 192 << 30, "no accelerator here: an MI300X's 192 GiB"


def print_probe(result: Probe, recipe: Recipe, derived, device) -> None:
    rate = steps_per_hour(result.seconds_per_step)
    print(f"probe: {result.seconds_per_step:.2f} s per optimizer step in {precision_name(result.precision)} "
          f"({recipe.train.batch_size} x "
          f"{derived.grad_accum} micro-batches, {result.tokens_per_step / result.seconds_per_step:,.0f} tokens/s) "
          f"over {result.num_steps} steps on {device}, online features -> {rate:,.0f} steps/hour; the recipe's "
          f"{derived.max_steps:,} steps -> {human_seconds(derived.max_steps * result.seconds_per_step)} at this rate")


if __name__ == "__main__":
    sys.exit(main())
