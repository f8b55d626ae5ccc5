"""Prefix snapshots, restores and request reset (issue 9) on CPU, fp32, the tiny 3-layer config.

One warmed-up speculative engine (requests may opt out of speculation) serves every check of `test_snapshots`;
nothing compiles after warmup, restores included. Incompatible engines only validate (no step runs there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ds4jax
from ds4jax import Engine, ErrorCode, Request
from ds4jax.runtime.pools import PoolError
from ds4jax.generation import engine as engine_lib
from ds4jax.generation.compiles import program_compiles
from ds4jax.generation.snapshots import Snapshot, SnapshotStore
from spec_helpers import agreeable_model, tiny3

_rng = np.random.default_rng(5)
PROMPT = _rng.integers(3, 256, 19).tolist()  # three chunks of 8; a snapshot at 11 splits the second one
OTHER = PROMPT[:11] + _rng.integers(3, 256, 6).tolist()  # shares an 11-token prefix with PROMPT
NEW = 10
# test_engine.py's engine but for its row buckets: the same pool specs, so this one's prefill [4 rows x 8], decode and
# speculative programs (4 rows x 4 steps / rounds) are that engine's 4-row programs, compiled once per run (the
# other worker loads them from the run's cache, tests/run_cache.py; the same worker has them in memory)
ENGINE = dict(max_slots=4, max_context=64, speculative=2, prefill_chunk=8, row_buckets=(4,),
              steps_per_call=4)


@pytest.fixture(scope="module")
def model():
    return agreeable_model(tiny3(), seed=0, damp=0.3, stream_gain=2.0)


@pytest.fixture(scope="module")
def engine(model):
    # the engine gets its own device copy of the weights: parking it deletes the buffers it was built with.
    # Committed to the device, as loaded checkpoints are: programs then compile per committed-ness of their
    # arguments, and the tripwire below sees any warmup call whose arguments differ from serving's.
    own = ds4jax.Model(model.config, jax.device_put(jax.tree.map(jnp.copy, model.params), jax.devices()[0]))
    eng = Engine(own, **ENGINE)
    eng.warmup()
    return eng


def req(prompt, **kw):
    kw.setdefault("max_new_tokens", NEW)
    return Request(prompt=prompt, **kw)


SAMPLED = dict(temperature=0.9, top_k=30, seed=7)
KINDS = {"greedy": {}, "greedy plain": dict(speculative=0), "sampled": SAMPLED,
         "sampled plain": dict(SAMPLED, speculative=0)}


def check_exact_restore(engine, fresh):
    """Prompt == a snapshot's prefix: zero prefill steps, first token from the saved logits, same tokens."""
    for name, kw in KINDS.items():
        engine.snapshots.clear()
        saved = engine.generate([req(PROMPT, snapshot=True, **kw)])[0]
        assert saved.tokens == fresh[name] and len(engine.snapshots) == 1
        steps = engine.stats.prefill_steps
        got = engine.generate([req(PROMPT, **kw)])[0]
        assert engine.stats.prefill_steps == steps, name  # zero prefill steps
        assert (got.tokens, got.prefill_tokens) == (fresh[name], 0), name
    # engine.snapshot() from on_token of the first token (between prefill and the first decode step)
    engine.snapshots.clear()
    taken = {}

    def on_first(ev):
        if ev.index == 0:
            taken["snap"] = engine.snapshot(taken["request"])
        return True

    taken["request"] = req(PROMPT, on_token=on_first)
    assert engine.generate([taken["request"]])[0].tokens == fresh["greedy"]
    assert taken["snap"].length == len(PROMPT) and len(engine.snapshots) == 1
    assert engine.generate([req(PROMPT)])[0].prefill_tokens == 0


