"""`Engine`'s constructor arguments: a value of the wrong type or range is an `ArgumentError` naming
``Engine.<argument>`` before anything is built (it was a bare TypeError / ValueError from deep inside, or taken as
is: ``max_queue="x"`` failed at the first full queue, ``speculative=2.5`` drafted 2). Nothing here compiles."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import ds4jax
from ds4jax.errors import ArgumentError
from small_engine import one_layer_model

SIZES = dict(max_slots=2, max_context=64)


@pytest.fixture(scope="module")
def model():
    return one_layer_model()


@pytest.mark.parametrize("name, value", [
    ("max_slots", 0), ("max_slots", 2.0), ("max_slots", "2"), ("max_slots", 2**31), ("max_context", None),
    ("speculative", 2.5), ("speculative", True), ("speculative", "1"), ("speculative", (0,)),
    ("memory_budget_bytes", math.nan), ("memory_budget_bytes", "1G"), ("memory_budget_bytes", 0),
    ("row_buckets", 1), ("row_buckets", (2, 0)), ("row_buckets", "12"), ("prefill_row_buckets", (1.5,)),
    ("draft_lengths", 3), ("kernels", "bogus"), ("kernels", 1), ("max_queue", "x"), ("max_queue", -1),
    ("max_queue", math.nan), ("snapshot_bytes", -1), ("snapshot_bytes", None), ("snapshot_bytes", 2.5),
    ("logprobs", 2.5), ("logprobs", None), ("check_finite", "no"), ("check_finite", 1),
    ("steps_per_call", np.float32(4)), ("lookup", "2"),
])
def test_bad_argument_is_named(model, name, value):
    with pytest.raises(ArgumentError) as e:
        ds4jax.Engine(model, **dict(SIZES, **{name: value}))
    assert f"Engine.{name}" in str(e.value), str(e.value)


@pytest.mark.parametrize("kwargs", [dict(max_queue=0), dict(max_queue=None), dict(snapshot_bytes=0),
                                    dict(kernels="reference"), dict(row_buckets=[1, 2]),
                                    dict(memory_budget_bytes=None, page_size=None, lookup=None),
                                    dict(kv_dtype=jnp.float8_e4m3fn), dict(check_finite=np.bool_(False))])
def test_good_arguments_pass(model, kwargs):
    ds4jax.Engine(model, **dict(SIZES, **kwargs))


@pytest.mark.parametrize("method, value", [
    ("park", "both"), ("park", None), ("park", 1), ("unpark", np.array(["draft"])), ("unpark", ["target", 0]),
    ("snapshot", "0"), ("snapshot", 0.0), ("snapshot", True), ("snapshot", np.array([0])),
])
def test_bad_park_and_snapshot_arguments_are_named(model, method, value):
    """`park` / `unpark` took a bad name as a bare ValueError (numpy's own, for an array); `snapshot` compared any
    value with the slot numbers (an array raised numpy's ambiguous-truth ValueError)."""
    engine = ds4jax.Engine(model, **SIZES)
    with pytest.raises(ArgumentError, match=rf"Engine\.{method}"):
        getattr(engine, method)(value)


def test_snapshot_at_must_be_an_integer(model):
    engine = ds4jax.Engine(model, **SIZES)
    with pytest.raises(ArgumentError, match=r"Engine\.snapshot\(at\)"):
        engine.snapshot(0, at="5")
    with pytest.raises(ds4jax.errors.PoolError, match="no running request"):  # good arguments, nothing running
        engine.snapshot(0, at=5)


@pytest.mark.parametrize("method, args, kwargs, says", [
    ("generate", (None,), {}, r"Engine\.generate\(requests\)='NoneType': must be a list"),
    ("generate", (ds4jax.Request(prompt=[5, 6], max_new_tokens=2),), {}, r"got one Request \(wrap it: \[request\]\)"),
    ("generate", ([],), {"on_result": 5}, r"Engine\.generate\(on_result\)=5: must be callable or None"),
    ("stream", ([],), {"feed": []}, r"Engine\.stream\(feed\)=\[\]: must be callable or None"),
    ("iterations", ("abc",), {}, r"Engine\.iterations\(requests\)='str'"),
    ("iterations", ([],), {"waiting": True}, r"Engine\.iterations\(waiting\)=True"),
])
def test_bad_call_arguments_are_named(model, method, args, kwargs, says):
    """A lone Request, `feed=[]` or `requests=None` raised a bare TypeError from inside; a non-callable `on_result`
    ended every request of the call as CANCELLED."""
    engine = ds4jax.Engine(model, **SIZES)
    with pytest.raises(ArgumentError, match=says):
        out = getattr(engine, method)(*args, **kwargs)
        if method != "generate":
            list(out)  # (stream and iterations are generators: they start at the first next())
