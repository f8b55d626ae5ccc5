"""The default model: what ``ds4jax generate`` runs when no ``--checkpoint`` is given.

A small DeepSeek-V4 trained on the Python 3.11 standard library's sources (PSF License) by
``scripts/train_default.py``, shipped in ``checkpoints/default`` (packed params, `ds4jax.io.packed_params`: one read
and one transfer; config.json, a byte-level BPE ``tokenizer.json``, the training report). ``DS4JAX_DEFAULT_CHECKPOINT`` points the default elsewhere.

The seeded random tiny model of earlier versions stays available for tests and experiments that need no files:
`random_model` / `random_tokenizer` (a `tiny` config with the byte-level tokenizer's vocabulary).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp

from ds4jax.compilation_cache import ensure_compilation_cache
from ds4jax.io.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from ds4jax.model import params as _params
from ds4jax.model.config import Config, load_config, tiny
from ds4jax.model.handle import Model
from ds4jax.runtime.executable_cache import cached_jit

SEED = 0
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "checkpoints", "default")


def default_checkpoint() -> str:
    """Directory of the default checkpoint (``DS4JAX_DEFAULT_CHECKPOINT`` or the repository's shipped one)."""
    path = os.environ.get("DS4JAX_DEFAULT_CHECKPOINT") or SHIPPED
    if not os.path.exists(os.path.join(path, "config.json")):
        from ds4jax.io.checkpoint import CheckpointError

        raise CheckpointError(f"the default checkpoint is not at {path} (it ships in the repository's "
                              "checkpoints/default; install with `pip install -e .` from a clone, or set "
                              "DS4JAX_DEFAULT_CHECKPOINT)")
    return path


def default_config() -> Config:
    return load_config(default_checkpoint())


@functools.lru_cache(maxsize=4)
def _load(path: str, dtype: Any) -> Model:
    from ds4jax.io.checkpoint import load

    return load(path, dtype=dtype)


def default_model(dtype: Any = jnp.float32, numerics: str = "reference") -> Model:
    """The trained default model. Weights are stored in bfloat16; the default compute dtype is float32 (faster on
    CPU, where bfloat16 matmuls are emulated). `numerics`: as `ds4jax.load`'s."""
    model = _load(default_checkpoint(), jnp.dtype(dtype))
    return model if numerics == "reference" else model.with_numerics(numerics)


def default_tokenizer() -> Tokenizer:
    path = default_checkpoint()
    tok = load_tokenizer(path)
    tok.note = f"default model {path} (DeepSeek-V4, 7M parameters, trained on the Python 3.11 standard library)"
    return tok


# ---- the seeded random tiny model (tests) ----------------------------------------------------------------------

def random_config() -> Config:
    """`tiny()` with the byte tokenizer's vocabulary and special ids."""
    return tiny(vocab_size=ByteTokenizer.VOCAB_SIZE, bos_token_id=ByteTokenizer.BOS, eos_token_id=ByteTokenizer.EOS)


@cached_jit
@functools.partial(jax.jit, static_argnames="cfg")
def _init(key, *, cfg: Config):
    """One program for all leaves (drawn eagerly, each leaf compiles its own few programs at startup)."""
    return _params.init(cfg, key, jnp.float32)


@functools.lru_cache(maxsize=4)
def random_model(dtype: Any = jnp.float32) -> Model:
    """Weights are drawn once in float32 and cast, so every dtype holds the same model (up to rounding)."""
    ensure_compilation_cache()  # (ds4jax.compilation_cache)
    cfg = random_config()
    weights = _init(jax.random.key(SEED), cfg=cfg)
    target = _params.abstract(cfg, dtype)  # per-leaf dtypes: norms/mHC/sinks stay float32, tid2eid int32
    return Model(config=cfg, params=jax.tree.map(lambda w, t: w.astype(t.dtype), weights, target))


def random_tokenizer() -> ByteTokenizer:
    return ByteTokenizer(note="tiny model with seeded random weights and the byte-level tokenizer")
