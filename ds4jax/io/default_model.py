"""The embedded default model: what ``ds4jax generate`` runs when no ``--checkpoint`` is given.

A deterministic `tiny` architecture whose vocabulary fits `ByteTokenizer`, with seeded random weights. It
produces gibberish; it exists so the package runs end to end on any machine without a download. A small trained
checkpoint will replace it (same entry points: `default_model`, `default_tokenizer`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ds4jax.model import params as _params
from ds4jax.model.config import Config, tiny
from ds4jax.model.handle import Model
from ds4jax.io.tokenizer import ByteTokenizer
from ds4jax.runtime.executable_cache import cached_jit

SEED = 0


def default_config() -> Config:
    """`tiny()` with the byte tokenizer's vocabulary and special ids."""
    return tiny(vocab_size=ByteTokenizer.VOCAB_SIZE, bos_token_id=ByteTokenizer.BOS, eos_token_id=ByteTokenizer.EOS)


@cached_jit
@functools.partial(jax.jit, static_argnames="cfg")
def _init(key, *, cfg: Config):
    """One program for all leaves (drawn eagerly, each leaf compiles its own few programs at startup)."""
    return _params.init(cfg, key, jnp.float32)


@functools.lru_cache(maxsize=4)
def default_model(dtype: Any = jnp.float32) -> Model:
    """Weights are drawn once in float32 and cast, so every dtype holds the same model (up to rounding)."""
    cfg = default_config()
    weights = _init(jax.random.key(SEED), cfg=cfg)
    target = _params.abstract(cfg, dtype)  # per-leaf dtypes: norms/mHC/sinks stay float32, tid2eid int32
    return Model(config=cfg, params=jax.tree.map(lambda w, t: w.astype(t.dtype), weights, target))


def default_tokenizer() -> ByteTokenizer:
    return ByteTokenizer(note="embedded default model (tiny, random weights) with the byte-level tokenizer")
