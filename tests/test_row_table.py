"""`row_plan.rows` from the per-slot `SlotTable` (gathered, written once at admission) equals the row-by-row build
it replaced (`reference_rows` below, the code as it was), field by field: padding rows on free slots and, once
those run out, on running slots outside the call; draft caps given per call; forced tokens and budget limits;
sampling values that saturate (temperature above float32, top_k above the vocabulary). Host only, no program."""

from __future__ import annotations

import numpy as np
import pytest

from ds4jax.generation import row_plan
from ds4jax.generation.delivery import Live
from ds4jax.generation.loops import Rows
from ds4jax.generation.requests import Budget, GenerateResult, Request
from ds4jax.generation.sampling import seed_key_data

VOCAB, SLOTS = 50, 8
_F32_MAX = float(np.finfo(np.float32).max)


def reference_rows(plan, running, max_slots, vocab, k_cap=None) -> Rows:
    """The former `row_plan.rows`: every field of every row set in Python."""
    used = {lv.slot for lv in plan if lv is not None}
    spare = [s for s in range(max_slots) if s not in used and s not in running]
    spare = iter(spare + [s for s in range(max_slots) if s not in used and s in running])
    arr = row_plan.padding(len(plan))
    caps = iter(k_cap) if k_cap is not None else None
    for r, lv in enumerate(plan):
        if lv is None:
            arr["slots"][r] = next(spare)
            continue
        q = lv.request
        arr["slots"][r], arr["active"][r], arr["cur"][r], arr["wake"][r] = lv.slot, True, lv.cur, True
        arr["n_out"][r], arr["max_new"][r], arr["stop_ids"][r] = len(lv.result.tokens), q.max_new_tokens, lv.stop
        arr["temperature"][r] = min(float(q.temperature), _F32_MAX)
        arr["top_p"][r], arr["top_k"][r] = q.top_p, min(int(q.top_k), vocab)
        arr["key_data"][r] = lv.key_data
        arr["k_cap"][r] = lv.k if caps is None else next(caps)
        arr["forced"][r, : len(lv.forced)] = lv.forced
        arr["n_forced"][r] = len(lv.forced)
        b = q.budget
        if b is not None and not lv.budget_done and not lv.forced:
            arr["limit"][r] = b.max_tokens - lv.span_count if lv.in_span else b.max_tokens + 1
    return Rows(**arr)


def live(slot: int, i: int, **req) -> Live:
    q = Request(prompt=[5, 6], **req)
    stop = np.full(8, -1, np.int32)
    stop[: len(q.stop_ids)] = q.stop_ids
    lv = Live(i, q, [5, 6], GenerateResult(), k=i % 3, key_data=seed_key_data(q.seed), stop=stop, submitted=0.0)
    lv.slot, lv.cur, lv.pos = slot, 7 + i, 2
    lv.result.tokens = list(range(i))
    return lv


def requests() -> list[Live]:
    lvs = [live(3, 0, max_new_tokens=9, temperature=0.7, top_k=10, top_p=0.9, seed=11, stop_ids=(1, 4)),
           live(5, 1, temperature=1e39, top_k=10 ** 6, seed=2 ** 40 + 3),  # both saturate
           live(0, 2, budget=Budget(max_tokens=6, close_ids=(8, 9))),
           live(6, 3, budget=Budget(max_tokens=4, close_ids=(8,), open_ids=(2,))),
           live(1, 4, budget=Budget(max_tokens=4, close_ids=(8, 9)))]
    lvs[3].in_span, lvs[3].span_count = True, 3  # inside the span: limit = what is left of it
    lvs[4].forced = [8, 9]  # forced tokens pending: no limit
    return lvs


@pytest.mark.parametrize("order, pad, running, caps", [
    ([0, 1, 2, 3, 4], 3, (), None),  # padding on free slots
    ([4, 2], 6, (0, 1, 2, 3, 4, 5, 6), None),  # free slots run out: running slots outside the call follow
    ([1, 3], 2, (7,), [1, 0]),  # a call's own draft caps
    ([0, 1, 2, 3, 4], 0, (), [2, 2, 0, 1, 0]),  # no padding at all
])
def test_rows_from_the_table_equal_the_row_by_row_build(order, pad, running, caps):
    lvs = requests()
    table = row_plan.SlotTable(SLOTS, VOCAB)
    for lv in reversed(lvs):  # admission order does not matter
        table.admit(lv)
    plan = [lvs[i] for i in order] + [None] * pad
    plan.insert(1, plan.pop())  # a padding row between live rows
    running = set(running) | {lv.slot for lv in lvs}
    got = row_plan.rows(plan, running, table, caps)
    want = reference_rows(plan, running, SLOTS, VOCAB, caps)
    for name in Rows._fields:
        a, b = getattr(got, name), getattr(want, name)
        if name == "history":  # lookup drafting's, added by the engine's speculative calls only
            assert a is None and b is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name


def test_a_slot_reused_by_another_request_takes_its_fields():
    """The table row of a slot is rewritten at each admission: nothing of the previous request leaks."""
    table = row_plan.SlotTable(SLOTS, VOCAB)
    first, second = live(2, 0, temperature=0.5, seed=1, stop_ids=(3,)), live(2, 1, seed=9)
    table.admit(first)
    table.admit(second)
    got, want = row_plan.rows([second], {2}, table), reference_rows([second], {2}, SLOTS, VOCAB)
    for name in Rows._fields:
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
