"""A caller that leaves the engine early (breaks out of `Engine.stream`, or Ctrl-C / an exception escaping
`generate`) cancels its unfinished requests and frees their slots: nothing of them runs, is streamed or reported
in a later call, which gets exactly the tokens it gets alone."""

from __future__ import annotations

import jax
import pytest

from ds4jax import ErrorCode, Request
from ds4jax.generation.engine import Engine
from small_engine import one_layer_model, small_engine

PROMPT = list(range(3, 13))
LATER = Request(prompt=PROMPT[:5], max_new_tokens=6)


@pytest.fixture(scope="module")
def served():
    engine = small_engine(one_layer_model())
    engine.warmup()
    return engine, engine.generate([LATER])[0].tokens


def later_call_is_clean(engine, alone):
    assert not engine._slots and not engine.tbook.active.any() and not engine.dbook.active.any()
    reported = []
    events = list(engine.stream([LATER], on_result=lambda i, r: reported.append((i, r.tokens))))
    assert [(ev.request, ev.token) for ev in events] == [(0, t) for t in alone]  # nothing of the earlier call
    assert reported == [(0, alone)] and engine.last_results[0].tokens == alone


def test_breaking_out_of_a_stream_cancels_its_requests(served):
    engine, alone = served
    cancelled = engine.stats.cancelled
    reported = []
    for ev in engine.stream([Request(prompt=PROMPT, max_new_tokens=20), Request(prompt=PROMPT[:4], max_new_tokens=20)],
                            on_result=lambda i, r: reported.append(i)):
        if ev.index >= 2:
            break
    assert engine.stats.cancelled == cancelled + 2 and reported == []  # they did not finish: nothing reported
    later_call_is_clean(engine, alone)


@pytest.mark.parametrize("where, lost", [("_decode_call", False), ("_spec_call", False), ("_spec_call", True)],
                         ids=["decode", "speculative", "pools lost"])
def test_an_interrupt_escaping_generate_leaves_the_engine_clean(served, monkeypatch, where, lost):
    engine, alone = served
    real, reported = getattr(Engine, where), []

    def interrupted(self, rows):
        real(self, rows)  # the pools were donated and replaced: the interrupt comes after the step
        if lost:  # as if it came inside the call, after the donation: the pools' buffers are gone
            for leaf in jax.tree.leaves((self.tpool, self.dpool)):
                leaf.delete()
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([Request(prompt=PROMPT, max_new_tokens=9, speculative=0),
                         Request(prompt=PROMPT[:7], max_new_tokens=9)], on_result=lambda i, r: reported.append(i))
    monkeypatch.undo()
    assert reported == []
    later_call_is_clean(engine, alone)
    res = engine.generate([Request(prompt=PROMPT[:7], max_new_tokens=5, on_token=lambda ev: ev.index < 1)])[0]
    assert res.error is ErrorCode.CANCELLED and len(res.tokens) == 2  # on_token cancellation is unchanged
