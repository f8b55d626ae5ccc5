"""A live `Engine`'s session features in random sequences (hypothesis stateful, CI-sized, deterministic).

One engine runs random batches of requests that share prompt prefixes (some saving prefix snapshots at their end
or inside the prompt, others hitting them; greedy and seeded sampling; plain and speculative; thinking budgets;
stop ids; streams cancelled from `on_token`), interleaved with park / unpark of either model and snapshot files
saved and loaded back. A second engine of the same shapes, never parked and without snapshots, gives each
request's reference tokens (compiled programs are shared: same static arguments).

Properties, after every step:
* a request that needs a parked model gets `MODEL_PARKED` and nothing else happens to it; every other request
  gets exactly its reference tokens (a cancelled one: the reference's first tokens, up to where it cancelled);
* no slot, page or draft page is left held; the snapshot store stays within its byte budget;
* a prompt equal to a stored snapshot's ids prefills nothing (in a batch that saves no snapshot: one saved may evict).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ds4jax import Budget, ErrorCode, Engine, FinishReason, Request
from small_engine import MAX_CONTEXT, one_layer_model

VOCAB = 256  # tiny()'s
BASE = [int(t) for t in np.random.default_rng(11).integers(0, VOCAB, 40)]  # the prompts' shared stem
SNAPSHOT_BYTES = 64 << 10  # a few snapshots of the one-layer model: evictions happen
SIZES = dict(max_slots=4, max_context=MAX_CONTEXT, speculative=1, prefill_chunk=8, row_buckets=(4,),
             steps_per_call=4)


def _engines():
    # two copies of the same weights: parking deletes the device arrays of the model an engine was built with
    return (Engine(one_layer_model(), snapshot_bytes=SNAPSHOT_BYTES, **SIZES),
            Engine(one_layer_model(), snapshot_bytes=0, **SIZES))


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a request asks (hashable: the reference's cache key) and how the fuzzed side sends it."""

    prompt: tuple[int, ...]
    max_new: int
    temperature: float
    seed: int
    speculative: int | None
    budget: int | None  # thinking budget (close id 7) or None
    stop: tuple[int, ...]

    def request(self, **extra) -> Request:
        budget = None if self.budget is None else Budget(max_tokens=self.budget, close_ids=(7,))
        return Request(prompt=list(self.prompt), max_new_tokens=self.max_new, temperature=self.temperature,
                       top_p=0.9 if self.temperature else 1.0, seed=self.seed, speculative=self.speculative,
                       budget=budget, stop_ids=self.stop, **extra)


@st.composite
def specs(draw):
    stem = draw(st.integers(1, len(BASE)))
    tail = draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))
    sampled = draw(st.booleans())
    return Spec(prompt=tuple(BASE[:stem] + tail), max_new=draw(st.integers(1, 12)),
                temperature=0.8 if sampled else 0.0, seed=draw(st.integers(0, 3)),
                speculative=draw(st.sampled_from([None, 0, 1])),
                budget=draw(st.sampled_from([None, None, 2, 5])),
                stop=draw(st.sampled_from([(), (), (BASE[3],), (BASE[5], BASE[9])])))


@st.composite
def sends(draw):
    """(spec, snapshot, snapshot_at, cancel_after) of one request of a batch."""
    spec = draw(specs())
    n = len(spec.prompt)
    at = tuple(sorted(draw(st.sets(st.integers(1, n - 1), max_size=2)))) if n > 1 else ()
    return (spec, draw(st.booleans()), at if draw(st.booleans()) else (),
            draw(st.sampled_from([None, None, None, 1, 3])))


