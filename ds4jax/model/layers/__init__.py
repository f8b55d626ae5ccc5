"""Pure building blocks of the DeepSeek-V4 forward pass (spec §3). Each function takes a params subtree."""
