"""Run-ahead decoding (`ds4jax/generation/run_ahead.py`): the engine starts the next decode call, plain or
speculative, from the previous one's outputs before reading it. Checked against the same engine with run-ahead off: the same tokens
and finish reasons for every request (greedy and sampled, stop ids, max_new_tokens, a stop string and a
cancelling `on_token` that the host alone sees, a request fed in mid-stream), that calls did run ahead (the
dispatch itself), and that nothing compiled for it."""

from __future__ import annotations

import typing

import pytest
from small_engine import one_layer_model, small_engine

from ds4jax import Request
from ds4jax.generation import compiles, run_ahead


class Counting(run_ahead.Ahead):
    made = 0
    ks: typing.ClassVar[list] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        Counting.made += 1
        Counting.ks.append(self.k)


def requests(stop_after: int | None = None):
    seen = []

    def cancel_after_3(event) -> bool:  # the host cancels mid-call: the call run ahead must drop its tokens
        seen.append(event)
        return len(seen) < 3

    return [Request(prompt=[5, 6, 7], max_new_tokens=23, speculative=0),
            Request(prompt=[9, 8, 7, 6], max_new_tokens=17, speculative=0, temperature=0.8, seed=4),
            Request(prompt=[3, 3], max_new_tokens=30, speculative=0, stop_ids=(stop_after,) if stop_after else ()),
            Request(prompt=[11, 12, 13], max_new_tokens=19, speculative=0, on_token=cancel_after_3)]


def outcome(results):
    return [(r.tokens, r.finish_reason, r.error) for r in results]


@pytest.fixture(scope="module")
def engine():
    e = small_engine(one_layer_model())
    e.warmup()
    return e


def test_same_tokens_as_without_run_ahead(engine, monkeypatch):
    off = outcome(engine.generate(requests()))
    stop = off[2][0][5]  # a token request 2 emits mid-way: a stop id the device sees
    with monkeypatch.context() as m:
        m.setattr(run_ahead, "may_run_ahead", lambda plan: False)
        want = outcome(engine.generate(requests(stop)))
    before = compiles.compile_count()
    monkeypatch.setattr(run_ahead, "Ahead", Counting)
    Counting.made = 0
    got = outcome(engine.generate(requests(stop)))
    assert got == want
    assert Counting.made >= 3, Counting.made  # it did run ahead
    assert compiles.compile_count() == before  # the call run ahead is the warmed-up program
    assert len(want[2][0]) <= 6 and want[2][1] == "stop" and want[3][1] == "cancelled"


def test_stop_string_and_fed_request(engine, monkeypatch):
    """A stop string (seen by the host only) and a request fed into the running stream (admission lands the call
    run ahead first): the same as without run-ahead."""
    text = Request(prompt="ab", max_new_tokens=25, speculative=0)
    first = engine.generate([text])[0]
    stop = first.text[4:6] if first.text and len(first.text) > 6 else None

    def run():
        reqs = [Request(prompt="ab", max_new_tokens=25, speculative=0, stop_strings=(stop,) if stop else ())]
        later = [Request(prompt=[9, 8], max_new_tokens=11, speculative=0)]
        calls = []

        def feed():
            calls.append(1)
            return later if len(calls) == 3 else []

        list(engine.stream(reqs, feed=feed))
        return outcome(engine.last_results)

    with monkeypatch.context() as m:
        m.setattr(run_ahead, "may_run_ahead", lambda plan: False)
        want = run()
    monkeypatch.setattr(run_ahead, "Ahead", Counting)
    Counting.made = 0
    got = run()
    assert got == want and Counting.made >= 1
    assert stop and got[0][1] == "stop" and len(got[0][0]) < 25 and len(got[1][0]) == 11  # both cases happened


