"""speculative_generate runs its compiled loop with the dispatcher's kernels (Pallas on a GPU), not a hard-wired
reference: the loop receives `kernels=resolve(None)`."""

import jax
import pytest
from spec_helpers import tiny3

import ds4jax
from ds4jax.generation import speculative
from ds4jax.model import params as P
from ds4jax.model.handle import Model
from ds4jax.runtime.kernels import Impl


class _Stop(Exception):
    pass


def test_loop_gets_the_dispatchers_kernels(monkeypatch):
    cfg = tiny3()
    model = Model(cfg, P.init(cfg, jax.random.key(0)))
    seen = {}

    def fake_loop(*args, **kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(speculative, "resolve", lambda impl: Impl.PALLAS if impl is None else impl)
    monkeypatch.setattr(speculative, "speculative_loop", fake_loop)
    with pytest.raises(_Stop):
        speculative.speculative_generate(model, [[1, 2, 3]], ds4jax.SamplingParams(max_new_tokens=4), k=2)
    assert seen["kernels"] is Impl.PALLAS
