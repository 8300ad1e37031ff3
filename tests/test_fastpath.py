"""The target's fast path (inference/engine/cpu/, the CPU backend): same parameters, logits within float32 rounding of
a float64 reference on every kernel branch, greedy speculative decoding still lossless, a fall-back where it cannot run,
and everything it changed given back by `undo`."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model, random_prompts
from torch import nn

from drafters import DraftModelDrafter, NgramDrafter
from drafters.dflash import DFlashConfig, DFlashDrafter
from drafters.draft_model import DraftModelConfig
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.medusa import MedusaConfig, MedusaDrafter
from drafters.mtp import MTPConfig, MTPDrafter
from inference.engine.api import speculative_generate
from inference.engine.backend import HF_PATH
from inference.engine.cpu import CpuBackend, fastpath, kernels
from inference.engine.target import TargetModel

# Two float32 forwards of the same 2-layer model that sum in different orders (MKL's sgemm, a vector-matrix product,
# oneDNN's blocked kernel; AVX2 and AVX-512 differ too) each sit a few eps (1.2e-7) of the logit scale from the
# float64 result; 2**7 eps leaves a wide margin yet is four orders of magnitude below a wrong weight or mask.
TOL = 2**7 * torch.finfo(torch.float32).eps


def fp32_pair(arch: str, backend: CpuBackend):
    """(HF float32 target, fast-path float32 target, float64 reference model) sharing one set of random weights."""
    model = make_tiny_model(arch, dtype=torch.float32)
    reference = copy.deepcopy(model).double()
    return TargetModel(copy.deepcopy(model)), TargetModel(model, backend=backend), reference


@pytest.mark.parametrize("kernel", ["chosen", *sorted(kernels.KERNELS)])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_fast_logits_are_within_float32_rounding_of_float64(arch, kernel, monkeypatch, cpu_backend):
    if kernel != "chosen":  # every row count on this one kernel, whatever this machine would choose
        monkeypatch.setattr(kernels, "plan_for", lambda timings: [kernel] * (kernels.MAX_ROWS + 1))
    hf, fast, reference = fp32_pair(arch, cpu_backend)
    assert fast.path == fastpath.FAST_PATH and hf.path == HF_PATH
    # a 70-token prefill runs F.linear (> kernels.MAX_ROWS rows), then 1, 2 and 5 rows through the plan's kernels
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


def test_parameters_state_dict_and_tying_are_unchanged_and_undo_gives_the_model_back(cpu_backend):
    model = make_tiny_model("llama", dtype=torch.float32)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    before = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    ids = torch.tensor([random_prompts(1, seed=2)[0]])
    plain = model(input_ids=ids).logits
    prepared = CpuBackend(cpu_backend.cache_dir, lean=False).prepare(model)
    assert prepared.path == fastpath.FAST_PATH and prepared.block_forward is None
    assert not any(type(module) is nn.Linear for module in model.modules())
    assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == before
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prepared.undo()
    assert not any(isinstance(module, fastpath.FastLinear) for module in model.modules())
    assert torch.equal(model(input_ids=ids).logits, plain)  # the same modules' kernels again: bit-identical


def test_undo_gives_the_stacked_projections_their_own_storage_back(cpu_backend):
    model = make_tiny_model("llama", dtype=torch.float32)
    values = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    prepared = cpu_backend.prepare(model)
    assert prepared.block_forward is not None and prepared.kernels.stacked
    storages = lambda: {p.untyped_storage().data_ptr() for p in model.parameters()}  # noqa: E731
    assert len(storages()) < len(list(model.parameters()))  # q/k/v and gate/up: views into one stacked weight each
    prepared.undo()
    assert prepared.path == HF_PATH and prepared.block_forward is None and prepared.kernels is None
    assert not any(isinstance(module, fastpath.FastLinear) for module in model.modules())
    assert len(storages()) == len(list(model.parameters()))
    assert all(torch.equal(tensor, values[name]) for name, tensor in model.state_dict().items())


def test_unsupported_models_keep_the_hf_path(cpu_backend):
    model = make_tiny_model("llama")  # float64
    assert "float32" in fastpath.unsupported_reason(model)
    target = TargetModel(model, backend=cpu_backend)
    assert target.path == HF_PATH and target.prepared.kernels is None
    assert not any(isinstance(module, fastpath.FastLinear) for module in model.modules())


def test_an_unsupported_family_is_refused_before_the_backend_touches_the_model(cpu_backend):
    model = make_tiny_model("llama", dtype=torch.float32)
    model.config.layer_types = ["full_attention", "heavily_compressed_attention"]  # DeepSeek-V4's
    with pytest.raises(ValueError, match="layer types .*heavily_compressed_attention"):
        TargetModel(model, backend=cpu_backend)
    assert any(type(module) is nn.Linear for module in model.modules())  # no kernel chosen, nothing swapped


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_speculative_equals_plain_greedy_on_the_fast_path(batch_size, cpu_backend):
    target = TargetModel(make_tiny_model("llama", dtype=torch.float32), backend=cpu_backend)
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


def test_a_served_drafter_runs_the_kernels_at_inference_and_its_own_linears_when_it_trains(cpu_backend):
    target = TargetModel(make_tiny_model("llama", dtype=torch.float32), backend=cpu_backend)
    info = target.target_info()
    drafter = Eagle3Drafter(Eagle3Config(layer_ids=(0, 1, 2), draft_vocab_size=info.vocab_size,
                                         init_head_from_target=False), info)
    before = {name: tensor.data_ptr() for name, tensor in drafter.state_dict().items()}
    assert target.serve(drafter) is drafter
    choice = target.drafter_kernels(drafter)
    assert choice is not None and choice.shapes
    assert not any(type(module) is nn.Linear for module in drafter.modules())
    assert {name: tensor.data_ptr() for name, tensor in drafter.state_dict().items()} == before
    target.serve(drafter)
    assert target.drafter_kernels(drafter) is choice  # served once
    for module in (m for m in drafter.modules() if isinstance(m, fastpath.FastLinear)):
        x = torch.randn(2, module.in_features)
        assert torch.equal(module(x), F.linear(x, module.weight, module.bias))  # training: its own linear, exactly
    # not served: a drafter without parameters, and any drafter of a target on the hf path
    ngram = NgramDrafter(NgramDrafter.Config(), info)
    assert target.serve(ngram) is ngram
    other = Eagle3Drafter(Eagle3Config(layer_ids=(0, 1, 2), draft_vocab_size=info.vocab_size), info)
    hf = TargetModel(make_tiny_model("llama", dtype=torch.float32))
    hf.serve(other)
    assert hf.drafter_kernels(other) is None and any(type(m) is nn.Linear for m in other.modules())
    target.prepared.undo()  # a served drafter is given back with the target
    assert any(type(m) is nn.Linear for m in drafter.modules()) and target.drafter_kernels(drafter) is None


@pytest.mark.parametrize("kind", ["dflash", "mtp", "medusa"])
def test_a_served_drafter_multiplies_by_the_targets_head_through_the_targets_own_fast_linear(kind, cpu_backend):
    """The frozen head a drafter shares with its target runs by the target's FastLinear (the same module: no layout
    held twice) at inference, and by F.linear, exactly, wherever a gradient flows through it."""
    target = TargetModel(make_tiny_model("llama", dtype=torch.float32), backend=cpu_backend)
    info = target.target_info()
    drafter = {"dflash": lambda: DFlashDrafter(DFlashConfig(layer_ids=(0, 1), block_size=4,
                                                                  mask_token_id=info.vocab_size - 1), info),
               "mtp": lambda: MTPDrafter(MTPConfig(num_modules=2), info),
               "medusa": lambda: MedusaDrafter(MedusaConfig(num_heads=2), info)}[kind]()
    [frozen] = drafter.frozen_tensors()  # declared by the drafter
    like = next(drafter.parameters())
    weight = frozen.get("lm_head_weight", like)
    x = torch.randn(3, info.hidden_size)
    plain = frozen.linear("lm_head_weight", x, like)
    assert torch.equal(plain, F.linear(x, weight))  # unserved: F.linear
    target.serve(drafter)
    head = target.model.get_output_embeddings()
    assert isinstance(head, fastpath.FastLinear) and frozen._served["lm_head_weight"] is head
    assert target.drafter_kernels(drafter).frozen == {"lm_head_weight": "shared"}
    unit = torch.finfo(torch.float32).eps / 2
    with torch.no_grad():
        served = frozen.linear("lm_head_weight", x, like)
    bound = info.hidden_size * unit * (x.abs() @ weight.abs().T)
    assert bool(((served - plain).abs() <= bound).all())
    trained = x.clone().requires_grad_(True)
    assert torch.equal(frozen.linear("lm_head_weight", trained, like), plain)  # a gradient flows: F.linear
    fastpath.disable(drafter, [frozen])
    assert "lm_head_weight" not in frozen._served
    # a drafter served on its own (no target to share with) gets a FastLinear of its own over the same tensor
    record = fastpath.enable(drafter, cpu_backend.cache_dir, frozen=[frozen])
    own = frozen._served["lm_head_weight"]
    assert own is not head and own.weight.data_ptr() == weight.data_ptr()
    assert record.frozen == {"lm_head_weight": "own"}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
def test_every_kernel_equals_the_product_to_the_float32_bound(name, bias):
    """|y - y_exact| <= K u (|x| |W|^T + |b|) per element, K the inner dimension and u float32's unit roundoff: the
    bound on any order of summing K + 1 float32 products (Higham, Accuracy and Stability, section 3.1)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=generator)
    b = torch.randn(96, generator=generator) if bias else None
    copy_ = kernels.make_layout(kernels.KERNELS[name].layout, weight)
    unit = torch.finfo(torch.float32).eps / 2
    for rows in range(1, kernels.MAX_ROWS + 1):
        x = torch.randn(rows, 80, generator=generator)
        got = kernels.KERNELS[name].run(x, copy_, weight, b)
        exact = x.double() @ weight.double().T + (b.double() if bias else 0)
        magnitude = x.double().abs() @ weight.double().abs().T + (b.double().abs() if bias else 0)
        assert got.shape == (rows, 96)
        assert bool(((got.double() - exact).abs() <= 81 * unit * magnitude).all()), (name, rows)


