"""`KVPool` construction / reset / sync and the host `PoolBook`: slots, pages, step validation (no model needed).

Every `PoolBook` error is a `PoolError` whose message names the culprit (slot, row, token id, chunk index,
lengths), and a failed call leaves the book unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from ds4jax.runtime import pools
from ds4jax.runtime.pool_spec import PoolSpec, shapes
from ds4jax.runtime.pools import PoolBook, PoolError
from ds4jax.runtime.roles import Role
from steps_helpers import CFG, DRAFT_SPEC, SPEC

V = CFG.vocab_size


def book_state(book: PoolBook):
    return book.lengths.copy(), book.page_table.copy(), book.active.copy(), list(book.free_pages)


def assert_book_unchanged(book: PoolBook, state) -> None:
    lengths, table, active, free = state
    assert (book.lengths == lengths).all() and (book.page_table == table).all() and (book.active == active).all()
    assert book.free_pages == free


# ---- pools -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [SPEC, DRAFT_SPEC], ids=["target", "draft"])
def test_pool_arrays_come_from_the_spec(spec):
    for make in (pools.zeros, pools.poisoned, pools.abstract):
        pool = make(spec)
        for name, (shape, dtype) in shapes(spec).items():
            arr = getattr(pool, name)
            assert tuple(arr.shape) == shape and jnp.dtype(arr.dtype) == jnp.dtype(dtype), (make.__name__, name)
    z, p = pools.zeros(spec), pools.poisoned(spec)
    assert (np.asarray(z.page_table) == -1).all() and (np.asarray(p.page_table) == -1).all()
    assert (np.asarray(z.lengths) == 0).all() and (np.asarray(p.lengths) == 0).all()
    for name in ("swa_kv", "c4_kv", "c4_state_gate", "c128_state_kv"):
        assert (np.asarray(getattr(z, name)) == 0).all() and np.isnan(np.asarray(getattr(p, name))).all()
    if spec is DRAFT_SPEC:  # sliding only: every compressed, state and page-table array is empty
        assert all(getattr(z, n).size == 0 for n in ("c4_kv", "indexer_kv", "c128_kv", "c4_state_kv",
                                                     "indexer_state_gate", "c128_state_gate", "page_table"))
        assert z.swa_kv.shape == (1, SPEC.max_slots, CFG.sliding_window + DRAFT_SPEC.draft_tokens - 1, CFG.head_dim)


def test_check_pool_names_the_array():
    pools.check_pool(pools.zeros(SPEC), SPEC, "x")
    bad = pools.zeros(SPEC).replace(c128_kv=jnp.zeros((1, 3, 32), jnp.float32))
    with pytest.raises(PoolError, match=r"x: pool.c128_kv has float32\[1, 3, 32\], the pool spec requires "
                                        r"float32\[1, 36, 32\]"):
        pools.check_pool(bad, SPEC, "x")
    with pytest.raises(PoolError, match=r"pool.swa_kv has bfloat16"):
        pools.check_pool(pools.zeros(SPEC.replace(dtype="bfloat16")), SPEC, "x")


def test_reset_slots_clears_rings_tables_and_lengths_of_those_slots_only():
    book = PoolBook(SPEC, V)
    for s in range(3):
        book.admit(s)
        book.reserve(s, 20 * (s + 1))
        book.commit([s], [10 + s])
    pool = book.sync(pools.poisoned(SPEC))
    before = {k: np.asarray(v) for k, v in vars(pool).items()}
    after = {k: np.asarray(v) for k, v in vars(pools.reset_slots(pool, [0, 2])).items()}
    for name, arr in after.items():
        if name == "swa_kv" or "state" in name:  # [layers, slots, rows, w]
            assert (arr[:, [0, 2]] == 0).all(), name
            assert np.isnan(arr[:, 1]).all(), name
        elif name in ("c4_kv", "indexer_kv", "c128_kv"):  # shared pages: untouched
            assert np.isnan(arr).all(), name
    assert (after["page_table"][[0, 2]] == -1).all() and (after["page_table"][1] == before["page_table"][1]).all()
    assert after["lengths"].tolist() == [0, 11, 0]


def test_reset_slots_writes_in_place():
    """The pool is donated: the reset's rings are the old rings' memory (no second copy of every slot's rings)."""
    pool = pools.poisoned(SPEC)
    where = {name: arr.unsafe_buffer_pointer() for name, arr in vars(pool).items() if arr.size}
    reset = pools.reset_slots(pool, [1])
    assert pool.swa_kv.is_deleted() and pool.c4_kv.is_deleted()
    moved = [name for name, ptr in where.items() if getattr(reset, name).unsafe_buffer_pointer() != ptr]
    assert not moved, moved


def test_sync_copies_host_tables():
    book = PoolBook(SPEC, V)
    book.admit(1)
    book.reserve(1, 40)
    book.commit([1], [33])
    pool = book.sync(pools.zeros(SPEC))
    assert np.asarray(pool.lengths).tolist() == [0, 33, 0] and pool.lengths.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(pool.page_table), book.page_table)
    assert np.asarray(pool.page_table)[1].tolist() == [0, 1, 2, -1, -1, -1]


