"""Plain (non-speculative) generation over the pooled steps: chunked prefill, then one decode step per token.

This is the simple correct loop: host bookkeeping validates every step, the pool is donated through it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.runtime import steps
from ds4jax.runtime.executable_cache import cached_jit
from ds4jax.errors import ArgumentError
from ds4jax.model.finite import nonfinite_error
from ds4jax.model.handle import Model
from ds4jax.model.inputs import INT64_MAX, INT64_MIN, check_int, check_real, check_token_ids, is_int
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pools import PoolBook, PoolError, zeros
from ds4jax.runtime.roles import Role
from ds4jax.generation.sampling import sample


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Validated at construction (`ArgumentError` naming the field): max_new_tokens >= 1, temperature finite and
    >= 0 (0 = greedy), top_p in (0, 1], seed a 64-bit integer, stop_ids non-negative integers."""

    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        check_sampling(self)


def check_sampling(p, where: str = "SamplingParams") -> None:
    """Every sampling field of `p` (a SamplingParams or anything with the same attributes)."""
    check_int(p.max_new_tokens, f"{where}.max_new_tokens", low=1)
    if check_real(p.temperature, f"{where}.temperature") < 0:
        raise ArgumentError("must be >= 0 (0 is greedy)", name=f"{where}.temperature", value=p.temperature)
    if not 0 < check_real(p.top_p, f"{where}.top_p") <= 1:
        raise ArgumentError("must be in (0, 1]", name=f"{where}.top_p", value=p.top_p)
    check_int(p.seed, f"{where}.seed", low=INT64_MIN, high=INT64_MAX)
    if not isinstance(p.stop_ids, (tuple, list)):
        raise ArgumentError("must be a tuple of token ids", name=f"{where}.stop_ids", value=p.stop_ids)
    for i, t in enumerate(p.stop_ids):
        check_int(t, f"{where}.stop_ids[{i}]", low=0)


def check_stop_ids(stop_ids, vocab_size: int) -> None:
    for i, t in enumerate(stop_ids):
        if t >= vocab_size:
            raise ArgumentError(f"is outside the vocabulary [0, {vocab_size})", name=f"stop_ids[{i}]", value=t)


def check_prompts(prompt_ids, cfg, max_new_tokens: int) -> list[list[int]]:
    """Ragged prompts as lists of ints: each non-empty, every id in the vocabulary, prompt + max_new_tokens within
    max_position_embeddings."""
    if not isinstance(prompt_ids, (list, tuple, np.ndarray, jax.Array)):
        raise ArgumentError("must be a list of token ids or a list of such lists", name="prompt_ids",
                            value=type(prompt_ids).__name__)
    try:
        flat = isinstance(prompt_ids, (list, tuple)) and len(prompt_ids) and not isinstance(
            prompt_ids[0], (list, tuple, np.ndarray, jax.Array))
        prompts = [list(prompt_ids)] if flat else _as_prompts(prompt_ids)
    except (TypeError, ValueError, KeyError):
        raise ArgumentError("must be a list of token ids or a list of such lists", name="prompt_ids",
                            value=type(prompt_ids).__name__) from None
    if not prompts:
        raise ArgumentError("is empty: at least one prompt is needed", name="prompt_ids", value=prompt_ids)
    for r, p in enumerate(prompts):
        name = "prompt_ids" if len(prompts) == 1 else f"prompt_ids[{r}]"
        if not isinstance(p, (list, tuple)) or any(not is_int(t) for t in p):
            raise ArgumentError("must be a sequence of integer token ids", name=name, value=p)
        check_token_ids(np.asarray(p, np.int64), cfg.vocab_size, name)
        if len(p) + max_new_tokens > cfg.max_position_embeddings:
            raise ArgumentError(f"{len(p)} prompt tokens + max_new_tokens {max_new_tokens} exceed "
                                f"max_position_embeddings ({cfg.max_position_embeddings})", name=name, value=len(p))
    return [[int(t) for t in p] for p in prompts]


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
             prefill_chunk: int | None = None, speculative: int = 0, check_finite: bool = False,
             on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """Generate for one prompt (list of ids) or several (list of lists, ragged). Returns new ids per prompt.

    Arguments are validated first (`ArgumentError` naming the prompt, position or field). `check_finite` raises
    `NonFiniteError` naming the first layer when logits turn NaN/Inf; `on_token(row, token)` sees every token as
    it is sampled (plain decoding only).

    speculative=k > 0 drafts k tokens per round with the model's MTP block (`ds4jax.speculative`); greedy output
    is identical to plain decoding, sampled output follows the same distribution."""
    cfg = model.config
    if not isinstance(params, SamplingParams):
        raise ArgumentError("must be a SamplingParams", name="params", value=params)
    prompts = check_prompts(prompt_ids, cfg, params.max_new_tokens)
    check_stop_ids(params.stop_ids, cfg.vocab_size)
    if prefill_chunk is not None:
        check_int(prefill_chunk, "prefill_chunk", low=1)
    if check_int(speculative, "speculative", low=0):
        if model.layout is not None:
            raise ArgumentError("speculative decoding on a mesh is not implemented yet (the draft steps are "
                                "single-device); generate without speculative=", name="speculative", value=speculative)
        from ds4jax.generation.speculative import speculative_generate  # imports this module

        return speculative_generate(model, prompts, params, k=speculative, prefill_chunk=prefill_chunk).tokens
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


def greedy_generate(model: Model, prompt_ids, max_new_tokens: int, *, prefill_chunk: int | None = None,
                    stop_ids: Sequence[int] = ()):
    """Greedy generation over the pooled steps. One prompt -> list of ids; several prompts -> list of lists."""
    result = generate(model, prompt_ids, SamplingParams(max_new_tokens=max_new_tokens, stop_ids=tuple(stop_ids)),
                      prefill_chunk=prefill_chunk)
    single = isinstance(prompt_ids, (list, tuple)) and len(prompt_ids) and isinstance(prompt_ids[0], (int, np.integer))
    single = single or (isinstance(prompt_ids, (np.ndarray, jax.Array)) and np.ndim(prompt_ids) == 1)
    return result[0] if single else result
