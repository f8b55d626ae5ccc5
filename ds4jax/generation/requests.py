"""What a caller hands the engine (`Request`) and what it gets back (`GenerateResult`, `TokenEvent`, `ErrorCode`).

A result is born failed (``finish_reason="error"``, ``ErrorCode.INTERNAL``, "not completed") and only the engine
marks it complete, so a result that escapes an unexpected path can never pass for a finished one.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Sequence

import numpy as np

# Here rather than in the JAX modules that use them, so that `ds4jax serve`'s HTTP front end (another process than
# the engine's with --engine-process) checks requests without importing JAX.
MAX_FORCED = 8  # most tokens the host can force into a row at once (a thinking budget's close ids)


def row_seed(seed: int, row: int) -> int:
    """Independent per-row seed of a batch call (rows of one call never share a sample stream)."""
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, row]).generate_state(2, np.uint32).view(np.uint64)[0]
    return int(state) & 0x7FFFFFFFFFFFFFFF  # a non-negative int64 (Request.seed's range)


class ErrorCode(str, enum.Enum):
    """Why a request failed. The value is the stable string written to batch outputs."""

    INVALID_REQUEST = "invalid_request"  # malformed: empty prompt, id outside the vocabulary, bad sampling values
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt + max_new_tokens (+ speculative window) exceed max_context
    CAPACITY_EXCEEDED = "capacity_exceeded"  # the queue is full, or the request needs more pages than exist
    CANCELLED = "cancelled"  # on_token / on_tokens returned False or raised
    INTERNAL = "internal"  # an engine step failed; the message says how
    MODEL_PARKED = "model_parked"  # the model the request needs is parked (`Engine.park`)
    INVALID_SNAPSHOT = "invalid_snapshot"  # a snapshot from another model, config, dtype or pool spec
    NON_FINITE = "non_finite"  # the logits went NaN/Inf: the request stopped before that token (`nonfinite_at`)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop id or stop string
    LENGTH = "length"  # max_new_tokens
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the raw model distribution (log_softmax of the logits, before
    temperature / top-p / top-k; forced tokens too) and the most likely alternatives, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability)


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One streamed token of one request (``index`` counts the request's generated tokens from 0)."""

    request: int  # position of the request in the list given to `generate` / `stream`
    token: int
    index: int
    logprob: TokenLogprob | None = None  # with Request.logprobs set (an engine built with logprobs=N)


@dataclasses.dataclass(frozen=True)
class Budget:
    """Thinking budget: once the span opened by `open_ids` (or the start of generation when empty) holds
    `max_tokens` tokens without its natural close (`close_ids`), the engine emits `close_ids` itself."""

    max_tokens: int
    close_ids: tuple[int, ...]
    open_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request. `prompt` is token ids, or text when the engine has a tokenizer.

    Sampling: ``temperature == 0`` is greedy; otherwise temperature, `top_k` (0 = off) and `top_p` filter the
    distribution and `seed` alone decides the draws (the same request gives the same tokens in any batch; with an
    adaptive engine a speculative one's also depend on the draft lengths its calls chose: each a sample of the same
    distribution).
    `speculative`: None uses the engine's k, 0 decodes this request plainly, 1..k caps its accepted drafts.
    `logprobs`: None records none; 0..N (an engine built with ``logprobs=N``) records each token's log-probability
    and that many alternatives (`TokenLogprob`, on the events and in `GenerateResult.logprobs`).
    `on_token(event)` is called for every token as it is delivered; returning False (or raising) cancels the
    request only. `on_tokens(events)` (instead of `on_token`, never both) is called once per delivery with the
    tokens one engine call gave the request (a decode call's, or its first token alone), in order, after they
    are all in its result; returning False (or raising) cancels it after them. The events are the same either
    way; one call per delivery spares a caller that buffers them (a server) its per-token calls."""

    prompt: Sequence[int] | str
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    speculative: int | None = None
    on_token: Callable[[TokenEvent], bool | None] | None = None
    budget: Budget | None = None
    snapshot: bool = False  # save a prefix snapshot of the prompt after prefill (issue 9)
    snapshot_at: tuple[int, ...] = ()  # extra prompt positions to snapshot at (prefill chunks split there)
    logprobs: int | None = None
    on_tokens: Callable[[list[TokenEvent]], bool | None] | None = None


@dataclasses.dataclass
class Timings:
    queue_s: float = 0.0  # submitted -> admitted into a slot
    prefill_s: float = 0.0  # admitted -> first token
    decode_s: float = 0.0  # first token -> finished
    tokens_per_s: float = 0.0  # generated tokens / (prefill + decode)


@dataclasses.dataclass
class GenerateResult:
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str | None = None
    finish_reason: str = FinishReason.ERROR.value
    error: ErrorCode | None = ErrorCode.INTERNAL
    message: str = "not completed"
    timings: Timings = dataclasses.field(default_factory=Timings)
    accepted_per_round: list[int] | None = None  # speculative: accepted drafts of each round
    prefill_tokens: int = 0  # prompt tokens this request prefilled (0 after an exact snapshot hit)
    budget_forced_close: bool = False
    nonfinite_at: int | None = None  # index of the first token whose logits held NaN/Inf (prefill, decode, rounds)
    logprobs: list[TokenLogprob] | None = None  # one per token, with Request.logprobs set

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def mean_accepted(self) -> float:
        a = self.accepted_per_round or []
        return sum(a) / len(a) if a else 0.0

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "finish_reason": self.finish_reason,
                "error": self.error.value if self.error else None, "message": self.message or None,
                "timings": dataclasses.asdict(self.timings),
                **({"accepted_per_round": self.accepted_per_round} if self.accepted_per_round is not None else {}),
                **({"nonfinite_at": self.nonfinite_at} if self.nonfinite_at is not None else {}),
                **({"logprobs": [{"logprob": t.logprob, "top": [list(x) for x in t.top]} for t in self.logprobs]}
                   if self.logprobs is not None else {})}
