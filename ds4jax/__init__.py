"""ds4jax: DeepSeek-V4 inference in JAX.

Dimension letters used in shape comments and einsums: b batch/request slot, t query tokens, s key rows,
h query heads, d head dim, r rotary dim, l q-LoRA rank, e embed, f expert ffw, x experts, m hyper-connection
streams, v vocab, g output groups, o output LoRA rank, c compressed entries, n top-k.

The public names below load on first use (PEP 562), so ``import ds4jax`` (and ``ds4jax --version`` /
``--help``) does not import JAX; the first access to a public name or a subpackage imports the whole API, as an
eager import did; a single-file module (``ds4jax.errors``, ``ds4jax.compilation_cache``) imports alone.
"""

import importlib
import os

from ds4jax import xla_flags as _xla_flags

_xla_flags.apply()  # before anything can start a JAX backend: DS4JAX_COMMAND_BUFFERS (docs/rocm.md)

# public name -> the module that defines it, in the order the eager imports ran
_EXPORTS = {
    "forward_logits": "ds4jax.model.api",
    "errors": "ds4jax", "Ds4jaxError": "ds4jax.errors", "InputError": "ds4jax.errors",
    "CheckpointError": "ds4jax.io.checkpoint", "load": "ds4jax.io.checkpoint", "save": "ds4jax.io.checkpoint",
    **dict.fromkeys(("AttentionType", "Config", "ConfigError", "MlpType", "flash", "flash_slice", "from_hf_config",
                     "pro", "tiny"), "ds4jax.model.config"),
    **dict.fromkeys(("SamplingParams", "generate", "greedy_generate"), "ds4jax.generation.generate"),
    "Model": "ds4jax.model.handle",
    "PoolSpec": "ds4jax.runtime.pool_spec", "configure": "ds4jax.runtime.pool_spec",
    "KVPool": "ds4jax.runtime.pools", "PoolBook": "ds4jax.runtime.pools", "PoolError": "ds4jax.runtime.pools",
    "Role": "ds4jax.runtime.roles",
    "SpecResult": "ds4jax.generation.speculative", "speculative_generate": "ds4jax.generation.speculative",
    "Engine": "ds4jax.generation.engine", "EngineStats": "ds4jax.generation.engine",
    **dict.fromkeys(("Budget", "ErrorCode", "FinishReason", "GenerateResult", "Request", "TokenEvent",
                     "TokenLogprob"),
                    "ds4jax.generation.requests"),
    **dict.fromkeys(("MeshError", "MeshLayout", "init_distributed", "make_mesh", "place_model"), "ds4jax.runtime.mesh"),
    "default_model": "ds4jax.io.default_model",
    "convert": "ds4jax.io.convert",
}
__all__ = sorted(_EXPORTS)


def _load_all() -> None:
    """Bind every public name, importing what the eager ``__init__`` imported (and so every subpackage that
    code reaching for ``ds4jax.model.config`` and the like after a bare ``import ds4jax`` expects)."""
    for name, module in _EXPORTS.items():
        if name not in globals():
            module = importlib.import_module(f"ds4jax.{name}" if module == "ds4jax" else module)
            globals()[name] = module if module.__name__ == f"ds4jax.{name}" else getattr(module, name)


def _plain_module(name: str) -> bool:
    """Whether ``ds4jax.<name>`` is a single-file module (not a subpackage, not a public name of another module)."""
    return _EXPORTS.get(name, "ds4jax") == "ds4jax" and os.path.isfile(os.path.join(__path__[0], f"{name}.py"))


def __getattr__(name: str):
    if name.startswith("__"):  # dunders (__path__ probes, copy/pickle hooks) never trigger the import
        raise AttributeError(name)
    if _plain_module(name):
        # a single-file module (ds4jax.errors, ds4jax.compilation_cache, ds4jax.cli, ...) imports alone: the import
        # system probes this hook before it imports a submodule (``from ds4jax import compilation_cache``), which
        # would otherwise pull the whole API into the CLI's start-up (seconds: docs/benchmarks/cli_startup.md)
        return importlib.import_module(f"ds4jax.{name}")
    _load_all()
    if name in globals():
        return globals()[name]
    try:  # a submodule not among the exports (ds4jax.cli, ds4jax.batch, ...)
        return importlib.import_module(f"ds4jax.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"ds4jax.{name}":
            raise
        raise AttributeError(f"module 'ds4jax' has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
