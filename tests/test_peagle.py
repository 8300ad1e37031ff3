"""P-EAGLE (drafters/peagle/): a proposal of any length is one forward of the draft layers; its speculators export
carries what vLLM needs (mask_token_id, mask_hidden) and reads back as the same drafter, ids listed in any order; what
it cannot read, and what vLLM would refuse, is one line or a failed doctor row. The contract (tests/test_contract.py)
covers its training forward against its proposals, losslessness, sampling law and trees; vLLM serving the export is
tests/test_serve_check.py (vLLM environment)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_contract import NUM_DRAFTS, build, tiny_target

from drafters import load_drafter
from drafters.peagle import PEagleConfig, PEagleDrafter
from drafters.peagle.export import export_checks
from inference.engine.api import speculative_generate


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=300, dtype=torch.float32)  # a loaded drafter's dtype: logits compare exactly


def drafts(drafter, target, k: int, prompt=(5, 17, 33, 9, 120, 41, 7)) -> torch.Tensor:
    """The drafter's proposal of k after the engine's prefill of one prompt (its begin): log-probabilities [1, k, V]."""
    speculative_generate(target, drafter, [list(prompt)], num_draft_tokens=1, max_new_tokens=1)
    return drafter.propose(k).log_probs


def test_a_proposal_of_any_length_is_one_forward_of_the_draft_layers(target):
    """EAGLE-3 runs its layers once per draft after the first; P-EAGLE once for all of them."""
    for kind, forwards in (("eagle3", lambda k: k - 1), ("peagle", lambda k: 1 if k > 1 else 0)):
        drafter = build(kind, target)
        calls = []
        drafter.layers[0].self_attn.q_proj.register_forward_hook(lambda module, args, out: calls.append(1))
        speculative_generate(target, drafter, [[5, 17, 33, 9]], num_draft_tokens=1, max_new_tokens=1)
        for k in (1, 2, NUM_DRAFTS, 6):
            calls.clear()
            assert drafter.propose(k).tokens.shape == (1, k)
            assert len(calls) == forwards(k), (kind, k)


def test_the_export_carries_what_vllm_reads_and_reads_back_as_the_same_drafter(target, tmp_path):
    drafter = build("peagle", target)
    drafter.save(str(tmp_path / "e"), "speculators")
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" == config["speculators_config"]["algorithm"]
    assert config["mask_token_id"] == drafter.mask_token_id and config["norm_before_residual"] is False
    weights = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert weights["mask_hidden"].shape == (1, 3 * target.target_info().hidden_size)
    loaded = load_drafter(str(tmp_path / "e"), target.target_info()).eval()
    assert loaded.kind == "peagle" and loaded.mask_token_id == drafter.mask_token_id
    assert torch.equal(drafts(loaded, target, NUM_DRAFTS), drafts(drafter, target, NUM_DRAFTS))
    assert all(row.status == "pass" for row in export_checks(str(tmp_path / "e"), target.target_info()))


def test_ids_listed_out_of_order_move_mask_hidden_with_fcs_columns(target, tmp_path):
    """A file listing the ids last-first, fc's and mask_hidden's blocks permuted alike, is the same drafter."""
    drafter = build("peagle", target)
    drafter.save(str(tmp_path / "e"), "speculators")
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"][::-1]
    (tmp_path / "e" / "config.json").write_text(json.dumps(config))
    weights = load_file(str(tmp_path / "e" / "model.safetensors"))
    for name in ("fc.weight", "mask_hidden"):
        weights[name] = torch.cat(weights[name].chunk(3, dim=1)[::-1], dim=1).contiguous()
    save_file(weights, str(tmp_path / "e" / "model.safetensors"))
    loaded = load_drafter(str(tmp_path / "e"), target.target_info()).eval()
    assert torch.equal(drafts(loaded, target, NUM_DRAFTS), drafts(drafter, target, NUM_DRAFTS))


@pytest.mark.parametrize("damage,row,reason", [
    ("no_mask_hidden", "parallel drafting", "mask_hidden not found in weights"),
    ("no_mask_token", "parallel drafting", "no mask_token_id"),
    ("short_mask_hidden", "parallel drafting", "fc reads 3 features"),
])
def test_what_vllm_would_refuse_fails_its_row_and_our_reader_in_one_line(target, tmp_path, damage, row, reason):
    build("peagle", target).save(str(tmp_path / "e"), "speculators")
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    weights = load_file(str(tmp_path / "e" / "model.safetensors"))
    if damage == "no_mask_hidden":
        del weights["mask_hidden"]
    elif damage == "short_mask_hidden":
        weights["mask_hidden"] = weights["mask_hidden"][:, :-1].contiguous()
    else:
        del config["mask_token_id"]
    (tmp_path / "e" / "config.json").write_text(json.dumps(config))
    save_file(weights, str(tmp_path / "e" / "model.safetensors"))
    rows = {check.name: check for check in export_checks(str(tmp_path / "e"), target.target_info())}
    assert rows[row].status == "fail" and reason in rows[row].detail
    assert rows["reader draftsmith"].status == "fail"
    with pytest.raises(ValueError, match=reason.split(" (")[0]) as err:
        load_drafter(str(tmp_path / "e"), target.target_info())
    assert "\n" not in str(err.value)


def test_a_mask_row_outside_the_vocabulary_or_used_for_text_is_one_line():
    info = tiny_target().target_info()
    with pytest.raises(ValueError, match=r"^drafter.mask_token_id 5000 is outside the target vocabulary"):
        PEagleDrafter(PEagleConfig(layer_ids=(1, 2, 4), draft_vocab_size=64, mask_token_id=5000), info)


def test_read_as_eagle3_the_same_weights_draft_the_first_token_alike_and_the_rest_otherwise(target):
    """What a server running the file as plain EAGLE-3 (vLLM without parallel_drafting) would draft: depth 0 is the
    same computation, the later depths are not (they read drafted tokens instead of the placeholders)."""
    parallel = build("peagle", target)
    chain = build("eagle3", target)
    state = {name: tensor for name, tensor in parallel.state_dict().items() if name != "mask_hidden"}
    chain.load_state_dict(state, strict=True)
    ours, theirs = drafts(parallel, target, NUM_DRAFTS), drafts(chain, target, NUM_DRAFTS)
    assert torch.equal(ours[:, 0], theirs[:, 0])
    assert not torch.allclose(ours[:, 1:], theirs[:, 1:])
