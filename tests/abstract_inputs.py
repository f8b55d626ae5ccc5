"""Abstract (shape-only) inputs of the engine's programs, for tests that trace or lower them without running them
(a helper module, not collected by pytest)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ds4jax.generation import loops

S = jax.ShapeDtypeStruct
I32 = jnp.int32


def rows(b: int) -> loops.Rows:
    """`loops.Rows` of `b` rows."""
    per_row = lambda dtype, *shape: S((b, *shape), dtype)  # noqa: E731
    return loops.Rows(slots=per_row(I32), active=per_row(jnp.bool_), cur=per_row(I32), n_out=per_row(I32),
                      max_new=per_row(I32), stop_ids=per_row(I32, loops.MAX_STOP_IDS),
                      temperature=per_row(jnp.float32), top_p=per_row(jnp.float32), top_k=per_row(I32),
                      key_data=per_row(jnp.uint32, 2), k_cap=per_row(I32), limit=per_row(I32),
                      forced=per_row(I32, loops.MAX_FORCED), n_forced=per_row(I32), wake=per_row(jnp.bool_))


def slot_state(cfg, slots: int, stream_dtype) -> loops.SlotState:
    """`loops.SlotState` of `slots` slots of model `cfg` (logits float32, streams in `stream_dtype`)."""
    v, stream = cfg.vocab_size, (cfg.hc_mult, cfg.hidden_size)
    return loops.SlotState(S((slots, v), jnp.float32), S((slots, *stream), stream_dtype),
                           S((slots, v), jnp.float32), S((slots, *stream), stream_dtype))
