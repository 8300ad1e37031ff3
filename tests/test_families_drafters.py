"""Every registered drafter kind through the engine on every family of tests/test_families.py: untrained, randomly
initialised drafters (the contract test's kinds, with each family's auto layer ids and default KV layers), greedy at
batch 3, chain and tree; output == plain greedy. Whether a kind is trained, exported and served on a family is the
trainer's side (docs/support.md)."""

from __future__ import annotations

import pytest
import torch
from test_families import EVERY_TEST, draft_model, family_target, plain_greedy, prompts

from drafters.assistant import AssistantConfig, AssistantDrafter
from drafters.dflash import DFlashConfig, DFlashDrafter
from drafters.dspark import DSparkConfig, DSparkDrafter
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.medusa import MedusaConfig, MedusaDrafter
from drafters.mtp import MTPConfig, MTPDrafter
from drafters.ngram import NgramConfig, NgramDrafter
from inference.engine.api import speculative_generate, tree_speculative_generate

MAX_NEW = 12
FACTORIES = {  # (target info, its number of layers) -> drafter; ids and widths every debug family has (Qwen3.5-MoE
    # has no dense intermediate_size to copy)
    "assistant": lambda info, n: AssistantDrafter(AssistantConfig(num_layers=2, kv_layers=KV_LAYERS.get(
        info.config["model_type"], (1, n - 1))), info),
    "dflash": lambda info, n: DFlashDrafter(DFlashConfig(layer_ids="auto", num_layers=1, block_size=3,
                                                         intermediate_size=128, mask_token_id=info.vocab_size - 1),
                                            info),
    "dspark": lambda info, n: DSparkDrafter(DSparkConfig(layer_ids="auto", num_layers=1, block_size=2,
                                                         intermediate_size=128, markov_rank=8,
                                                         mask_token_id=info.vocab_size - 1), info),
    "eagle3": lambda info, n: Eagle3Drafter(Eagle3Config(layer_ids="auto", num_layers=1, intermediate_size=128,
                                                         draft_vocab_size=info.vocab_size,
                                                         init_head_from_target=False), info),
    "medusa": lambda info, n: MedusaDrafter(MedusaConfig(num_heads=2), info),
    "mtp": lambda info, n: MTPDrafter(MTPConfig(num_modules=1, reuse=True), info),
    "ngram": lambda info, n: NgramDrafter(NgramConfig(), info),
}
KV_LAYERS = {"gemma4_text": (),  # Gemma 4 layers: the default mapping (last sliding, last global layer)
             "nemotron_h": (2, 5), "zamba2": (1, 1)}  # their attention layers
# Cells that are refused when the drafter is built, with the one-line reason (docs/support.md says why).
REFUSED = {
    ("tiny-deepseek-v3", "assistant"): "MLA cache",  # compressed K/V with decoupled RoPE keys
    ("tiny-deepseek-v3.2", "assistant"): "MLA cache",  # MLA as well, whose keys an indexer selects
    ("tiny-glm-5", "assistant"): "MLA cache",
    ("tiny-jamba", "mtp"): "which the MTP block is built from",  # no rotary embedding class (no positions)
    ("tiny-zamba2", "mtp"): "which the MTP block is built from",  # its first decoder layer class is Mamba's
    ("tiny-falcon-h1", "mtp"): "an MTP block cannot be a full-attention layer",  # every layer holds a Mamba mixer
    ("tiny-zamba2", "assistant"): "caches 2 KV heads of dim 32",  # its shared attention reads [hidden, embeddings]
}


def build(kind: str, name: str):
    target = family_target(name)
    info = target.target_info()
    if kind == "draft_model":
        return target, draft_model(target, name)
    torch.manual_seed(1)
    drafter = FACTORIES[kind](info, target.num_layers).to(torch.float64)
    with torch.no_grad():  # off any zero or identity start
        for parameter in drafter.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    return target, drafter.eval()


def assert_refused(name: str, kind: str) -> None:
    """The cell is refused in one line (REFUSED's words), when the drafter is built or at the generation's start."""
    with pytest.raises(ValueError, match=REFUSED[name, kind]):
        target, drafter = build(kind, name)
        speculative_generate(target, drafter, prompts(), num_draft_tokens=2, max_new_tokens=2)


@pytest.mark.parametrize("kind", sorted(FACTORIES) + ["draft_model"])
@pytest.mark.parametrize("name", EVERY_TEST)
def test_every_kind_is_lossless_on_every_family(name, kind):
    """Every family but those whose machinery another runs (test_families.SAME_MACHINERY: their refusals alone)."""
    if (name, kind) in REFUSED:
        assert_refused(name, kind)
        return
    target, drafter = build(kind, name)
    plain = [tokens[:MAX_NEW] for tokens in plain_greedy(name)]
    chain = speculative_generate(target, drafter, prompts(), num_draft_tokens=2, max_new_tokens=MAX_NEW,
                                 eos_token_ids=[])
    assert chain.tokens == plain
    tree = tree_speculative_generate(target, drafter, prompts(), tree_budget=4, max_new_tokens=MAX_NEW,
                                     eos_token_ids=[])
    assert tree.tokens == plain


@pytest.mark.parametrize("name,kind", [cell for cell in REFUSED if cell[0] not in EVERY_TEST])
def test_the_other_families_refuse_their_cells_in_one_line(name, kind):
    assert_refused(name, kind)
