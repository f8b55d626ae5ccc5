"""Host side of the engine's log-probabilities: a call's `sampling.TokenLogprobs` buffers (fetched once per call)
become one `TokenLogprob` per delivered token, with only as many alternatives as the request asked for."""

from __future__ import annotations

from ds4jax.generation.requests import TokenLogprob
from ds4jax.generation.sampling import TokenLogprobs
from ds4jax.runtime.distributed import fetch as fetch_arrays  # device_get across processes


def fetch(lp: TokenLogprobs | None, requests) -> TokenLogprobs | None:
    """The buffers as numpy arrays, if any of the call's `requests` asked for logprobs (else None, as when
    logprobs are off: nothing is copied to the host). Every process asks the same (its requests are the same)."""
    if lp is None or all(r.logprobs is None for r in requests):
        return None
    return TokenLogprobs(*fetch_arrays(tuple(lp)))


def wanted(lp: TokenLogprobs | None, live) -> TokenLogprobs | None:
    """`lp` if a request of `live` asked for logprobs, else None: what a call's fetch takes along (device arrays)."""
    return None if lp is None or all(lv.request.logprobs is None for lv in live) else lp


def row(lp: TokenLogprobs | None, r: int, count: int, n: int | None) -> list[TokenLogprob] | None:
    """Row `r`'s first `count` tokens of a [B, W] call (`n` alternatives each; None: the request wants none)."""
    if lp is None or n is None:
        return None
    ids, top = lp.top_ids[r, :count, :n].tolist(), lp.top[r, :count, :n].tolist()
    return [TokenLogprob(t, tuple(zip(i, p))) for t, i, p in zip(lp.token[r, :count].tolist(), ids, top)]


def first(lp: TokenLogprobs | None, r: int, n: int | None) -> list[TokenLogprob] | None:
    """Row `r`'s first token of a [B] call (prefill, restore) as a one-token list."""
    if lp is None or n is None:
        return None
    return [TokenLogprob(float(lp.token[r]), tuple(zip(lp.top_ids[r, :n].tolist(), lp.top[r, :n].tolist())))]
