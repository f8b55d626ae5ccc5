"""Token sampling: greedy, temperature, top-k and nucleus (top-p), with per-request keys; log-probabilities of the
emitted tokens (`token_logprobs`)."""

import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax import xla_flags


def filter_logits(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array | None = None
                  ) -> jax.Array:
    """Scaled, top-k and nucleus-filtered log-probabilities [..., v] (float32).

    temperature > 0, top_p in (0, 1], top_k >= 0 (0 = off); all broadcast against logits[..., 0]. When no row
    filters (top_p 1 and top_k 0 everywhere: plain temperature sampling, OpenAI's defaults) the vocabulary is not
    sorted at all (`cheaper_when`, where branching is free)."""
    # shifted by the max first (softmax does not change): a tiny temperature then sends the other tokens to -inf
    # instead of sending the top ones to +inf (inf - inf is NaN in log_softmax)
    logits = logits.astype(jnp.float32)
    scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature[..., None]
    top_k = None if top_k is None else jnp.broadcast_to(top_k, scaled.shape[:-1])

    def filtered():
        order = jnp.argsort(-scaled, axis=-1)
        sorted_scaled = jnp.take_along_axis(scaled, order, axis=-1)
        sorted_logp = jax.nn.log_softmax(sorted_scaled, axis=-1)
        before = jnp.cumsum(jnp.exp(sorted_logp), axis=-1) - jnp.exp(sorted_logp)  # mass strictly above each token
        rank = jnp.arange(scaled.shape[-1], dtype=jnp.int32)
        # the most likely token is always kept, also when a tiny top_p rounds to 0 in float32
        keep_sorted = (before < top_p[..., None]) | (top_p[..., None] >= 1.0) | (rank == 0)
        if top_k is not None:
            keep_sorted = keep_sorted & ((top_k[..., None] <= 0) | (rank < top_k[..., None]))
        # back to vocabulary order by a scatter through the permutation (a second argsort to invert it cost a whole
        # sort of the vocabulary per row again)
        keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1, inplace=False)
        return jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)

    unfiltered = jnp.all(jnp.broadcast_to(top_p, scaled.shape[:-1]) >= 1.0)
    if top_k is not None:
        unfiltered = unfiltered & jnp.all(top_k <= 0)
    return cheaper_when(unfiltered, lambda: jax.nn.log_softmax(scaled, axis=-1), filtered)


BRANCH_ENV = "DS4JAX_GREEDY_BRANCH"  # auto (default) | on | off: see `branch_on_greedy`


def branch_on_greedy(environ=os.environ) -> bool:
    """Whether programs traced now branch around the sampling machinery when no running row samples (`cheaper_when`).

    `filter_logits` sorts the vocabulary per row, and a draw derives a key and generates random bits over it: about
    a dozen kernels per sampled position, which a greedy batch (benchmarks, evaluations, most batch jobs) never
    needs, and a speculative round has 2k + 1 such positions. Skipping them takes a `lax.cond`, which is free where
    the branch is taken on the device (CPU: a host jump; CUDA with ds4jax's default command buffers, which record
    CONDITIONAL: `xla_flags.records_conditionals`), but costs XLA:GPU a host round trip elsewhere (the predicate
    copied back, the stream drained), more than the kernels it saves in a launch-bound loop: so not on ROCm, whose
    command buffers are off.
    ``DS4JAX_GREEDY_BRANCH=on|off`` decides instead. Read at trace time (the executable cache keys DS4JAX_*)."""
    chosen = environ.get(BRANCH_ENV, "auto").strip().lower()
    if chosen not in ("auto", "on", "off"):
        raise ValueError(f"{BRANCH_ENV}={chosen!r}: expected auto, on or off")
    if chosen != "auto":
        return chosen == "on"
    return jax.default_backend() == "cpu" or xla_flags.records_conditionals(environ.get("XLA_FLAGS", ""))


def none_sample(temperature: jax.Array, live: jax.Array | None = None) -> jax.Array:
    """[] bool: no row that runs (`live`, default every row) samples, so every token is an argmax."""
    greedy = temperature <= 0
    return jnp.all(greedy if live is None else greedy | ~live)


def cheaper_when(condition: jax.Array, cheap: Callable[[], Any], full: Callable[[], Any]) -> Any:
    """`full()`, or `cheap()` when `condition` holds and the programs branch (`branch_on_greedy`). `cheap()` must
    equal `full()` wherever `condition` holds (the argmax of an all-greedy batch; the unfiltered softmax when nothing
    is filtered); both return the same structure."""
    if not branch_on_greedy():
        return full()
    return jax.lax.cond(condition, cheap, full)


def sample(logits: jax.Array, keys: jax.Array | Callable[[], jax.Array], temperature: jax.Array, top_p: jax.Array,
           top_k: jax.Array | None = None, live: jax.Array | None = None) -> jax.Array:
    """logits [b, v], keys [b] (typed PRNG keys, or a function that derives them: called only when a row samples),
    temperature/top_p/top_k [b]; temperature 0 means greedy.

    `live` [b] (optional): the rows whose tokens are used; the others' (padding, finished) may be anything."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn():
        safe_t = jnp.where(temperature > 0, temperature, 1.0)
        logp = filter_logits(logits, safe_t, top_p, top_k)
        tok = jax.vmap(jax.random.categorical)(keys() if callable(keys) else keys, logp).astype(jnp.int32)
        return jnp.where(temperature > 0, tok, greedy)

    return cheaper_when(none_sample(temperature, live), lambda: greedy, drawn)


KEY_IMPL = "threefry2x32"  # the PRNG of every request's key data (`seed_key_data`), whatever JAX's default is


def seed_key_data(seed: int) -> np.ndarray:
    """Raw threefry key data [2] uint32 of `seed` (what jax.random.key(seed) holds), built on the host."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return np.asarray([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def token_keys(key_data: jax.Array, index: jax.Array) -> jax.Array:
    """Typed keys [b] for token `index[b]` of each request: draws depend on the request's seed and the index only."""
    base = jax.random.wrap_key_data(key_data, impl=KEY_IMPL)
    return jax.vmap(jax.random.fold_in)(base, index)


class TokenLogprobs(NamedTuple):
    """Log-probabilities of emitted tokens under the raw model distribution (log_softmax of the float32 logits,
    before temperature / top-p / top-k, as vLLM's default ``raw_logprobs``); shapes [...] and [..., n]."""
    token: jax.Array  # float32 the emitted token's log-probability
    top_ids: jax.Array  # int32 the n most likely ids, most likely first
    top: jax.Array  # float32 their log-probabilities


def token_logprobs(logits: jax.Array, tokens: jax.Array, n: int) -> TokenLogprobs:
    """logits [..., v], tokens [...] (any id in the vocabulary: sampled, greedy or forced) -> `TokenLogprobs`."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token = jnp.take_along_axis(logp, jnp.clip(tokens, 0, logp.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    top, top_ids = jax.lax.top_k(logp, n)
    return TokenLogprobs(token, top_ids.astype(jnp.int32), top)