def test_the_first_call_of_a_sequence_does_not_price_plain(engine, monkeypatch):
    """The draft policy's costs: the first plain call of a run-ahead sequence waited for the host, so only the calls
    after it (run ahead) are observed; a call with nothing run ahead after it is observed as before."""
    seen = []
    monkeypatch.setattr(engine.policy, "observe_cost", lambda rows, k, s, steps: seen.append(k))
    calls = engine.stats.decode_calls
    engine.generate([Request(prompt=[5, 6, 7], max_new_tokens=23, speculative=0)])
    calls = engine.stats.decode_calls - calls
    assert calls >= 3 and len(seen) == calls - 1, (calls, seen)
    seen.clear()
    monkeypatch.setattr(run_ahead, "may_run_ahead", lambda plan: False)
    calls = engine.stats.decode_calls
    engine.generate([Request(prompt=[5, 6, 7], max_new_tokens=23, speculative=0)])
    assert len(seen) == engine.stats.decode_calls - calls >= 3


def spec_requests(stop_after: int | None = None):
    """Speculative (the engine's k = 1) versions of `requests`: greedy and sampled, a stop id, a host cancel."""
    return [Request(prompt=r.prompt, max_new_tokens=r.max_new_tokens, speculative=None, temperature=r.temperature,
                    seed=r.seed, stop_ids=r.stop_ids, on_token=r.on_token) for r in requests(stop_after)]


def test_speculative_calls_run_ahead_with_the_same_tokens(engine, monkeypatch):
    """Speculative rounds run ahead too (each call's draft state and pools are the next one's inputs): the same
    tokens, finish reasons and accepted drafts per round as without run-ahead, calls of k = 1 did run ahead, and
    nothing compiled for it (the rows reach the program committed either way)."""
    plain = outcome(engine.generate(spec_requests()))
    stop = plain[2][0][5]
    with monkeypatch.context() as m:
        m.setattr(run_ahead, "may_run_ahead", lambda plan: False)
        base = engine.generate(spec_requests(stop))
    before = compiles.compile_count()
    monkeypatch.setattr(run_ahead, "Ahead", Counting)
    Counting.made, Counting.ks = 0, []
    got = engine.generate(spec_requests(stop))
    assert outcome(got) == outcome(base)
    assert [r.accepted_per_round for r in got] == [r.accepted_per_round for r in base]
    assert Counting.made >= 3 and set(Counting.ks) == {1}, Counting.ks
    assert compiles.compile_count() == before
    assert outcome(base)[2][1] == "stop" and outcome(base)[3][1] == "cancelled"


def test_a_new_draft_length_reads_the_call_run_ahead_first(engine, monkeypatch):
    """When the policy picks another draft length than the call run ahead has (speculation switched off and on
    again), that call is read first and its tokens delivered: the same tokens as a fixed policy without run-ahead."""
    with monkeypatch.context() as m:
        m.setattr(run_ahead, "may_run_ahead", lambda plan: False)
        want = outcome(engine.generate(spec_requests()[:2]))
    picks = iter([1, 1, 0, 0, 1, 1, 1, 0] * 8)
    monkeypatch.setattr(engine.policy, "choose", lambda live, rows, drain=False: next(picks))
    monkeypatch.setattr(run_ahead, "Ahead", Counting)
    Counting.made, Counting.ks = 0, []
    got = outcome(engine.generate(spec_requests()[:2]))
    assert got[0] == want[0]  # the greedy request (a sampled one's draws differ between plain and speculative)
    assert got[1][2] is None and len(got[1][0]) == 17
    assert {0, 1} <= set(Counting.ks), Counting.ks  # plain and speculative calls both ran ahead


def test_a_request_alone_runs_ahead_from_its_first_decode_call(engine, monkeypatch):
    """Whether a call may run ahead is judged after the iteration's admission and prefill: a request alone, its
    prompt prefilled in one chunk, starts its second decode call from its first (before, the iteration that
    admitted it ran its first call without one, since a request had been queued)."""
    monkeypatch.setattr(run_ahead, "Ahead", Counting)
    Counting.made, Counting.ks = 0, []
    calls = engine.stats.decode_calls
    engine.generate([Request(prompt=[5, 6, 7], max_new_tokens=23, speculative=0)])
    calls = engine.stats.decode_calls - calls
    assert calls >= 3 and Counting.made >= calls, (calls, Counting.made)  # each call started the next (the last's
    # was dispatched for rows the device had finished: it ran no step, and nobody read it)