# ---- PoolBook: slots ---------------------------------------------------------------------------------------------

def test_admit_and_release_slots():
    book = PoolBook(SPEC, V)
    assert [book.admit(), book.admit(2), book.admit()] == [0, 2, 1]  # no slot given: the lowest free one
    state = book_state(book)
    with pytest.raises(PoolError, match="all 3 request slots are in use"):
        book.admit()
    with pytest.raises(PoolError, match="slot 2 is already in use"):
        book.admit(2)
    assert_book_unchanged(book, state)
    book.release(2)
    with pytest.raises(PoolError, match=r"slot 3 is outside \[0, 3\)"):
        book.admit(3)
    with pytest.raises(PoolError, match=r"slot -1 is outside \[0, 3\)"):
        book.admit(-1)
    assert book.admit() == 2


def test_reserve_allocates_whole_pages_and_release_returns_them():
    book = PoolBook(SPEC, V)
    a, b = book.admit(), book.admit()
    assert SPEC.num_pages == 18 and len(book.free_pages) == 18
    book.reserve(a, 1)
    assert book.page_table[a].tolist() == [0, -1, -1, -1, -1, -1]
    book.reserve(a, 16)  # still one page
    assert (book.page_table[a] >= 0).sum() == 1
    book.reserve(b, 17)
    book.reserve(a, 40)
    assert book.page_table[b].tolist()[:2] == [1, 2] and book.page_table[a].tolist()[:3] == [0, 3, 4]
    book.reserve(a, 5)  # never shrinks
    assert (book.page_table[a] >= 0).sum() == 3
    book.reserve(a, SPEC.max_context)
    assert (book.page_table[a] >= 0).sum() == SPEC.pages_per_slot
    used = book.page_table[book.page_table >= 0]
    assert len(set(used.tolist())) == used.size == 8 and len(book.free_pages) == 10
    book.commit([a], [7])
    book.release(a)
    assert (book.page_table[a] == -1).all() and book.lengths[a] == 0 and not book.active[a]
    assert len(book.free_pages) == 16
    book.release(a)  # releasing twice returns nothing twice
    assert len(book.free_pages) == 16
    c = book.admit()
    book.reserve(c, 96)
    assert set(book.page_table[c].tolist()) == {0, 3, 4, 5, 6, 7}  # the released pages come back first


def test_reserve_errors_leave_the_book_unchanged():
    small = PoolSpec.for_role(CFG, role=Role.TARGET, max_slots=3, max_context=96, page_size=16, dtype="float32",
                              num_pages=8)  # oversubscribed: 8 pages for 3 slots x 6
    book = PoolBook(small, V)
    a, b = book.admit(), book.admit()
    book.reserve(a, 48)
    state = book_state(book)
    with pytest.raises(PoolError, match=rf"slot {b}: needs 6 more pages, only 5 are free"):
        book.reserve(b, 96)
    with pytest.raises(PoolError, match=rf"slot {a}: 97 tokens exceed the pool's max_context of 96"):
        book.reserve(a, 97)
    assert_book_unchanged(book, state)
    book.reserve(b, 80)
    assert len(book.free_pages) == 0


