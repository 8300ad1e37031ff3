"""What the drafters compute differently on an accelerator, checked on the CPU (design/gpu_readiness.md 1.1, 1.4):

- masked attention repeats K/V to every query head off the CPU (drafters/layers.expands_kv_heads), so CUDA and ROCm
  keep a fused kernel instead of the math one; repeated, it equals the grouped formulation: outputs bitwise, K/V
  gradients to fp32 rounding (a group's gradients summed in another order), whole training steps alike. On the CPU
  K/V stay grouped, so CPU training stays bitwise what it was;
- the target's frozen tensors stay in the target's dtype (layers.FrozenTargetTensors): an fp32 drafter beside a bf16
  target holds no fp32 copy of the embedding, nor of the lm_head under autocast; the full-vocabulary teacher's
  product runs in the target's dtype, its softmax in fp32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_long_sequences import FACTORIES, FULL_VOCAB, loss_and_grads, make_batch, target_info

from drafters import layers
from drafters.layers import FrozenTargetTensors, attention
from drafters.losses import full_vocab_cross_entropy, soft_cross_entropy

SHAPES = [(2, 4, 2, 7, 11, 8), (1, 8, 2, 33, 40, 16), (2, 6, 3, 5, 9, 4)]  # B, H, H_kv, n, C, d


def inputs(batch, heads, kv_heads, n, columns, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, head_dim, generator=generator)
    k, v = (torch.randn(batch, kv_heads, columns, head_dim, generator=generator) for _ in range(2))
    mask = torch.rand(batch, 1, n, columns, generator=generator) > 0.4
    mask[..., 0] = True  # every query row sees a key
    return q, k, v, mask


def test_masked_attention_repeats_kv_only_off_the_cpu(monkeypatch):
    """SDPA receives grouped K/V on the CPU and with no mask; repeated ones for a mask on any other device."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((k.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v, mask = inputs(*SHAPES[1])
    attention(q, k, v, mask)
    meta = [t.to("meta") for t in (q, k, v, mask)]
    attention(*meta)
    attention(*meta[:3], None)
    assert seen == [(2, True), (8, False), (2, True)]
    assert not layers.expands_kv_heads(torch.device("cpu")) and layers.expands_kv_heads(torch.device("meta"))


@pytest.mark.parametrize("shape", SHAPES)
def test_repeated_kv_equals_grouped_attention(shape, monkeypatch):
    """fp32: outputs and the query gradient bitwise; each K/V gradient sums its group's H / H_kv per-head terms in
    another order, a few units of fp32 rounding of the largest."""
    results = []
    for repeat in (False, True):
        monkeypatch.setattr(layers, "expands_kv_heads", lambda device: repeat)
        q, k, v, mask = (t.requires_grad_(t.is_floating_point()) for t in inputs(*shape))
        out = attention(q, k, v, mask)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append((out.detach(), q.grad, k.grad, v.grad))
    (out_a, dq_a, dk_a, dv_a), (out_b, dq_b, dk_b, dv_b) = results
    assert torch.equal(out_a, out_b) and torch.equal(dq_a, dq_b)
    for grouped, repeated in ((dk_a, dk_b), (dv_a, dv_b)):
        bound = 8 * torch.finfo(torch.float32).eps * float(grouped.abs().max()) * (shape[1] // shape[2])
        torch.testing.assert_close(repeated, grouped, rtol=0, atol=bound)


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark", "assistant"])
def test_a_training_step_with_repeated_kv_equals_the_grouped_one(kind, monkeypatch):
    """The masked attention of EAGLE-3's step 0 (a padded batch), DFlash / DSpark blocks and the assistant's queries
    over the target's K/V: the loss bitwise, gradients to fp32 rounding."""
    torch.manual_seed(0)
    drafter = {**FACTORIES, **FULL_VOCAB}[kind](target_info())
    batch = make_batch(drafter)  # two rows of different lengths: padded
    grouped = loss_and_grads(drafter, batch)
    monkeypatch.setattr(layers, "expands_kv_heads", lambda device: True)
    repeated = loss_and_grads(drafter, batch)
    assert torch.equal(grouped[0], repeated[0])
    for name, grad in grouped[2].items():
        torch.testing.assert_close(repeated[2][name], grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()), msg=name)


