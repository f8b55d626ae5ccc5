"""Types and ranges of `Engine`'s constructor arguments, checked before anything is built.

The engine's own checks (pool sizing, buckets, chunks, the draft policy) compare and divide these values; a string,
a NaN, a float or a bool there surfaced as a bare ``TypeError`` / ``ValueError`` deep inside, or was taken as is
(``max_queue="x"`` failed only at the first full queue; ``speculative=2.5`` silently drafted 2). Each bad value is
an `ArgumentError` naming ``Engine.<argument>`` here; what depends on the model or on the other arguments (vocabulary,
context, pages, the MTP block) stays with the checks that know it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ds4jax.errors import ArgumentError
from ds4jax.model.inputs import INT32_MAX, check_int
from ds4jax.runtime.kernels import Impl

# argument -> (smallest value, None allowed)
_INTS = {"max_slots": (1, False), "max_context": (1, False), "speculative": (0, False),
         "memory_budget_bytes": (1, True), "page_size": (1, True), "prefill_chunk": (1, False),
         "prefill_tokens": (1, True), "steps_per_call": (1, False), "max_queue": (0, True),
         "snapshot_bytes": (0, False), "logprobs": (0, False), "lookup": (0, True)}
_SIZES = ("row_buckets", "prefill_row_buckets", "draft_lengths")  # None or a sequence of positive ints


def check_engine_args(**args: Any) -> None:
    """Raise `ArgumentError` for the first argument (by keyword) whose type or range no engine can take."""
    for name, value in args.items():
        where = f"Engine.{name}"
        if name in _INTS:
            low, optional = _INTS[name]
            if not (optional and value is None):
                # slots and positions are int32 on the device
                check_int(value, where, low=low, high=INT32_MAX if name in ("max_slots", "max_context") else None)
        elif name in _SIZES:
            if value is None:
                continue
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise ArgumentError("must be a sequence of positive integers (or None)", name=where, value=value)
            for i, v in enumerate(value):
                check_int(v, f"{where}[{i}]", low=1)
        elif name == "check_finite":
            if not isinstance(value, (bool, np.bool_)):
                raise ArgumentError("must be True or False", name=where, value=value)
        elif name == "kernels":
            choices = [i.value for i in Impl]
            if value is not None and not isinstance(value, Impl) and not (isinstance(value, str) and value in choices):
                raise ArgumentError(f"must be None, an Impl or one of {choices}", name=where, value=value)
        else:
            raise TypeError(f"check_engine_args: no check for {name!r}")


def call_requests(method: str, requests: Any, **callbacks: Any) -> list:
    """The requests of an `Engine.generate` / `stream` / `iterations` call as a list, its callbacks checked: a bare
    TypeError came from inside for a lone `Request` (not wrapped in a list) or `feed=[]`, and a non-callable
    `on_result` ended every request of the call as CANCELLED."""
    from ds4jax.generation.requests import Request

    if isinstance(requests, Request):
        raise ArgumentError("takes a list of Requests, got one Request (wrap it: [request])",
                            name=f"Engine.{method}(requests)")
    if isinstance(requests, (str, bytes, dict)) or not hasattr(requests, "__iter__"):
        raise ArgumentError("must be a list (or another iterable) of Requests", name=f"Engine.{method}(requests)",
                            value=type(requests).__name__)
    for name, f in callbacks.items():
        if f is not None and not callable(f):
            raise ArgumentError("must be callable or None", name=f"Engine.{method}({name})", value=f)
    return list(requests)
