"""Which rows one engine call runs: the requests it takes (`fit`), their order padded to a row bucket (`plan`) and
the `Rows` arrays the programs read (`rows`). With data-parallel pools (`data` > 1) row block d of a call
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
                k_cap=np.zeros(b, np.int32), limit=np.full(b, NO_LIMIT, np.int32),
                forced=np.zeros((b, MAX_FORCED), np.int32), n_forced=np.zeros(b, np.int32))


def rows(plan: list[Live | None], running: set[int], max_slots: int, vocab: int, k_cap=None) -> Rows:
    """`Rows` of a plan: padding rows (None) get distinct unused slots (free slots first); `running` holds the
    slots in use. `k_cap` (optional, per live row of `plan`) replaces each request's own draft cap."""
    used = {lv.slot for lv in plan if lv is not None}
    spare = [s for s in range(max_slots) if s not in used and s not in running]
    spare = iter(spare + [s for s in range(max_slots) if s not in used and s in running])
    arr = padding(len(plan))
    caps = iter(k_cap) if k_cap is not None else None
    for r, lv in enumerate(plan):
        if lv is None:
            arr["slots"][r] = next(spare)
            continue
        q = lv.request
        arr["slots"][r] = lv.slot
        arr["active"][r] = True
        arr["cur"][r] = lv.cur
        arr["n_out"][r] = len(lv.result.tokens)
        arr["max_new"][r] = q.max_new_tokens
        arr["stop_ids"][r] = lv.stop
        # valid values beyond the device's types saturate: top_k >= vocab is "off", temperature <= float32 max
        arr["temperature"][r] = min(float(q.temperature), _FLOAT32_MAX)
        arr["top_p"][r] = q.top_p
        arr["top_k"][r] = min(int(q.top_k), vocab)
        arr["key_data"][r] = lv.key_data
        arr["k_cap"][r] = lv.k if caps is None else next(caps)
        arr["forced"][r, : len(lv.forced)] = lv.forced
        arr["n_forced"][r] = len(lv.forced)
        budget = q.budget
        if budget is not None and not lv.budget_done and not lv.forced:
            # stop exactly at the budget's end; outside the span, N + 1 tokens cannot overshoot it
            arr["limit"][r] = budget.max_tokens - lv.span_count if lv.in_span else budget.max_tokens + 1
    return Rows(**arr)