class EngineSessions(RuleBasedStateMachine):
    engine: Engine
    reference: Engine

    @initialize()
    def start(self):
        self.engine, self.reference = ENGINES
        self.engine.unpark("all")
        self.engine.snapshots.clear()
        self.parked: set[str] = set()
        self.dir = tempfile.mkdtemp(prefix="sessions_fuzz_")

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def _needs_parked(self, spec: Spec) -> bool:
        """Whether `spec` needs a model that is parked now (the engine answers MODEL_PARKED)."""
        return "target" in self.parked or (spec.speculative != 0 and "draft" in self.parked)

    def _reference(self, spec: Spec) -> list[int]:
        if spec not in REFERENCE:
            r = self.reference.generate([spec.request()])[0]
            assert r.ok, r.message
            REFERENCE[spec] = r.tokens
        return REFERENCE[spec]

    @rule(batch=st.lists(sends(), min_size=1, max_size=6))
    def run(self, batch):
        # snapshots stored before the batch; one the batch saves may evict them (LRU), so only a batch that saves
        # none must hit them
        saves = any(snapshot or at for _, snapshot, at, _ in batch)
        stored = set() if saves else {tuple(s.ids) for s in self.engine.snapshots}
        requests = []
        for spec, snapshot, at, cancel_after in batch:
            extra = dict(snapshot=snapshot, snapshot_at=at)
            if cancel_after is not None:
                seen = []
                extra["on_token"] = lambda e, seen=seen, n=cancel_after: seen.append(e) or len(seen) < n
            requests.append(spec.request(**extra))
        results = self.engine.generate(requests)
        for (spec, _, _, cancel_after), r in zip(batch, results):
            if self._needs_parked(spec):
                assert (r.error, r.tokens) == (ErrorCode.MODEL_PARKED, []), (spec, r)
                continue
            want = self._reference(spec)
            if cancel_after is not None and cancel_after <= len(want):  # False from the last token cancels too
                assert r.error is ErrorCode.CANCELLED and r.finish_reason == FinishReason.CANCELLED.value, (spec, r)
                assert r.tokens == want[:len(r.tokens)] and len(r.tokens) >= cancel_after, (spec, r.tokens, want)
                continue
            assert r.ok, (spec, r.error, r.message)
            assert r.tokens == want, (spec, r.tokens, want)
            if spec.prompt in stored:
                assert r.prefill_tokens == 0, (spec, r.prefill_tokens)

    @rule(batch=st.lists(specs(), min_size=1, max_size=5), stop_after=st.integers(0, 12))
    def stream_closed_early(self, batch, stop_after):
        """A stream left after `stop_after` events (a `break`): its unfinished requests are cancelled, the tokens
        it gave are each request's reference tokens, and the engine is left clean (the invariant)."""
        if self.parked:
            return
        got: dict[int, list[int]] = {}
        events = self.engine.stream([spec.request() for spec in batch])
        for n, event in enumerate(events):
            if n == stop_after:
                break
            got.setdefault(event.request, []).append(event.token)
        events.close()
        for i, tokens in got.items():
            assert tokens == self._reference(batch[i])[:len(tokens)], (batch[i], tokens)

    @rule(spec=specs())
    def snapshot_from_on_token(self, spec):
        """`Engine.snapshot(request)` from the first token's callback stores the whole prompt: the same prompt
        then prefills nothing and gives the same tokens."""
        if self._needs_parked(spec):
            return
        taken, mine = [], []

        def first(event):
            if event.index == 0:
                taken.append(self.engine.snapshot(mine[0]))

        mine.append(spec.request(on_token=first))
        r = self.engine.generate(mine)[0]
        assert r.ok and r.tokens == self._reference(spec), (spec, r)
        assert len(taken) == 1 and taken[0].ids == spec.prompt
        if any(tuple(s.ids) == spec.prompt for s in self.engine.snapshots):  # stored (not over the budget)
            again = self.engine.generate([spec.request()])[0]
            assert again.ok and (again.tokens, again.prefill_tokens) == (self._reference(spec), 0), (spec, again)

    @rule(which=st.sampled_from(["target", "draft", "all"]))
    def park(self, which):
        self.engine.park(which)
        self.parked |= {"target", "draft"} if which == "all" else {which}

    @rule(which=st.sampled_from(["target", "all"]))
    def unpark(self, which):
        self.engine.unpark(which)
        self.parked -= {"target", "draft"} if which == "all" else {which}

    @precondition(lambda self: "draft" in self.parked and "target" not in self.parked)
    @rule()
    def unpark_draft(self):
        self.engine.unpark("draft")
        self.parked.discard("draft")

    @rule()
    def save_and_load_snapshots(self):
        path = os.path.join(self.dir, "snapshots.safetensors")
        before = sorted(tuple(s.ids) for s in self.engine.snapshots)
        self.engine.snapshots.save(path)
        self.engine.snapshots.clear()
        self.engine.snapshots.load(path)
        assert sorted(tuple(s.ids) for s in self.engine.snapshots) == before

    @invariant()
    def nothing_held(self):
        e = self.engine
        assert not e._slots, e._slots
        assert not e.tbook.active.any() and len(e.tbook.free_pages) == e.tspec.num_pages
        if e.dbook is not None:
            assert not e.dbook.active.any()
        assert e.snapshots.nbytes <= SNAPSHOT_BYTES


