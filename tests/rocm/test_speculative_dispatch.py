"""Speculative generation runs its compiled rounds with the dispatcher's kernels (Pallas on a GPU), not a
hard-wired reference: `speculative_generate` -> `Engine` -> `spec_rounds.speculative_loop(kernels=resolve(None))`."""

import jax
import pytest
from spec_helpers import tiny3

import ds4jax
from ds4jax.generation import engine, spec_rounds, speculative
from ds4jax.model import params as P
from ds4jax.errors import RuntimeFailure
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

    # the dispatcher says Pallas (as it does on a GPU); the engine must hand that choice to the rounds
    monkeypatch.setattr(engine, "resolve", lambda impl: Impl.PALLAS if impl is None else Impl(impl))
    monkeypatch.setattr(spec_rounds, "speculative_loop", fake_loop)
    monkeypatch.setattr(engine.Engine, "_prefill_call", _skip_prefill(engine.Engine._prefill_call))
    with pytest.raises(RuntimeFailure, match="_Stop"):  # a failed step: an INTERNAL result, raised as a runtime failure
        speculative.speculative_generate(model, [[1, 2, 3]], ds4jax.SamplingParams(max_new_tokens=4), k=2)
    assert seen["kernels"] is Impl.PALLAS


def _skip_prefill(real):
    """Prefill with the reference kernels (interpreted Pallas would only slow the test down); rounds untouched."""

    def call(self, *args):
        chosen, self.kernels = self.kernels, Impl.REFERENCE
        try:
            return real(self, *args)
        finally:
            self.kernels = chosen

    return call
