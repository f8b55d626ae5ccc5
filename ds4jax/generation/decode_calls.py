"""The engine's decode calls (mixed into `Engine`): one call of plain steps or speculative rounds over a part of
the decoding rows, its outputs read in one fetch and delivered row by row, and the call run ahead (`run_ahead`):
started from the previous call's outputs before that call is read, read by the next iteration.

The call run ahead is dispatched from a worker thread: a program with a `while_loop` holds the dispatching thread
until the loop ends (the loop's condition is read on the host each iteration on GPU, and XLA:CPU runs it inline),
so dispatched from the engine's thread it would keep that thread from delivering the call before. The worker
only dispatches (`_decode_call`, which also takes the new pool); XLA releases the GIL while the program runs. The
engine's thread reads `self.tpool` again only after the worker is done (`_settle_ahead`, `Ahead.out.result()`)."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np

from ds4jax.generation import logprob_rows, lookup as lookup_mod, run_ahead
from ds4jax.generation.delivery import Live
from ds4jax.generation.requests import TokenEvent
from ds4jax.runtime.distributed import fetch  # device_get across processes (data-parallel rows)


class EngineDecode:
    def _decode_once(self, part: list[Live], k: int, events: list[TokenEvent] | None, ahead_ok: bool) -> None:
        """One call of up to M plain steps (k = 0) or M speculative rounds of k drafts over `part`; its outputs
        come back in one fetch (logprobs only if a request of `part` asked), then go out row by row. A call
        whose rows may run ahead (`ahead_ok` and `run_ahead.may_run_ahead`) starts the next one before it is read;
        an iteration whose call was started that way only reads it."""
        plan = self._row_plan(part, self.row_buckets)
        ahead = self._ahead
        if ahead is not None and (k != ahead.k or not ahead.serves(plan)):  # other rows or draft length: read it
            self._land(events)
            part, ahead = [lv for lv in part if not lv.done], None
            if not part:
                return
            plan = self._row_plan(part, self.row_buckets)
        if ahead is not None:
            self._ahead, rows, out, start = None, ahead.rows, ahead.out.result(), max(ahead.dispatched, self._read_at)
        else:
            rows = self._padding_rows(plan, [min(lv.k, k) for lv in plan if lv is not None])
            if k and self.lookup:
                rows = rows._replace(history=lookup_history(plan))
            start = time.perf_counter()
            if k:
                slots = np.array([lv.slot for lv in part], np.int32)
                behind = slots[self.dbook.lengths[slots] != self.tbook.lengths[slots]]
                if behind.size:  # decoded plainly for a while: the draft's cache rejoins at the target's length
                    self.dbook.lengths[behind] = self.tbook.lengths[behind]
                    self.dpool = self.dbook.sync(self.dpool)
            out = self._spec_call(rows) if k else self._decode_call(rows)
        # a speculative call runs ahead only at a draft length the policy keeps (not a probe or an exploration)
        if (ahead_ok and self.programs.runs_ahead and out.cur is not None and run_ahead.may_run_ahead(plan)
                and (not k or self.policy.keeps(k, len(plan)))):
            nxt = run_ahead.next_rows(rows, out)
            call = self._spec_call if k else self._decode_call
            self._ahead = run_ahead.Ahead(plan, nxt, self._dispatcher().submit(call, nxt), time.perf_counter(), k)
        # the first call of a run-ahead sequence waited for the host; the calls after it show what plain costs,
        # so the adaptive policy does not price plain by it (it measured plain dearer than it runs)
        self._read(plan, part, out, k, start, events, observe=ahead is not None or self._ahead is None)

    def _land(self, events: list[TokenEvent] | None) -> None:
        """Read the call run ahead and deliver its tokens; rows that finished meanwhile drop theirs."""
        ahead, self._ahead = self._ahead, None
        out = ahead.out.result()
        part = [lv for lv in ahead.part if not lv.done]
        if part:
            self._read(ahead.plan, part, out, ahead.k, max(ahead.dispatched, self._read_at), events)

    def _settle_ahead(self) -> None:
        """Wait until the call run ahead (if any) was dispatched, so `self.tpool` is the pool after it; an error
        of its dispatch is left for whoever reads it."""
        if self._ahead is not None:
            concurrent.futures.wait([self._ahead.out])

    def _dispatcher(self) -> concurrent.futures.ThreadPoolExecutor:
        if getattr(self, "_worker", None) is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ds4jax-run-ahead")
        return self._worker

    def _read(self, plan: list[Live | None], part: list[Live], out, k: int, start: float, events,
              observe: bool = True) -> None:
        """Fetch a decode / speculative call's outputs for `part` (rows of `plan`) and deliver them; `observe`:
        its time per step goes to the draft policy's costs."""
        row_of = {lv.slot: r for r, lv in enumerate(plan) if lv is not None}
        slots = np.array([lv.slot for lv in part], np.int32)
        after = out.lengths if getattr(out, "lengths", None) is not None else self.programs.lengths(self.tpool)
        looked = (out.looked, out.skipped) if k and out.looked is not None else None
        tokens, ran, bad, lengths, accepted, lp, looked = fetch(
            (out.tokens, out.rounds if k else out.steps, out.bad, after, out.accepted if k else None,
             logprob_rows.wanted(out.logprobs, part), looked))
        self._read_at = time.perf_counter()
        ran = int(ran)
        if k:
            self.stats.spec_calls += 1
            self.stats.spec_rounds += ran
            if looked is not None:
                self.stats.lookup_drafts += int(np.sum(looked[0][[row_of[lv.slot] for lv in part]]))
                self.stats.lookup_skips += int(looked[1])
        else:
            self.stats.decode_calls += 1
            self.stats.decode_steps += ran
        if observe:
            self.policy.observe_cost(len(plan), k, self._read_at - start, ran)
        self.tbook.lengths[slots] = lengths[slots]
        rounds = {}
        if k:  # the draft pool advances with the target in every round
            self.dbook.lengths[slots] = lengths[slots]
            accepted = accepted.tolist()
            for lv in part:
                rounds[lv.slot] = got = [a for a in accepted[row_of[lv.slot]] if a >= 0]
                lv.result.accepted_per_round.extend(got)
        self._out.deliver_call(part, row_of, tokens, bad, lp, events, self.check_finite)
        for lv in part if k else ():  # after delivery, which tells the requests that ended in this call
            self.policy.observe_rounds(lv, rounds[lv.slot], min(lv.k, k), finished=lv.done)


def lookup_history(plan: list[Live | None]) -> np.ndarray:
    """The rows' token histories for lookup drafting: each request's prompt then its tokens so far, the pending
    token last (None: a padding row)."""
    w = lookup_mod.WINDOW
    return lookup_mod.host_history([None if lv is None else lv.ids[-w:] + lv.result.tokens[-w:] for lv in plan])

