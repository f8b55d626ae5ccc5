"""`generate` / `greedy_generate`: batch calls over a one-shot `Engine` (the one generation path).

The engine is sized from power-of-two buckets of the call (`buckets.one_shot`: prompt count, prompt length and
max_new_tokens; a fixed number of steps per host call), so a call whose arguments fall in the same buckets as an
earlier one compiles nothing (tests/test_generate_buckets.py counts). Bad arguments raise `PoolError` here
(these are the simple functional API); `Engine.generate` returns error results instead.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from typing import Callable

from ds4jax.errors import ArgumentError, DeviceMemoryError, RuntimeFailure
from ds4jax.generation import buckets, compile_ahead
from ds4jax.generation.engine import Engine, bucket, default_page_size, pool_dtype  # noqa: F401 (re-exported)
from ds4jax.generation.requests import ErrorCode, GenerateResult, Request, row_seed  # noqa: F401 (re-exported)
from ds4jax.model.finite import nonfinite_error
from ds4jax.model.handle import Model
from ds4jax.model.inputs import INT64_MAX, INT64_MIN, check_int, check_real, check_token_ids, is_int
from ds4jax.runtime import kv_quant
from ds4jax.runtime.pool_spec import most_drafts
from ds4jax.runtime.pools import PoolError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Validated at construction (`ArgumentError` naming the field): max_new_tokens >= 1, temperature finite and
    >= 0 (0 = greedy), top_p in (0, 1], seed a 64-bit integer, stop_ids non-negative integers, top_k >= 0."""

    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    top_k: int = 0  # 0 = off

    def __post_init__(self):
        check_sampling(self)
        check_int(self.top_k, "SamplingParams.top_k", low=0)
        # held as Python numbers: numpy's fixed-width arithmetic on a numpy field (np.uint64(2**64 - 1) passes the
        # checks) would wrap around where the context is checked
        for name, kind in (("max_new_tokens", int), ("seed", int), ("top_k", int), ("temperature", float),
                           ("top_p", float)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))


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
        if len(p) + int(max_new_tokens) > cfg.max_position_embeddings:
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


def run_batch(model: Model, prompts: list[list[int]], params: SamplingParams, *, k: int = 0,
              prefill_chunk: int | None = None, on_token: Callable[[int, int], None] | None = None,
              check_finite: bool = False, steps_per_call: int | None = None,
              kv_dtype: str = "auto", lookup: int | None = None) -> list[GenerateResult]:
    """Run validated prompts through a one-shot engine sized for them; raises PoolError on a rejected request,
    `RuntimeFailure` (`DeviceMemoryError`) when an engine step failed, and
    `NonFiniteError` (check_finite) naming the first layer when a token's logits were NaN/Inf."""
    data = 1 if model.layout is None else model.layout.axis_sizes["data"]
    shape = buckets.one_shot([len(p) for p in prompts], params.max_new_tokens, speculative=k, data=data,
                             max_position_embeddings=model.config.max_position_embeddings,
                             prefill_chunk=prefill_chunk, steps_per_call=steps_per_call,
                             most_drafts=most_drafts(model.config))
    engine = Engine(model, **shape, check_finite=check_finite, kv_dtype=kv_dtype, lookup=lookup)
    requests = [Request(prompt=p, max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                        top_p=params.top_p, top_k=params.top_k, seed=row_seed(params.seed, r),
                        stop_ids=tuple(params.stop_ids), speculative=k or None,  # k: the pools may take more
                        on_token=None if on_token is None else (lambda ev, r=r: on_token(r, ev.token) and None))
                for r, p in enumerate(prompts)]
    compile_ahead.start(engine, streaming=on_token is not None)  # decode programs compiling beside the prefill's
    results = engine.generate(requests)
    for r, res in enumerate(results):
        if check_finite and res.error is ErrorCode.NON_FINITE:  # name the first layer that produced them
            i = res.nonfinite_at
            raise nonfinite_error(model, prompts[r] + res.tokens[:i], where=f"prompt {r}, generated token {i}")
        if res.error is ErrorCode.INTERNAL:  # a failed step, not a bad request: a runtime failure (CLI exit 3)
            oom = "RESOURCE_EXHAUSTED" in res.message or "out of memory" in res.message.lower()
            raise (DeviceMemoryError if oom else RuntimeFailure)(res.message)
        if res.error is not None:
            raise PoolError(res.message)
    return results


