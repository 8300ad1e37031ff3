"""The `speculators_config` section of a vLLM speculators config.json, written alike by every speculators export.

vLLM reads the verifier and the proposal length from it (`vllm serve DIR`); speculators' own loaders read it too.
"""

from __future__ import annotations

from typing import Any

from drafters.base import TargetInfo


def speculators_section(algorithm: str, target_info: TargetInfo, speculative_tokens: int) -> dict[str, Any]:
    """{"algorithm", "proposal_methods": [one greedy proposal of `speculative_tokens`], "default_proposal_method",
    "verifier": the target's name and architectures}."""
    proposal = {
        "proposal_type": "greedy",
        "speculative_tokens": speculative_tokens,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    return {
        "algorithm": algorithm,
        "proposal_methods": [proposal],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": target_info.name_or_path,
                     "architectures": list(target_info.config.get("architectures") or [])},
    }