def test_the_plan_takes_the_fastest_kernel_per_row_count_and_the_next_timed_count_between():
    timings = {1: {"linear": 3.0, "transposed": 1.5, "onednn": 1.0}, 2: {"linear": 2.0, "transposed": 4.0,
                                                                        "onednn": 2.0},
               4: {"linear": 5.0, "transposed": 6.0, "onednn": 1.0}}
    plan = kernels.plan_for(timings)
    assert len(plan) == kernels.MAX_ROWS + 1
    # a tie goes to the first name in sorted order; 3 rows take 4's choice; past the last timed count, its choice
    assert plan[1:5] == ["onednn", "linear", "onednn", "onednn"] and plan[16] == "onednn"


def test_a_plan_reads_the_weight_and_at_most_one_other_layout():
    """Each count's fastest kernel reads another layout (transposed, oneDNN's, MKL's): the plan keeps one, the one
    whose kernels are least slower than the fastest summed over the counts, and the weight itself elsewhere."""
    timings = {1: {"linear": 4.0, "transposed": 1.0, "onednn": 2.0, "onednn-pad4": 2.5},
               2: {"linear": 4.0, "transposed": 3.0, "onednn": 1.0, "onednn-pad4": 1.2},
               4: {"linear": 1.1, "transposed": 3.0, "onednn": 2.0, "onednn-pad4": 1.0}}
    plan = kernels.plan_for(timings)
    layouts = {kernels.KERNELS[name].layout for name in plan}
    assert layouts == {"weight", "onednn"}  # onednn: 2 + 1 + 1 (ratios); transposed: 1 + 3 + 1.1
    assert plan[1:5] == ["onednn", "onednn", "onednn-pad4", "onednn-pad4"]
    assert kernels.plan_for({1: {"linear": 1.0, "transposed": 1.0}})[1] == "linear"  # a tie: no extra copy


