"""The target's fast path (inference/engine/fastpath.py): same parameters, logits within float32 rounding of a float64
reference on every kernel branch, greedy speculative decoding still lossless, and a fall-back where it cannot run."""

import copy

import pytest
import torch
from conftest import make_tiny_model, random_prompts
from torch import nn

from drafters import DraftModelDrafter, NgramDrafter
from drafters.draft_model import DraftModelConfig
from inference.engine import fastpath
from inference.engine.generate import speculative_generate
from inference.engine.target import TargetModel

# Two float32 forwards of the same 2-layer model that sum in different orders (MKL's sgemm, a vector-matrix product,
# oneDNN's blocked kernel; AVX2 and AVX-512 differ too) each sit a few eps (1.2e-7) of the logit scale from the
# float64 result; 2**7 eps leaves a wide margin yet is four orders of magnitude below a wrong weight or mask.
TOL = 2**7 * torch.finfo(torch.float32).eps


def fp32_pair(arch: str):
    """(HF float32 target, fast-path float32 target, float64 reference model) sharing one set of random weights."""
    model = make_tiny_model(arch, dtype=torch.float32)
    reference = copy.deepcopy(model).double()
    return TargetModel(copy.deepcopy(model)), TargetModel(model, fast_path=True), reference


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_fast_logits_are_within_float32_rounding_of_float64(arch):
    hf, fast, reference = fp32_pair(arch)
    assert fast.path == fastpath.FAST_PATH and hf.path == fastpath.HF_PATH
    # a 70-token prefill runs F.linear (> MAX_PACKED_ROWS rows), then 1 row (vector-matrix) and 2, 5 rows (oneDNN)
    ids = torch.tensor([random_prompts(1, seed=3, min_len=78, max_len=78)[0]])
    with torch.no_grad():
        reference_logits = reference(input_ids=ids).logits
    scale = float(reference_logits.abs().max())
    for target in (hf, fast):
        logits = [target.prefill(ids[:, :70], torch.ones_like(ids[:, :70]))[0]]
        logits += [target.extend(ids[:, start:stop])[0] for start, stop in ((70, 71), (71, 73), (73, 78))]
        got = torch.cat([logits[0], *logits[1:]], dim=1).double()
        want = torch.cat([reference_logits[:, 69:70], reference_logits[:, 70:]], dim=1)
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL * scale)


def test_parameters_state_dict_and_tying_are_unchanged():
    model = make_tiny_model("llama", dtype=torch.float32)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    before = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    ids = torch.tensor([random_prompts(1, seed=2)[0]])
    plain = model(input_ids=ids).logits
    assert fastpath.enable(model) == fastpath.FAST_PATH
    assert not any(type(module) is nn.Linear for module in model.modules())
    assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == before
    assert model.lm_head.weight is model.model.embed_tokens.weight
    fastpath.disable(model)
    assert not any(isinstance(module, fastpath.FastLinear) for module in model.modules())
    assert torch.equal(model(input_ids=ids).logits, plain)  # the same modules' kernels again: bit-identical


def test_unsupported_models_keep_the_hf_path():
    model = make_tiny_model("llama")  # float64
    assert "float32" in fastpath.unsupported_reason(model)
    target = TargetModel(model, fast_path=True)
    assert target.path == fastpath.HF_PATH
    assert not any(isinstance(module, fastpath.FastLinear) for module in model.modules())


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_speculative_equals_plain_greedy_on_the_fast_path(batch_size):
    target = TargetModel(make_tiny_model("llama", dtype=torch.float32), fast_path=True)
    info = target.target_info()
    drafters = {"ngram": NgramDrafter(NgramDrafter.Config(), info),
                "draft_model": DraftModelDrafter(DraftModelConfig(path="tiny"), info,
                                                 model=make_tiny_model("llama", seed=5, num_layers=1,
                                                                       dtype=torch.float32))}
    prompts = random_prompts(3, seed=1)
    plain = [speculative_generate(target, None, [p], num_draft_tokens=0, max_new_tokens=30).tokens[0] for p in prompts]
    for name, drafter in drafters.items():
        for k in (1, 3, 6):
            for start in range(0, 3, batch_size):
                chunk = prompts[start:start + batch_size]
                out = speculative_generate(target, drafter, chunk, num_draft_tokens=k, max_new_tokens=30)
                assert out.tokens == plain[start:start + batch_size], (name, k)
