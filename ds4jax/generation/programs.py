"""The engine's programs: the `Programs` interface both placements implement, and what `Engine.warmup` compiled
(one `Program` record per engine program, with its shape and its compile time).

A record covers one warm-up call: the program itself plus the small helpers its first call needed (page-table
syncs, placements), so `compiles` may exceed 1; 0 means the program was already compiled in this process.
`disk_hits` counts compiles served by JAX's persistent compilation cache. `seconds` is the call's wall time
(tracing, lowering, compiling and one run on padding rows); `compile_seconds` the part spent in XLA. Programs
compiled side by side on a thread pool (`runtime/precompile.py`) count their compile there, so their `seconds`
add up to more than the warm-up took: `WarmupReport.wall_seconds` is the elapsed time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Iterator, Protocol

import jax
import numpy as np

from ds4jax.generation import compiles
from ds4jax.runtime import precompile
from ds4jax.runtime.pools import PoolError

# what the second number of a program's shape counts, per kind
_WIDTH_UNIT = {"prefill": "tokens", "decode": "steps", "speculative": "rounds"}
_WHOLE = {"slot-reset": "every slot (mask)", "fingerprint": "every weight"}  # programs without rows


@dataclasses.dataclass(frozen=True)
class Program:
    kind: str  # prefill, decode, speculative, fingerprint, restore, snapshot-save, snapshot-load, slot-reset
    rows: int  # rows of the call (slots it serves); 0 for whole-pool programs
    width: int  # prefill: prompt tokens per row; decode: steps per call; speculative: rounds per call; else 0
    compiles: int  # XLA compilations during its warm-up call (0: already compiled in this process)
    disk_hits: int  # of which served by the persistent compilation cache
    compile_seconds: float
    seconds: float  # wall time of the warm-up call

    @property
    def shape(self) -> str:
        if self.kind in _WHOLE:
            return _WHOLE[self.kind]
        rows = f"{self.rows} row{'s' * (self.rows != 1)}"
        return f"{rows} x {self.width} {_WIDTH_UNIT[self.kind]}" if self.kind in _WIDTH_UNIT else rows


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """`Engine.warmup`'s result: its programs in the order compiled; `str()` is a table."""

    programs: tuple[Program, ...]
    wall_seconds: float | None = None  # elapsed time of the whole warm-up (programs compiled in parallel overlap)
    compile_threads: int = 1  # threads the programs compiled on

    @property
    def compiles(self) -> int:
        return sum(p.compiles for p in self.programs)

    @property
    def disk_hits(self) -> int:
        return sum(p.disk_hits for p in self.programs)

    @property
    def compile_seconds(self) -> float:
        return sum(p.compile_seconds for p in self.programs)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.programs)

    def table(self) -> str:
        head = ("program", "shape", "compiles", "from cache", "compile s", "wall s")
        rows = [(p.kind, p.shape, str(p.compiles), str(p.disk_hits), f"{p.compile_seconds:.2f}", f"{p.seconds:.2f}")
                for p in self.programs]
        rows.append((f"total ({len(self.programs)} programs)", "", str(self.compiles), str(self.disk_hits),
                     f"{self.compile_seconds:.2f}", f"{self.seconds:.2f}"))
        widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
        line = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        rule = "-" * len(line(head))
        out = [line(head), rule] + [line(r) for r in rows[:-1]] + [rule, line(rows[-1])]
        if self.wall_seconds is not None:
            out.append(f"elapsed {self.wall_seconds:.2f} s (compiled on {self.compile_threads} "
                       f"thread{'s' * (self.compile_threads != 1)})")
        return "\n".join(out)

    __str__ = table


class Recorder:
    """Times the warm-up calls: `with recorder.program(kind, rows, width): <run it once>`. `wait` blocks until
    the call's device work is done, so each record's wall time is its own."""

    def __init__(self, wait: Callable[[], None]):
        self._wait = wait
        self._programs: list[Program] = []
        self._last: list[Program] = []

        self._start = time.perf_counter()
        self.compile_threads = 1

    @contextlib.contextmanager
    def program(self, kind: str, rows: int = 0, width: int = 0, precompiled=None, last: bool = False,
                earlier: float = 0.0) -> Iterator[None]:
        """`precompiled`: the program's compile on precompile's pool (a `precompile.Compiled`), counted here. The
        calling thread's compiles only: the warm-up runs its small programs while the pool compiles the others.
        `last`: listed after the records without it (the report keeps the order a reader expects: the big programs,
        then the small ones that ran meanwhile). `earlier`: seconds the call already ran in the capture pass (one
        that compiles nothing runs to its end there, e.g. small weights' fingerprint on the host)."""
        before, start = compiles.thread_totals(), time.perf_counter()
        yield
        self._wait()
        seconds = time.perf_counter() - start + earlier
        spent = compiles.thread_totals() - before
        if precompiled is not None:
            spent = compiles.CompileTotals(spent.compiles + precompiled.totals.compiles,
                                           spent.seconds + precompiled.totals.seconds,
                                           spent.disk_hits + precompiled.totals.disk_hits)
            seconds += precompiled.seconds
        (self._last if last else self._programs).append(
            Program(kind, int(rows), int(width), spent.compiles, spent.disk_hits, spent.seconds, seconds))

    def report(self) -> WarmupReport:
        return WarmupReport(tuple(self._programs + self._last), time.perf_counter() - self._start, self.compile_threads)