def test_a_fast_linear_holds_only_the_weight_copies_its_plan_reads():
    linear = nn.Linear(16, 8)
    plain = fastpath.FastLinear(linear, ["linear"] * (kernels.MAX_ROWS + 1))
    assert plain.copies == {"weight": None}
    mixed = fastpath.FastLinear(linear, ["linear", "transposed"] + ["onednn-pad4"] * (kernels.MAX_ROWS - 1))
    assert set(mixed.copies) == {"transposed", "onednn"} | {"weight"}
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(mixed(x), linear(x), rtol=0, atol=1e-5)


def test_the_choice_is_timed_once_per_machine_and_then_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "busy", lambda: False)
    linears = {(8, 16, False): [nn.Linear(16, 8, bias=False) for _ in range(3)]}
    first = kernels.choose(linears, cache_dir=str(tmp_path))[(8, 16, False)]
    again = kernels.choose(linears, cache_dir=str(tmp_path))[(8, 16, False)]
    assert not first["cached"] and again["cached"] and again["plan"] == first["plan"]
    assert set(first["timings_ms"]) == set(kernels.TIMED_ROWS) and len(list(tmp_path.iterdir())) == 1


def test_a_choice_timed_on_a_busy_machine_is_not_kept_and_retime_times_again(tmp_path, monkeypatch):
    linears = {(8, 16, False): [nn.Linear(16, 8, bias=False) for _ in range(3)]}
    monkeypatch.setattr(kernels, "busy", lambda: True)
    assert not kernels.choose(linears, cache_dir=str(tmp_path))[(8, 16, False)]["cached"]
    assert not list(tmp_path.iterdir())  # used by this process, never cached
    monkeypatch.setattr(kernels, "busy", lambda: False)
    kernels.choose(linears, cache_dir=str(tmp_path))
    assert kernels.choose(linears, cache_dir=str(tmp_path))[(8, 16, False)]["cached"]
    monkeypatch.setenv("DRAFTSMITH_RETIME_KERNELS", "1")
    assert not kernels.choose(linears, cache_dir=str(tmp_path))[(8, 16, False)]["cached"]
