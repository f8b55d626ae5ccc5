"""`ds4jax.Engine` on CPU, fp32, the tiny 3-layer config (every attention kind).

Compilation dominates on CPU, so one warmed-up engine (plain and speculative rows, two row buckets) serves every
check of `test_serving`, and the compile tripwire covers all of them: after `warmup()` nothing compiles.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import ds4jax
from ds4jax import Engine, ErrorCode, Request
from ds4jax.generation import buckets, engine as engine_lib
from ds4jax.generation.loops import MAX_STOP_IDS
from ds4jax.io.tokenizer import ByteTokenizer
from ds4jax.runtime import kernels as kernel_dispatch
from ds4jax.runtime.kernels import Impl
from spec_helpers import agreeable_model, tiny3

_rng = np.random.default_rng(11)
LENGTHS = (5, 11, 19, 3, 14, 9)  # ragged; 19 > two windows, chunks of 8 split most prompts
MAX_NEW = (12, 20, 7, 16, 10, 12)
# None: the engine's k (2); 0: plain decoding; 1: at most one accepted draft per round
SPECULATIVE = (None, 0, None, 0, 1, None)
PROMPTS = [_rng.integers(3, 256, n).tolist() for n in LENGTHS]


def requests(overrides: dict | None = None) -> list[Request]:
    overrides = overrides or {}
    out = []
    for i, (p, m, s) in enumerate(zip(PROMPTS, MAX_NEW, SPECULATIVE)):
        kw = dict(prompt=p, max_new_tokens=m, speculative=s)
        if i == 5:  # one seeded sampled request: its draws depend on its seed alone, not on the batch
            kw.update(temperature=0.8, top_k=40, top_p=0.9, seed=123)
        kw.update(overrides.get(i, {}))
        out.append(Request(**kw))
    return out


@pytest.fixture(scope="module")
def model():
    # committed to the device, as test_snapshots.py's engine (and a loaded checkpoint) is: jit keys its programs on
    # the arguments' committed-ness, so the two files' equal programs are then one in a process
    m = agreeable_model(tiny3(), seed=0, damp=0.3, stream_gain=2.0)
    return ds4jax.Model(m.config, jax.device_put(m.params, jax.devices()[0]))


@pytest.fixture(scope="module")
def engine(model):
    # no snapshot store: nothing here snapshots, so warmup() skips the restore and fingerprint programs
    # (test_snapshots.py warms those up and checks that restores compile nothing after it)
    eng = Engine(model, max_slots=4, max_context=64, speculative=2, prefill_chunk=8,
                 row_buckets=(2, 4), steps_per_call=4, tokenizer=ByteTokenizer(), snapshot_bytes=0)
    assert eng.warmup().compiles > 0
    return eng


def check_batched_equals_alone(engine, alone):
    """Six mixed requests on four slots: the last two join mid-flight (when the first slots free up); every
    request's tokens equal its tokens alone (greedy plain, greedy speculative, seeded sampling)."""
    order = [(ev.request, ev.index) for ev in engine.stream(requests())]
    results = engine.last_results
    assert [r.tokens for r in results] == alone
    assert all(r.ok and r.finish_reason == "length" for r in results)
    first_late = order.index((4, 0))
    assert any(req < 4 and idx > 0 for req, idx in order[first_late:]), "request 4 did not join mid-flight"
    spec = [r for r, s in zip(results, SPECULATIVE) if s != 0]
    assert all(r.accepted_per_round for r in spec) and results[1].accepted_per_round is None
    assert max(max(r.accepted_per_round) for r in spec) == 2 and max(results[4].accepted_per_round) <= 1
    assert all(r.timings.tokens_per_s > 0 and r.timings.queue_s >= 0 for r in results)


def check_cancellation(engine, alone):
    """on_token returning False (request 1, after 4 tokens) or raising (request 2, after 2) cancels only that
    request: it keeps what was delivered, its slot is reused by the queued requests, the others are identical."""
    def stop_after(n, how):
        def cb(ev):
            if ev.index + 1 >= n:
                if how == "raise":
                    raise RuntimeError("client went away")
                return False
            return True
        return cb

    results = engine.generate(requests({1: dict(on_token=stop_after(4, "false")),
                                        2: dict(on_token=stop_after(2, "raise"))}))
    for i, r in enumerate(results):
        if i == 1:
            assert (r.finish_reason, r.error, r.tokens) == ("cancelled", ErrorCode.CANCELLED, alone[1][:4])
        elif i == 2:
            assert (r.finish_reason, r.error, r.tokens) == ("cancelled", ErrorCode.CANCELLED, alone[2][:2])
            assert "client went away" in r.message
        else:
            assert r.ok and r.tokens == alone[i], i
    assert not engine._slots and not engine.tbook.active.any()


