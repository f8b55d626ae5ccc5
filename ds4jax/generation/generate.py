"""Plain (non-speculative) generation over the pooled steps: chunked prefill, then one decode step per token.

This is the simple correct loop: host bookkeeping validates every step, the pool is donated through it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.runtime import steps
from ds4jax.model.handle import Model
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pools import PoolBook, PoolError, zeros
from ds4jax.runtime.roles import Role
from ds4jax.generation.sampling import sample


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()


def _as_prompts(prompt_ids) -> list[list[int]]:
    arr = prompt_ids
    if isinstance(arr, (np.ndarray, jax.Array)):
        arr = np.asarray(arr)
        return [arr.tolist()] if arr.ndim == 1 else [list(r) for r in arr.tolist()]
    if len(arr) and isinstance(arr[0], (int, np.integer)):
        return [list(arr)]
    return [list(p) for p in arr]


def default_page_size(cfg) -> int:
    """The peers' 256-token page, or the smallest multiple of both compression ratios above it."""
    step = math.lcm(cfg.csa_ratio, cfg.hca_ratio)
    return -(-256 // step) * step


def pool_dtype(model: Model) -> str:
    return jnp.dtype(model.params["embed"].dtype).name


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
        out, pool = runner(model).prefill(model.params, pool, batch, cfg=model.config, spec=spec,
                                          need_logits=bool(c.finishing))
        book.commit(slots, c.n)
        if c.finishing:
            last_logits = keep_rows(last_logits, out.logits, c.finishing)
    return last_logits, pool


def runner(model: Model):
    """The pooled steps: `ds4jax.runtime.steps`, or their mesh twin when the model is placed on a mesh."""
    return steps if model.layout is None else model.layout.steps(model.config)


def keep_rows(kept: jax.Array | None, new: jax.Array, rows: Sequence[int]) -> jax.Array:
    """`new` on `rows`, `kept` elsewhere (one device op, whatever the number of rows)."""
    mask = np.zeros(new.shape[0], bool)
    mask[list(rows)] = True
    mask = jnp.asarray(mask).reshape((-1,) + (1,) * (new.ndim - 1))
    return new if kept is None else jnp.where(mask, new, kept)


def generate(model: Model, prompt_ids, params: SamplingParams = SamplingParams(), *,
             prefill_chunk: int | None = None, speculative: int = 0) -> list[list[int]]:
    """Generate for one prompt (list of ids) or several (list of lists, ragged). Returns new ids per prompt.

    speculative=k > 0 drafts k tokens per round with the model's MTP block (`ds4jax.speculative`); greedy output
    is identical to plain decoding, sampled output follows the same distribution."""
    if speculative:
        if model.layout is not None:
            from ds4jax.errors import ArgumentError

            raise ArgumentError("speculative decoding on a mesh is not implemented yet (the draft steps are "
                                "single-device); generate without speculative=", name="speculative", value=speculative)
        from ds4jax.generation.speculative import speculative_generate  # imports this module

        return speculative_generate(model, prompt_ids, params, k=speculative, prefill_chunk=prefill_chunk).tokens
    cfg = model.config
    prompts = _as_prompts(prompt_ids)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise PoolError("every prompt needs at least one token")
    if params.max_new_tokens < 1:
        raise PoolError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    longest = max(len(p) for p in prompts)
    page = default_page_size(cfg)
    max_context = longest + params.max_new_tokens
    spec = PoolSpec.for_role(cfg, role=Role.TARGET, max_slots=len(prompts), max_context=max_context,
                             page_size=page, dtype=pool_dtype(model))
    run = runner(model)
    book = run.book(spec, cfg.vocab_size) if model.layout is not None else PoolBook(spec, cfg.vocab_size)
    slots = [book.admit() for _ in prompts]
    for s, p in zip(slots, prompts):
        book.reserve(s, len(p) + params.max_new_tokens)
    pool = book.sync(zeros(spec)) if model.layout is None else run.sync(book, run.zeros(spec), spec)
    logits, pool = chunked_prefill(model, pool, book, spec, slots, prompts, prefill_chunk or longest)

    rows = len(prompts)
    keys = jax.random.split(jax.random.key(params.seed), rows)
    temperature = jnp.full((rows,), params.temperature, jnp.float32)
    top_p = jnp.full((rows,), params.top_p, jnp.float32)
    stop = set(params.stop_ids)
    out: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(rows, bool)
    for step in range(params.max_new_tokens):
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
        token = np.asarray(sample(logits, step_keys, temperature, top_p))
        for r in range(rows):
            if not done[r]:
                out[r].append(int(token[r]))
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


def greedy_generate(model: Model, prompt_ids, max_new_tokens: int, *, prefill_chunk: int | None = None,
                    stop_ids: Sequence[int] = ()):
    """Greedy generation over the pooled steps. One prompt -> list of ids; several prompts -> list of lists."""
    result = generate(model, prompt_ids, SamplingParams(max_new_tokens=max_new_tokens, stop_ids=tuple(stop_ids)),
                      prefill_chunk=prefill_chunk)
    single = isinstance(prompt_ids, (list, tuple)) and len(prompt_ids) and isinstance(prompt_ids[0], (int, np.integer))
    single = single or (isinstance(prompt_ids, (np.ndarray, jax.Array)) and np.ndim(prompt_ids) == 1)
    return result[0] if single else result
