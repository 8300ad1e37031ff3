"""The target's features: the cache, vLLM extraction, streaming, where the target lives."""
