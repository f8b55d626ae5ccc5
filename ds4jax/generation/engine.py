"""`Engine`: continuous batching over explicit pools with bounded compiles, streaming and cancellation.

The engine owns the pools (target, and the MTP draft's when speculating), their host books and a per-slot
device state. Requests wait in a FIFO queue and join free slots between calls; every iteration runs

1. admission: validate (errors become results, never exceptions), reserve every page the request can need;
2. one prefill chunk over the rows still prefilling (their first token is sampled on device);
3. one multi-step call over the decoding rows: `decode_loop` (up to M tokens) for plain rows and
   `speculative_loop` (up to M rounds) for speculative ones; each returns early when a row finishes;
4. delivery: tokens go to `on_token` / the stream in order; finished or cancelled requests free and reset
   their slot.

Shapes come only from the buckets (`buckets.py`: one prefill width per prefill row bucket from a token budget,
`row_buckets` for decode), so `warmup()` compiles a small, fixed set of programs (it returns them with their
compile seconds, `programs.WarmupReport`) and after it no workload compiles anything (tests/test_engine.py
counts; tests/test_snapshots.py with snapshots and after unpark, weights committed to the device as loaded
checkpoints are). Decode never pays for prefill
width: the two are separate programs.

On one device and on one-stage meshes the calls are the fused programs of `loops` / `spec_rounds`; on a layer
split `stage_programs.StagePrograms` runs the same prefill and plain decode calls stage by stage, and prefix
snapshots per stage pool (no speculative rounds there).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.compilation_cache import ensure_compilation_cache
from ds4jax.generation import logprob_rows, loops, snapshots, spec_rounds
from ds4jax.generation.buckets import _positive, bucket, engine_buckets  # noqa: F401 (bucket: re-exported)
from ds4jax.generation.compiles import compile_count
from ds4jax.generation.programs import Recorder, WarmupReport
from ds4jax.generation.request_checks import request_problem
from ds4jax.generation.loops import MAX_FORCED, MAX_STOP_IDS, NO_LIMIT, Rows, SlotState
from ds4jax.generation.requests import ErrorCode, FinishReason, GenerateResult, Request, TokenEvent
from ds4jax.generation.sampling import seed_key_data
from ds4jax.generation.snapshots import Snapshot, SnapshotStore
from ds4jax.model.handle import Model
from ds4jax.runtime import pools, precompile
from ds4jax.runtime.data_parallel import local_spec, rows_over_data
from ds4jax.runtime.distributed import fetch  # device_get across processes (data-parallel rows)
from ds4jax.runtime.kernels import Impl, resolve
from ds4jax.runtime.pool_spec import PoolSpec, configure
from ds4jax.runtime.pools import PoolBook, PoolError
from ds4jax.runtime.roles import Role

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def default_page_size(cfg) -> int:
    """The peers' 256-token page, or the smallest multiple of both compression ratios above it."""
    step = math.lcm(cfg.csa_ratio, cfg.hca_ratio)
    return -(-256 // step) * step


def pool_dtype(model: Model) -> str:
    return jnp.dtype(model.params["embed"].dtype).name


@jax.jit
def _slot_rows(state: SlotState, slot):
    return state.last_logits[slot], state.last_stream[slot]


@functools.partial(jax.jit, donate_argnames=("state",))
def _set_slot_rows(state: SlotState, slot, logits, stream) -> SlotState:
    return rows_over_data(state._replace(
        last_logits=state.last_logits.at[slot].set(logits),
        last_stream=state.last_stream.at[slot].set(stream.astype(state.last_stream.dtype))))


def _placements(tree) -> list:
    """Each leaf's sharding if it is committed to it, else None: parked weights come back exactly where they were
    (a warmed-up program keys its executable on whether each argument is committed)."""
    return [x.sharding if getattr(x, "committed", False) else None for x in jax.tree.leaves(tree)]


@dataclasses.dataclass
class EngineStats:
    prefill_steps: int = 0  # prefill chunk calls
    decode_calls: int = 0  # multi-step plain decode calls
    decode_steps: int = 0  # decode steps inside them
    spec_calls: int = 0  # multi-round speculative calls
    spec_rounds: int = 0
    tokens: int = 0  # tokens delivered
    prompt_tokens: int = 0  # prompt tokens prefilled
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    compiles: int = 0  # XLA compilations that happened inside engine calls (warmup included)
    compiles_after_warmup: int = 0
    snapshots_saved: int = 0
    snapshot_hits: int = 0  # requests restored from a snapshot (exact or prefix)


@dataclasses.dataclass
class _Live:
    index: int
    request: Request
    ids: list[int]
    result: GenerateResult
    k: int  # accepted-draft cap (0 = plain decoding)
    key_data: np.ndarray
    stop: np.ndarray
    submitted: float
    slot: int = -1
    pos: int = 0  # prompt tokens prefilled
    cur: int = 0
    admitted: float = 0.0
    first_token: float = 0.0
    done: bool = False
    snap_points: tuple[int, ...] = ()  # prompt lengths after which to save a prefix snapshot
    restored: int = 0  # prefix length restored from a snapshot (0 = none)
    # thinking budget: whether the span is open, its tokens so far, finished (closed or forced), forced ids
    in_span: bool = False
    span_count: int = 0
    budget_done: bool = False
    forced: list = dataclasses.field(default_factory=list)
    recent: list = dataclasses.field(default_factory=list)


class Engine:
    """Serve `Request`s on one model. See the module docstring; `generate`, `stream`, `warmup`, `stats`.

    model: a `Model` (with its MTP block when `speculative` > 0). speculative=k (or draft=True for k=2): draft k
    tokens per round with the MTP block; requests may opt out (`Request.speculative=0`) or cap k.
    Pools: `max_slots` x `max_context` exactly, or sized from `memory_budget_bytes` (`configure`).
    steps_per_call: M, the most tokens (plain) or rounds (speculative) per host round trip (a layer split: per
    host loop of single steps).
    prefill_chunk: the most prompt tokens a row takes per prefill call; prefill_tokens: the most one prefill call
    takes in all (default max(prefill_chunk, 16 x max_slots)), so a call of R rows takes
    min(prefill_chunk, prefill_tokens // R) per row.
    row_buckets / prefill_row_buckets: the row counts of decode / prefill calls (`buckets.engine_buckets`).
    kernels: `Impl` or its name; default from DS4JAX_KERNELS / the backend (`ds4jax.runtime.kernels`).
    logprobs: N > 0 makes every program also return each token's log-probability and its N most likely
    alternatives (requests ask with `Request.logprobs` <= N); 0 (the default) compiles the programs without them."""

    def __init__(self, model: Model, *, max_slots: int = 8, max_context: int = 4096, speculative: int = 0,
                 draft: bool = False, memory_budget_bytes: int | None = None, page_size: int | None = None,
                 prefill_chunk: int = 256, prefill_tokens: int | None = None,
                 row_buckets: Sequence[int] | None = None, prefill_row_buckets: Sequence[int] | None = None,
                 steps_per_call: int = 8, kernels: Impl | str | None = None,
                 tokenizer=None, max_queue: int | None = None, snapshot_bytes: int = 256 << 20,
                 check_finite: bool = True, logprobs: int = 0):
        ensure_compilation_cache()  # compiled programs persist across processes (ds4jax.compilation_cache)
        cfg = model.config
        k = int(speculative) or (2 if draft else 0)
        if k < 0:
            raise PoolError(f"speculative must be >= 0, got {speculative}")
        if k and not model.has_mtp:
            raise PoolError("speculative decoding needs the MTP block; this checkpoint has no mtp.* tensors")
        self.layout = model.layout  # a `MeshLayout` when the params are placed on a mesh
        self.data = 1 if self.layout is None else self.layout.axis_sizes["data"]
        self.stages = None  # a layer split runs stage by stage (`StagePrograms`), everything else fused programs
        if self.layout is not None and self.layout.num_stages > 1:
            from ds4jax.generation.stage_programs import StagePrograms

            self.stages = StagePrograms(self.layout, cfg)
        # a shallow copy: park/unpark swap the engine's entries, never the caller's dict
        self.model, self.cfg, self.k, self.tokenizer = Model(cfg, dict(model.params), self.layout,
                                                                   scan_layers=model.scan_layers), cfg, k, tokenizer
        self._parked: set[str] = set()
        self._host: dict[str, dict] = {}
        self.kernels = resolve(kernels)
        self.max_queue = max_queue
        # NaN/Inf logits end that request with ErrorCode.NON_FINITE; False keeps generating (the greedy stand-in
        # token 0 replaces the bad draw) and only records `nonfinite_at` (`generate(check_finite=False)`)
        self.check_finite = bool(check_finite)
        self.steps_per_call = _positive(steps_per_call, "steps_per_call")  # 0 would loop on nothing
        self.logprobs = int(logprobs)
        if not 0 <= self.logprobs <= cfg.vocab_size or (self.logprobs and self.stages is not None):
            raise PoolError(f"logprobs must be in [0, {cfg.vocab_size}] (the vocabulary) and 0 on a layer split, "
                            f"got {logprobs}")
        page = page_size or default_page_size(cfg)
        common = dict(max_context=max_context, max_slots=max_slots, memory_budget_bytes=memory_budget_bytes,
                      draft_tokens=k + 1 if k else 0, page_size=page, dtype=pool_dtype(model))
        self.tspec: PoolSpec = self._configure(Role.TARGET, common)
        self.dspec: PoolSpec | None = self._configure(Role.DRAFT, common) if k else None
        # data-parallel pools: every call's rows split evenly over the data shards
        self.buckets = engine_buckets(self.tspec.max_slots, self.data, prefill_chunk=prefill_chunk,
                                      prefill_tokens=prefill_tokens, row_buckets=row_buckets,
                                      prefill_row_buckets=prefill_row_buckets)
        self.row_buckets, self.prefill_row_buckets = self.buckets.rows, self.buckets.prefill_rows
        self.stats = EngineStats()
        self._warm = False
        self._on_result = None
        self.snapshots = SnapshotStore(snapshot_bytes)
        self._fingerprint: dict[str, str] | None = None
        self._ratios = snapshots.entries_per_page(cfg, self.tspec)
        self._reset_state()

    # ---- state -----------------------------------------------------------------------------------------------
    def _reset_state(self) -> None:
        self._new_target_state()
        self._new_draft_state()
        self._slots: dict[int, _Live] = {}  # slot -> live request
        self._to_reset: set[int] = set()

    def _committed(self, tree):
        """`tree` committed to the weights' device. A jitted program keys its executable on whether each argument
        is committed; fresh arrays are not, a step's outputs are (when the weights are): without this, warmup
        (on fresh pools) and serving (on step outputs) would compile the same program twice."""
        sharding = getattr(self.model.params["embed"], "sharding", None)
        if not isinstance(sharding, jax.sharding.SingleDeviceSharding):
            return tree
        return jax.device_put(tree, sharding)

    def _new_draft_state(self) -> None:
        self.dbook = self._book(self.dspec) if self.dspec else None
        if self.dspec is None:
            self.dpool = None
        elif self.stages is not None:  # the draft lives on a layer split's last stage
            self.dpool = self.dbook.sync(self.stages.draft_zeros(self.dspec))
        else:
            self.dpool = self.dbook.sync(self._zeros(self.dspec))

    def _new_target_state(self) -> None:
        cfg, s = self.cfg, self.tspec.max_slots
        self.tbook = self._book(self.tspec)
        self.tpool = self._sync(self.tbook, self._zeros(self.tspec), self.tspec)
        stream = jnp.dtype(self.tspec.dtype)  # the model's activation dtype
        state = SlotState(jnp.zeros((s, cfg.vocab_size), jnp.float32), jnp.zeros((s, cfg.hc_mult, cfg.hidden_size), stream),
                          jnp.zeros((s, cfg.vocab_size), jnp.float32), jnp.zeros((s, cfg.hc_mult, cfg.hidden_size), stream))
        if self.stages is not None:  # beside the logits, on the last stage
            state = self.stages.slot_state(state)
        elif self.layout is not None:  # slot rows beside their pools (over data)
            state = jax.tree.map(lambda a: jax.device_put(a, self.layout.batch_sharding(a.shape)), state)
        self.slot_state = self._committed(state)

    # ---- placement: one device, or the model's mesh --------------------------------------------------------
    def _configure(self, role: Role, common: dict) -> PoolSpec:
        """Pool spec of a role; on a mesh `memory_budget_bytes` is per device and every data shard gets an equal
        share of the slots and pages."""
        if self.layout is not None and common["memory_budget_bytes"] is not None:
            rest = {k: v for k, v in common.items() if k != "memory_budget_bytes"}
            spec, _ = self.layout.configure(self.cfg, role=role, memory_budget_bytes=common["memory_budget_bytes"],
                                            params_dtype=self.model.params["embed"].dtype, **rest)
        else:
            spec = configure(self.cfg, role=role, **common)
        local_spec(spec, self.data)  # slots and pages divisible by data, or a PoolError naming them
        return spec

    def _book(self, spec: PoolSpec) -> PoolBook:
        if self.data > 1:
            from ds4jax.runtime.mesh_steps import ShardedPoolBook

            return ShardedPoolBook(spec, self.cfg.vocab_size, self.data)
        return PoolBook(spec, self.cfg.vocab_size)

    def _sync(self, book: PoolBook, pool, spec: PoolSpec):
        """`pool` with the book's page table and lengths (a layer split: every stage's pool)."""
        return book.sync(pool) if self.stages is None else self.stages.sync(book, pool, spec)

    def _dplaced(self, dpool):
        """The draft pool on its canonical placement (a layer split: on the last stage)."""
        return self._placed(dpool, self.dspec) if self.stages is None else self.stages.draft_placed(dpool, self.dspec)

    def _lost(self) -> bool:
        """Whether a failed call took the donated pools with it."""
        if self.tpool is None:  # parked
            return False
        draft_lost = self.dpool is not None and self.dpool.lengths.is_deleted()
        if self.stages is not None:
            return self.stages.lost(self.tpool) or draft_lost
        return self.tpool.lengths.is_deleted() or draft_lost

    def _zeros(self, spec: PoolSpec) -> pools.KVPool:
        if self.stages is not None:
            return self.stages.zeros(spec)
        return self._committed(pools.allocate(spec)) if self.layout is None else self.layout.pool_zeros(spec)

    def _placed(self, pool: pools.KVPool, spec: PoolSpec) -> pools.KVPool:
        """`pool` on its canonical placement (a program run outside the engine's steps, e.g. the slot reset,
        may return zero-size arrays replicated; the steps would then compile again for that input)."""
        if self.stages is not None:
            return self.stages.placed(pool, spec)
        return pool if self.layout is None else jax.device_put(pool, self.layout.pool_shardings(spec))

    def _on_mesh(self):
        """Trace and run the engine's programs under the model's mesh and rules (nothing on one device)."""
        return contextlib.nullcontext() if self.layout is None else self.layout.active()

    # ---- public API ------------------------------------------------------------------------------------------
    def generate(self, requests: Sequence[Request], *, on_result=None) -> list[GenerateResult]:
        """Run every request to completion; results in the same order. Never raises for a bad request.

        on_result(index, result) is called as each request finishes (batch jobs write results as they come)."""
        results: list[GenerateResult] | None = None
        gen = self._run(list(requests), on_result)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                results = stop.value
                break
        return results

    def stream(self, requests: Sequence[Request], *, on_result=None, feed=None) -> Iterator[TokenEvent]:
        """Yield a `TokenEvent` per token as it is delivered; `self.last_results` holds the results afterwards.
        Closing the stream early (a `break`, an exception in the loop) cancels its unfinished requests.

        feed() (optional) is called before every iteration and returns more requests to join this stream (their
        indices continue after `requests`); the stream ends once nothing is queued or running and feed() returned
        nothing: a server's driver thread (`ds4jax.serving.driver`) keeps one engine busy this way."""
        gen = self._run(list(requests), on_result, feed)
        try:
            while True:
                try:
                    yield from next(gen)
                except StopIteration as stop:
                    self.last_results = stop.value
                    return
        finally:
            gen.close()

    def warmup(self) -> WarmupReport:
        """Compile every program the engine can run, once each (on padding rows, which write nothing): a prefill
        program per prefill row bucket, a decode (and speculative) program per row bucket, and with snapshots on
        the restore and snapshot programs; then the slot reset. The fused prefill / decode / speculative / restore
        programs are lowered first and compiled side by side on a thread pool (`runtime/precompile.py`,
        ``DS4JAX_COMPILE_THREADS``), then each runs once. Returns the programs with their compile seconds
        (`print(engine.warmup())` shows the table; `.compiles` counts XLA compilations)."""
        if self._slots or self._parked:
            raise PoolError("warmup() needs an idle engine with nothing parked")
        rec = Recorder(lambda: jax.block_until_ready((self.tpool, self.dpool, self.slot_state)))
        pad = lambda rows: self._padding_rows([None] * rows)  # noqa: E731
        calls = []  # (kind, rows, width, run once on padding rows): the programs worth compiling in parallel
        for rows, width in self.buckets.prefill:
            z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
            calls.append(("prefill", rows, width, lambda rows=rows, width=width: self._prefill_call(
                pad(rows), z(rows, width), z(rows), z(rows, width), np.zeros(rows, bool))))
        for rows in self.row_buckets:
            calls.append(("decode", rows, self.steps_per_call, lambda rows=rows: self._decode_call(pad(rows))))
            if self.k:
                calls.append(("speculative", rows, self.steps_per_call, lambda rows=rows: self._spec_call(pad(rows))))
        if self.snapshots.budget_bytes > 0:
            rows = self.buckets.restore_rows
            calls.append(("restore", rows, 0, lambda rows=rows: self._restore_call(
                pad(rows), np.zeros(rows, bool), np.zeros(rows, np.int32))))
        compiled = [None] * len(calls)
        if self.stages is None:  # fused programs: lowered here, compiled side by side, then run below
            with precompile.capturing() as jobs:
                captured = [precompile.run_captured(run) for *_, run in calls]
            done = iter(precompile.compile_all(jobs))
            compiled = [next(done) if c else None for c in captured]
            rec.compile_threads = precompile.threads(sum(c is not None for c in compiled))
        for (kind, rows, width, run), pre in zip(calls, compiled):
            if kind == "restore":
                continue  # after the fingerprint, as before
            with rec.program(kind, rows, width, precompiled=pre):
                run()
        if self.snapshots.budget_bytes > 0:  # restore and snapshot programs (snapshot_bytes=0: none)
            with rec.program("fingerprint"):  # digests of the weights, which every snapshot carries
                self.fingerprint()
            kind, rows, width, run = calls[-1]
            with rec.program(kind, rows, precompiled=compiled[-1]):
                run()
            # snapshot programs: save slot 0 and restore it, through the host arrays a real snapshot holds (no
            # pages: every paged write is dropped; slot 0 is reset below)
            with rec.program("snapshot-save", 1):
                arrays = self._snapshot_arrays(0, 0)
            with rec.program("snapshot-load", 1):
                self._write_snapshot(0, arrays, pages=0, length=1)
        with rec.program("slot-reset"):
            self._to_reset.add(0)
            self._apply_resets()
        self._warm = True
        report = rec.report()
        self.stats.compiles += report.compiles
        return report

    # ---- validation ------------------------------------------------------------------------------------------
    def _validate(self, index: int, req: Request, now: float) -> _Live | GenerateResult:
        def fail(code: ErrorCode, message: str) -> GenerateResult:
            return GenerateResult(finish_reason=FinishReason.ERROR.value, error=code,
                                  message=f"request {index}: {message}")

        if not isinstance(req, Request):
            return fail(ErrorCode.INVALID_REQUEST, f"expected a ds4jax.Request, got {type(req).__name__}")
        problem = request_problem(req)  # types and ranges first: the checks below compare and index
        if problem:
            return fail(ErrorCode.INVALID_REQUEST, problem)
        v = self.cfg.vocab_size
        prompt = req.prompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return fail(ErrorCode.INVALID_REQUEST, "a text prompt needs an engine built with a tokenizer")
            ids = self.tokenizer.encode(prompt, add_bos=getattr(self.tokenizer, "bos_id", None) is not None)
        else:
            try:
                ids = [int(t) for t in np.asarray(prompt).reshape(-1).tolist()] if len(prompt) else []
            except (TypeError, ValueError):
                return fail(ErrorCode.INVALID_REQUEST, "prompt must be token ids or text")
        if not ids:
            return fail(ErrorCode.INVALID_REQUEST, "the prompt is empty (it needs at least one token)")
        bad = [i for i, t in enumerate(ids) if not 0 <= t < v]
        if bad:
            return fail(ErrorCode.INVALID_REQUEST, f"prompt token {ids[bad[0]]} at index {bad[0]} is outside the "
                                                   f"vocabulary [0, {v})")
        if not isinstance(req.max_new_tokens, (int, np.integer)) or req.max_new_tokens < 1:
            return fail(ErrorCode.INVALID_REQUEST, f"max_new_tokens must be an int >= 1, got {req.max_new_tokens!r}")
        if not (math.isfinite(req.temperature) and req.temperature >= 0):
            return fail(ErrorCode.INVALID_REQUEST, f"temperature must be finite and >= 0, got {req.temperature}")
        if not 0 < req.top_p <= 1:
            return fail(ErrorCode.INVALID_REQUEST, f"top_p must be in (0, 1], got {req.top_p}")
        if req.top_k < 0:
            return fail(ErrorCode.INVALID_REQUEST, f"top_k must be >= 0 (0 = off), got {req.top_k}")
        stops = tuple(req.stop_ids)
        if len(stops) > MAX_STOP_IDS:
            return fail(ErrorCode.INVALID_REQUEST, f"at most {MAX_STOP_IDS} stop ids are supported, got {len(stops)}")
        if any(not 0 <= int(s) < v for s in stops):
            return fail(ErrorCode.INVALID_REQUEST, f"stop ids {stops} must lie in the vocabulary [0, {v})")
        if req.stop_strings and self.tokenizer is None:
            return fail(ErrorCode.INVALID_REQUEST, "stop_strings need an engine built with a tokenizer")
        if req.on_token is not None and not callable(req.on_token):
            return fail(ErrorCode.INVALID_REQUEST, "on_token must be callable")
        k = self.k if req.speculative is None else req.speculative
        if not isinstance(k, (int, np.integer)) or k < 0 or k > self.k:
            return fail(ErrorCode.INVALID_REQUEST, f"speculative={req.speculative!r}: this engine drafts up to "
                                                   f"{self.k} tokens per round (0 = plain decoding)")
        if "target" in self._parked:
            return fail(ErrorCode.MODEL_PARKED, "the target model is parked (Engine.unpark('target'))")
        if k and "draft" in self._parked:
            return fail(ErrorCode.MODEL_PARKED, "the draft (MTP) model is parked; unpark('draft') or send "
                                                "speculative=0")
        need = len(ids) + req.max_new_tokens + (self.k + 1 if self.k else 0)
        if need > self.tspec.max_context:
            return fail(ErrorCode.PROMPT_TOO_LONG, f"{len(ids)} prompt tokens + {req.max_new_tokens} new tokens"
                        + (f" + {self.k + 1} speculative positions" if self.k else "")
                        + f" exceed max_context {self.tspec.max_context}")
        if self.tbook.pages_needed(need) > self.tspec.num_pages:
            return fail(ErrorCode.CAPACITY_EXCEEDED, f"needs {self.tbook.pages_needed(need)} pages; the pool has "
                                                     f"{self.tspec.num_pages}")
        budget = req.budget
        if budget is not None:
            seqs = (("close_ids", tuple(budget.close_ids), 1), ("open_ids", tuple(budget.open_ids), 0))
            if not isinstance(budget.max_tokens, (int, np.integer)) or budget.max_tokens < 1:
                return fail(ErrorCode.INVALID_REQUEST, f"budget.max_tokens must be an int >= 1, got "
                                                       f"{budget.max_tokens!r}")
            for name, seq, least in seqs:
                if not least <= len(seq) <= MAX_FORCED or any(not 0 <= int(t) < v for t in seq):
                    return fail(ErrorCode.INVALID_REQUEST, f"budget.{name} must hold {least}..{MAX_FORCED} ids "
                                                           f"in the vocabulary [0, {v}), got {seq}")
        if req.logprobs is not None and (not self.logprobs or req.logprobs > self.logprobs):
            return fail(ErrorCode.INVALID_REQUEST, f"logprobs={req.logprobs}: this engine returns at most "
                                                   f"{self.logprobs} alternatives (Engine(logprobs=N))"
                        if self.logprobs else "logprobs needs an engine built with Engine(logprobs=N)")
        points = set()
        for p in req.snapshot_at:
            if not isinstance(p, (int, np.integer)) or not 1 <= p <= len(ids):
                return fail(ErrorCode.INVALID_REQUEST, f"snapshot_at position {p!r} is outside [1, {len(ids)}]")
            points.add(int(p))
        if req.snapshot:
            points.add(len(ids))
        stop = np.full(MAX_STOP_IDS, -1, np.int32)
        stop[: len(stops)] = stops
        result = GenerateResult(prefill_tokens=len(ids), accepted_per_round=[] if k else None,
                                logprobs=None if req.logprobs is None else [])
        return _Live(index, req, ids, result, int(k), seed_key_data(req.seed), stop, now,
                     snap_points=tuple(sorted(points)), in_span=budget is not None and not budget.open_ids)

    # ---- the loop --------------------------------------------------------------------------------------------
    def _run(self, requests: list, on_result=None, feed=None) -> Iterator[list[TokenEvent]]:
        results: list[GenerateResult | None] = []
        queue: collections.deque[_Live] = collections.deque()
        self._on_result = on_result

        def enqueue(req) -> None:
            i, now = len(results), time.perf_counter()
            results.append(None)
            try:
                got = self._validate(i, req, now)
            except Exception as exc:  # noqa: BLE001 - e.g. a field of the wrong type: the request's problem
                got = GenerateResult(error=ErrorCode.INVALID_REQUEST, message=f"request {i}: {exc!r}")
            if not isinstance(got, GenerateResult) and self.max_queue is not None and len(queue) >= self.max_queue:
                got = GenerateResult(error=ErrorCode.CAPACITY_EXCEEDED,
                                     message=f"request {i}: the queue is full ({self.max_queue} waiting)")
            if isinstance(got, GenerateResult):
                results[i] = got
                self.stats.failed += 1
                if on_result is not None:
                    on_result(i, got)
            else:
                queue.append(got)
                results[i] = got.result

        for req in requests:
            enqueue(req)
        before = compile_count()
        try:
            while True:
                for req in (feed() if feed is not None else ()):
                    enqueue(req)
                if not (queue or self._slots):
                    break
                events: list[TokenEvent] = []
                restored = self._admit(queue)
                if restored:
                    self._guarded(restored, lambda: self._restore_once(restored, events))
                prefilling = self._fit([lv for lv in self._slots.values() if lv.pos < len(lv.ids)],
                                       self.prefill_row_buckets[-1])
                if prefilling:
                    self._guarded(prefilling, lambda: self._prefill_once(prefilling, events))
                decoding = [lv for lv in self._slots.values() if lv.pos == len(lv.ids) and not lv.done]
                plain = [lv for lv in decoding if lv.k == 0]
                spec = [lv for lv in decoding if lv.k > 0]
                for group, speculative in ((plain, False), (spec, True)):
                    for start in range(0, len(group), self.row_buckets[-1]):
                        part = group[start: start + self.row_buckets[-1]]
                        self._guarded(part, lambda: self._decode_once(part, speculative, events))
                self._release_finished()
                if events:
                    yield events
        finally:
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
        if not self._slots:
            return
        self._on_result = None
        for lv in self._slots.values():
            if not lv.done:
                self._finish(lv, FinishReason.CANCELLED, ErrorCode.CANCELLED, f"request {lv.index}: the caller "
                             "stopped before it finished (stream closed or interrupted)")
        self._release_finished()
        if self._lost():  # interrupted inside a call that donated the pools: start over with fresh ones
            self._reset_state()

    def _guarded(self, group: list[_Live], fn) -> None:
        """Run one engine call for `group`; an exception fails those requests (INTERNAL), never the caller and
        never the other requests, unless the donated pools were lost with it (then every running request)."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - an engine bug must not take other callers down
            lost = self._lost()
            for lv in (list(self._slots.values()) if lost else group):
                if not lv.done:
                    self._finish(lv, FinishReason.ERROR, ErrorCode.INTERNAL, f"engine step failed: {exc!r}")
            if lost:  # donated pools are gone: start over with fresh ones
                self._slots.clear()
                self._reset_state()

    def _admit(self, queue) -> list[_Live]:
        """Admit queued requests into free slots; returns those restored from a prefix snapshot."""
        if queue:  # freed slots are reset before they are reused (a one-shot engine never pays for it)
            self._apply_resets()
        admitted = []
        while queue and len(self._slots) < self.tspec.max_slots:
            lv = queue[0]
            need = len(lv.ids) + lv.request.max_new_tokens + (self.k + 1 if self.k else 0)
            if self.tbook.pages_needed(need) > len(self.tbook.free_pages):
                break  # wait for pages (FIFO: the head waits, nothing overtakes it)
            queue.popleft()
            slot = self.tbook.admit()
            self.tbook.reserve(slot, need)
            if self.dbook is not None:
                self.dbook.admit(slot)
                self.dbook.reserve(slot, need)
            lv.slot, lv.admitted = slot, time.perf_counter()
            lv.result.timings.queue_s = lv.admitted - lv.submitted
            self._slots[slot] = lv
            admitted.append(lv)
        if admitted:
            self.tpool = self._sync(self.tbook, self.tpool, self.tspec)
            if self.dpool is not None:
                self.dpool = self.dbook.sync(self.dpool)
        restored = []
        if len(self.snapshots):
            for lv in admitted:
                snap = self.snapshots.longest_prefix(lv.ids)
                if snap is not None:
                    self._guarded([lv], lambda: self._inject(lv, snap))
                    if not lv.done:
                        restored.append(lv)
        return restored

    def _apply_resets(self) -> None:
        if not self._to_reset:
            return
        slots = sorted(self._to_reset)
        if self.stages is not None:
            self.tpool = self._sync(self.tbook, self.stages.reset(self.tpool, slots, self.tspec), self.tspec)
        else:
            self.tpool = self.tbook.sync(self._placed(pools.reset_slots(self.tpool, slots), self.tspec))
        if self.dpool is not None:
            self.dpool = self.dbook.sync(self._dplaced(pools.reset_slots(self.dpool, slots)))
        self._to_reset.clear()

    def _fit(self, live: list[_Live], rows: int) -> list[_Live]:
        """The first of `live` that one call of `rows` rows can take (rows / data per data shard)."""
        if self.data == 1:
            return live[:rows]
        taken, out = collections.Counter(), []
        for lv in live:
            shard = lv.slot // (self.tspec.max_slots // self.data)
            if taken[shard] < rows // self.data:
                taken[shard] += 1
                out.append(lv)
        return out

    def _row_plan(self, live: list[_Live], buckets: Sequence[int]) -> list[_Live | None]:
        """The rows of one call: `live` padded (None) to the smallest bucket that holds them. With data-parallel
        pools, row block d (rows / data rows) serves the requests whose slots live on data shard d."""
        if self.data == 1:
            n = next(b for b in buckets if b >= len(live))
            return list(live) + [None] * (n - len(live))
        per = self.tspec.max_slots // self.data
        blocks = [[lv for lv in live if lv.slot // per == d] for d in range(self.data)]
        n = next(b for b in buckets if b // self.data >= max(map(len, blocks)))
        return [x for block in blocks for x in block + [None] * (n // self.data - len(block))]

    def _padding_rows(self, plan: list[_Live | None]) -> Rows:
        """Rows of a `_row_plan`: padding rows (None) get distinct unused slots (free slots first)."""
        live = [lv for lv in plan if lv is not None]
        used = {lv.slot for lv in live}
        spare = [s for s in range(self.tspec.max_slots) if s not in used and s not in self._slots]
        spare += [s for s in range(self.tspec.max_slots) if s not in used and s in self._slots]
        spare = iter(spare)
        slots = [next(spare) if lv is None else lv.slot for lv in plan]
        b = len(plan)
        arr = dict(slots=np.asarray(slots, np.int32), active=np.zeros(b, bool), cur=np.zeros(b, np.int32),
                   n_out=np.zeros(b, np.int32), max_new=np.ones(b, np.int32),
                   stop_ids=np.full((b, MAX_STOP_IDS), -1, np.int32), temperature=np.zeros(b, np.float32),
                   top_p=np.ones(b, np.float32), top_k=np.zeros(b, np.int32), key_data=np.zeros((b, 2), np.uint32),
                   k_cap=np.zeros(b, np.int32), limit=np.full(b, NO_LIMIT, np.int32),
                   forced=np.zeros((b, MAX_FORCED), np.int32), n_forced=np.zeros(b, np.int32))
        for r, lv in enumerate(plan):
            if lv is None:
                continue
            q = lv.request
            arr["active"][r] = True
            arr["cur"][r] = lv.cur
            arr["n_out"][r] = len(lv.result.tokens)
            arr["max_new"][r] = q.max_new_tokens
            arr["stop_ids"][r] = lv.stop
            # valid values beyond the device's types saturate: top_k >= vocab is "off", temperature <= float32 max
            arr["temperature"][r] = min(float(q.temperature), _FLOAT32_MAX)
            arr["top_p"][r] = q.top_p
            arr["top_k"][r] = min(int(q.top_k), self.cfg.vocab_size)
            arr["key_data"][r] = lv.key_data
            arr["k_cap"][r] = lv.k
            arr["forced"][r, : len(lv.forced)] = lv.forced
            arr["n_forced"][r] = len(lv.forced)
            budget = q.budget
            if budget is not None and not lv.budget_done and not lv.forced:
                # stop exactly at the budget's end; outside the span, N + 1 tokens cannot overshoot it
                arr["limit"][r] = budget.max_tokens - lv.span_count if lv.in_span else budget.max_tokens + 1
        return Rows(**arr)

    # ---- prefill ---------------------------------------------------------------------------------------------
    @staticmethod
    def _chunk_plan(lv: _Live, width: int) -> int:
        """Tokens of `lv`'s prompt the next chunk of `width` takes (a chunk ends exactly at each snapshot position)."""
        end = next((p for p in lv.snap_points if p > lv.pos), len(lv.ids))
        return min(end - lv.pos, width)

    def _prefill_call(self, rows: Rows, token_ids, n_tokens, next_ids, finishing):
        if self.stages is not None:
            first, self.tpool, self.dpool, self.slot_state = self.stages.prefill(
                self.model.params, self.tpool, self.dpool, self.slot_state, rows, token_ids, n_tokens, next_ids,
                finishing, spec=self.tspec, dspec=self._live_dspec, kernels=self.kernels)
            return first, None
        with self._on_mesh():
            first, self.tpool, self.dpool, self.slot_state, lp = loops.prefill_call(
                self.model.params, self.tpool, self.dpool, self.slot_state, rows, token_ids, n_tokens, next_ids,
                finishing, cfg=self.cfg, tspec=self.tspec, dspec=self._live_dspec, kernels=self.kernels,
                logprobs=self.logprobs)
        return first, lp

    def _prefill_once(self, live: list[_Live], events: list[TokenEvent]) -> None:
        plan = self._row_plan(live, self.prefill_row_buckets)
        row_of = {lv.slot: r for r, lv in enumerate(plan) if lv is not None}
        width = self.buckets.width(len(plan))  # the token budget's share per row of this row bucket
        n = [self._chunk_plan(lv, width) for lv in live]
        rows = self._padding_rows(plan)
        b = rows.slots.shape[0]
        tok = np.zeros((b, width), np.int32)
        nxt = np.zeros((b, width), np.int32)
        n_tokens = np.zeros(b, np.int32)
        finishing = np.zeros(b, bool)
        for lv, c in zip(live, n):
            r = row_of[lv.slot]
            tok[r, :c] = lv.ids[lv.pos: lv.pos + c]
            follow = lv.ids[lv.pos + 1: lv.pos + c + 1]
            nxt[r, : len(follow)] = follow
            n_tokens[r] = c
            finishing[r] = lv.pos + c == len(lv.ids)
        self.tbook.check_extend(rows.slots, tok, n_tokens)  # padding rows (n_tokens 0) are not looked at
        first, lp = self._prefill_call(rows, tok, n_tokens, nxt, finishing)
        self.stats.prefill_steps += 1
        self.stats.prompt_tokens += int(n_tokens.sum())
        self.tbook.commit(rows.slots, n_tokens)
        if self.dbook is not None:
            self.dbook.commit(rows.slots, n_tokens)
        if finishing.any():
            first, lp = np.asarray(fetch(first)), logprob_rows.fetch(lp, [lv.request for lv in live])
        now = time.perf_counter()
        for lv, c in zip(live, n):
            r = row_of[lv.slot]
            lv.pos += c
            if lv.pos in lv.snap_points:
                self._save_snapshot(lv)
            if finishing[r]:
                lv.first_token = now
                lv.result.timings.prefill_s = now - lv.admitted
                token = int(first[r])
                if token < 0:  # the logits were not finite
                    lv.result.nonfinite_at, token = 0, 0
                    if self.check_finite:
                        self._fail_nonfinite(lv)
                        continue
                self._deliver(lv, [token], events, logprob_rows.first(lp, r, lv.request.logprobs))
                if not lv.done:
                    self._check_finished(lv)

    # ---- decode ----------------------------------------------------------------------------------------------
    def _decode_call(self, rows: Rows):
        if self.stages is not None:
            out, self.tpool = self.stages.decode(self.model.params, self.tpool, rows, spec=self.tspec,
                                                 kernels=self.kernels, max_steps=self.steps_per_call)
            return out
        with self._on_mesh():
            out, self.tpool = loops.decode_loop(self.model.params, self.tpool, rows, cfg=self.cfg, spec=self.tspec,
                                                kernels=self.kernels, max_steps=self.steps_per_call,
                                                logprobs=self.logprobs)
        return out

    def _spec_call(self, rows: Rows):
        if self.stages is not None:
            out, self.tpool, self.dpool, self.slot_state = self.stages.speculate(
                self.model.params, self.tpool, self.dpool, self.slot_state, rows, spec=self.tspec, dspec=self.dspec,
                k=self.k, kernels=self.kernels, max_rounds=self.steps_per_call)
            return out
        with self._on_mesh():
            out, self.tpool, self.dpool, self.slot_state = spec_rounds.speculative_loop(
                self.model.params, self.tpool, self.dpool, self.slot_state, rows, cfg=self.cfg, tspec=self.tspec,
                dspec=self.dspec, k=self.k, kernels=self.kernels, max_rounds=self.steps_per_call,
                logprobs=self.logprobs)
        return out

    def _decode_once(self, part: list[_Live], speculative: bool, events: list[TokenEvent]) -> None:
        plan = self._row_plan(part, self.row_buckets)
        row_of = {lv.slot: r for r, lv in enumerate(plan) if lv is not None}
        rows = self._padding_rows(plan)
        if speculative:
            out = self._spec_call(rows)
            tokens, rounds, accepted, bad = fetch((out.tokens, out.rounds, out.accepted, out.bad))
            self.stats.spec_calls += 1
            self.stats.spec_rounds += int(rounds)
        else:
            out = self._decode_call(rows)
            tokens, steps_run, bad = fetch((out.tokens, out.steps, out.bad))
            accepted = None
            self.stats.decode_calls += 1
            self.stats.decode_steps += int(steps_run)
        lp = logprob_rows.fetch(out.logprobs, [lv.request for lv in part])
        for lv in part:
            r = row_of[lv.slot]
            if bad[r] >= 0 and lv.result.nonfinite_at is None:
                lv.result.nonfinite_at = int(bad[r])
        lengths = np.asarray(fetch(self.tpool.lengths if self.stages is None else self.stages.lengths(self.tpool)))
        for lv in part:
            r = row_of[lv.slot]
            self.tbook.lengths[lv.slot] = lengths[lv.slot]
            if speculative:  # the draft pool advances with the target in every round
                self.dbook.lengths[lv.slot] = lengths[lv.slot]
            if accepted is not None:
                lv.result.accepted_per_round.extend(int(a) for a in accepted[r] if a >= 0)
            emitted = [int(t) for t in tokens[r] if t >= 0]
            if self.check_finite and bad[r] >= 0:  # only the tokens before the first bad one are real
                emitted = emitted[: max(int(bad[r]) - len(lv.result.tokens), 0)]
            self._deliver(lv, emitted, events, logprob_rows.row(lp, r, len(emitted), lv.request.logprobs))
            if self.check_finite and bad[r] >= 0 and not lv.done:
                self._fail_nonfinite(lv)
            if not lv.done:
                self._check_finished(lv)

    # ---- park / unpark (issue 9) ---------------------------------------------------------------------------------
    @property
    def _live_dspec(self) -> PoolSpec | None:
        return None if "draft" in self._parked else self.dspec

    @staticmethod
    def _parts(which: str, verb: str) -> list[str]:
        if which in ("", "all"):
            return ["target", "draft"]
        if which in ("target", "draft"):
            return [which]
        raise ValueError(f"{verb}({which!r}): expected '' or 'all' (both), 'target' or 'draft'")

    def park(self, which: str = "") -> None:
        """Release device memory: 'target' (its parameters, pools and per-slot state; the draft cannot run
        without the target's embedding and head either), 'draft' (the MTP parameters and the draft pool), or
        both ('' / 'all'). Parameters are kept in host memory; requests needing a parked model return
        `ErrorCode.MODEL_PARKED`. The engine deletes the device buffers of the model it was built with."""
        parts = self._parts(which, "park")
        if self._slots:
            raise PoolError("park() needs an idle engine")
        params = self.model.params
        if self.stages is not None:  # the draft's embedding copy goes with either part
            self.stages.drop_draft_params()
        for part in parts:
            if part in self._parked or (part == "draft" and not self.k):
                continue
            keys = ["mtp"] if part == "draft" else [k for k in params if k != "mtp"]
            self._host[part] = {k: (jax.device_get(params[k]), _placements(params[k])) for k in keys}
            doomed = [params[k] for k in keys]
            if part == "target":
                doomed += [self.tpool, self.slot_state]
                self.tpool = self.slot_state = None
            else:
                doomed.append(self.dpool)
                self.dpool = None
            for k in keys:
                params[k] = None
            for leaf in jax.tree.leaves(doomed):
                if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                    leaf.delete()
            self._parked.add(part)

    def unpark(self, which: str = "") -> None:
        """Bring parked models back (same parameters bit for bit, fresh pools); unparking only the draft while
        the target is parked is an error."""
        parts = self._parts(which, "unpark")
        if parts == ["draft"] and "target" in self._parked:
            raise PoolError("unpark('draft'): the target is parked and the draft needs it; unpark('target') or "
                            "unpark('all') first")
        for part in ("target", "draft"):
            if part not in parts or part not in self._parked:
                continue
            for k, (host, placements) in self._host.pop(part).items():
                leaves, treedef = jax.tree.flatten(host)
                self.model.params[k] = jax.tree.unflatten(
                    treedef, [jax.device_put(x, p) for x, p in zip(leaves, placements)])
            if part == "target":
                self._new_target_state()
            else:
                self._new_draft_state()
            self._parked.discard(part)

    @property
    def parked(self) -> tuple[str, ...]:
        return tuple(sorted(self._parked))

    # ---- prefix snapshots (issue 9) ----------------------------------------------------------------------------
    def fingerprint(self) -> dict[str, str]:
        if self._fingerprint is None:
            self._fingerprint = snapshots.fingerprint(self.model, self.tspec, self.dspec)
        return self._fingerprint

    def _save_snapshot(self, lv: _Live) -> Snapshot:
        """Snapshot `lv`'s slot right after prefilling its first lv.pos prompt tokens."""
        length = lv.pos
        pages = self.tbook.pages_needed(length)
        snap = Snapshot(tuple(lv.ids[:length]), self.fingerprint(), self._snapshot_arrays(lv.slot, pages), pages)
        self.snapshots.put(snap)
        self.stats.snapshots_saved += 1
        return snap

    def _snapshot_arrays(self, slot: int, pages: int) -> dict[str, np.ndarray]:
        """Host copies of `slot`'s state: its per-slot arrays, the rows of its first `pages` pages, last rows."""
        if self.stages is not None:
            t = self.stages.extract(self.tpool, slot, self.tspec)
        else:
            t = snapshots.extract(self.tpool, np.int32(slot), ratios=self._ratios)
        d = snapshots.extract(self.dpool, np.int32(slot), ratios=()) if self.dpool is not None else {}
        logits, stream = _slot_rows(self.slot_state, np.int32(slot))
        t, d, logits, stream = fetch((t, d, logits, stream))
        arrays = {f"target/{k}": v for k, v in t.items()}
        for name, per_page in self._ratios:
            arrays[f"target/{name}"] = arrays[f"target/{name}"][:, : pages * per_page]
        arrays.update({f"draft/{k}": v for k, v in d.items()})
        arrays["last_logits"], arrays["last_stream"] = logits, stream
        return arrays

    def _write_snapshot(self, slot: int, arrays: dict[str, np.ndarray], pages: int, length: int) -> None:
        """Write a snapshot's host arrays into `slot` (its pages already assigned): target at `length`, the draft
        at `length` - 1 (`restore_call` computes its pending row)."""
        target = {k[len("target/"):]: v for k, v in arrays.items() if k.startswith("target/")}
        for name, per_page in self._ratios:  # pad the held pages back to the slot's page capacity
            a = target[name]
            full = self.tspec.pages_per_slot * per_page
            target[name] = np.concatenate([a, np.zeros((a.shape[0], full - a.shape[1]) + a.shape[2:], a.dtype)], 1)
        if self.stages is not None:
            self.tpool = self.stages.inject(self.tpool, slot, target, pages, length, self.tspec)
        else:
            self.tpool = snapshots.inject(self.tpool, np.int32(slot), target, np.int32(pages), np.int32(length),
                                          ratios=self._ratios)
        if self._live_dspec is not None:
            draft = {k[len("draft/"):]: v for k, v in arrays.items() if k.startswith("draft/")}
            self.dpool = snapshots.inject(self.dpool, np.int32(slot), draft, np.int32(0), np.int32(length - 1),
                                          ratios=())
            if self.stages is not None:
                self.dpool = self.stages.draft_placed(self.dpool, self.dspec)
        self.slot_state = _set_slot_rows(self.slot_state, np.int32(slot), arrays["last_logits"],
                                         arrays["last_stream"])
        if self.stages is not None:  # canonical placement, as the stage programs return it
            self.slot_state = self.stages.slot_state(self.slot_state)

    def snapshot(self, which, at: int | None = None) -> Snapshot:
        """Snapshot a running request (its slot, or its `Request`) right after its prefill, e.g. from on_token of
        its first token. Positions inside the prompt (`at`) are taken during prefill: `Request(snapshot_at=...)`;
        `Request(snapshot=True)` snapshots the whole prompt without a callback."""
        live = [lv for lv in self._slots.values() if lv.slot == which or lv.request is which]
        if not live:
            raise PoolError(f"snapshot({which!r}): no running request there")
        lv = live[0]
        if at is not None and at != len(lv.ids):
            raise PoolError(f"snapshot(at={at}): only the whole prompt ({len(lv.ids)} tokens) can be snapshotted "
                            "after prefill; pass Request(snapshot_at=({at},)) to snapshot inside the prompt")
        if lv.pos < len(lv.ids) or len(lv.result.tokens) > 1:
            raise PoolError("snapshot(): a request can be snapshotted between its prefill and its first decode step")
        return self._save_snapshot(lv)

    def _inject(self, lv: _Live, snap: Snapshot) -> None:
        mine = self.fingerprint()
        bad = [k for k in sorted(set(mine) | set(snap.fingerprint)) if mine.get(k) != snap.fingerprint.get(k)]
        if bad or (self.dspec is not None) != any(k.startswith("draft/") for k in snap.arrays):
            self._finish(lv, FinishReason.ERROR, ErrorCode.INVALID_SNAPSHOT,
                         f"request {lv.index}: the prefix snapshot of {snap.length} tokens was made by another "
                         f"engine ({', '.join(bad) or 'draft'} differ)")
            return
        length = snap.length
        self._write_snapshot(lv.slot, snap.arrays, snap.pages, length)
        self.tbook.lengths[lv.slot] = length
        if self._live_dspec is not None:
            self.dbook.lengths[lv.slot] = length - 1
        lv.pos, lv.restored = length, length
        lv.result.prefill_tokens = len(lv.ids) - length
        self.stats.snapshot_hits += 1

    def _restore_once(self, live: list[_Live], events: list[TokenEvent]) -> None:
        """First tokens of exact hits (sampled from the saved logits) and the draft's pending row."""
        exact = [lv.restored == len(lv.ids) for lv in live]
        if self._live_dspec is None and not any(exact):
            return
        rest = list(live)
        while rest:
            part = self._fit(rest, self.buckets.restore_rows)
            rest = rest[len(part):] if self.data == 1 else [lv for lv in rest if lv not in part]
            plan = self._row_plan(part, (self.buckets.restore_rows,))
            row_of = {lv.slot: r for r, lv in enumerate(plan) if lv is not None}
            rows = self._padding_rows(plan)
            b = rows.slots.shape[0]
            sampled, nxt = np.zeros(b, bool), np.zeros(b, np.int32)
            for lv in part:
                r = row_of[lv.slot]
                sampled[r] = lv.restored == len(lv.ids)
                nxt[r] = 0 if sampled[r] else lv.ids[lv.restored]
            first, lp = self._restore_call(rows, sampled, nxt)
            if self._live_dspec is not None:
                for lv in part:
                    self.dbook.lengths[lv.slot] = lv.restored
            first, lp = np.asarray(fetch(first)), logprob_rows.fetch(lp, [lv.request for lv in part])
            now = time.perf_counter()
            for lv in part:
                r = row_of[lv.slot]
                if sampled[r]:
                    lv.first_token = now
                    lv.result.timings.prefill_s = now - lv.admitted
                    self._deliver(lv, [int(first[r])], events, logprob_rows.first(lp, r, lv.request.logprobs))
                    if not lv.done:
                        self._check_finished(lv)

    def _restore_call(self, rows: Rows, sampled, next_ids):
        """-> (first tokens, their logprobs or None)."""
        if self.stages is not None:
            first, self.dpool, self.slot_state = self.stages.restore(
                self.dpool, self.slot_state, rows, sampled, next_ids, params=self.model.params,
                dspec=self._live_dspec, kernels=self.kernels)
            return first, None
        with self._on_mesh():
            first, self.dpool, self.slot_state, lp = loops.restore_call(
                self.model.params, self.dpool, self.slot_state, rows, sampled, next_ids, cfg=self.cfg,
                dspec=self._live_dspec, kernels=self.kernels, logprobs=self.logprobs)
        return first, lp

    # ---- delivery and finishing ------------------------------------------------------------------------------
    def _deliver(self, lv: _Live, tokens: list[int], events: list[TokenEvent], logprobs=None) -> None:
        """logprobs: one `TokenLogprob` per token, or None (the request asked for none)."""
        del lv.forced[: len(tokens)]  # forced tokens are the first a call emits
        for j, t in enumerate(tokens):
            if lv.done:
                return
            self._track_budget(lv, t)
            res = lv.result
            lp = logprobs[j] if logprobs is not None else None
            ev = TokenEvent(lv.index, t, len(res.tokens), lp)
            res.tokens.append(t)
            if lp is not None:
                res.logprobs.append(lp)
            lv.cur = t
            self.stats.tokens += 1
            events.append(ev)
            if lv.request.on_token is not None:
                try:
                    keep = lv.request.on_token(ev)
                except Exception as exc:  # noqa: BLE001 - the callback's failure cancels its own request only
                    self._finish(lv, FinishReason.CANCELLED, ErrorCode.CANCELLED, f"on_token raised {exc!r}")
                    return
                if keep is False:
                    self._finish(lv, FinishReason.CANCELLED, ErrorCode.CANCELLED, "on_token returned False")
                    return
            if lv.request.stop_strings:
                text = self.tokenizer.decode(res.tokens)
                hit = [text.index(s) for s in lv.request.stop_strings if s and s in text]
                if hit:
                    self._finish(lv, FinishReason.STOP)
                    lv.result.text = text[: min(hit)]
                    return

    def _track_budget(self, lv: _Live, token: int) -> None:
        budget = lv.request.budget
        if budget is None or lv.budget_done:
            return
        lv.recent = (lv.recent + [token])[-MAX_FORCED:]
        ends_with = lambda seq: len(seq) and tuple(lv.recent[-len(seq):]) == tuple(seq)
        if lv.in_span:
            lv.span_count += 1
            if ends_with(budget.close_ids):  # a natural close: the budget is left alone
                lv.in_span, lv.budget_done = False, True
            elif lv.span_count >= budget.max_tokens:  # the engine closes the span: the next tokens are forced
                lv.forced = [int(t) for t in budget.close_ids]
                lv.in_span, lv.budget_done = False, True
                lv.result.budget_forced_close = True
        elif ends_with(budget.open_ids):
            lv.in_span, lv.span_count = True, 0

    def _fail_nonfinite(self, lv: _Live) -> None:
        """The request's logits went NaN/Inf at token `nonfinite_at`: it ends there as an error (its slot is freed
        like any other); the rest of the batch runs on, each row's numerics being its own."""
        i = lv.result.nonfinite_at
        self._finish(lv, FinishReason.ERROR, ErrorCode.NON_FINITE,
                     f"request {lv.index}: the logits of generated token {i} were NaN/Inf; generation stopped there "
                     f"({i} tokens kept)")

    def _check_finished(self, lv: _Live) -> None:
        toks = lv.result.tokens
        if toks and toks[-1] in lv.request.stop_ids:
            self._finish(lv, FinishReason.STOP)
        elif len(toks) >= lv.request.max_new_tokens:
            self._finish(lv, FinishReason.LENGTH)

    def _finish(self, lv: _Live, reason: FinishReason, error: ErrorCode | None = None, message: str = "") -> None:
        lv.done = True
        res = lv.result
        now = time.perf_counter()
        res.finish_reason, res.error, res.message = reason.value, error, message
        t = res.timings
        if lv.first_token:
            t.decode_s = now - lv.first_token
        elif lv.admitted:
            t.prefill_s = now - lv.admitted
        busy = t.prefill_s + t.decode_s
        t.tokens_per_s = len(res.tokens) / busy if busy > 0 else 0.0
        if self.tokenizer is not None and res.text is None:
            res.text = self.tokenizer.decode(res.tokens)
        if self._on_result is not None:
            self._on_result(lv.index, res)
        if reason is FinishReason.CANCELLED:
            self.stats.cancelled += 1
        elif error is not None:
            self.stats.failed += 1
        else:
            self.stats.completed += 1

    def _release_finished(self) -> None:
        for slot, lv in list(self._slots.items()):
            if lv.done:
                del self._slots[slot]
                self.tbook.release(slot)
                if self.dbook is not None:
                    self.dbook.release(slot)
                self._to_reset.add(slot)
