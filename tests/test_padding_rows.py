"""No silent clamping in a step: padding rows and rows without pages neither read nor write any live request.

A padding row (n_tokens 0) addresses the null slot, whatever slot it names (a live request's, the same slot as a
live row of the step, or -1); a page id of -1 maps to no row (writes dropped, reads end before it). Checked on
NaN-poisoned pools: a read of another request's storage would make an output NaN, and a write would change it.
The steps below skip `PoolBook.check_extend` where it would refuse them, as a buggy caller would.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from ds4jax.runtime import pools, steps  # noqa: E402
from steps_helpers import (CFG, SPEC, Runner, assert_poison_only_where_unwritten, reference,  # noqa: E402
                           rel_err_per_position, snapshot)

LIVE, OTHER = 0, 1  # LIVE owns pages 0..5 (the first allocated); OTHER is admitted without pages
PROMPT = 20


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from steps_helpers import make_model

    return make_model(tmp_path_factory.mktemp("pad_ckpt"), CFG, seed=1, mtp=False)[0]


@pytest.fixture(scope="module")
def seq():
    return np.random.default_rng(1).integers(0, CFG.vocab_size, (1, PROMPT + 4)).astype(np.int32)


def _step(r: Runner, slots, tok, n, mode):
    batch = steps.StepBatch(jnp.asarray(slots, jnp.int32), jnp.asarray(tok, jnp.int32), jnp.asarray(n, jnp.int32))
    if mode == "decode":
        out, r.pool = steps.decode(r.params, r.pool, batch, cfg=r.cfg, spec=r.spec)
    else:
        out, r.pool = steps.prefill(r.params, r.pool, batch, cfg=r.cfg, spec=r.spec, all_logits=True)
    r.book.commit([s for s, k in zip(slots, n) if k], [k for k in n if k])
    return out


def test_padding_rows_naming_live_slots_write_and_read_nothing(model, seq):
    """Padding rows name the live slot itself (a duplicate slot in the step) or -1: the live request's logits
    still equal the full forward, and the poisoned pool changes only where the live request wrote."""
    ref = np.asarray(reference(CFG, model.params, jnp.asarray(seq))[0])[0]
    r = Runner(model)
    r.admit(LIVE)
    tok = np.zeros((2, 70), np.int32)
    tok[1, :PROMPT] = seq[0, :PROMPT]
    r.book.check_extend([LIVE, LIVE], tok, [0, PROMPT])  # padding rows are exempt from the distinct-slot rule
    out = _step(r, [LIVE, LIVE], tok, [0, PROMPT], "all")
    got = [np.asarray(out.logits[1, :PROMPT])]
    assert np.isfinite(np.asarray(out.streams[0])).all(), "the padding row read poisoned storage"
    for i, (slots, row) in enumerate((([LIVE, LIVE], 0), ([-1, LIVE], 1), ([LIVE, -1], 0), ([LIVE, LIVE], 1))):
        tok = np.zeros((2, 1), np.int32)
        tok[row, 0] = seq[0, PROMPT + i]
        n = [0, 0]
        n[row] = 1
        out = _step(r, slots, tok, n, "decode")
        got.append(np.asarray(out.logits[row])[None])
        assert np.isfinite(np.asarray(out.streams[1 - row])).all(), "the padding row read poisoned storage"
    err = rel_err_per_position(np.concatenate(got), ref[: PROMPT + 4])
    assert err.max() <= 1e-5, f"rel err {err.max():.2e} at position {err.argmax()}"
    assert_poison_only_where_unwritten(r.pool, SPEC, r.book)


def test_a_row_without_pages_writes_and_reads_nothing_of_other_requests(model, seq):
    """OTHER has no pages (its table row is all -1; today's host check would refuse the step). Its compressed
    entries must not land on page 0 (LIVE's) and its attention must not read LIVE's entries: with every pool
    row NaN, OTHER's outputs stay finite and the pool is unchanged outside OTHER's own slot rings."""
    r = Runner(model)
    r.admit(LIVE)
    r.book.admit(OTHER)
    r.book.commit([LIVE], [PROMPT])  # LIVE "holds" PROMPT tokens, all of them NaN in the poisoned pool
    r.pool = r.book.sync(pools.poisoned(SPEC))
    assert r.book.page_table[LIVE, 0] == 0 and (r.book.page_table[OTHER] == -1).all()
    before = snapshot(r.pool)
    tok = np.zeros((2, 70), np.int32)
    tok[0, :PROMPT] = seq[0, :PROMPT]  # closes C4 and C128 windows: entries to write, entries to read
    out = _step(r, [OTHER, LIVE], tok, [PROMPT, 0], "all")
    assert np.isfinite(np.asarray(out.logits[0, :PROMPT])).all(), "a row without pages read another request"
    assert np.isfinite(np.asarray(out.streams[1])).all(), "the padding row read poisoned storage"
    after = snapshot(r.pool)
    for name, arr in after.items():
        if name == "lengths":
            assert arr.tolist() == [PROMPT, PROMPT, 0]
        elif arr.ndim == 4:  # [layers, slots, rows, w]: only OTHER's own rings may change
            keep = [s for s in range(SPEC.max_slots) if s != OTHER]
            assert np.array_equal(arr[:, keep], before[name][:, keep], equal_nan=True), name
        else:  # paged pools (OTHER has no page to write) and page tables
            assert np.array_equal(arr, before[name], equal_nan=True), f"pool.{name} changed"
