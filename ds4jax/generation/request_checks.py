"""Every check of a generation request, in two layers.

* Field checks (`check_request` / `request_problem`; a `ds4jax.Request` or anything with its attributes): types
  and ranges only, so the engine-level checks can compare and index without meeting a string, a NaN or a float
  where an id belongs. `request_problem` returns the first problem as a message naming the field and the value,
  or None.
* Engine checks (`check_for_engine`): the field checks, then what depends on the engine (vocabulary, stop ids,
  draft cap, parked models, context and pages, budget, logprobs and snapshot positions). It raises `Rejected` with the
  `ErrorCode` the engine puts in the request's result; the engine itself checks nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ds4jax.errors import ArgumentError
from ds4jax.generation.loops import MAX_FORCED, MAX_STOP_IDS
from ds4jax.generation.requests import ErrorCode, Request
from ds4jax.io.tokenizer import unencodable_at
from ds4jax.model.inputs import INT64_MIN, check_int, check_real
from ds4jax.runtime.roles import Role


def _ids(value, name: str, *, low: int = 0) -> None:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ArgumentError("must be a sequence of token ids", name=name, value=value)
    for i, t in enumerate(value):
        check_int(t, f"{name}[{i}]", low=low)


def check_request(req, where: str = "Request") -> None:
    """Raise `ArgumentError` for the first malformed field of `req`."""
    prompt = req.prompt
    if not isinstance(prompt, str):
        if hasattr(prompt, "ndim") and getattr(prompt, "ndim", 1) != 1:
            raise ArgumentError("must be text or a 1-D sequence of token ids", name=f"{where}.prompt",
                                value=getattr(prompt, "shape", None))
        _ids(prompt, f"{where}.prompt")
    check_int(req.max_new_tokens, f"{where}.max_new_tokens", low=1)
    temperature = check_real(req.temperature, f"{where}.temperature")
    if temperature < 0:
        raise ArgumentError("must be >= 0 (0 is greedy)", name=f"{where}.temperature", value=req.temperature)
    top_p = check_real(req.top_p, f"{where}.top_p")
    if not 0 < top_p <= 1:
        raise ArgumentError("must be in (0, 1]", name=f"{where}.top_p", value=req.top_p)
    check_int(getattr(req, "top_k", 0), f"{where}.top_k", low=0)
    check_int(req.seed, f"{where}.seed", low=INT64_MIN, high=2**64 - 1)  # the engine derives uint64 row seeds
    _ids(req.stop_ids, f"{where}.stop_ids")
    stop_strings = getattr(req, "stop_strings", ())
    if isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stop_strings):
        raise ArgumentError("must be a tuple of non-empty strings", name=f"{where}.stop_strings", value=stop_strings)
    speculative = getattr(req, "speculative", None)
    if speculative is not None:
        check_int(speculative, f"{where}.speculative", low=0)
    on_token = getattr(req, "on_token", None)
    if on_token is not None and not callable(on_token):
        raise ArgumentError("must be callable", name=f"{where}.on_token", value=on_token)
    on_tokens = getattr(req, "on_tokens", None)
    if on_tokens is not None and not callable(on_tokens):
        raise ArgumentError("must be callable", name=f"{where}.on_tokens", value=on_tokens)
    if on_token is not None and on_tokens is not None:
        raise ArgumentError("set on_token or on_tokens, not both", name=f"{where}.on_tokens", value=on_tokens)
    logprobs = getattr(req, "logprobs", None)
    if logprobs is not None:
        check_int(logprobs, f"{where}.logprobs", low=0)
    snapshot_at = getattr(req, "snapshot_at", ())
    _ids(snapshot_at, f"{where}.snapshot_at", low=1)
    budget = getattr(req, "budget", None)
    if budget is not None:
        check_int(budget.max_tokens, f"{where}.budget.max_tokens", low=1)
        _ids(budget.close_ids, f"{where}.budget.close_ids")
        _ids(budget.open_ids, f"{where}.budget.open_ids")


def request_problem(req, where: str = "Request") -> str | None:
    try:
        check_request(req, where)
    except ArgumentError as e:
        return str(e)
    except Exception as e:  # an object whose attributes misbehave (__len__, __iter__ raising...)
        return f"{where}: malformed ({type(e).__name__}: {e})"
    return None



@dataclasses.dataclass(frozen=True)
class Limits:
    """What an engine can serve: the request checks that need the engine (vocabulary, k, context, pages)."""
    vocab: int
    max_k: int  # the engine's draft tokens per round (0: no speculation)
    max_context: int
    num_pages: int
    page_size: int
    paged: bool  # False: a sliding-window-only pool, which needs no pages
    logprobs: int = 0  # the most alternatives a request may ask for (`Engine(logprobs=N)`; 0: logprobs off)


@dataclasses.dataclass(frozen=True)
class Checked:
    """A request the engine can run: its prompt ids, draft cap, snapshot points and stop ids."""
    ids: list[int]
    k: int
    snap_points: tuple[int, ...]
    stop: tuple[int, ...]


class Rejected(Exception):
    """A request the engine cannot run: `code` (an `ErrorCode`) and a message naming the field."""

    def __init__(self, code, message: str):
        super().__init__(message)
        self.code = code


def tokenize(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise Rejected(ErrorCode.INVALID_REQUEST, "a text prompt needs an engine built with a tokenizer")
        at = unencodable_at(prompt)
        if at is not None:
            raise Rejected(ErrorCode.INVALID_REQUEST, f"prompt: not valid Unicode (a lone surrogate at character {at})")
        return tokenizer.encode(prompt, add_bos=getattr(tokenizer, "bos_id", None) is not None)
    return [int(t) for t in np.asarray(prompt).reshape(-1).tolist()] if len(prompt) else []


def check_for_engine(req, limits: Limits, *, tokenizer, parked=frozenset()) -> Checked:
    """Every check of a request against an engine, field checks (`check_request`) first; raises `Rejected`.
    `parked`: the parked `Role`s."""
    bad = lambda message: Rejected(ErrorCode.INVALID_REQUEST, message)  # noqa: E731
    if not isinstance(req, Request):
        raise bad(f"expected a ds4jax.Request, got {type(req).__name__}")
    problem = request_problem(req)  # types and ranges first: the checks below compare and index
    if problem:
        raise bad(problem)
    v = limits.vocab
    ids = tokenize(req.prompt, tokenizer)
    if not ids:
        raise bad("the prompt is empty (it needs at least one token)")
    out = [i for i, t in enumerate(ids) if t >= v]
    if out:
        raise bad(f"prompt token {ids[out[0]]} at index {out[0]} is outside the vocabulary [0, {v})")
    stops = tuple(int(s) for s in req.stop_ids)
    if len(stops) > MAX_STOP_IDS:
        raise bad(f"at most {MAX_STOP_IDS} stop ids are supported, got {len(stops)}")
    if any(s >= v for s in stops):
        raise bad(f"stop ids {stops} must lie in the vocabulary [0, {v})")
    if req.stop_strings and tokenizer is None:
        raise bad("stop_strings need an engine built with a tokenizer")
    k = limits.max_k if req.speculative is None else int(req.speculative)
    if k > limits.max_k:
        raise bad(f"speculative={req.speculative!r}: this engine drafts up to {limits.max_k} tokens per round "
                  "(0 = plain decoding)")
    if Role.TARGET in parked:
        raise Rejected(ErrorCode.MODEL_PARKED, "the target model is parked (Engine.unpark('target'))")
    if k and Role.DRAFT in parked:
        raise Rejected(ErrorCode.MODEL_PARKED, "the draft (MTP) model is parked; unpark('draft') or send "
                                               "speculative=0")
    window = limits.max_k + 1 if limits.max_k else 0
    # int(): a numpy unsigned max_new_tokens (np.uint64(2**64 - 1) passes the field check) would wrap around in
    # numpy's arithmetic and look small enough to fit
    need = len(ids) + int(req.max_new_tokens) + window
    if need > limits.max_context:
        raise Rejected(ErrorCode.PROMPT_TOO_LONG, f"{len(ids)} prompt tokens + {req.max_new_tokens} new tokens"
                       + (f" + {window} speculative positions" if window else "")
                       + f" exceed max_context {limits.max_context}")
    pages = -(-need // limits.page_size) if limits.paged else 0
    if pages > limits.num_pages:
        raise Rejected(ErrorCode.CAPACITY_EXCEEDED, f"needs {pages} pages; the pool has {limits.num_pages}")
    budget = req.budget
    if budget is not None:
        for name, seq, least in (("close_ids", tuple(budget.close_ids), 1), ("open_ids", tuple(budget.open_ids), 0)):
            if not least <= len(seq) <= MAX_FORCED or any(int(t) >= v for t in seq):
                raise bad(f"budget.{name} must hold {least}..{MAX_FORCED} ids in the vocabulary [0, {v}), got {seq}")
    if req.logprobs is not None and not limits.logprobs:
        raise bad("logprobs needs an engine built with Engine(logprobs=N)")
    if req.logprobs is not None and req.logprobs > limits.logprobs:
        raise bad(f"logprobs={req.logprobs}: this engine returns at most {limits.logprobs} alternatives "
                  "(Engine(logprobs=N))")
    points = {int(p) for p in req.snapshot_at}
    beyond = [p for p in req.snapshot_at if p > len(ids)]
    if beyond:
        raise bad(f"snapshot_at position {beyond[0]!r} is outside [1, {len(ids)}]")
    if req.snapshot:
        points.add(len(ids))
    return Checked(ids, k, tuple(sorted(points)), stops)
