"""ds4jax: DeepSeek-V4 inference in JAX.

Dimension letters used in shape comments and einsums: b batch/request slot, t query tokens, s key rows,
h query heads, d head dim, r rotary dim, l q-LoRA rank, e embed, f expert ffw, x experts, m hyper-connection
streams, v vocab, g output groups, o output LoRA rank, c compressed entries, n top-k.
"""

from ds4jax.config import AttentionType, Config, ConfigError, MlpType, flash, flash_slice, from_hf_config, pro, tiny
from ds4jax.roles import Role

__all__ = [
    "AttentionType", "Config", "ConfigError", "MlpType", "Role",
    "flash", "flash_slice", "from_hf_config", "pro", "tiny",
]
