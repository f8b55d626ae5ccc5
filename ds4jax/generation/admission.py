"""The engine's admission and release of requests (mixed into `Engine`): a submitted request is checked (an error
becomes its result, never an exception), waits in the FIFO queue, and joins a free slot once every page it can
need is free (its prompt, `max_new_tokens` and the speculative window, reserved at once: a running request never
waits for pages); its fixed sampling fields go to the `row_plan.SlotTable` then, and a stored prefix snapshot
is written into its slot. A finished request's slot is released at once and reset before the next admission
reuses it (a one-shot engine never pays for the reset).
"""

from __future__ import annotations

import time

from ds4jax.generation.delivery import Live
from ds4jax.generation.request_checks import Rejected, check_for_engine
from ds4jax.generation.requests import ErrorCode, GenerateResult


class EngineAdmission:
    def _check(self, index: int, req, now: float) -> Live | GenerateResult:
        """`req` (the `index`-th of its call) as a `Live` waiting to be admitted, or the result that refuses it."""
        try:
            c = check_for_engine(req, self.limits, tokenizer=self.tokenizer, parked=self._parking.parked)
        except Rejected as r:
            return GenerateResult(error=r.code, message=f"request {index}: {r}")
        except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer failing on the text: the request's problem
            return GenerateResult(error=ErrorCode.INVALID_REQUEST, message=f"request {index}: {exc!r}")
        return Live.start(index, req, c, now)

    def _admit(self, queue) -> list[Live]:
        """Admit queued requests into free slots; returns those restored from a prefix snapshot."""
        if queue:  # freed slots are reset before they are reused (a one-shot engine never pays for it)
            self._apply_resets()
        admitted = []
        window = self.k + 1 if self.k else 0
        while queue and len(self._slots) < self.tspec.max_slots:
            lv = queue[0]
            need = len(lv.ids) + lv.request.max_new_tokens + window
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
            self._table.admit(lv)
            admitted.append(lv)
        if admitted:
            self.tpool = self.programs.sync(self.tbook, self.tpool, self.tspec)
            if self.dpool is not None:
                self.dpool = self.dbook.sync(self.dpool)
        restored = []
        if len(self.snapshots):
            # a snapshot saved while the draft was parked has no draft state: with the draft running it is a miss
            # (the request prefills), never an error
            usable = None if self._live_dspec is None else (lambda snap: snap.has_draft)
            for lv in admitted:
                snap = self.snapshots.longest_prefix(lv.ids, usable)
                if snap is not None:
                    self._guarded([lv], lambda: self._inject(lv, snap))
                    if not lv.done:
                        restored.append(lv)
        return restored

    def _apply_resets(self) -> None:
        if not self._to_reset:
            return
        slots, p = sorted(self._to_reset), self.programs
        self.tpool = p.sync(self.tbook, p.reset(self.tpool, slots, self.tspec), self.tspec)
        if self.dpool is not None:
            self.dpool = self.dbook.sync(p.draft_reset(self.dpool, slots, self.dspec))
        self._to_reset.clear()

    def _release_finished(self) -> None:
        for slot in [s for s, lv in self._slots.items() if lv.done]:
            del self._slots[slot]
            self.tbook.release(slot)
            if self.dbook is not None:
                self.dbook.release(slot)
            self._to_reset.add(slot)
