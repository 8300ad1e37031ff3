"""Drafter registry: one explicit dict, kind name -> class (STYLE.md, Registry)."""

from drafters.base import DraftContext, Drafter, DraftOutput, Proposal, TargetInfo

DRAFTERS: dict[str, type[Drafter]] = {}

__all__ = ["DRAFTERS", "DraftContext", "DraftOutput", "Drafter", "Proposal", "TargetInfo"]