def check_errors(engine, alone, monkeypatch):
    """Every error code short of the issue-9 ones, each in a batch with good requests that stay identical."""
    v = engine.cfg.vocab_size
    good = requests()
    bad = {
        "empty": (Request(prompt=[], max_new_tokens=4), ErrorCode.INVALID_REQUEST, "empty"),
        "vocab": (Request(prompt=[1, v, 2], max_new_tokens=4), ErrorCode.INVALID_REQUEST, f"token {v} at index 1"),
        "max_new": (Request(prompt=[1], max_new_tokens=0), ErrorCode.INVALID_REQUEST, "max_new_tokens"),
        "top_p": (Request(prompt=[1], top_p=0.0), ErrorCode.INVALID_REQUEST, "top_p"),
        "k": (Request(prompt=[1], speculative=5), ErrorCode.INVALID_REQUEST, "speculative=5"),
        "stops": (Request(prompt=[1], stop_ids=tuple(range(MAX_STOP_IDS + 1))), ErrorCode.INVALID_REQUEST,
                  "stop ids"),
        "type": ("not a request", ErrorCode.INVALID_REQUEST, "ds4jax.Request"),
        "long": (Request(prompt=[5] * 50, max_new_tokens=20), ErrorCode.PROMPT_TOO_LONG, "exceed max_context 64"),
    }
    batch = [good[0], *(b[0] for b in bad.values()), good[1]]
    results = engine.generate(batch)
    assert results[0].tokens == alone[0] and results[-1].tokens == alone[1]
    for r, (name, (_, code, text)) in zip(results[1:-1], bad.items()):
        assert (r.finish_reason, r.error) == ("error", code), name
        assert text in r.message, (name, r.message)

    engine.max_queue = 2  # the third waiting request is refused
    try:
        results = engine.generate(good[:3])
    finally:
        engine.max_queue = None
    assert [r.tokens for r in results[:2]] == alone[:2]
    assert results[2].error is ErrorCode.CAPACITY_EXCEEDED and "queue is full" in results[2].message

    calls = {"n": 0}
    real = engine._decode_call

    def failing(rows):  # the second plain decode call fails: its requests get INTERNAL, the rest continue
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real(rows)

    monkeypatch.setattr(engine, "_decode_call", failing)
    results = engine.generate(good)
    monkeypatch.undo()
    failed = [i for i, r in enumerate(results) if r.error is ErrorCode.INTERNAL]
    assert failed and all("injected failure" in results[i].message for i in failed)
    assert all(results[i].tokens == alone[i] for i in range(len(good)) if i not in failed)
    assert all(alone[i][: len(results[i].tokens)] == results[i].tokens for i in failed)  # kept what was made
    assert engine.generate([good[3]])[0].tokens == alone[3]  # the engine still serves


def check_text_and_stops(engine, alone):
    """Text prompts and stop strings (with the engine's tokenizer), stop ids ending a request early."""
    tok = ByteTokenizer()
    stop = alone[0][5]
    cut = alone[0].index(stop) + 1
    r = engine.generate([requests({0: dict(stop_ids=(stop,))})[0]])[0]
    assert (r.finish_reason, r.tokens) == ("stop", alone[0][:cut])
    text = tok.decode(alone[3])
    needle = next((text[i: i + 1] for i in range(1, len(text)) if text[i] != "\ufffd"), None)
    assert needle, f"no stop string to test in {text!r}"
    r = engine.generate([requests({3: dict(stop_strings=(needle,))})[3]])[0]
    assert r.finish_reason == "stop" and needle not in r.text
    r = engine.generate([Request(prompt="hello", max_new_tokens=3, speculative=0)])[0]
    assert r.ok and len(r.tokens) == 3 and r.text == tok.decode(r.tokens)