class Programs(Protocol):
    """What the engine runs, whichever way the model is placed: `fused_programs.FusedPrograms` (one compiled
    program per call: one device, one-stage meshes) or `stage_programs.StagePrograms` (a layer split, stage by
    stage). A target pool is whatever `zeros` returns (a `KVPool`, or a split's `StagePools`; both have
    `lengths`); the engine only hands it back. Every call donates the pools it takes and returns the new ones.
    prefill / restore also return their first tokens' `sampling.TokenLogprobs`, decode / speculate theirs in
    `DecodeOut.logprobs` / `SpecOut.logprobs` (None when the engine's logprobs are off; always on a split)."""

    precompiles: bool  # whether warm-up may lower the calls first and compile them side by side
    runs_ahead: bool  # whether a decode call may start from the previous one's outputs (`run_ahead`)
    supports_lookup: bool  # whether speculate takes lookup > 0 (drafts from each row's history: `lookup`)

    def zeros(self, spec): ...
    def draft_zeros(self, dspec): ...
    def sync(self, book, pool, spec): ...  # the book's page table and lengths on the pool
    def placed(self, pool, spec): ...  # the canonical placement (the steps compile for it)
    def draft_placed(self, dpool, dspec): ...
    def reset(self, pool, slots, spec): ...
    def draft_reset(self, dpool, slots, dspec): ...
    def lengths(self, pool): ...
    def lost(self, pool) -> bool: ...  # a failed call took the donated pool with it
    def slot_state(self, state): ...  # the per-slot state on its placement
    def drop_draft_params(self) -> None: ...
    def extract(self, pool, slot, spec) -> dict: ...  # snapshot rows of a slot, one-device layout
    def inject(self, pool, slot, arrays, n_pages, length, spec): ...
    def extract_draft(self, dpool, slot) -> dict: ...
    def inject_draft(self, dpool, slot, arrays, length, dspec): ...
    def slot_rows(self, state, slot): ...  # (last logits, last stream) of a slot
    def set_slot_rows(self, state, slot, logits, stream): ...
    def prefill(self, params, tpool, dpool, slot_state, rows, token_ids, n_tokens, next_ids, finishing, *, spec,
                dspec, kernels): ...
    def decode(self, params, tpool, rows, *, spec, kernels, max_steps): ...
    def speculate(self, params, tpool, dpool, slot_state, rows, *, spec, dspec, k, kernels, max_rounds,
                  lookup=0): ...
    def restore(self, params, dpool, slot_state, rows, sampled, next_ids, *, dspec, kernels): ...


def programs_for(layout, cfg, params, logprobs: int) -> Programs:
    """The `Programs` an engine runs for `layout`: stage by stage on a layer split (one process; no logprobs), else
    one fused program per call."""
    if layout is not None and layout.num_stages > 1:
        from ds4jax.generation.stage_programs import StagePrograms, check_one_process

        if logprobs:
            raise PoolError(f"logprobs must be 0 on a layer split (its stage programs return none), got {logprobs}")
        check_one_process(layout)
        return StagePrograms(layout, cfg)
    from ds4jax.generation.fused_programs import FusedPrograms

    return FusedPrograms(layout, cfg, params, logprobs)


_DECODING = ("speculative", "decode")  # longest to compile first (a speculative program holds a verify and drafts)


def _capture_order(calls: list[tuple[str, int, int, Callable[[], object]]]) -> list[int]:
    """The order in which the warm-up captures its programs (indices into `calls`, which keeps the report's order):
    the decode and speculative programs first, most rows first, then the rest as listed (the fingerprint before the
    restore). Each compile starts at its capture and the warm-up ends with the last one; the decode programs compile
    longest (the 8-row decode loop ended every cold warm-up timed on the H100 and H200, started fourth of six:
    docs/benchmarks/startup_timeline_h100/, startup_timeline_h200/), so they start first."""
    def key(i: int):
        kind, rows = calls[i][0], calls[i][1]
        return (0, _DECODING.index(kind), -rows, i) if kind in _DECODING else (1, 0, 0, i)
    return sorted(range(len(calls)), key=key)


