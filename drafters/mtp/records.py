"""The MTP checkpoint layouts: where each family's checkpoint keeps MTP module k's tensors and what it carries, one
record per layout (`RECORDS`), read and written by drafters/mtp/export.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

NATIVE_LAYOUTS = ("deepseek_v3", "qwen3_next", "qwen3_5", "mimo", "nemotron_h")
EXPORT_FORMATS = NATIVE_LAYOUTS + ("speculators",)
# Target model types whose checkpoints ship MTP weights in a known layout (a mismatch is an error).
FAMILY_LAYOUTS = {"deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v3", "glm4_moe": "deepseek_v3",
                  "qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5",
                  "qwen3_5_moe_text": "qwen3_5", "mimo": "mimo", "nemotron_h": "nemotron_h"}
_DEEPSEEK_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                   "final_norm.weight": "shared_head.norm.weight"}
_QWEN_NAMES = {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
               "eh_proj.weight": "fc.weight", "final_norm.weight": "norm.weight"}
_MIMO_NAMES = {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
               "eh_proj.weight": "input_proj.weight", "final_norm.weight": "final_layernorm.weight"}
# Nemotron-H numbers the blocks of its one MTP step mtp.layers.0 .. P-1: the fusion on the first, the end norm on the
# last ({last}: P - 1, from the target's mtp_layers_block_type), each block's own norm and mixer in its names.
_NEMOTRON_NAMES = {"enorm.weight": "layers.0.enorm.weight", "hnorm.weight": "layers.0.hnorm.weight",
                   "eh_proj.weight": "layers.0.eh_proj.weight",
                   "final_norm.weight": "layers.{last}.final_layernorm.weight"}
# DeepSeek-V3 stores the embedding and head again per module: their names -> the TargetInfo tensors they copy
SHARED_COPIES = {"embed_tokens.weight": "embed_weight", "shared_head.head.weight": "lm_head_weight"}
# Who reads each export layout: none of them has a draft-vocabulary head (d2t / t2d), so check_exportable refuses one.
DRAFT_VOCAB_READERS = {"speculators": "vLLM's speculators mtp reader (method mtp)",
                       "deepseek_v3": "the DeepSeek-V3 MTP loader of vLLM and SGLang (shared_head = the target's head)",
                       "qwen3_next": "vLLM's Qwen3-Next MTP loader", "qwen3_5": "vLLM's Qwen3.5 MTP loader",
                       "mimo": "vLLM's MiMo MTP loader", "nemotron_h": "vLLM's Nemotron-H MTP loader (NemotronHMTP)"}


@dataclass(frozen=True)
class CheckpointLayout:
    """Where one layout keeps MTP module k, and what it carries: the one record each layout is read and written by.

    fixed: our module-local name -> the layout's, under fixed_prefix; the block's tensors sit under block_prefix.
    Prefixes take {index}: k, or the decoder layer N + k when `after_decoder` (DeepSeek-V3 numbers its MTP modules
    after the target's layers). owned: the prefix of every MTP tensor name (after_decoder: layers numbered >= N).
    marker: the tensor-name pattern (group 1: the index) that marks the layout in a checkpoint, with `requires`
    present too, described in errors as `looked_for` (None: the layout is told apart by the target's family, or is
    not a checkpoint layout). shared_copies: each module stores the embedding and head again. one_module: it carries
    exactly one module. split_experts: a checkpoint stores MoE experts one tensor each. count_key: the config key
    counting the modules (in text_config when `count_in_text_config` and there is one)."""

    fixed: Mapping[str, str]
    fixed_prefix: str
    block_prefix: str
    owned: str = ""
    after_decoder: bool = False
    marker: str | None = None
    requires: str | None = None
    looked_for: str | None = None
    shared_copies: bool = False
    one_module: bool = False
    split_experts: bool = True
    count_key: str = "num_nextn_predict_layers"
    count_in_text_config: bool = False

    def prefixes(self, num_layers: int, k: int) -> tuple[str, str]:
        """(prefix of the fixed names, prefix of the block) of module k."""
        index = num_layers + k if self.after_decoder else k
        return self.fixed_prefix.format(index=index), self.block_prefix.format(index=index)

    def fixed_names(self, num_layers: int, k: int, num_blocks: int) -> dict[str, str]:
        """{our module-local name: the checkpoint's} of module k's fixed tensors (num_blocks: its step's blocks)."""
        prefix = self.prefixes(num_layers, k)[0]
        return {ours: prefix + theirs.format(last=max(num_blocks, 1) - 1) for ours, theirs in self.fixed.items()}

    def counted(self, config: dict) -> dict:
        """The dict of a config.json that holds `count_key` (its text_config when `count_in_text_config`)."""
        nested = config.get("text_config")
        return nested if self.count_in_text_config and isinstance(nested, dict) else config

    def owns(self, name: str, num_layers: int) -> bool:
        """True when tensor `name` of a checkpoint belongs to this layout's MTP modules."""
        if self.after_decoder:
            match = re.match(r"model\.layers\.(\d+)\.", name)
            return bool(match) and int(match.group(1)) >= num_layers
        return name.startswith(self.owned)


RECORDS = {
    "deepseek_v3": CheckpointLayout(_DEEPSEEK_NAMES, "model.layers.{index}.", "model.layers.{index}.",
                                    after_decoder=True, marker=r"model\.layers\.(\d+)\.eh_proj\.weight",
                                    looked_for="model.layers.{N+k}.eh_proj.weight", shared_copies=True),
    "qwen3_next": CheckpointLayout(_QWEN_NAMES, "mtp.", "mtp.layers.{index}.", owned="mtp.",
                                   marker=r"mtp\.layers\.(\d+)\.input_layernorm\.weight", requires="mtp.fc.weight",
                                   looked_for="mtp.fc.weight + mtp.layers.{k}.*", one_module=True),
    # Qwen3-Next's names and markers; the target's family tells the two apart
    "qwen3_5": CheckpointLayout(_QWEN_NAMES, "mtp.", "mtp.layers.{index}.", owned="mtp.", one_module=True,
                                count_key="mtp_num_hidden_layers", count_in_text_config=True),
    "mimo": CheckpointLayout(_MIMO_NAMES, "model.mtp_layers.{index}.", "model.mtp_layers.{index}.",
                             owned="model.mtp_layers.", marker=r"model\.mtp_layers\.(\d+)\.input_proj\.weight",
                             looked_for="model.mtp_layers.{k}.input_proj.weight"),
    "nemotron_h": CheckpointLayout(_NEMOTRON_NAMES, "mtp.", "mtp.layers.", owned="mtp.", one_module=True,
                                   marker=r"mtp\.layers\.(\d+)\.eh_proj\.weight",
                                   looked_for="mtp.layers.0.eh_proj.weight + mtp.layers.{j}.*"),
    "speculators": CheckpointLayout(_MIMO_NAMES, "mtp_layers.{index}.", "mtp_layers.{index}.", owned="mtp_layers.",
                                    one_module=True, split_experts=False),
}


# How vLLM (0.32: config/speculative.py, hf_config_override) picks its MTP model for `method: mtp` from the target's
# config: the model types, or first architectures, that route to each layout's MTP model. Any other config gets no MTP
# model, whatever tensors the checkpoint holds.
VLLM_ROUTES = {"deepseek_v3": ({"deepseek_v3", "deepseek_v32", "glm_moe_dsa"}, {"Glm4MoeForCausalLM"}),
               "qwen3_next": ({"qwen3_next"}, set()),
               "qwen3_5": ({"qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"}, set()),
               "mimo": (set(), {"MiMoForCausalLM"}),
               "nemotron_h": ({"nemotron_h"}, set())}
