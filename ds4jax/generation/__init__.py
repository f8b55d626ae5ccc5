"""Floor 3: generation loops, sampling and speculative decoding over the runtime steps."""