class EngineWarmup:
    """`Engine.warmup` (mixed into `Engine`): every program of the engine compiled and run once."""

    def warmup(self) -> WarmupReport:
        """Compile every program the engine can run, once each (on padding rows, which write nothing): a prefill
        program per prefill row bucket, a decode (and speculative) program per row bucket, and with snapshots on
        the restore and snapshot programs; then the slot reset. Fused programs are lowered one by one, each
        compiling on a thread pool from the moment it is lowered, so the compiles overlap each other and the
        lowering of the next (`runtime/precompile.py`, ``DS4JAX_COMPILE_THREADS``); then each runs once.
        Returns the programs with their compile seconds (`print(engine.warmup())` shows the table; `.compiles`
        counts XLA compilations)."""
        with self._exclusive("warmup()"):
            if self._parking.parked:
                raise PoolError("warmup() needs an idle engine with nothing parked")
            return self._warmup()

    def _decode_program_calls(self) -> list[tuple[str, int, int, Callable[[], object]]]:
        """(kind, rows, width, run once on padding rows) of the decode program of every row bucket and its
        speculative ones (padding rows capped at k: the program of k drafts); the warm-up's, and what a one-shot
        engine compiles ahead (`compile_ahead`)."""
        pad = lambda rows: self._padding_rows([None] * rows)  # noqa: E731
        calls = []
        for rows in self.row_buckets:
            calls.append(("decode", rows, self.steps_per_call, lambda rows=rows: self._decode_call(pad(rows))))
            for k in self.policy.ks:
                capped = lambda rows=rows, k=k: pad(rows)._replace(k_cap=np.full(rows, k, np.int32))  # noqa: E731
                calls.append(("speculative", rows, self.steps_per_call,
                              lambda capped=capped: self._spec_call(capped())))
        return calls

    def _warm_small_programs(self, rec: Recorder, snapshots_on: bool) -> None:
        """The snapshot save / load programs (with snapshots on) and the slot reset, each compiled and run once."""
        if snapshots_on:
            # snapshot programs: save slot 0 and restore it, through the host arrays a real snapshot holds (no
            # pages: every paged write is dropped; slot 0 is reset below)
            with rec.program("snapshot-save", 1, last=True):
                arrays = self._slot_snaps.arrays(self.tpool, self.dpool, self.slot_state, 0, 0)
            with rec.program("snapshot-load", 1, last=True):
                self._write_snapshot(0, arrays, pages=0, length=1)
        with rec.program("slot-reset", last=True):
            self._to_reset.add(0)
            self._apply_resets()

    def _warmup(self) -> WarmupReport:
        rec = Recorder(lambda: jax.block_until_ready((self.tpool, self.dpool, self.slot_state)))
        pad = lambda rows: self._padding_rows([None] * rows)  # noqa: E731
        z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        calls = []  # (kind, rows, width, run once on padding rows)
        for rows, width in self.buckets.prefill:
            calls.append(("prefill", rows, width, lambda rows=rows, width=width: self._prefill_call(
                pad(rows), z(rows, width), z(rows), z(rows, width), np.zeros(rows, bool))))
        calls += self._decode_program_calls()
        snapshots_on = self.snapshots.budget_bytes > 0
        if snapshots_on:  # the weights' digests (every snapshot carries them), then the restore program
            # the digest program compiles on the pool beside the others: run after them it stood alone on the
            # critical path (H100: 4.8 s cold, 1.3 s cached of a 6.6 s cached warm-up)
            calls.append(("fingerprint", 0, 0, self.fingerprint))
            rows = self.buckets.restore_rows
            calls.append(("restore", rows, 0, lambda rows=rows: self._restore_call(
                pad(rows), np.zeros(rows, bool), np.zeros(rows, np.int32))))
        compiled = [None] * len(calls)
        ran_here = {}  # seconds of the calls that ran to their end in the capture pass (nothing to compile)
        if self.programs.precompiles:  # lowered here, compiled side by side (each from its capture on), then run
            threads = precompile.threads(len(calls))
            order = _capture_order(calls)
            with precompile.capturing(threads=threads) as jobs:
                captured = {}
                for i in order:
                    start = time.perf_counter()
                    captured[i] = precompile.run_captured(calls[i][-1])
                    if not captured[i]:
                        ran_here[i] = time.perf_counter() - start
            # the small programs compile and run here while the pool compiles the big ones (after the pool they
            # stood alone on the critical path: 0.65 s of an H200 host's 24.5 s cold warm-up,
            # docs/benchmarks/startup_timeline_h200/); the padding-row runs below write nothing, so slot 0 stays reset
            self._warm_small_programs(rec, snapshots_on)
            done = iter(precompile.compile_all(jobs))  # in capture order
            for i in order:
                compiled[i] = next(done) if captured[i] else None
            rec.compile_threads = min(threads, max(1, sum(c is not None for c in compiled)))
        # in the warm-up's order (the fingerprint before the restore)
        for i, ((kind, rows, width, run), pre) in enumerate(zip(calls, compiled)):
            with rec.program(kind, rows, width, precompiled=pre, earlier=ran_here.get(i, 0.0)):
                run()
        if not self.programs.precompiles:
            self._warm_small_programs(rec, snapshots_on)
        self._warm = True
        report = rec.report()
        self.stats.compiles += report.compiles
        return report
