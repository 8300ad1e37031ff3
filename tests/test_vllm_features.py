"""features.extractor: vllm (train/features/vllm_features.py, train/features/vllm_connector.py).

Without vLLM: the recipe fields and their refusals, the engine's keyword arguments, the one-line error when vLLM is
missing, the head-only target (its final norm and argmax equal the full target's exactly: same weights, same ops),
the connector file's completion test on a real flock, and per-process GPU pinning.
With vLLM (marker `peer`, skipped where it is not importable): vLLM's features of two SmolLM2 samples equal the HF
target's to float32 tolerance, written through the real FeatureCache. benchmarks/training/vllm_features.py is the full
check (8 conversations, every layer, 50 training steps from each cache).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os

import pytest
import torch
from conftest import served_target

from inference.engine.target import head_target
from train.cli import main as cli
from train.config import load_recipe
from train.features.vllm_features import (data_parallel, engine_kwargs, head_outputs, pin_devices, vllm_layer_ids,
                                          written)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes", "debug", "tiny_eagle3.yaml")
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_extractor_defaults_to_hf_and_engine_fields_are_strict():
    recipe = load_recipe(TINY)
    assert recipe.features.extractor == "hf" and recipe.features.vllm.tensor_parallel_size == 1
    recipe = load_recipe(TINY, ["features.extractor=vllm", "features.vllm.tensor_parallel_size=8",
                                "features.vllm.max_num_seqs=256", "features.vllm.gpu_memory_utilization=0.8"])
    assert (recipe.features.vllm.tensor_parallel_size, recipe.features.vllm.max_num_seqs) == (8, 256)
    refusals = {
        "features.extractor=sglang": "features.extractor: 'sglang' is not one of ['hf', 'vllm']",
        "features.vllm.tp=2": "unknown config key(s) features.vllm.tp",
        "features.vllm.tensor_parallel_size=0": "features.vllm.tensor_parallel_size must be >= 1",
        "features.vllm.gpu_memory_utilization=1.5": "features.vllm.gpu_memory_utilization must be in (0, 1]",
        "features.vllm.data_parallel_rank=1": "features.vllm: set both data_parallel_size and data_parallel_rank",
    }
    for override, message in refusals.items():
        with pytest.raises(ValueError) as err:
            load_recipe(TINY, [override])
        assert str(err.value).startswith(message), override
    with pytest.raises(ValueError, match=r"data_parallel_rank 4 is not in \[0, data_parallel_size=4\)"):
        load_recipe(TINY, ["features.vllm.data_parallel_rank=4", "features.vllm.data_parallel_size=4"])


def test_data_parallel_ranks_come_from_the_recipe_or_the_launcher():
    recipe = load_recipe(TINY, ["features.vllm.data_parallel_rank=3", "features.vllm.data_parallel_size=8"])
    assert data_parallel(recipe.features.vllm, 0, 1) == (3, 8)
    assert data_parallel(load_recipe(TINY).features.vllm, 1, 2) == (1, 2)
    with pytest.raises(ValueError, match="launch one process per job"):
        data_parallel(recipe.features.vllm, 0, 2)


def test_engine_captures_the_requested_layers_and_the_final_one_through_our_connector():
    assert vllm_layer_ids([27, 2, 15, 2], 30) == [2, 15, 27, 30]
    assert vllm_layer_ids([2, 30], 30) == [2, 30]
    settings = load_recipe(TINY).features.vllm
    kwargs = engine_kwargs("/m", "float32", settings, device_type="cpu", layer_ids=[2, 15, 27, 30],
                           staging="/s", max_len=384)
    assert kwargs["speculative_config"] == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                            "draft_model_config": {"hf_config": {
                                                "eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}}}
    transfer = kwargs["kv_transfer_config"]
    assert (transfer["kv_connector"], transfer["kv_connector_module_path"]) == (
        "DraftsmithHiddenStatesConnector", "train.features.vllm_connector")
    assert transfer["kv_connector_extra_config"] == {"shared_storage_path": "/s"}
    assert (kwargs["max_model_len"], kwargs["enforce_eager"], kwargs["gpu_memory_utilization"]) == (385, True, 0.1)
    assert kwargs["language_model_only"] is True  # a vision-language release serves its text model, as ours
    assert kwargs["trust_remote_code"] is False  # only the user's target.trust_remote_code turns it on
    assert engine_kwargs("/m", "float32", settings, device_type="cpu", layer_ids=[1], staging="/s", max_len=9,
                         trust_remote_code=load_recipe(TINY, ["target.trust_remote_code=true"]).target.trust_remote_code
                         )["trust_remote_code"] is True
    on_gpu = engine_kwargs("/m", "bfloat16", settings, device_type="cuda", layer_ids=[1], staging="/s", max_len=9)
    assert (on_gpu["enforce_eager"], on_gpu["gpu_memory_utilization"]) == (False, 0.9)
    # an eager CPU engine computes vLLM's custom ops with its torch reference (eager_kwargs); GPU kernels stay
    assert kwargs["compilation_config"] == {"custom_ops": ["none"]} and "compilation_config" not in on_gpu


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown where vLLM is not installed")
def test_prepare_without_vllm_is_one_line(tmp_path, capsys):
    argv = ["prepare", TINY, "features.mode=offline", "features.extractor=vllm",
            f"features.cache_dir={tmp_path / 'f'}", f"output.dir={tmp_path / 'run'}"]
    assert cli(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert errors == ["draftsmith prepare: error: features.extractor is vllm but vllm is not importable in this "
                      "environment; install it (docs/distributed.md, 'The vLLM environment') or set "
                      "features.extractor=hf"]
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("name", ["debug:tiny-llama", "debug:tiny-nemotron-h"])  # whose checkpoint says `backbone.`
def test_head_target_holds_only_the_head_and_computes_what_the_full_target_does(name):
    from inference.assets.store import resolve_target
    from inference.engine.target import TargetModel

    path = resolve_target(name)
    full = TargetModel.from_pretrained(path)
    head = head_target(path, torch.float32, "cpu")
    assert all(p.is_meta for p in head.layers.parameters())
    assert not head.final_norm.weight.is_meta and not head.model.get_output_embeddings().weight.is_meta
    ids = torch.randint(0, 256, (1, 23))
    out = full.features(ids, torch.ones_like(ids), (1, full.num_layers), return_logits=True)
    last, argmax, (values, top) = head_outputs(head, out.hidden[full.num_layers][0], top_k=4)
    assert torch.equal(last, out.final_hidden[0]) and torch.equal(argmax, out.argmax[0])
    expected_values, expected_ids = out.logits[0].float().topk(4, dim=-1)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=1e-5)  # one matmul, blocked differently
    assert torch.equal(top, expected_ids)


def test_a_connector_file_is_complete_only_once_its_writer_releases_the_lock(tmp_path):
    path = str(tmp_path / "req.safetensors")
    assert not written(path)
    fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what the connector holds while it writes
    open(path, "wb").close()
    assert not written(path)
    os.close(fd)
    assert written(path)


def test_each_process_of_a_launch_gets_its_own_tensor_parallel_gpus(monkeypatch):
    settings = load_recipe(TINY, ["features.vllm.tensor_parallel_size=2"]).features.vllm
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    pin_devices(settings, 2, 4, "cuda")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ValueError, match="needs 4 GPUs, 3 are visible"):
        pin_devices(settings, 1, 2, "cuda")


def deepseek_v3_target(directory) -> str:
    """A tiny random DeepSeek-V3 (MLA, a dense layer then two of routed experts with the release's routing) that
    vLLM CPU runs: kv_lora_rank 512 and a 64-wide rotary part, its CPU MLA kernel's only head size.
    transformers' DeepseekV3Config writes neither key of the release's routing, and vLLM reads their absence as the
    older DeepSeek's: softmax scores (`scoring_func`, transformers always sigmoid) and no score correction bias
    (`topk_method`), so the file states both, as the release's does."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=260, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                              num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                              n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                              first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64,
                              qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=2048, eos_token_id=258,
                              pad_token_id=256, bos_token_id=None, tie_word_embeddings=False)
    return served_target(directory, DeepseekV3ForCausalLM, config, scoring_func="sigmoid", topk_method="noaux_tc")


