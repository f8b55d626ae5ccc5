"""`generate` / `greedy_generate`: batch calls over a one-shot `Engine` (the one generation path).

The engine is sized from the call (slots and context rounded up to powers of two, one prefill width, one
multi-step length), so calls of the same buckets share compiled programs. Bad arguments raise `PoolError` here
(these are the simple functional API); `Engine.generate` returns error results instead.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from ds4jax.generation.engine import Engine, bucket, default_page_size, pool_dtype  # noqa: F401 (re-exported)
from ds4jax.generation.requests import GenerateResult, Request
from ds4jax.model.handle import Model
from ds4jax.runtime.pools import PoolError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    top_k: int = 0  # 0 = off


def _as_prompts(prompt_ids) -> list[list[int]]:
    arr = prompt_ids
    if isinstance(arr, (np.ndarray, jax.Array)):
        arr = np.asarray(arr)
        return [arr.tolist()] if arr.ndim == 1 else [list(r) for r in arr.tolist()]
    if len(arr) and isinstance(arr[0], (int, np.integer)):
        return [list(arr)]
    return [list(p) for p in arr]


def row_seed(seed: int, row: int) -> int:
    """Independent per-row seed of a batch call (rows of one call never share a sample stream)."""
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, row]).generate_state(2, np.uint32).view(np.uint64)[0])


def run_batch(model: Model, prompt_ids, params: SamplingParams, *, k: int = 0, prefill_chunk: int | None = None
              ) -> list[GenerateResult]:
    """Run prompts through a one-shot engine sized for them; raises PoolError on the first failed request."""
    prompts = _as_prompts(prompt_ids)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise PoolError("every prompt needs at least one token")
    if params.max_new_tokens < 1:
        raise PoolError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    longest = max(len(p) for p in prompts)
    new_bucket = bucket(params.max_new_tokens)
    max_context = bucket(longest + new_bucket + (k + 1 if k else 0))
    slots = bucket(len(prompts))
    engine = Engine(model, max_slots=slots, max_context=max_context, speculative=k,
                    prefill_chunk=prefill_chunk or bucket(longest), chunk_buckets=(prefill_chunk or bucket(longest),),
                    row_buckets=(slots,), steps_per_call=new_bucket)
    requests = [Request(prompt=p, max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                        top_p=params.top_p, top_k=params.top_k, seed=row_seed(params.seed, r),
                        stop_ids=tuple(params.stop_ids)) for r, p in enumerate(prompts)]
    results = engine.generate(requests)
    for r in results:
        if r.error is not None:
            raise PoolError(r.message)
    return results


def generate(model: Model, prompt_ids, params: SamplingParams = SamplingParams(), *,
             prefill_chunk: int | None = None, speculative: int = 0) -> list[list[int]]:
    """Generate for one prompt (list of ids) or several (list of lists, ragged). Returns new ids per prompt.

    speculative=k > 0 drafts k tokens per round with the model's MTP block; greedy output is identical to plain
    decoding, sampled output follows the same distribution."""
    if speculative < 0:
        raise PoolError(f"k must be >= 1, got {speculative}")
    return [r.tokens for r in run_batch(model, prompt_ids, params, k=speculative, prefill_chunk=prefill_chunk)]


def greedy_generate(model: Model, prompt_ids, max_new_tokens: int, *, prefill_chunk: int | None = None,
                    stop_ids: Sequence[int] = ()):
    """Greedy generation over the pooled steps. One prompt -> list of ids; several prompts -> list of lists."""
    result = generate(model, prompt_ids, SamplingParams(max_new_tokens=max_new_tokens, stop_ids=tuple(stop_ids)),
                      prefill_chunk=prefill_chunk)
    single = isinstance(prompt_ids, (list, tuple)) and len(prompt_ids) and isinstance(prompt_ids[0], (int, np.integer))
    single = single or (isinstance(prompt_ids, (np.ndarray, jax.Array)) and np.ndim(prompt_ids) == 1)
    return result[0] if single else result
