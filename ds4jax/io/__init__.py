"""Floor 2: reading and writing checkpoints, tokenizers, the embedded default model."""