ENGINES: tuple[Engine, Engine] = ()  # type: ignore[assignment]
REFERENCE: dict[Spec, list[int]] = {}


@pytest.fixture(scope="module")
def engines():
    global ENGINES
    ENGINES = _engines()
    ENGINES[0].warmup()
    yield ENGINES
    ENGINES = ()


def test_engine_sessions_in_random_sequences(engines):
    EngineSessions.TestCase.settings = settings(
        derandomize=True, database=None, deadline=None, print_blob=True, max_examples=15, stateful_step_count=8,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    EngineSessions.TestCase().runTest()


def test_a_snapshot_saved_while_the_draft_is_parked(engines):
    """Found by the machine above: a plain request saving a snapshot while the draft was parked stored one
    without the draft's state, and after `unpark` a speculative request with that prompt failed with
    INVALID_SNAPSHOT ("made by another engine (draft differ)"); so did a plain one still parked. Now it is a hit
    while the draft is parked and a miss (a normal prefill) once it runs. And the snapshots' fingerprint, when
    first taken with the draft parked, described the model without it: every engine that never parked refused
    those snapshots."""
    engine, reference = engines
    engine.unpark("all")  # as the machine's last example left it
    engine.snapshots.clear()
    prompt = BASE[:12]
    want = {k: reference.generate([Request(prompt=prompt, max_new_tokens=6, speculative=k)])[0].tokens
            for k in (0, None)}
    engine._fingerprint = None  # as in a new engine: its first snapshot comes after the park
    engine.park("draft")
    try:
        saved = engine.generate([Request(prompt=prompt, max_new_tokens=6, speculative=0, snapshot=True)])[0]
        assert saved.ok and saved.tokens == want[0], saved
        assert len(engine.snapshots) == 1 and not next(iter(engine.snapshots)).has_draft
        hit = engine.generate([Request(prompt=prompt, max_new_tokens=6, speculative=0)])[0]
        assert hit.ok and (hit.tokens, hit.prefill_tokens) == (want[0], 0), hit
        assert engine.fingerprint() == reference.fingerprint()
    finally:
        engine.unpark("draft")
    missed = engine.generate([Request(prompt=prompt, max_new_tokens=6)])[0]
    assert missed.ok and (missed.tokens, missed.prefill_tokens) == (want[None], len(prompt)), missed
    engine.snapshots.clear()


def test_plain_requests_with_the_draft_parked_on_a_data_parallel_mesh(engines):
    """Found by the machine on a data-parallel mesh: with the draft parked, every plain request failed INTERNAL (the
    per-shard step's specs still named the MTP block, now None). Tokens equal one device's."""
    import jax

    from ds4jax.runtime.mesh import make_mesh, place_model

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    _, reference = engines
    engine = Engine(place_model(one_layer_model(), make_mesh(data=2, devices=jax.devices()[:2])), snapshot_bytes=0,
                    **SIZES)
    prompt = BASE[:9]
    engine.park("draft")
    got = engine.generate([Request(prompt=prompt, max_new_tokens=5, speculative=0),
                           Request(prompt=prompt, max_new_tokens=5)])
    assert got[0].ok and got[0].tokens == reference.generate([Request(prompt=prompt, max_new_tokens=5,
                                                                       speculative=0)])[0].tokens, got[0]
    assert got[1].error is ErrorCode.MODEL_PARKED
