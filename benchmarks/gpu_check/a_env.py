"""A. The environment, and masked SDPA of every backend against an fp32 reference.

Every drafter's attention with a mask (DFlash / DSpark blocks, EAGLE-3's training-time test) goes through
`scaled_dot_product_attention` with a boolean mask, and which kernel serves it is torch's choice. pytorch#147460: on
ROCm torch 2.6 the memory-efficient kernel returned wrong values with a custom mask. So each backend is forced in turn
(flash, memory-efficient, cuDNN, math), with grouped-query attention (`enable_gqa`) and with K/V repeated, on bf16
inputs; a backend that refuses the case is "not eligible", one that runs must match an fp32 explicit softmax over the
same (bf16) inputs within the bound below.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform

import torch
import torch.nn.functional as F

from benchmarks.gpu_check.context import BF16_EPS, CheckFailed, Context
from benchmarks.gpu_check.summary import one_line

PACKAGES = ("transformers", "accelerate", "datasets", "pyarrow", "fsspec", "huggingface_hub", "safetensors")


def machine(ctx: Context) -> dict:
    """Versions and the device; a package that does not import says why (datasets is carried as a wheel)."""
    info = {"device": str(ctx.device), "torch": torch.__version__, "python": platform.python_version()}
    if ctx.device.type != "cpu":
        backend = getattr(torch, ctx.device.type)
        info["name"] = backend.get_device_name(0)
        info["memory_gib"] = round(backend.get_device_properties(0).total_memory / 2**30, 1)
    for name in ("cuda", "hip"):
        version = getattr(torch.version, name, None)
        if version:
            info[name] = version
    for name in PACKAGES:
        try:
            importlib.import_module(name)
            info[name] = importlib.metadata.version(name.replace("_", "-"))
        except Exception as err:  # noqa: BLE001 - any failure to import is what is reported
            info[name] = f"missing ({one_line(err)})"
    found = importlib.util.find_spec("deepspeed") is not None  # found, not imported: its import alone takes seconds
    info["deepspeed"] = importlib.metadata.version("deepspeed") if found else "missing"
    return info


def reference(q, k, v, mask) -> torch.Tensor:
    """fp32 softmax(q k^T / sqrt(d), masked) v, with K/V repeated to the query heads. q [B, H, n, d], k/v [B, H_kv,
    C, d], mask [B, 1, n, C] (True = may attend)."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(groups, dim=1) for x in (k, v))
    scores = q.float() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def tolerance(q, k, v, mask) -> float:
    """The error bound of a bf16 attention over these inputs. A score s rounded to bf16 moves by up to eps/2 |s|, so
    a softmax weight moves by up to eps * max|s| relative (its own and the normaliser's); rounding the weights and
    the output adds eps/2 each. Summed over the values: eps * max|v| * (max|s| + 1), doubled for accumulation order.
    A wrong kernel (the ROCm bug) is off by O(max|v|)."""
    groups = q.shape[1] // k.shape[1]
    scores = q.float() @ k.float().repeat_interleave(groups, dim=1).transpose(-1, -2) / q.shape[-1] ** 0.5
    max_score = scores.masked_fill(~mask, 0.0).abs().max().item()
    return 2 * BF16_EPS * v.float().abs().max().item() * (max_score + 1)


def backends() -> dict[str, object]:
    from torch.nn.attention import SDPBackend

    names = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
    return {name.lower(): getattr(SDPBackend, name) for name in names if hasattr(SDPBackend, name)}


def attend(backend, q, k, v, mask, gqa: bool) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel

    if not gqa:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def sdpa_check(ctx: Context) -> tuple[dict, list[str]]:
    """{backend: {"gqa": error or "not eligible: ...", "repeated": ...}} and the failures."""
    shape = (2, 32, 64, 128, 8, 96) if not ctx.cpu else (1, 4, 16, 32, 2, 24)
    batch, heads, queries, dim, kv_heads, keys = shape
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, queries, dim, generator=generator).to(ctx.device, torch.bfloat16)
    k = torch.randn(batch, kv_heads, keys, dim, generator=generator).to(ctx.device, torch.bfloat16)
    v = torch.randn(batch, kv_heads, keys, dim, generator=generator).to(ctx.device, torch.bfloat16)
    mask = torch.rand(batch, 1, queries, keys, generator=generator) < 0.5
    mask[..., 0] = True  # no row attends to nothing
    mask = mask.to(ctx.device)
    expected, bound = reference(q, k, v, mask), tolerance(q, k, v, mask)
    results: dict = {"tolerance": round(bound, 5)}
    failures = []
    for name, backend in backends().items():
        results[name] = {}
        for variant, gqa in (("gqa", True), ("repeated", False)):
            try:
                out = attend(backend, q, k, v, mask, gqa)
            except RuntimeError as err:
                results[name][variant] = f"not eligible: {one_line(err)[:120]}"
                continue
            error = (out.float() - expected).abs().max().item()
            results[name][variant] = round(error, 5)
            if not error <= bound:
                failures.append(f"SDPA {name} ({variant}) off by {error:.3g} > {bound:.3g}")
    if not isinstance(results.get("math", {}).get("repeated"), float):
        failures.append("SDPA math backend did not run")
    return results, failures


def run(ctx: Context) -> dict:
    numbers = {"machine": machine(ctx)}
    numbers["sdpa_max_error"], failures = sdpa_check(ctx)
    if failures:
        raise CheckFailed("; ".join(failures), numbers)
    return numbers
