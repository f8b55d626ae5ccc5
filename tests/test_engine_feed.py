"""`Engine.stream(feed=...)`: requests fed into a running stream join it (the server's driver thread), with the
tokens they get alone; the stream ends once nothing runs and feed() has nothing more."""

from ds4jax import Request
from small_engine import one_layer_model, small_engine


def test_fed_requests_join_a_running_stream():
    engine = small_engine(one_layer_model())
    first = Request(prompt=[5, 6, 7], max_new_tokens=9, speculative=0)
    later = [Request(prompt=[9, 8], max_new_tokens=5), Request(prompt=[4], max_new_tokens=0)]  # the 2nd is invalid
    alone = engine.generate([first, later[0]])
    calls, seen = [], []

    def feed():
        calls.append(len(engine._slots))
        return later if len(calls) == 2 else []

    events = list(engine.stream([first], feed=feed, on_result=lambda i, r: seen.append(i)))
    results = engine.last_results
    assert calls[1] == 1  # fed while the first request was running
    assert [r.tokens for r in results[:2]] == [r.tokens for r in alone]
    assert results[2].error is not None and sorted(seen) == [0, 1, 2]
    assert {e.request for e in events} == {0, 1} and not engine._slots
