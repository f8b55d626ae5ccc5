"""ds4jax: DeepSeek-V4 inference in JAX.

Dimension letters used in shape comments and einsums: b batch/request slot, t query tokens, s key rows,
h query heads, d head dim, r rotary dim, l q-LoRA rank, e embed, f expert ffw, x experts, m hyper-connection
streams, v vocab, g output groups, o output LoRA rank, c compressed entries, n top-k.
"""

from ds4jax import xla_flags as _xla_flags

_xla_flags.apply()  # before anything can start a JAX backend: DS4JAX_COMMAND_BUFFERS (docs/rocm.md)

from ds4jax.model.api import forward_logits  # noqa: E402
from ds4jax import errors
from ds4jax.errors import Ds4jaxError, InputError
from ds4jax.io.checkpoint import CheckpointError, load, save
from ds4jax.model.config import AttentionType, Config, ConfigError, MlpType, flash, flash_slice, from_hf_config, pro, tiny
from ds4jax.generation.generate import SamplingParams, generate, greedy_generate
from ds4jax.model.handle import Model
from ds4jax.runtime.pool_spec import PoolSpec, configure
from ds4jax.runtime.pools import KVPool, PoolBook, PoolError
from ds4jax.runtime.roles import Role
from ds4jax.generation.speculative import SpecResult, speculative_generate
from ds4jax.runtime.mesh import MeshError, MeshLayout, init_distributed, make_mesh, place_model
from ds4jax.io.default_model import default_model
from ds4jax.io.convert import convert

__all__ = [
    "AttentionType", "CheckpointError", "Ds4jaxError", "InputError", "errors", "Config", "ConfigError", "KVPool", "MlpType", "Model", "PoolBook",
    "PoolError", "PoolSpec", "Role", "SamplingParams", "SpecResult", "speculative_generate", "configure", "flash", "flash_slice", "forward_logits",
    "from_hf_config", "generate", "greedy_generate", "load", "pro", "save", "tiny",
    "MeshError", "MeshLayout", "init_distributed", "make_mesh", "place_model",
    "default_model", "convert",
]
