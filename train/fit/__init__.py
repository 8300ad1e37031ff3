"""The training loop and what it writes: optimizer, metrics, checkpoints."""