def bf16_target_info():
    info = target_info()
    return dataclasses.replace(info, embed_weight=info.embed_weight.bfloat16(),
                               lm_head_weight=info.lm_head_weight.bfloat16())


def frozen_holders(drafter) -> list[FrozenTargetTensors]:
    return [value for module in drafter.modules() for value in vars(module).values()
            if isinstance(value, FrozenTargetTensors)]


@pytest.mark.parametrize("kind", sorted({**FACTORIES, **FULL_VOCAB}))
def test_frozen_target_tensors_stay_in_the_targets_dtype(kind):
    """An fp32 drafter of a bf16 target trains under bf16 autocast (forward under autocast, loss outside, as
    accelerate runs it) with no copy of a target tensor at all; without autocast the only copy is the head it
    multiplies fp32 rows by (that product is fp32 then), never the embedding, whose rows convert exactly."""
    info = bf16_target_info()
    drafter = {**FACTORIES, **FULL_VOCAB}[kind](info)
    batch = make_batch(drafter)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = drafter(batch)
    loss, _ = drafter.loss(output, batch)
    loss.backward()
    holders = frozen_holders(drafter)
    assert holders and torch.isfinite(loss)
    assert all(holder._copies == {} for holder in holders)
    like = next(drafter.parameters())
    assert holders[0].on_device("embed_weight", like).data_ptr() == info.embed_weight.data_ptr()
    loss, _ = drafter.loss(drafter(batch), batch)
    assert torch.isfinite(loss)
    assert {name for holder in holders for name, _, _ in holder._copies} <= {"lm_head_weight"}
    # what the drafter declares is what a scan of its attributes finds, and `estimate` counts those copies only
    from train.estimate import target_copy_values

    assert {id(h) for h in drafter.frozen_tensors()} == {id(h) for h in holders}
    copies = [t for holder in holders for t in holder._copies.values()]
    assert target_copy_values(drafter) == sum(t.numel() for t in copies)
    assert target_copy_values(torch.nn.Sequential(drafter)) == target_copy_values(drafter)  # seen through a wrapper


def test_embedding_rows_in_the_drafters_dtype_equal_a_converted_copys():
    holder = FrozenTargetTensors(bf16_target_info())
    like = torch.zeros(1)
    ids = torch.tensor([[4, 9, 4], [95, 0, 17]])
    rows = holder.embedding("embed_weight", ids, like)
    assert rows.dtype == torch.float32 and holder._copies == {}
    assert torch.equal(rows, F.embedding(ids, holder.get("embed_weight", like)))  # get: the old fp32 copy


def test_full_vocab_teacher_runs_in_the_targets_dtype():
    """The teacher's logits are the bf16 product (as the bf16 target computes them), softmaxed in fp32: equal to that
    reference, and not to the fp32 product's (so the check can tell them apart)."""
    info = bf16_target_info()
    drafter = FULL_VOCAB["mtp"](info)
    batch = make_batch(drafter)
    output = drafter(batch)
    head = drafter._target_tensor("lm_head_weight")
    assert head.dtype == torch.bfloat16
    cell_loss, _ = full_vocab_cross_entropy(output, batch, head, soft=True)
    rows = output.batch_index.unsqueeze(1).expand_as(output.label_position)
    hidden = batch["final_hidden"][rows, output.label_position - 1]
    in_bf16 = torch.softmax(F.linear(hidden.bfloat16(), head).float(), dim=-1)
    in_fp32 = torch.softmax(F.linear(hidden, head.float()), dim=-1)
    torch.testing.assert_close(cell_loss, soft_cross_entropy(output.logits, in_bf16), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(cell_loss, soft_cross_entropy(output.logits, in_fp32), rtol=1e-6, atol=1e-6)