def generate(model: Model, prompt_ids, params: SamplingParams = SamplingParams(), *,
             prefill_chunk: int | None = None, speculative: int = 0, check_finite: bool = False,
             on_token: Callable[[int, int], None] | None = None,
             steps_per_call: int | None = None, kv_dtype: str = "auto",
             lookup: int | None = None) -> list[list[int]]:
    """Generate for one prompt (list of ids) or several (list of lists, ragged). Returns new ids per prompt.

    Arguments are validated first (`ArgumentError` naming the prompt, position or field). `check_finite` raises
    `NonFiniteError` naming the first layer when logits turn NaN/Inf; `on_token(row, token)` sees every token as
    it is delivered.

    speculative=k > 0 drafts k tokens per round with the model's MTP block; greedy output is identical to plain
    decoding, sampled output follows the same distribution (not on a layer split: `ArgumentError`). With it,
    lookup=n > 0 also drafts from each greedy request's own tokens where its last >= n tokens occurred before
    (`Engine`'s `lookup`; None: its default, 3 with speculative decoding; 0: off).
    steps_per_call: decode steps per host round trip (default `buckets.ONE_SHOT_STEPS`); `on_token` sees a
    call's tokens when it returns, so a streaming caller asks for few (`ds4jax generate`: 1).
    kv_dtype: "auto" (the KV cache in the model's dtype) or "fp8" (`Engine`'s argument)."""
    cfg = model.config
    if not isinstance(params, SamplingParams):
        raise ArgumentError("must be a SamplingParams", name="params", value=params)
    prompts = check_prompts(prompt_ids, cfg, params.max_new_tokens)
    check_stop_ids(params.stop_ids, cfg.vocab_size)
    if prefill_chunk is not None:
        check_int(prefill_chunk, "prefill_chunk", low=1)
    k = check_int(speculative, "speculative", low=0)
    lookup = check_lookup(lookup, k)
    if k and not model.has_mtp:
        raise PoolError("speculative decoding needs the MTP block; this checkpoint has no mtp.* tensors")
    if steps_per_call is not None:
        check_int(steps_per_call, "steps_per_call", low=1)
    kv_quant.check_argument(kv_dtype)
    return [r.tokens for r in run_batch(model, prompts, params, k=k, prefill_chunk=prefill_chunk,
                                        on_token=on_token, check_finite=check_finite,
                                        steps_per_call=steps_per_call, kv_dtype=kv_dtype, lookup=lookup)]


def check_lookup(lookup, k: int) -> int | None:
    """`lookup` for a call with `k` drafts: None (the engine's default), 0..MAX_N, and > 0 only with k > 0
    (`ArgumentError` naming it)."""
    from ds4jax.generation.lookup import check_min_n

    if lookup is None:
        return None
    try:
        n = check_min_n(lookup)
    except ValueError as e:
        raise ArgumentError(str(e), name="lookup", value=lookup) from None
    if n and not k:
        raise ArgumentError("drafts inside speculative rounds: give speculative=k > 0 too", name="lookup", value=lookup)
    return n


def greedy_generate(model: Model, prompt_ids, max_new_tokens: int, *, prefill_chunk: int | None = None,
                    stop_ids: Sequence[int] = (), kv_dtype: str = "auto"):
    """Greedy generation over the pooled steps. One prompt -> list of ids; several prompts -> list of lists."""
    result = generate(model, prompt_ids, SamplingParams(max_new_tokens=max_new_tokens, stop_ids=tuple(stop_ids)),
                      prefill_chunk=prefill_chunk, kv_dtype=kv_dtype)
    single = isinstance(prompt_ids, (list, tuple)) and len(prompt_ids) and isinstance(prompt_ids[0], (int, np.integer))
    single = single or (isinstance(prompt_ids, (np.ndarray, jax.Array)) and np.ndim(prompt_ids) == 1)
    return result[0] if single else result