def test_serving(model, engine, monkeypatch):
    before = engine_lib.compile_count()
    alone = [engine.generate([q])[0].tokens for q in requests()]
    assert [len(a) for a in alone] == list(MAX_NEW)
    check_batched_equals_alone(engine, alone)
    check_cancellation(engine, alone)
    check_errors(engine, alone, monkeypatch)
    check_text_and_stops(engine, alone)
    # the tripwire: mixed prompt lengths, batch sizes, budgets, plain / speculative / sampled rows, cancellations
    # and errors compiled nothing after warmup()
    assert engine_lib.compile_count() == before
    assert engine.stats.compiles_after_warmup == 0
    assert engine.stats.prefill_steps and engine.stats.decode_calls and engine.stats.spec_calls
    # multi-step: fewer host round trips than tokens
    assert engine.stats.decode_steps > engine.stats.decode_calls


def test_greedy_wrapper_matches_engine(model):
    """`ds4jax.generate` is the engine: an Engine of the sizes generate picks (`buckets.one_shot`) gives the same
    tokens and compiles nothing: generate ran these very programs, one generation path. (Tokens across engine
    sizes are `check_batched_equals_alone`'s: row buckets 2 and 4.)"""
    got = ds4jax.greedy_generate(model, PROMPTS[:3], 6, prefill_chunk=8)
    shape = buckets.one_shot([len(p) for p in PROMPTS[:3]], 6, speculative=0, data=1,
                             max_position_embeddings=model.config.max_position_embeddings, prefill_chunk=8)
    before = engine_lib.compile_count()
    eng = Engine(model, **shape)
    assert got == [r.tokens for r in eng.generate([Request(prompt=p, max_new_tokens=6) for p in PROMPTS[:3]])]
    assert engine_lib.compile_count() == before


def test_every_step_goes_through_the_kernel_dispatcher(model, monkeypatch):
    """Under kernels='pallas_interpret' every program the engine traces (prefill with the draft extend, plain
    decode, speculative rounds: draft chain, verify, draft extend; the snapshot restore) runs the Pallas kernels; the reference
    kernels raise if anything reaches them. DS4JAX_KERNELS picks the default."""
    import pallas_kernels

    def forbidden(*a, **k):
        raise AssertionError("a step took the reference kernel path")

    seen = []
    real_attn, real_topk = kernel_dispatch.sparse_attention, kernel_dispatch.indexer_topk

    def attn(*a, impl, **k):
        seen.append(("attention", impl))
        return real_attn(*a, impl=impl, **k)

    def topk(*a, impl, **k):
        seen.append(("indexer", impl))
        return real_topk(*a, impl=impl, **k)

    monkeypatch.setattr(pallas_kernels, "sparse_attention_reference", forbidden)
    monkeypatch.setattr(pallas_kernels, "indexer_topk_reference", forbidden)
    monkeypatch.setattr(kernel_dispatch, "sparse_attention", attn)
    monkeypatch.setattr(kernel_dispatch, "indexer_topk", topk)
    monkeypatch.setenv("DS4JAX_KERNELS", "pallas_interpret")
    eng = Engine(model, max_slots=2, max_context=32, speculative=1, prefill_chunk=8,
                 row_buckets=(2,), steps_per_call=2)
    assert eng.kernels is Impl.PALLAS_INTERPRET
    results = eng.generate([Request(prompt=PROMPTS[0], max_new_tokens=4),
                            Request(prompt=PROMPTS[3], max_new_tokens=4, speculative=0)])
    assert all(r.ok and len(r.tokens) == 4 for r in results)
    # the snapshot restore program (the draft's pending row after an exact hit) too
    saved = eng.generate([Request(prompt=PROMPTS[0], max_new_tokens=4, snapshot=True)])[0]
    restored = eng.generate([Request(prompt=PROMPTS[0], max_new_tokens=4)])[0]
    assert (restored.tokens, restored.prefill_tokens, eng.stats.snapshot_hits) == (saved.tokens, 0, 1)
    assert seen and {impl for _, impl in seen} == {Impl.PALLAS_INTERPRET}
    # traced: the target's 3 layers (1 CSA: the indexer) in prefill, decode and verify = 9 attention + 3 indexer
    # calls; the draft (attention only) in the prefill-path and decode-path extends (k=1: no chain step) = 2
    assert sum(kind == "indexer" for kind, _ in seen) >= 3 and sum(kind == "attention" for kind, _ in seen) >= 11
