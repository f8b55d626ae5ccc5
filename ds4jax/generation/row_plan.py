"""Which rows one engine call runs: the requests it takes (`fit`), their order padded to a row bucket (`plan`) and
the `Rows` arrays the programs read (`rows`, from the per-slot `SlotTable` written at admission). With data-parallel pools (`data` > 1) row block d of a call
serves the slots of data shard d, so every shard gets rows / data rows.
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from ds4jax.generation.delivery import Live
from ds4jax.generation.loops import MAX_FORCED, MAX_STOP_IDS, NO_LIMIT, Rows

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def fit(live: list[Live], rows: int, max_slots: int, data: int) -> list[Live]:
    """The first of `live` that one call of `rows` rows can take (rows / data per data shard)."""
    if data == 1:
        return live[:rows]
    taken, out = collections.Counter(), []
    for lv in live:
        shard = lv.slot // (max_slots // data)
        if taken[shard] < rows // data:
            taken[shard] += 1
            out.append(lv)
    return out


def plan(live: list[Live], buckets: Sequence[int], max_slots: int, data: int) -> list[Live | None]:
    """The rows of one call: `live` padded (None) to the smallest bucket that holds them."""
    if data == 1:
        n = next(b for b in buckets if b >= len(live))
        return list(live) + [None] * (n - len(live))
    per = max_slots // data
    blocks = [[lv for lv in live if lv.slot // per == d] for d in range(data)]
    n = next(b for b in buckets if b // data >= max(map(len, blocks)))
    return [x for block in blocks for x in block + [None] * (n // data - len(block))]


def padding(b: int) -> dict[str, np.ndarray]:
    """`Rows` fields of `b` padding rows (inactive: they write nothing), slots still to fill in."""
    return dict(slots=np.zeros(b, np.int32), active=np.zeros(b, bool), cur=np.zeros(b, np.int32),
                n_out=np.zeros(b, np.int32), max_new=np.ones(b, np.int32),
                stop_ids=np.full((b, MAX_STOP_IDS), -1, np.int32), temperature=np.zeros(b, np.float32),
                top_p=np.ones(b, np.float32), top_k=np.zeros(b, np.int32), key_data=np.zeros((b, 2), np.uint32),
                k_cap=np.zeros(b, np.int32), limit=np.full(b, NO_LIMIT, np.int32), wake=np.zeros(b, bool),
                forced=np.zeros((b, MAX_FORCED), np.int32), n_forced=np.zeros(b, np.int32))


FIXED = ("max_new", "stop_ids", "temperature", "top_p", "top_k", "key_data", "k_cap")  # fixed while a request runs
_PAD = {name: a[0] for name, a in padding(1).items()}  # one padding row's value of each field


class SlotTable:
    """Per slot, the `Rows` fields that stay fixed while its request runs (`FIXED`), written once at admission:
    a call gathers them with one numpy take per field instead of building every row in Python."""

    def __init__(self, max_slots: int, vocab: int):
        self.max_slots, self.vocab = max_slots, vocab
        empty = padding(max_slots)
        self.fields = {name: empty[name] for name in FIXED}

    def admit(self, lv: Live) -> None:
        q, f, s = lv.request, self.fields, lv.slot
        f["max_new"][s] = q.max_new_tokens
        f["stop_ids"][s] = lv.stop
        # valid values beyond the device's types saturate: top_k >= vocab is "off", temperature <= float32 max
        f["temperature"][s] = min(float(q.temperature), _FLOAT32_MAX)
        f["top_p"][s] = q.top_p
        f["top_k"][s] = min(int(q.top_k), self.vocab)
        f["key_data"][s] = lv.key_data
        f["k_cap"][s] = lv.k


def rows(plan: list[Live | None], running: set[int], table: SlotTable, k_cap=None, wake: bool = True) -> Rows:
    """`Rows` of a plan: padding rows (None) get distinct unused slots (free slots first); `running` holds the
    slots in use. `k_cap` (optional, per live row of `plan`) replaces each request's own draft cap. `wake`: the
    call ends when a live row finishes (`Rows.wake`). Every live request's slot must have been written to `table`
    (`SlotTable.admit`)."""
    b, live = len(plan), [lv for lv in plan if lv is not None]
    at = [r for r, lv in enumerate(plan) if lv is not None]
    slots = np.zeros(b, np.int32)
    active = np.zeros(b, bool)
    active[at] = True
    slots[at] = [lv.slot for lv in live]
    pad = ~active
    if len(at) < b:  # padding rows: slots of no row of this call, those of no request first
        free = np.ones(table.max_slots, bool)
        free[slots[at]] = False
        busy = np.zeros(table.max_slots, bool)
        busy[list(running)] = True
        spare = np.concatenate([np.flatnonzero(free & ~busy), np.flatnonzero(free & busy)])
        slots[pad] = spare[: b - len(at)]
    arr = {name: table.fields[name][slots] for name in FIXED}  # takes: copies, the table stays as it is
    if len(at) < b:
        for name in FIXED:
            arr[name][pad] = _PAD[name]
    if k_cap is not None:
        arr["k_cap"][at] = k_cap
    cur, n_out = np.zeros(b, np.int32), np.zeros(b, np.int32)
    cur[at] = [lv.cur for lv in live]
    n_out[at] = [len(lv.result.tokens) for lv in live]
    limit, forced, n_forced = np.full(b, NO_LIMIT, np.int32), np.zeros((b, MAX_FORCED), np.int32), np.zeros(b, np.int32)
    for r, lv in zip(at, live):
        if lv.forced:
            forced[r, : len(lv.forced)] = lv.forced
            n_forced[r] = len(lv.forced)
        budget = lv.request.budget
        if budget is not None and not lv.budget_done and not lv.forced:
            # stop exactly at the budget's end; outside the span, N + 1 tokens cannot overshoot it
            limit[r] = budget.max_tokens - lv.span_count if lv.in_span else budget.max_tokens + 1
    return Rows(slots=slots, active=active, cur=cur, n_out=n_out, limit=limit, forced=forced, n_forced=n_forced,
                wake=active & wake, **arr)


def prefill_inputs(live: list[Live], row_of: dict[int, int], b: int, width: int):
    """One prefill call's inputs for `live` (`row_of`: slot -> row of a call of `b` rows, `width` tokens per row).
    A row takes its next prompt tokens, up to `width`, ending exactly at each snapshot position. Returns (tokens
    each of `live` takes, token ids [b, width], the id after each (the draft's input) [b, width], n_tokens [b],
    finishing [b]: the prompt ends in this chunk)."""
    n = [min(next((p for p in lv.snap_points if p > lv.pos), len(lv.ids)) - lv.pos, width) for lv in live]
    tok, nxt = np.zeros((b, width), np.int32), np.zeros((b, width), np.int32)
    n_tokens, finishing = np.zeros(b, np.int32), np.zeros(b, bool)
    for lv, c in zip(live, n):
        r = row_of[lv.slot]
        tok[r, :c] = lv.ids[lv.pos: lv.pos + c]
        follow = lv.ids[lv.pos + 1: lv.pos + c + 1]
        nxt[r, : len(follow)] = follow
        n_tokens[r] = c
        finishing[r] = lv.pos + c == len(lv.ids)
    return n, tok, nxt, n_tokens, finishing
