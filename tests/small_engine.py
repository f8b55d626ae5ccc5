"""The cheapest live `Engine` for tests that need one: one sliding-window layer with its MTP block, so both the
plain and the speculative (k=1) decode programs exist; compiled once per process (same static arguments)."""

from __future__ import annotations

import jax

import ds4jax
from ds4jax import Engine
from ds4jax.io.tokenizer import ByteTokenizer
from ds4jax.model import params as P
from ds4jax.model.config import AttentionType, MlpType
from ds4jax.model.handle import Model

MAX_CONTEXT = 64


def one_layer_model(seed: int = 3) -> Model:
    cfg = ds4jax.tiny(num_layers=1, attention_types=(AttentionType.SLIDING,), mlp_types=(MlpType.HASH,))
    return Model(cfg, jax.jit(P.init, static_argnums=0)(cfg, jax.random.key(seed)))  # one program, not per leaf


def small_engine(model: Model, logprobs: int = 0) -> Engine:
    """Four slots of MAX_CONTEXT tokens, speculative k=1, one prefill width and one row bucket."""
    return Engine(model, max_slots=4, max_context=MAX_CONTEXT, speculative=1, prefill_chunk=8,
                  row_buckets=(4,), steps_per_call=4, tokenizer=ByteTokenizer(), snapshot_bytes=0, logprobs=logprobs)


def build_small_engine(logprobs: int = 0, seed: int = 3) -> Engine:
    """`small_engine(one_layer_model(seed), logprobs)`, module-level so that an engine process can be given it
    (ds4jax/serving/engine_process.py pickles the builder)."""
    return small_engine(one_layer_model(seed), logprobs=logprobs)