def check_suffix_and_split(engine, fresh):
    """A snapshot at position 11 (inside a chunk of 8, not a multiple of 4 or 8) splits the chunk exactly;
    a longer prompt sharing the prefix prefills only its suffix; a shorter prompt prefills fresh."""
    engine.snapshots.clear()
    split = engine.generate([req(PROMPT, snapshot_at=(11,))])[0]
    assert split.tokens == fresh["greedy"] and len(engine.snapshots) == 1
    assert next(iter(engine.snapshots)).length == 11
    hits = engine.stats.snapshot_hits
    for name, kw in (("other", {}), ("other sampled", SAMPLED)):
        got = engine.generate([req(OTHER, **kw)])[0]
        assert (got.tokens, got.prefill_tokens) == (fresh[name], len(OTHER) - 11), name
    assert engine.stats.snapshot_hits == hits + 2
    short = engine.generate([req(PROMPT[:7])])[0]
    assert short.prefill_tokens == 7 and engine.stats.snapshot_hits == hits + 2
    assert short.tokens == fresh["short"]


def check_restored_path_cancel_and_errors(engine, fresh, monkeypatch):
    """Cancellation and errors on a restored request behave as on a fresh one, and three requests in a row on
    the same slot (cancelled, errored, restored) each give what they give alone: the slot is fully reset."""
    engine.snapshots.clear()
    engine.generate([req(PROMPT, snapshot=True)])
    # restored + cancelled after 3 tokens
    got = engine.generate([req(PROMPT, on_token=lambda ev: ev.index < 2)])[0]
    assert (got.finish_reason, got.error, got.tokens) == ("cancelled", ErrorCode.CANCELLED, fresh["greedy"][:3])
    # restored + an engine failure in the restore step: INTERNAL for that request only
    real = engine._restore_call
    monkeypatch.setattr(engine, "_restore_call", lambda *a: (_ for _ in ()).throw(RuntimeError("restore broke")))
    bad, good = engine.generate([req(PROMPT), req(OTHER, speculative=0)])
    monkeypatch.setattr(engine, "_restore_call", real)
    assert bad.error is ErrorCode.INTERNAL and "restore broke" in bad.message
    assert good.ok and good.tokens == fresh["other"]
    # restored + invalid fields: the same codes as fresh requests
    assert engine.generate([req(PROMPT, top_p=2.0)])[0].error is ErrorCode.INVALID_REQUEST
    # three in a row on slot 0: fresh cancelled, fresh errored mid-decode, restored; then a fresh one
    calls = {"n": 0}
    real_decode = engine._spec_call

    def failing(rows):  # the first speculative call fails: after the prefill and the first token
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("decode broke")
        return real_decode(rows)

    slots = []

    def slot_of(keep=lambda ev: True):  # records the slot a request runs in (it runs alone)
        def cb(ev):
            slots.append(tuple(engine._slots))
            return keep(ev)
        return cb

    engine.snapshots.clear()
    a = engine.generate([req(OTHER, on_token=slot_of(lambda ev: ev.index < 4))])[0]
    assert a.tokens == fresh["other"][:5] and a.error is ErrorCode.CANCELLED
    monkeypatch.setattr(engine, "_spec_call", failing)
    b = engine.generate([req(PROMPT, snapshot=True, on_token=slot_of())])[0]
    monkeypatch.setattr(engine, "_spec_call", real_decode)
    assert b.error is ErrorCode.INTERNAL and b.tokens == fresh["greedy"][:1] and "decode broke" in b.message
    c = engine.generate([req(PROMPT, on_token=slot_of())])[0]  # restored from the snapshot the errored one saved
    assert (c.tokens, c.prefill_tokens) == (fresh["greedy"], 0)
    d = engine.generate([req(OTHER, on_token=slot_of())])[0]
    assert (d.tokens, d.prefill_tokens) == (fresh["other"], len(OTHER))  # the 19-token snapshot does not apply
    assert set(slots) == {(0,)}, "the four requests did not all run in slot 0"


