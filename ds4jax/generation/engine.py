"""`Engine`: continuous batching over explicit pools with bounded compiles, streaming and cancellation.

The engine owns the pools (target, and the MTP draft's when speculating), their host books and a per-slot
device state. Requests wait in a FIFO queue and join free slots between calls; every iteration runs

1. admission: check (`request_checks`: errors become results, never exceptions), reserve every page the
   request can need, restore prefix snapshots;
2. one prefill chunk over the rows still prefilling (their first token is sampled on device);
3. one multi-step call over the decoding rows: up to M plain decode steps for plain rows, up to M speculative
   rounds for speculative ones; each returns early when a row finishes;
4. delivery (`delivery`): tokens go to `on_token` / `on_tokens` / the stream in order; finished or cancelled
   requests free and reset their slot.

Shapes come only from the buckets (`buckets.py`: one prefill width per prefill row bucket from a token budget,
`row_buckets` for decode), so `warmup()` compiles a small, fixed set of programs (it returns them with their
compile seconds, `programs.WarmupReport`) and after it no workload compiles anything (tests/test_engine.py
counts; tests/test_snapshots.py with snapshots and after unpark). Decode never pays for prefill width: the two
are separate programs.

The calls go through one `programs.Programs`: the fused programs of `fused_programs` on one device and on
one-stage meshes, `stage_programs.StagePrograms` stage by stage on a layer split. Admission (`admission`), the
prefill and decode calls (`prefill_calls`, `decode_calls`), parking (`parking`) and snapshot bookkeeping
(`slot_snapshots`) live in their own modules, row planning in `row_plan`.

Host work per call is kept off the per-token path: a call's outputs come back in one fetch, a request's fixed
row fields are written once at admission (`row_plan.SlotTable`), a row's tokens go out together unless a
callback, stop string or thinking budget must see them one by one (`Delivery.deliver`), and `generate` builds
no `TokenEvent` for a request without `on_token` (scripts/profile_engine_host.py measures it).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Iterator, Sequence

import numpy as np

from ds4jax.compilation_cache import ensure_compilation_cache
from ds4jax.errors import EngineBusy
from ds4jax.generation import draft_policy, engine_pools, lookup as lookup_mod, row_plan, run_ahead
from ds4jax.generation.admission import EngineAdmission
from ds4jax.generation.buckets import _positive, bucket, engine_buckets  # noqa: F401 (bucket: re-exported)
from ds4jax.generation.compiles import compile_count
from ds4jax.generation.decode_calls import EngineDecode
from ds4jax.generation.draft_policy import Adaptive
from ds4jax.generation.delivery import Delivery, EngineStats, Live  # noqa: F401 (EngineStats: re-exported)
from ds4jax.generation.engine_args import call_requests, check_engine_args
from ds4jax.generation.fused_programs import FusedPrograms
from ds4jax.generation.engine_pools import default_page_size, pool_dtype  # noqa: F401 (re-exported)
from ds4jax.generation.loops import Rows
from ds4jax.generation.parking import EngineParking, Parking
from ds4jax.generation.prefill_calls import EnginePrefill
from ds4jax.generation.programs import EngineWarmup, Programs, programs_for
from ds4jax.generation.request_checks import Limits
from ds4jax.generation.requests import ErrorCode, FinishReason, GenerateResult, Request, TokenEvent
from ds4jax.generation.slot_snapshots import EngineSnapshots, SlotSnapshots
from ds4jax.generation.snapshots import SnapshotStore
from ds4jax.model.handle import Model
from ds4jax.runtime import kv_quant
from ds4jax.runtime.kernels import Impl, resolve
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pools import PoolError
from ds4jax.runtime.roles import Role


class Engine(EngineAdmission, EnginePrefill, EngineDecode, EngineParking, EngineSnapshots, EngineWarmup):
    """Serve `Request`s on one model. See the module docstring; `generate`, `stream`, `warmup`, `stats`.

    model: a `Model` (with its MTP block when `speculative` > 0). speculative=k (or draft=True for k=2): draft k
    tokens per round with the MTP block; requests may opt out (`Request.speculative=0`) or cap k.
    adaptive: True or an `Adaptive`: each call picks its draft length (0 = plain) from the live batch and the
    acceptance so far, up to k (`draft_policy`); False: always k.
    draft_lengths (not adaptive): the draft lengths of the speculative programs, each in 1..k (default (k,)); a call
    runs the shortest that serves its rows' caps, else the longest. The pools stay sized for k: a one-shot engine
    (`buckets.one_shot`) sizes them for a bucket of its k and runs its k, so another k of that bucket shares its
    prefill and decode programs.
    Pools: `max_slots` x `max_context` exactly, or sized from `memory_budget_bytes` (`configure`).
    steps_per_call: M, the most tokens (plain) or rounds (speculative) per host round trip (a layer split: per
    host loop of single steps).
    prefill_chunk: the most prompt tokens a row takes per prefill call; prefill_tokens: the most one prefill call
    takes in all (default max(prefill_chunk, 16 x max_slots)), so a call of R rows takes
    min(prefill_chunk, prefill_tokens // R) per row.
    row_buckets / prefill_row_buckets: the row counts of decode / prefill calls (`buckets.engine_buckets`).
    kernels: `Impl` or its name; default from DS4JAX_KERNELS / the backend (`ds4jax.runtime.kernels`).
    logprobs: N > 0 makes every program also return each token's log-probability and its N most likely
    alternatives (requests ask with `Request.logprobs` <= N); 0 (the default) compiles the programs without them.
    kv_dtype: "auto" (the KV pools in the model's dtype) or "fp8" (E4M3 with a float32 scale per row, the device's
    variant: `ds4jax.runtime.kv_quant`); with a memory budget, fp8 fits about twice the tokens.
    lookup (with speculative=k): n > 0 lets a greedy row draft the k tokens that followed the latest earlier
    occurrence of its last >= n tokens (prompt lookup, `ds4jax.generation.lookup`); a round whose running rows all
    found one runs no MTP draft step. None (the default): 3 when speculating on one program per call (not on a
    layer split), else 0; 0: the MTP block drafts every round."""

    def __init__(self, model: Model, *, max_slots: int = 8, max_context: int = 4096, speculative: int = 0,
                 draft: bool = False, memory_budget_bytes: int | None = None, page_size: int | None = None,
                 prefill_chunk: int = 256, prefill_tokens: int | None = None,
                 row_buckets: Sequence[int] | None = None, prefill_row_buckets: Sequence[int] | None = None,
                 steps_per_call: int = 8, kernels: Impl | str | None = None,
                 tokenizer=None, max_queue: int | None = None, snapshot_bytes: int = 256 << 20,
                 check_finite: bool = True, adaptive: bool | Adaptive = False, logprobs: int = 0,
                 kv_dtype: str = "auto", draft_lengths: Sequence[int] | None = None, lookup: int | None = None):
        # every argument but these (each checked where it is used) by type and range; a new one needs its check
        check_engine_args(**{k: v for k, v in locals().items() if k not in ("self", "model", "draft", "tokenizer",
                                                                             "adaptive", "kv_dtype")})
        ensure_compilation_cache()  # compiled programs persist across processes (ds4jax.compilation_cache)
        cfg = model.config
        k = int(speculative) or (2 if draft else 0)
        if k < 0:
            raise PoolError(f"speculative must be >= 0, got {speculative}")
        if k and not model.has_mtp:
            raise PoolError("speculative decoding needs the MTP block; this checkpoint has no mtp.* tensors")
        try:
            self.lookup = 0 if lookup is None else lookup_mod.check_min_n(lookup)
        except ValueError as exc:
            raise PoolError(str(exc)) from None
        if self.lookup and not k:
            raise PoolError(f"lookup={lookup} drafts inside speculative rounds: give speculative=k > 0 too")
        self.layout = model.layout  # a `MeshLayout` when the params are placed on a mesh
        self.data = 1 if self.layout is None else self.layout.axis_sizes["data"]
        # a shallow copy: park/unpark swap the engine's entries, never the caller's dict
        self.model = Model(cfg, dict(model.params), self.layout, scan_layers=model.scan_layers)
        self.cfg, self.k, self.tokenizer = cfg, k, tokenizer
        self.policy = draft_policy.policy(k, adaptive, draft_lengths)  # the draft length of each call
        self.logprobs = int(logprobs)
        if not 0 <= self.logprobs <= cfg.vocab_size:
            raise PoolError(f"logprobs must be in [0, {cfg.vocab_size}] (the vocabulary), got {logprobs}")
        self.programs: Programs = programs_for(self.layout, cfg, self.model.params, self.logprobs)
        if self.lookup and not self.programs.supports_lookup:
            raise PoolError("lookup drafting does not run on a layer split (pass lookup=0)")
        if lookup is None and k and self.programs.supports_lookup:
            self.lookup = lookup_mod.DEFAULT_MIN_N
        self.kernels = resolve(kernels)
        self.max_queue = max_queue
        # NaN/Inf logits end that request with ErrorCode.NON_FINITE; False keeps generating (the greedy stand-in
        # token 0 replaces the bad draw) and only records `nonfinite_at` (`generate(check_finite=False)`)
        self.check_finite = bool(check_finite)
        self.steps_per_call = _positive(steps_per_call, "steps_per_call")  # 0 would loop on nothing
        common = dict(max_context=max_context, max_slots=max_slots, memory_budget_bytes=memory_budget_bytes,
                      draft_tokens=k + 1 if k else 0, page_size=page_size or default_page_size(cfg),
                      dtype=pool_dtype(model), kv_dtype=kv_quant.check_argument(kv_dtype))
        self.tspec: PoolSpec = engine_pools.pool_spec(self.model, Role.TARGET, self.data, **common)
        self.dspec: PoolSpec | None = engine_pools.pool_spec(self.model, Role.DRAFT, self.data, **common) if k else None
        # data-parallel pools: every call's rows split evenly over the data shards
        self.buckets = engine_buckets(self.tspec.max_slots, self.data, prefill_chunk=prefill_chunk,
                                      prefill_tokens=prefill_tokens, row_buckets=row_buckets,
                                      prefill_row_buckets=prefill_row_buckets)
        self.row_buckets, self.prefill_row_buckets = self.buckets.rows, self.buckets.prefill_rows
        self.limits = Limits(cfg.vocab_size, k, self.tspec.max_context, self.tspec.num_pages, self.tspec.page_size,
                             self.tspec.pages_per_slot > 0, self.logprobs)
        self.stats = EngineStats()
        self._table = row_plan.SlotTable(self.tspec.max_slots, cfg.vocab_size)  # admitted requests' fixed row fields
        self._out = Delivery(self.stats, tokenizer)
        self._parking = Parking()
        self._warm = False
        self._lock, self._owner = threading.Lock(), None  # see `_exclusive`
        self.snapshots = SnapshotStore(snapshot_bytes)
        self._slot_snaps = SlotSnapshots(self.programs, cfg, self.tspec, self.dspec)
        self._fingerprint: dict[str, str] | None = None
        self._reset_state()

    @property
    def stages(self):
        """The layer split's `StagePrograms`, or None when every call is one fused program."""
        return None if isinstance(self.programs, FusedPrograms) else self.programs

    # ---- pools and state -------------------------------------------------------------------------------------
    def _reset_state(self) -> None:
        self._new_state(Role.TARGET)
        self._new_state(Role.DRAFT)
        self._slots: dict[int, Live] = {}  # slot -> live request
        self._to_reset: set[int] = set()
        self._ahead: run_ahead.Ahead | None = None  # a plain decode call started before the last one was read
        self._read_at = 0.0  # when the last decode call's outputs were read
        self._wake = True  # this iteration's `Rows.wake` (set by `_run` from its queue and feed)

    def _new_state(self, role: Role) -> None:
        """Fresh pools, books and (target) per-slot state of a role."""
        p, vocab = self.programs, self.cfg.vocab_size
        if role is Role.DRAFT:
            self.dbook = engine_pools.book(self.dspec, vocab, self.data) if self.dspec else None
            self.dpool = self.dbook.sync(p.draft_zeros(self.dspec)) if self.dspec else None
        else:
            self.tbook = engine_pools.book(self.tspec, vocab, self.data)
            self.tpool = p.sync(self.tbook, p.zeros(self.tspec), self.tspec)
            self.slot_state = p.slot_state(engine_pools.slot_state_zeros(self.cfg, self.tspec))

    def _lost(self) -> bool:
        """Whether a failed call took the donated pools with it."""
        self._settle_ahead()
        if self.tpool is None:  # parked
            return False
        return self.programs.lost(self.tpool) or (self.dpool is not None and self.dpool.lengths.is_deleted())

    @property
    def _live_dspec(self) -> PoolSpec | None:
        return None if Role.DRAFT in self._parking else self.dspec

    # ---- public API ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _exclusive(self, what: str):
        """One call at a time: another thread's call waits for this one to end; a call from inside one on the same
        thread (a callback) would wait for itself and raises `EngineBusy` at once."""
        if self._owner == threading.get_ident():
            raise EngineBusy(f"Engine.{what}: called from inside another call of this engine on the same thread "
                             "(a callback or an open stream's loop); call it after that call returns")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def generate(self, requests: Sequence[Request], *, on_result=None) -> list[GenerateResult]:
        """Run every request to completion; results in the same order. Never raises for a bad request.

        on_result(index, result) is called as each request finishes (batch jobs write results as they come).
        Thread-safe: calls from several threads run one after another, each with its own results and callbacks."""
        with self._exclusive("generate()"):
            gen = self._run(call_requests("generate", requests, on_result=on_result), on_result, streaming=False)
            while True:
                try:
                    next(gen)
                except StopIteration as stop:
                    return stop.value

    def stream(self, requests: Sequence[Request], *, on_result=None, feed=None, waiting=None) -> Iterator[TokenEvent]:
        """Yield a `TokenEvent` per token as it is delivered; `self.last_results` holds the results afterwards.
        Closing the stream early (a `break`, an exception in the loop) cancels its unfinished requests.

        feed() (optional) is called before every iteration and returns more requests to join this stream (their
        indices continue after `requests`); the stream ends once nothing is queued or running and feed() returned
        nothing: a server's driver thread (`ds4jax.serving.driver`) keeps one engine busy this way.
        waiting() (optional, with feed) says whether requests wait outside the engine for a slot. A decode call
        ends as soon as one of its rows finishes only while a request waits (here or, per waiting(), at the
        feed); otherwise a finished row idles to the call's end (at most `steps_per_call` - 1 steps) and the call
        runs on. Without waiting(), any feed may bring a request at any time, so every finished row ends its call.
        The stream holds the engine from its first event until it ends or is closed: other threads' calls wait."""
        with self._exclusive("stream()"):
            gen = self._run(call_requests("stream", requests, on_result=on_result, feed=feed, waiting=waiting),
                            on_result, feed, feed_waits=waiting)
            try:
                while True:
                    try:
                        yield from next(gen)
                    except StopIteration as stop:
                        self.last_results = stop.value
                        return
            finally:
                gen.close()

    def iterations(self, requests: Sequence[Request], *, on_result=None, feed=None, waiting=None) -> Iterator[None]:
        """`stream` for a caller that takes every token through the requests' callbacks (`Request.on_token` /
        `on_tokens`): it yields None once after each engine iteration (all the tokens it delivered are with the
        callbacks by then) and builds no `TokenEvent` list for the stream, so it costs nothing per token
        beyond the callbacks (a server's driver thread flushes what its callbacks buffered at each yield).
        feed, waiting, on_result, closing early and `last_results`: as in `stream`."""
        with self._exclusive("iterations()"):
            gen = self._run(call_requests("iterations", requests, on_result=on_result, feed=feed,
                                          waiting=waiting), on_result, feed, streaming=False,
                            feed_waits=waiting, ticks=True)
            try:
                while True:
                    try:
                        next(gen)
                    except StopIteration as stop:
                        self.last_results = stop.value
                        return
                    yield None
            finally:
                gen.close()

    # ---- the loop --------------------------------------------------------------------------------------------
    def _run(self, requests: list, on_result=None, feed=None, streaming=True,
             feed_waits=None, ticks=False) -> Iterator[list[TokenEvent] | None]:
        """Yields each iteration's `TokenEvent`s (none when not `streaming`: `generate` reads only the results,
        so no event is built for a request without `on_token`); returns the results. ticks (not streaming):
        yields None after each iteration instead (`iterations`)."""
        results: list[GenerateResult | None] = []
        queue: collections.deque[Live] = collections.deque()
        self._out.on_result = on_result

        def enqueue(req) -> None:
            i = len(results)
            got = self._check(i, req, time.perf_counter())
            if isinstance(got, Live) and self.max_queue is not None and len(queue) >= self.max_queue:
                got = GenerateResult(error=ErrorCode.CAPACITY_EXCEEDED,
                                     message=f"request {i}: the queue is full ({self.max_queue} waiting)")
            if isinstance(got, GenerateResult):
                results.append(got)
                self._out.count(FinishReason.ERROR, got.error)
                self._out.report(i, got)
            else:
                queue.append(got)
                results.append(got.result)

        for req in requests:
            enqueue(req)
        before = compile_count()
        try:
            while True:
                for req in (feed() if feed is not None else ()):
                    enqueue(req)
                if not (queue or self._slots):
                    break
                events: list[TokenEvent] | None = [] if streaming else None
                waiting = bool(queue) and len(self._slots) < self.tspec.max_slots  # admission may rewrite pages
                if self._ahead is not None and waiting:
                    self._guarded(self._ahead.part, lambda: self._land(events))
                restored = self._admit(queue)
                if restored:
                    self._guarded(restored, lambda: self._restore_once(restored, events))
                # (not the rows admission already finished: an invalid snapshot, a failed restore)
                prefilling = self._fit([lv for lv in self._slots.values() if lv.prefilling and not lv.done],
                                       self.prefill_row_buckets[-1])
                if prefilling:
                    self._guarded(prefilling, lambda: self._prefill_once(prefilling, events))
                decoding = [lv for lv in self._slots.values() if not lv.prefilling and not lv.done]
                # a call ends as a row finishes only for a request still waiting for a slot (in the queue, or at
                # the feed: a server's), otherwise finished rows idle to the call's end
                self._wake = bool(queue) or feed is not None and (feed_waits is None or feed_waits())
                parts = list(self._decode_parts(decoding))
                # a call may run ahead when nothing is queued or still prefilling (an admission or a prefill lands
                # it first): judged after this iteration's admission and prefill, so a request's first decode call,
                # right after its one-chunk prefill, starts its second
                ahead_ok = len(parts) == 1 and not queue and not any(
                    lv.prefilling and not lv.done for lv in self._slots.values())
                for part, k in parts:
                    self._guarded(part, lambda: self._decode_once(part, k, events, ahead_ok))
                self._release_finished()
                if events:
                    yield events
                elif ticks:
                    yield None
        finally:
            self._settle_ahead()  # rows that finished while it ran: its pool is the engine's, its tokens nobody's
            self._ahead = None
            self._abandon()
            n = compile_count() - before
            self.stats.compiles += n
            if self._warm:
                self.stats.compiles_after_warmup += n
        return results

    def _abandon(self) -> None:
        """The caller left `_run` with requests still running (a closed stream, Ctrl-C, an exception from a
        callback): they are cancelled and their slots freed, so no later call runs them. `on_result` is not
        called for them: they did not finish (a batch job reruns them)."""
        self._out.on_result = None
        if not self._slots:
            return
        for lv in self._slots.values():
            if not lv.done:
                self._out.finish(lv, FinishReason.CANCELLED, ErrorCode.CANCELLED, f"request {lv.index}: the caller "
                                 "stopped before it finished (stream closed or interrupted)")
        self._release_finished()
        if self._lost():  # interrupted inside a call that donated the pools: start over with fresh ones
            self._reset_state()

    def _guarded(self, group: list[Live], fn) -> None:
        """Run one engine call for `group`; an exception fails those requests (INTERNAL), never the caller and
        never the other requests, unless the donated pools were lost with it (then every running request)."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - an engine bug must not take other callers down
            lost = self._lost()
            for lv in (list(self._slots.values()) if lost else group):
                if not lv.done:
                    self._out.finish(lv, FinishReason.ERROR, ErrorCode.INTERNAL, f"engine step failed: {exc!r}")
            if lost:  # donated pools are gone: start over with fresh ones
                self._slots.clear()
                self._reset_state()

    # ---- rows of a call ----------------------------------------------------------------------------------------
    def _decode_parts(self, decoding: list[Live]) -> Iterator[tuple[list[Live], int]]:
        """The decode calls of an iteration, each (rows, draft length): the policy picks the draft length of the
        speculative-capable rows; those it sends plain join the plain rows' calls."""
        most = self.row_buckets[-1]
        capable = [lv for lv in decoding if lv.k > 0]
        rows = len(self._row_plan(capable[:most], self.row_buckets))
        # with nothing waiting for a slot (`_wake` off) these rows drain: the policy weighs their slowest one
        k = self.policy.choose(capable[:most], rows, drain=not self._wake) if capable else 0
        for group, kk in (([lv for lv in decoding if not (lv.k and k)], 0), ([lv for lv in capable if k], k)):
            for start in range(0, len(group), most):
                yield group[start: start + most], kk

    def _fit(self, live: list[Live], rows: int) -> list[Live]:
        return row_plan.fit(live, rows, self.tspec.max_slots, self.data)

    def _row_plan(self, live: list[Live], buckets: Sequence[int]) -> list[Live | None]:
        return row_plan.plan(live, buckets, self.tspec.max_slots, self.data)

    def _padding_rows(self, plan: list[Live | None], k_cap=None) -> Rows:
        # a decode call ends early when a row finishes only if a request waits for a slot (`Rows.wake`)
        return row_plan.rows(plan, self._slots.keys(), self._table, k_cap, wake=self._wake)

    # ---- the calls (one place each, so a test can wrap one) ---------------------------------------------------
    def _prefill_call(self, rows: Rows, token_ids, n_tokens, next_ids, finishing):
        """-> (first tokens, their `TokenLogprobs` or None)."""
        first, self.tpool, self.dpool, self.slot_state, lp = self.programs.prefill(
            self.model.params, self.tpool, self.dpool, self.slot_state, rows, token_ids, n_tokens, next_ids,
            finishing, spec=self.tspec, dspec=self._live_dspec, kernels=self.kernels)
        return first, lp

    def _decode_call(self, rows: Rows):
        out, self.tpool = self.programs.decode(self.model.params, self.tpool, rows, spec=self.tspec,
                                               kernels=self.kernels, max_steps=self.steps_per_call)
        return out

    def _spec_call(self, rows: Rows):
        """Speculative rounds with the fewest drafts that serve every row's cap (`Rows.k_cap`)."""
        cap = int(np.max(rows.k_cap))
        k = next((k for k in self.policy.ks if k >= cap), self.policy.ks[-1])
        if self.lookup and rows.history is None:  # the warm-up's padding rows: nothing to look up
            rows = rows._replace(history=lookup_mod.host_history([None] * len(rows.slots)))
        out, self.tpool, self.dpool, self.slot_state = self.programs.speculate(
            self.model.params, self.tpool, self.dpool, self.slot_state, rows, spec=self.tspec, dspec=self.dspec,
            k=k, kernels=self.kernels, max_rounds=self.steps_per_call, lookup=self.lookup)
        return out

    def _restore_call(self, rows: Rows, sampled, next_ids):
        """-> (first tokens, their `TokenLogprobs` or None)."""
        first, self.dpool, self.slot_state, lp = self.programs.restore(
            self.model.params, self.dpool, self.slot_state, rows, sampled, next_ids, dspec=self._live_dspec,
            kernels=self.kernels)
        return first, lp
