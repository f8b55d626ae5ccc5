"""The engine's prefill calls (mixed into `Engine`): one chunk over the rows still prefilling, and the first token
of a request, whether its prefill's last chunk sampled it or a restored snapshot's logits did
(`slot_snapshots.EngineSnapshots._restore_once` hands its rows here too).

A row's first token is sampled on the device by the call that ends its prompt; only a call in which some row
finishes its prompt fetches the tokens (and the log-probabilities a request asked for), so a long prompt's
earlier chunks cost no host round trip."""

from __future__ import annotations

import time

from ds4jax.generation import logprob_rows, row_plan
from ds4jax.generation.delivery import Live
from ds4jax.generation.requests import TokenEvent
from ds4jax.runtime.distributed import fetch  # device_get across processes (data-parallel rows)


class EnginePrefill:
    def _first_token(self, lv: Live, token: int, logprobs, now: float, events: list[TokenEvent] | None) -> None:
        """A request's first token, sampled by its prefill's last chunk or from a restored snapshot's logits
        (logprobs: its `TokenLogprob` as a one-item list, or None)."""
        lv.first_token = now
        lv.result.timings.prefill_s = now - lv.admitted
        if token < 0:  # the logits were not finite
            lv.result.nonfinite_at, token = 0, 0
            if self.check_finite:
                self._out.fail_nonfinite(lv)
                return
        self._out.deliver(lv, [token], events, logprobs)
        if not lv.done:
            self._out.check_finished(lv)

    def _prefill_once(self, live: list[Live], events: list[TokenEvent] | None) -> None:
        """One prefill call over `live` (rows still prefilling): each takes its share of the call's token budget;
        the pages were reserved at admission, snapshots due at a chunk's end are saved, and the rows whose prompt
        ended get their first token."""
        plan = self._row_plan(live, self.prefill_row_buckets)
        row_of = {lv.slot: r for r, lv in enumerate(plan) if lv is not None}
        rows = self._padding_rows(plan)
        width = self.buckets.width(len(plan))  # the token budget's share per row of this row bucket
        n, tok, nxt, n_tokens, finishing = row_plan.prefill_inputs(live, row_of, len(plan), width)
        self.tbook.check_extend(rows.slots, tok, n_tokens)  # padding rows (n_tokens 0) are not looked at
        first, lp = self._prefill_call(rows, tok, n_tokens, nxt, finishing)
        self.stats.prefill_steps += 1
        self.stats.prompt_tokens += int(n_tokens.sum())
        self.tbook.commit(rows.slots, n_tokens)
        if self.dbook is not None:
            self.dbook.commit(rows.slots, n_tokens)
        if finishing.any():
            first, lp = fetch((first, logprob_rows.wanted(lp, live)))
        now = time.perf_counter()
        for lv, c in zip(live, n):
            lv.pos += c
            if lv.pos in lv.snap_points:
                self._save_snapshot(lv)
            r = row_of[lv.slot]
            if finishing[r]:
                self._first_token(lv, int(first[r]), logprob_rows.first(lp, r, lv.request.logprobs), now, events)