def check_lru(engine):
    engine.snapshots.clear()
    saved = engine.stats.snapshots_saved
    engine.generate([req(PROMPT, snapshot_at=(5, 11, 19))])
    assert engine.stats.snapshots_saved == saved + 3
    store = engine.snapshots
    sizes = {s.length: s.nbytes for s in store}
    assert sorted(sizes) == [5, 11, 19] and store.evictions == 0
    small = SnapshotStore(sizes[11] + sizes[19] + sizes[5] // 2)
    for s in sorted(store, key=lambda s: s.length):
        small.put(s)
    assert small.evictions == 1 and [s.length for s in small] == [11, 19]  # the oldest (5) went
    assert small.longest_prefix(PROMPT).length == 19
    small.put(next(s for s in store if s.length == 5))  # 11 is now the least recently used
    assert small.evictions == 2 and sorted(s.length for s in small) == [5, 19]
    tiny = SnapshotStore(sizes[5] - 1)
    assert not tiny.put(next(iter(store))) and tiny.rejected == 1 and len(tiny) == 0
    assert store.longest_prefix(PROMPT[:10]).length == 5 and store.longest_prefix([1, 2]) is None


def check_disk_and_invalid(engine, model, fresh, tmp_path):
    """Save / load through safetensors; a snapshot from another model, config, dtype or pool spec gives
    INVALID_SNAPSHOT naming what differs (these engines fail at admission: no step of theirs runs)."""
    engine.snapshots.clear()
    engine.generate([req(PROMPT, snapshot=True)])
    path = str(tmp_path / "snaps.safetensors")
    engine.snapshots.save(path)
    engine.snapshots.clear()
    assert engine.snapshots.load(path) == 1
    got = engine.generate([req(PROMPT)])[0]
    assert (got.tokens, got.prefill_tokens) == (fresh["greedy"], 0)

    others = {
        "model": agreeable_model(tiny3(), seed=1, damp=0.3, stream_gain=2.0),
        "config": ds4jax.Model(model.config.replace(rope_theta=model.config.rope_theta * 2), model.params),
        "dtype": ds4jax.Model(model.config, jax.tree.map(
            lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, model.params)),
        "pool": model,
    }
    # a fine-tune of the same model: one element of its largest tensor (the embedding) differs
    leaves, treedef = jax.tree.flatten(model.params)
    big = max(range(len(leaves)), key=lambda i: leaves[i].size)
    leaves[big] = leaves[big].reshape(-1).at[-1].add(1.0).reshape(leaves[big].shape)
    tuned = ds4jax.Model(model.config, jax.tree.unflatten(treedef, leaves))
    for what, other in [*others.items(), ("model", tuned)]:
        kw = dict(ENGINE, max_context=128) if what == "pool" else ENGINE
        eng = Engine(other, **kw)
        eng.snapshots.load(path)
        r = eng.generate([req(PROMPT)])[0]
        assert r.error is ErrorCode.INVALID_SNAPSHOT and what in r.message, (what, r.message)
        assert eng.stats.prefill_steps == 0, what  # failed at admission: its prompt was not prefilled


def check_budget(engine, fresh):
    """Thinking budget: at exactly N tokens without the natural close the engine emits the close ids once and
    generation continues as if the close ids had been generated (plain and speculative, fresh and restored);
    a natural close before N is left alone; an open_ids span counts from its opening."""
    ref = fresh["greedy"]
    vocab = engine.cfg.vocab_size
    close = tuple(t for t in range(3, vocab) if t not in ref)[:2]
    n = 4
    continued = engine.generate([req(PROMPT + ref[:n] + list(close), max_new_tokens=NEW - n - 2)])[0].tokens
    want = ref[:n] + list(close) + continued
    engine.snapshots.clear()
    for restored in (False, True):
        for kw in ({}, dict(speculative=0)):
            if restored and not len(engine.snapshots):
                engine.generate([req(PROMPT, snapshot=True)])
            events = []
            r = engine.generate([req(PROMPT, budget=ds4jax.Budget(max_tokens=n, close_ids=close),
                                     on_token=lambda ev: events.append(ev.token), **kw)])[0]
            assert r.prefill_tokens == (0 if restored else len(PROMPT))
            assert (r.tokens, r.budget_forced_close) == (want, True), (restored, kw)
            assert events == want and r.tokens.count(close[0]) == 1  # streamed exactly, closed once
    j = next(i for i in range(1, n) if ref[i] not in ref[:i])  # a token that first appears before N
    natural = engine.generate([req(PROMPT, budget=ds4jax.Budget(max_tokens=n, close_ids=(ref[j],)))])[0]
    assert (natural.tokens, natural.budget_forced_close) == (ref, False)
    o = next(i for i in range(NEW - n - 2) if ref[i] not in ref[:i])  # span opens after token o
    opened = engine.generate([req(PROMPT, budget=ds4jax.Budget(max_tokens=n, close_ids=close,
                                                                 open_ids=(ref[o],)))])[0]
    assert opened.budget_forced_close and opened.tokens[: o + 1 + n + 2] == ref[: o + 1 + n] + list(close)
    bad = engine.generate([req(PROMPT, budget=ds4jax.Budget(max_tokens=0, close_ids=close))])[0]
    assert bad.error is ErrorCode.INVALID_REQUEST and "budget" in bad.message


def _bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def check_park(engine, fresh):
    """Parking releases the device buffers (jax.live_arrays), each selector does what it says, a request that
    needs a parked model gets MODEL_PARKED, and outputs after unparking are identical."""
    live = lambda: sum(x.nbytes for x in jax.live_arrays())
    params = engine.model.params
    mtp, target = _bytes(params["mtp"]), _bytes({k: v for k, v in params.items() if k != "mtp"})
    dpool, tpool = _bytes(engine.dpool), _bytes(engine.tpool)
    for bad in ("bogus", "both", None):
        with pytest.raises((ValueError, TypeError)):
            engine.park(bad)
    start = live()
    engine.park("draft")
    assert engine.parked == ("draft",) and start - live() >= mtp + dpool
    kept = jax.tree.leaves(({k: v for k, v in params.items() if k != "mtp"}, engine.tpool, engine.slot_state))
    assert kept and not any(x.is_deleted() for x in kept), "parking the draft released the target's buffers"
    del kept  # (a reference would keep buffers alive that the steps below replace)
    compiled = program_compiles()
    spec, plain = engine.generate([req(PROMPT), req(PROMPT, speculative=0)])
    assert spec.error is ErrorCode.MODEL_PARKED and plain.tokens == fresh["greedy"]
    # (a prefill without the draft's extend is a program of its own; the plain decode steps are the warmed-up ones)
    assert "jit(decode_loop)" not in program_compiles() - compiled
    engine.park("target")
    assert engine.parked == ("draft", "target") and start - live() >= mtp + dpool + target + tpool
    assert engine.generate([req(PROMPT, speculative=0)])[0].error is ErrorCode.MODEL_PARKED
    with pytest.raises(PoolError, match="target is parked"):
        engine.unpark("draft")
    engine.unpark("all")
    before = engine_lib.compile_count()
    assert engine.parked == () and engine.generate([req(PROMPT)])[0].tokens == fresh["greedy"]
    assert engine_lib.compile_count() == before, "unparked weights are committed where they were: nothing compiles"
    engine.park("")
    assert engine.parked == ("draft", "target")
    engine.unpark("target")
    engine.unpark("draft")
    assert engine.generate([req(PROMPT, **SAMPLED)])[0].tokens == fresh["sampled"]
    start = live()
    engine.park("all")
    assert engine.parked == ("draft", "target") and start - live() >= mtp + dpool + target + tpool
    engine.unpark("")
    assert engine.parked == () and engine.generate([req(PROMPT)])[0].tokens == fresh["greedy"]


def test_snapshots(model, engine, monkeypatch, tmp_path):
    before = engine_lib.compile_count()
    engine.snapshots.clear()
    fresh = {name: engine.generate([req(PROMPT, **kw)])[0].tokens for name, kw in KINDS.items()}
    fresh["other"] = engine.generate([req(OTHER)])[0].tokens
    fresh["other sampled"] = engine.generate([req(OTHER, **SAMPLED)])[0].tokens
    fresh["short"] = engine.generate([req(PROMPT[:7])])[0].tokens
    assert fresh["greedy"] == fresh["greedy plain"] and fresh["sampled"] != fresh["greedy"]
    check_exact_restore(engine, fresh)
    check_suffix_and_split(engine, fresh)
    check_restored_path_cancel_and_errors(engine, fresh, monkeypatch)
    check_lru(engine)
    check_budget(engine, fresh)
    assert engine_lib.compile_count() == before  # restores, snapshots and failures compiled nothing
    assert engine.stats.compiles_after_warmup == 0
    check_disk_and_invalid(engine, model, fresh, tmp_path)
    check_park(engine, fresh)
