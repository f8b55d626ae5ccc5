"""Floor 1: the architecture (config, parameters, pure blocks, full-sequence forward); imports nothing of ours."""
