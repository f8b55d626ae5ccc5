"""Plain generation for a model placed on a layer split (`model.layout` with several stages): chunked prefill,
then one decode step per token through `MeshSteps`, one program per stage. `ds4jax.generate` routes here only
for layer splits; every other model, on one device or on a one-stage mesh, goes through `Engine`.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.generation.engine import default_page_size, pool_dtype
from ds4jax.generation.sampling import sample
from ds4jax.model.finite import nonfinite_error
from ds4jax.model.handle import Model
from ds4jax.runtime import steps
from ds4jax.runtime.executable_cache import cached_jit
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pools import PoolBook
from ds4jax.runtime.roles import Role


class Chunk(NamedTuple):
    tokens: np.ndarray  # [rows, chunk] int32 (zero padded)
    n: list[int]  # valid tokens per row
    start: list[int]  # first prompt position of each row's chunk
    finishing: list[int]  # rows whose prompt ends in this chunk


def prompt_chunks(prompts: Sequence[Sequence[int]], chunk: int) -> Iterator[Chunk]:
    """Split ragged prompts into aligned steps of `chunk` tokens per row (rows that are done get n = 0)."""
    pos = [0] * len(prompts)
    while any(p < len(q) for p, q in zip(pos, prompts)):
        n = [min(chunk, len(q) - p) for p, q in zip(pos, prompts)]
        tok = np.zeros((len(prompts), chunk), np.int32)
        for r, q in enumerate(prompts):
            tok[r, : n[r]] = q[pos[r] : pos[r] + n[r]]
        finishing = [r for r in range(len(prompts)) if n[r] and pos[r] + n[r] == len(prompts[r])]
        yield Chunk(tok, n, list(pos), finishing)
        pos = [p + k for p, k in zip(pos, n)]


def chunked_prefill(model: Model, pool, book: PoolBook, spec: PoolSpec, slots: Sequence[int],
                    prompts: Sequence[Sequence[int]], chunk: int):
    """Prefill every prompt in chunks of `chunk` tokens; returns (last-token logits [rows, v], pool).

    Only chunks in which some prompt ends project to the vocabulary."""
    last_logits = None
    for c in prompt_chunks(prompts, chunk):
        book.check_extend(slots, c.tokens, c.n)
        batch = steps.StepBatch(jnp.asarray(slots, jnp.int32), jnp.asarray(c.tokens), jnp.asarray(c.n, jnp.int32))
        out, pool = model.layout.steps(model.config).prefill(model.params, pool, batch, cfg=model.config, spec=spec,
                                                             need_logits=bool(c.finishing))
        book.commit(slots, c.n)
        if c.finishing:
            last_logits = keep_rows(last_logits, out.logits, c.finishing)
    return last_logits, pool


def keep_rows(kept: jax.Array | None, new: jax.Array, rows: Sequence[int]) -> jax.Array:
    """`new` on `rows`, `kept` elsewhere (one device op, whatever the number of rows)."""
    mask = np.zeros(new.shape[0], bool)
    mask[list(rows)] = True
    mask = jnp.asarray(mask).reshape((-1,) + (1,) * (new.ndim - 1))
    return new if kept is None else jnp.where(mask, new, kept)


def mesh_generate(model: Model, prompts: list[list[int]], params, *, prefill_chunk: int | None = None,
                  check_finite: bool = False, on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """`generate` for validated prompts on a model placed on a layer split (rows = slots, in order; with ``data``
    the number of prompts must divide evenly over it)."""
    cfg = model.config
    longest = max(len(p) for p in prompts)
    page = default_page_size(cfg)
    max_context = longest + params.max_new_tokens
    spec = PoolSpec.for_role(cfg, role=Role.TARGET, max_slots=len(prompts), max_context=max_context,
                             page_size=page, dtype=pool_dtype(model))
    run = model.layout.steps(cfg)
    book = run.book(spec, cfg.vocab_size)
    slots = [book.admit() for _ in prompts]
    for s, p in zip(slots, prompts):
        book.reserve(s, len(p) + params.max_new_tokens)
    pool = run.sync(book, run.zeros(spec), spec)
    logits, pool = chunked_prefill(model, pool, book, spec, slots, prompts, prefill_chunk or longest)

    rows = len(prompts)
    keys = jax.random.split(jax.random.key(params.seed), rows)
    temperature = jnp.full((rows,), min(params.temperature, float(np.finfo(np.float32).max)), jnp.float32)
    top_p = jnp.full((rows,), params.top_p, jnp.float32)
    stop = set(params.stop_ids)
    out: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(rows, bool)
    for step in range(params.max_new_tokens):
        token, finite = _sample_step(logits, keys, step, temperature, top_p)
        token = np.asarray(token)
        if check_finite and not bool(finite):
            bad = int(np.argmin(np.asarray(finite_rows(logits))))
            raise nonfinite_error(model, prompts[bad] + out[bad], where=f"prompt {bad}, generated token {step}")
        for r in range(rows):
            if not done[r]:
                out[r].append(int(token[r]))
                if on_token is not None:
                    on_token(r, int(token[r]))
                done[r] = int(token[r]) in stop or len(out[r]) >= params.max_new_tokens
        if done.all():
            break
        n = (~done).astype(np.int32)
        tok = np.where(done, 0, token)[:, None].astype(np.int32)
        book.check_extend(slots, tok, n)
        batch = steps.StepBatch(jnp.asarray(slots, jnp.int32), jnp.asarray(tok), jnp.asarray(n))
        res, pool = run.decode(model.params, pool, batch, cfg=cfg, spec=spec)
        book.commit(slots, n)
        logits = res.logits
    return out




@cached_jit
@jax.jit
def _sample_step(logits, keys, step, temperature, top_p):
    """One sampling step as one program (eagerly it is a dozen small ones, each compiled at startup).
    Also returns whether every logit is finite (the numerics guard's check costs no extra transfer)."""
    tokens = sample(logits, jax.vmap(lambda k: jax.random.fold_in(k, step))(keys), temperature, top_p)
    return tokens, jnp.isfinite(logits).all()


@jax.jit
def finite_rows(logits):
    return jnp.isfinite(logits).all(axis=-1)


