"""The tree forward and KV compaction against real (tiny) transformers targets (inference/engine/tree/target.py).

Naive references: each root-to-node path fed as a plain chain after the same prefill gives the same logits as the
tree forward; after compaction the cache is the cache of the accepted path fed plainly (next logits identical).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from drafters.base import FeatureRequest
from inference.engine.target import TargetModel
from inference.engine.tree.draft import DraftTree
from inference.engine.tree.target import tree_extend

# node:     0   1   2   3   4   5   6
PARENTS = [-1, 0, 0, 1, 1, 3, 2]
TOKENS = [7, 11, 12, 13, 14, 15, 16]
PROMPTS = [[5, 9, 33, 4, 18], [21, 3, 8]]
# Eager attention turns left padding into NaN in the plain engine too (a fully masked padding query row gives NaN
# keys that 0-weights cannot cancel), so eager runs use rows of one length.
EQUAL_PROMPTS = [[5, 9, 33, 4, 18], [21, 3, 8, 40, 2]]


def logits_tolerance(kernel: str) -> dict:
    """rtol/atol for logits and hidden states of two forwards grouping the same float64 work differently (tree, chain).

    sdpa runs in the model's float64, so the two agree to far better than 1e-9. HF's eager attention computes its
    softmax in float32 (`softmax(..., dtype=torch.float32)`) and casts back, so the attention weights carry float32
    rounding (eps 1.2e-7) whose size depends on the CPU's summation order (AVX2 and AVX-512 differ): about 4 eps was
    seen after two layers and the x8 lm_head; 2**7 eps leaves a margin of 30 without hiding a wrong mask, which moves
    logits by O(1)."""
    if kernel == "eager":
        tol = 2**7 * torch.finfo(torch.float32).eps
        return dict(rtol=tol, atol=tol)
    return dict(rtol=1e-9, atol=1e-9)


def make_target(arch: str, kernel: str) -> TargetModel:
    model = make_tiny_model(arch)
    model.config._attn_implementation = kernel
    return TargetModel(model, name_or_path=f"tiny-{arch}")


def small_tree(batch: int) -> DraftTree:
    parents = torch.tensor(PARENTS)
    depth = torch.zeros_like(parents)
    for node in range(1, len(PARENTS)):
        depth[node] = depth[parents[node]] + 1
    tokens = torch.tensor(TOKENS)
    return DraftTree(tokens.repeat(batch, 1), parents.repeat(batch, 1), depth.repeat(batch, 1),
                     torch.ones(batch, len(PARENTS), dtype=torch.bool))


def path_to(node: int) -> list[int]:
    nodes = [node]
    while PARENTS[nodes[-1]] >= 0:
        nodes.append(PARENTS[nodes[-1]])
    return nodes[::-1]


def prompts_for(kernel: str) -> list[list[int]]:
    return EQUAL_PROMPTS if kernel == "eager" else PROMPTS


def prefill(target: TargetModel, request: FeatureRequest | None = None):
    prompts = prompts_for(target.model.config._attn_implementation)
    width = max(map(len, prompts))
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return target.prefill(input_ids, mask, request)


@pytest.mark.parametrize("arch,kernel", [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa")])
def test_tree_logits_equal_each_path_fed_as_a_chain(arch, kernel):
    target = make_target(arch, kernel)
    request = FeatureRequest(layer_ids=(1, 2), final_hidden=True)
    prefill(target, request)
    logits, served = tree_extend(target, small_tree(len(PROMPTS)), request)
    for node in range(len(PARENTS)):
        path = path_to(node)
        prefill(target, request)
        chain_logits, chain_served = target.extend(torch.tensor([TOKENS[i] for i in path]).repeat(len(PROMPTS), 1),
                                                   request)
        torch.testing.assert_close(logits[:, node], chain_logits[:, -1], **logits_tolerance(kernel))
        for layer_id in (1, 2):
            torch.testing.assert_close(served.hidden[layer_id][:, node], chain_served.hidden[layer_id][:, -1],
                                       **logits_tolerance(kernel))
        torch.testing.assert_close(served.final_hidden[:, node], chain_served.final_hidden[:, -1],
                                   **logits_tolerance(kernel))


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_compaction_leaves_the_cache_of_the_accepted_path(kernel):
    """Row 0 accepts 0 -> 1 -> 3 -> 5 entirely, row 1 keeps 0 -> 2 (a non-first branch): afterwards one more token
    gives the logits of a target that read prompt + path plainly, and the path's features are those of the path."""
    target = make_target("llama", kernel)
    request = FeatureRequest(layer_ids=(2,))
    prefill(target, request)
    mark = target.mark()
    _, served = tree_extend(target, small_tree(2), request)
    path = torch.tensor([[0, 1, 3, 5], [0, 2, -1, -1]])
    keep = torch.tensor([4, 2])
    target.keep_path(mark, path, keep)
    features = served.along(path)
    probe = torch.tensor([[40], [41]])
    logits, _ = target.extend(probe)
    for row, prompt in enumerate(prompts_for(kernel)):
        plain = make_target("llama", kernel)
        kept = [TOKENS[node] for node in path[row, : keep[row]].tolist()]
        plain_logits, plain_served = plain.extend(torch.tensor([prompt + kept]), request)
        expected, _ = plain.extend(probe[row : row + 1])
        torch.testing.assert_close(logits[row], expected[0], **logits_tolerance(kernel))
        torch.testing.assert_close(features.hidden[2][row, : keep[row]], plain_served.hidden[2][0, len(prompt):],
                                   **logits_tolerance(kernel))
    assert target.runner.lengths.tolist() == [len(p) + k + 1 for p, k in zip(prompts_for(kernel), keep.tolist())]


def test_a_kernel_without_arbitrary_masks_is_refused():
    target = make_target("llama", "sdpa")
    prefill(target)
    target.model.config._attn_implementation = "flash_attention_2"  # a kernel that cannot read a 4-D mask
    with pytest.raises(ValueError, match="attn_implementation"):
        tree_extend(target, small_tree(len(PROMPTS)))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_tree_over_the_lean_forward_equals_each_path_fed_as_a_chain(arch, cpu_backend):
    """On the fast path the tree forward runs the lean forward too (its 4-D mask passed through): float32, and the
    tree's 7 rows and each chain's 1-4 rows may run different kernels, so the float32 summation bound applies."""
    target = TargetModel(make_tiny_model(arch, dtype=torch.float32), name_or_path=f"tiny-{arch}", backend=cpu_backend)
    assert target.decode == "lean"
    tol = dict(rtol=2**7 * torch.finfo(torch.float32).eps, atol=2**7 * torch.finfo(torch.float32).eps)
    request = FeatureRequest(layer_ids=(1, 2), final_hidden=True)
    prefill(target, request)
    logits, served = tree_extend(target, small_tree(len(PROMPTS)), request)
    for node in range(len(PARENTS)):
        path = path_to(node)
        prefill(target, request)
        chain_logits, chain_served = target.extend(torch.tensor([TOKENS[i] for i in path]).repeat(len(PROMPTS), 1),
                                                   request)
        scale = max(float(chain_logits.abs().max()), 1.0)
        torch.testing.assert_close(logits[:, node], chain_logits[:, -1], rtol=tol["rtol"], atol=tol["atol"] * scale)
        torch.testing.assert_close(served.final_hidden[:, node], chain_served.final_hidden[:, -1], **tol)