@pytest.mark.peer
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (see docs/distributed.md, 'The vLLM environment')")
@pytest.mark.parametrize("name", ["smollm2", "tiny-deepseek-v3"])
def test_vllm_features_equal_hf_features(tmp_path, monkeypatch, name):
    """SmolLM2 (Llama), and an MLA target, whose attention vLLM CPU computes wrong from the second token on when its
    eager engine runs the C++ rotary kernel (train/features/vllm_features.py, eager_kwargs)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from datasets import Dataset
    from vllm import LLM

    from drafters.base import FeatureRequest
    from inference.assets.store import resolve_target
    from inference.engine.target import TargetModel
    from train.features.cache import FeatureCache, cache_meta, write_cache
    from train.features.vllm_features import write_cache_vllm

    path = (resolve_target("smollm2-135m-instruct") if name == "smollm2" else
            deepseek_v3_target(tmp_path / "target"))
    full = TargetModel.from_pretrained(path)
    tokens = [full.tokenizer(text)["input_ids"] for text in ("The capital of France is Paris, and", "def f(a):")]
    layer_ids = (2, 15, 27) if name == "smollm2" else (1, 2)
    dataset = Dataset.from_dict({"input_ids": tokens, "loss_mask": [[1] * len(t) for t in tokens]})
    request = FeatureRequest(layer_ids=layer_ids)
    meta = cache_meta(full.target_info(), request, torch.float32, len(tokens))
    hf, vl = FeatureCache(str(tmp_path / "hf"), meta), FeatureCache(str(tmp_path / "vllm"), meta)
    write_cache(full, dataset, hf, batch_size=1, pad_token_id=0, progress=False)
    head = head_target(path, torch.float32, "cpu")
    settings = load_recipe(TINY).features.vllm
    llm = LLM(**engine_kwargs(path, "float32", settings, device_type="cpu",
                              layer_ids=vllm_layer_ids(list(layer_ids), full.num_layers),
                              staging=str(tmp_path / "staging"), max_len=64))
    try:
        assert write_cache_vllm(head, llm, dataset, vl, progress=False) == 2
    finally:  # the next engine in this process builds its own parallel groups (an MoE target's expert group)
        from vllm.distributed import cleanup_dist_env_and_memory

        del llm
        cleanup_dist_env_and_memory()
    for index in range(len(tokens)):
        a, b = hf.read(index), vl.read(index)
        assert torch.equal(a["input_ids"], b["input_ids"])
        for key in [f"hidden.{i}" for i in layer_ids] + ["final_hidden"]:
            torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-4)  # fp32, other kernels' sum orders
