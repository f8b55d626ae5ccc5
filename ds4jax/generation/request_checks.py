"""Field checks of a generation request (`ds4jax.Request` or anything with its attributes), before the engine
looks at it: types and ranges only, so the engine's own checks (vocabulary, capacity, parked models) can compare
and index without meeting a string, a NaN or a float where an id belongs. `request_problem` returns the first
problem as a message naming the field and the value (the engine turns it into an INVALID_REQUEST result), or None.
"""

from __future__ import annotations

from ds4jax.errors import ArgumentError
from ds4jax.model.inputs import INT64_MIN, check_int, check_real


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

