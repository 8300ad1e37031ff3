"""Targets and draft models in the draftsmith cache: the converted SmolLM2 store and `resolve_target` (store.py), tiny
random debug targets (debug_target.py)."""

import os


def default_cache_dir() -> str:
    """$DRAFTSMITH_CACHE, else ~/.cache/draftsmith."""
    return os.environ.get("DRAFTSMITH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "draftsmith")