def test_draft_book_needs_no_pages():
    book = PoolBook(DRAFT_SPEC, V)
    s = book.admit()
    book.reserve(s, DRAFT_SPEC.max_context)
    assert book.page_table.shape == (3, 0) and book.free_pages == []
    book.check_extend([s], np.ones((1, 4), np.int32), [4])
    with pytest.raises(PoolError, match="exceed the pool's max_context"):
        book.reserve(s, DRAFT_SPEC.max_context + 1)


# ---- PoolBook: step validation --------------------------------------------------------------------------------------

@pytest.fixture
def book():
    b = PoolBook(SPEC, V)
    b.admit(0)
    b.admit(2)
    b.reserve(0, 96)
    b.reserve(2, 16)
    b.commit([0, 2], [90, 15])
    return b


def test_check_extend_accepts_a_valid_ragged_step(book):
    tok = np.zeros((2, 6), np.int32)
    tok[1, :5] = V - 1
    tok[0, 3:] = V + 7  # padding beyond n_tokens is not looked at
    book.check_extend([0, 2], tok, [3, 1])
    book.check_extend([2, 0], tok[::-1], [1, 0])
    book.commit([0, 2], [3, 1])
    assert book.lengths[[0, 2]].tolist() == [93, 16]


@pytest.mark.parametrize("slots, tok, n, match", [
    ([0, 0], np.zeros((2, 3)), [1, 1], r"slots must be distinct, got \[0, 0\]"),
    ([0, 2], np.zeros((2,)), [1, 1], r"token_ids must be \[rows=2, chunk\], got shape \(2,\)"),
    ([0, 2], np.zeros((3, 3)), [1, 1], r"token_ids must be \[rows=2, chunk\], got shape \(3, 3\)"),
    ([0, 1], np.zeros((2, 3)), [1, 1], r"row 1: slot 1 is not an admitted request slot"),
    ([3, 0], np.zeros((2, 3)), [1, 1], r"row 0: slot 3 is not an admitted request slot"),
    ([0, 2], np.zeros((2, 3)), [1, 4], r"row 1: n_tokens 4 is outside \[0, 3\]"),
    ([0, 2], np.zeros((2, 3)), [-1, 1], r"row 0: n_tokens -1 is outside \[0, 3\]"),
    ([0, 2], [[0, 0, 0], [5, V, 0]], [1, 3], rf"row 1 \(slot 2\): token id {V} at chunk index 1 is outside the "
                                             rf"vocabulary \[0, {V}\)"),
    ([0, 2], [[0, -3, 0], [5, 5, 0]], [2, 3], r"row 0 \(slot 0\): token id -3 at chunk index 1"),
    ([0, 2], [[0, 0, 0], [0, 0, 2**40]], [1, 3], r"row 1 \(slot 2\): token id 1099511627776 at chunk index 2"),
    ([0, 2], np.zeros((2, 7)), [7, 1], r"row 0 \(slot 0\): 90 \+ 7 tokens exceed max_context 96"),
    ([0, 2], np.zeros((2, 7)), [1, 6], r"row 1 \(slot 2\): no pages reserved for 21 tokens"),
    ([0, 2], np.zeros((2, 3)), [1], r"n_tokens must have one entry per row \(2\), got 1"),
    ([0, 2], np.zeros((2, 3)), [1, 1, 1], r"n_tokens must have one entry per row \(2\), got 3"),
])
def test_check_extend_errors_name_the_culprit(book, slots, tok, n, match):
    state = book_state(book)
    with pytest.raises(PoolError, match=match):
        book.check_extend(slots, np.asarray(tok, np.int64), n)
    assert_book_unchanged(book, state)


def test_errors_are_value_errors():
    assert issubclass(PoolError, ValueError)
    assert jax.tree.structure(pools.zeros(SPEC)).num_leaves == 16  # 12 arrays + the FP8 cache's 4 scale arrays
