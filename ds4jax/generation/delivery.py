"""A running request's host state (`Live`) and what happens to its tokens: delivery in order to `on_token` and
the stream, stop strings, the thinking budget, and finishing (timings, text, `on_result`, the counters).

User callbacks run here, and an exception in one (`on_token`, `on_result`) ends only its own request, as
cancelled with the exception named in its message: it never reaches the engine's loop or another request.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ds4jax.generation import logprob_rows
from ds4jax.generation.loops import MAX_FORCED, MAX_STOP_IDS
from ds4jax.generation.requests import ErrorCode, FinishReason, GenerateResult, Request, TokenEvent
from ds4jax.generation.sampling import TokenLogprobs, seed_key_data


@dataclasses.dataclass
class EngineStats:
    prefill_steps: int = 0  # prefill chunk calls
    decode_calls: int = 0  # multi-step plain decode calls
    decode_steps: int = 0  # decode steps inside them
    spec_calls: int = 0  # multi-round speculative calls
    spec_rounds: int = 0
    lookup_drafts: int = 0  # row-rounds whose drafts came from the row's own history (`lookup`)
    lookup_skips: int = 0  # speculative rounds that ran no MTP draft step (every running row looked its drafts up)
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
class Live:
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
    # speculation: drafts accepted, and rounds that rejected one (`draft_policy`)
    drafts_accepted: int = 0
    drafts_rejected: int = 0

    @classmethod
    def start(cls, index: int, req: Request, checked, now: float) -> "Live":
        """A request that passed `request_checks.check_for_engine` (`checked`), submitted at `now`."""
        stop = np.full(MAX_STOP_IDS, -1, np.int32)
        stop[: len(checked.stop)] = checked.stop
        result = GenerateResult(prefill_tokens=len(checked.ids), accepted_per_round=[] if checked.k else None,
                                logprobs=None if req.logprobs is None else [])
        return cls(index, req, checked.ids, result, checked.k, seed_key_data(req.seed), stop, now,
                   snap_points=checked.snap_points, in_span=req.budget is not None and not req.budget.open_ids)

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.ids)


def track_budget(lv: Live, token: int) -> None:
    """Follow the thinking span through `token`; when it runs out, the close ids become forced tokens."""
    budget = lv.request.budget
    if budget is None or lv.budget_done:
        return
    lv.recent = (lv.recent + [token])[-MAX_FORCED:]
    ends_with = lambda seq: len(seq) and tuple(lv.recent[-len(seq):]) == tuple(seq)  # noqa: E731
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


def _event(request: int, token: int, index: int, logprob, _new=object.__new__, _set=object.__setattr__) -> TokenEvent:
    """`TokenEvent(request, token, index, logprob)`, the same object (equal, hashing, printing and pickling alike),
    built with one attribute write instead of the frozen dataclass's four guarded ones: about half the cost of
    a streamed token's event (tests/test_delivery_bulk.py checks it equals the constructor's)."""
    ev = _new(TokenEvent)
    _set(ev, "__dict__", {"request": request, "token": token, "index": index, "logprob": logprob})
    return ev


class Delivery:
    """Delivers tokens and finishes requests for one engine; `on_result` is the running call's callback."""

    def __init__(self, stats: EngineStats, tokenizer):
        self.stats, self.tokenizer = stats, tokenizer
        self.on_result = None

    def deliver(self, lv: Live, tokens: list[int], events: list[TokenEvent] | None, logprobs=None) -> None:
        """logprobs: one `TokenLogprob` per token, or None (the request asked for none). events: where the stream's
        `TokenEvent`s go (None: nobody reads them, `Engine.generate`)."""
        del lv.forced[: len(tokens)]  # forced tokens are the first a call emits
        if lv.done or not tokens:
            return
        q, res = lv.request, lv.result
        on_tokens = q.on_tokens
        if q.on_token is None and not q.stop_strings and (q.budget is None or lv.budget_done):
            # nothing can end the request between these tokens, nor watches them one by one: all at once
            n = len(res.tokens)
            res.tokens.extend(tokens)
            if logprobs is not None:
                res.logprobs.extend(logprobs)
            lv.cur = tokens[-1]
            self.stats.tokens += len(tokens)
            if events is not None or on_tokens is not None:
                i = lv.index
                evs = [_event(i, t, n + j, None if logprobs is None else logprobs[j]) for j, t in enumerate(tokens)]
                if events is not None:
                    events.extend(evs)
                if on_tokens is not None:
                    self._call(lv, "on_tokens", on_tokens, evs)
            return
        out, on_token, stop_strings, budget = res.tokens, q.on_token, q.stop_strings, q.budget is not None
        bulk: list[TokenEvent] | None = [] if on_tokens is not None else None  # for on_tokens, after the loop
        stopped = None  # the text up to a stop string that ended the request
        for j, t in enumerate(tokens):
            if lv.done:
                return
            if budget:
                track_budget(lv, t)
            lp = logprobs[j] if logprobs is not None else None
            ev = _event(lv.index, t, len(out), lp)
            out.append(t)
            if lp is not None:
                res.logprobs.append(lp)
            lv.cur = t
            self.stats.tokens += 1
            if events is not None:
                events.append(ev)
            if bulk is not None:
                bulk.append(ev)
            if on_token is not None and not self._call(lv, "on_token", on_token, ev):
                return
            if stop_strings:
                text = self.tokenizer.decode(out)
                hit = [text.index(s) for s in stop_strings if s and s in text]
                if hit:
                    stopped = text[: min(hit)]
                    break
        if bulk and not self._call(lv, "on_tokens", on_tokens, bulk):
            return
        if stopped is not None:
            self.finish(lv, FinishReason.STOP)
            lv.result.text = stopped

    def _call(self, lv: Live, name: str, callback, arg) -> bool:
        """A user callback of `lv`'s request (`on_token(event)` / `on_tokens(events)`); False when it cancelled the
        request (it returned False or raised: its failure cancels its own request only)."""
        try:
            keep = callback(arg)
        except Exception as exc:  # noqa: BLE001 - the callback's failure cancels its own request only
            self.finish(lv, FinishReason.CANCELLED, ErrorCode.CANCELLED, f"{name} raised {exc!r}")
            return False
        if keep is False:
            self.finish(lv, FinishReason.CANCELLED, ErrorCode.CANCELLED, f"{name} returned False")
            return False
        return True

    def deliver_call(self, part: list[Live], row_of: dict[int, int], tokens: np.ndarray, bad: np.ndarray,
                     lp: TokenLogprobs | None, events: list[TokenEvent] | None, check_finite: bool) -> None:
        """A decode / speculative call's tokens [B, W] (-1 = none) of the requests `part` (`row_of`: slot -> row),
        in `part`'s order: each row's tokens, those before its first non-finite one (`bad` [B], -1 = none) when
        `check_finite`; then the request fails (non-finite) or finishes (stop id, max_new_tokens). One numpy pass
        splits the tokens of every row (no per-token `int()`); lp: the call's fetched logprobs or None."""
        valid = tokens >= 0
        flat, ends, bad = tokens[valid].tolist(), np.cumsum(valid.sum(1)).tolist(), bad.tolist()
        for lv in part:
            r, res = row_of[lv.slot], lv.result
            b = bad[r]
            if b >= 0 and res.nonfinite_at is None:
                res.nonfinite_at = b
            emitted = flat[ends[r - 1] if r else 0: ends[r]]
            if check_finite and b >= 0:  # only the tokens before the first bad one are real
                emitted = emitted[: max(b - len(res.tokens), 0)]
            self.deliver(lv, emitted, events, logprob_rows.row(lp, r, len(emitted), lv.request.logprobs))
            if check_finite and b >= 0 and not lv.done:
                self.fail_nonfinite(lv)
            if not lv.done:
                self.check_finished(lv)

    def check_finished(self, lv: Live) -> None:
        toks = lv.result.tokens
        if toks and toks[-1] in lv.request.stop_ids:
            self.finish(lv, FinishReason.STOP)
        elif len(toks) >= lv.request.max_new_tokens:
            self.finish(lv, FinishReason.LENGTH)

    def fail_nonfinite(self, lv: Live) -> None:
        """The request's logits went NaN/Inf at token `nonfinite_at`: it ends there as an error (its slot is freed
        like any other); the rest of the batch runs on, each row's numerics being its own."""
        i = lv.result.nonfinite_at
        self.finish(lv, FinishReason.ERROR, ErrorCode.NON_FINITE,
                    f"request {lv.index}: the logits of generated token {i} were NaN/Inf; generation stopped there "
                    f"({i} tokens kept)")

    def finish(self, lv: Live, reason: FinishReason, error: ErrorCode | None = None, message: str = "") -> None:
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
        self.count(reason, error)
        self.report(lv.index, res)

    def count(self, reason: FinishReason, error: ErrorCode | None) -> None:
        if reason is FinishReason.CANCELLED:
            self.stats.cancelled += 1
        elif error is not None:
            self.stats.failed += 1
        else:
            self.stats.completed += 1

    def report(self, index: int, res: GenerateResult) -> None:
        """`on_result(index, res)`; if it raises, the request counts as cancelled by its callback (the result says
        so) and nothing else is disturbed."""
        if self.on_result is None:
            return
        try:
            self.on_result(index, res)
        except Exception as exc:  # noqa: BLE001 - the callback's failure is its own request's
            if res.finish_reason != FinishReason.CANCELLED.value:  # recount it as cancelled
                if res.error is None:
                    self.stats.completed -= 1
                else:
                    self.stats.failed -= 1
                self.stats.cancelled += 1
            res.finish_reason, res.error = FinishReason.CANCELLED.value, ErrorCode.CANCELLED
            res.message = f"on_result raised {exc!r}" + (f" (after: {res.message})" if res.message else "")
