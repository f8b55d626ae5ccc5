"""Pooled prefill / decode / verify / draft-extend steps against the cache-free full forward (CPU, fp32).

Issue 3 "Must show": chunked prefill (chunks 1, 3, 7, 64, whole prompt) + decode equals the full forward at every
position, indexer selections included; draft steps on both draft-extend paths equal the full-sequence MTP forward,
trace without compressor / indexer code and run on zero-capacity compressed pools; a target step handed a draft
pool spec fails at trace time; NaN-poisoned unused pool memory never reaches an output (and is never written);
bad inputs raise before anything is written; a reused slot is bit-identical to a fresh one.

Every test shares the programs of `steps_helpers` (one config, one pool spec per role, two-row batches, chunk
widths 1 / 3 / 7 / 70): compile time, not run time, is what these tests cost.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jax.extend.core import jaxprs_in_params  # noqa: E402

from ds4jax.runtime import pools  # noqa: E402
from ds4jax.runtime import steps  # noqa: E402
from ds4jax.runtime.kernels import resolve  # noqa: E402
from ds4jax.runtime.pools import KVPool, PoolError  # noqa: E402
from ds4jax.runtime.roles import Role  # noqa: E402
from steps_helpers import (CFG, DRAFT_SPEC, K, SPEC, TOTAL, Runner, assert_poison_only_where_unwritten,  # noqa: E402
                           assert_same_pool, chunk_plan, mtp_reference, per_row_logits, reference,
                           rel_err_per_position, run_plan, snapshot)

TOL = 1e-5
X_SLOT, Y_SLOT = 2, 0  # two requests in non-contiguous slots; slot 1 stays unused (poisoned) unless a test needs it
X_PROMPT, Y_PROMPT, N_DECODE = 70, 45, 6  # X wraps the 10-row SWA ring 7 times, closes 17 C4 / 8 C128 windows


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from steps_helpers import make_model

    return make_model(tmp_path_factory.mktemp("steps_ckpt"), CFG, seed=0, mtp=True)[0]


@pytest.fixture(scope="module")
def seqs():
    """Two random token sequences [2, TOTAL]: request X reads row 0, request Y row 1."""
    return np.random.default_rng(0).integers(0, CFG.vocab_size, (2, TOTAL)).astype(np.int32)


@pytest.fixture(scope="module")
def ref(model, seqs):
    logits, sels = reference(CFG, model.params, jnp.asarray(seqs))
    return np.asarray(logits), [np.asarray(s) for s in sels]


def check_against_reference(ref, got_logits, got_sels, lengths):
    """Per request b: logits of positions [0, lengths[b]) and the CSA indexer selections, token by token."""
    ref_logits, ref_sels = ref
    for b, length in enumerate(lengths):
        got = got_logits[b]
        assert got.shape[0] == length
        assert np.isfinite(got).all(), f"request {b}: non-finite logits at {np.flatnonzero(~np.isfinite(got).all(-1))}"
        err = rel_err_per_position(got, ref_logits[b, :length])
        assert err.max() <= TOL, f"request {b}: rel err {err.max():.2e} at position {err.argmax()}"
        if got_sels is None:
            continue
        assert len(got_sels[b]) == len(ref_sels) == 2
        for j, (mine, theirs) in enumerate(zip(got_sels[b], ref_sels)):
            theirs = theirs[b, :length]  # same order too: score descending, ties to the lower entry, -1 = none
            assert mine.shape == theirs.shape
            bad = np.flatnonzero((mine != theirs).any(-1))
            assert bad.size == 0, (f"request {b}, CSA layer #{j}: selection differs at positions {bad.tolist()}: "
                                   f"{mine[bad[:3]].tolist()} vs {theirs[bad[:3]].tolist()}")


def joined(*parts):
    """Concatenate the per-request outputs of several `run_plan` calls."""
    logits = [np.concatenate([p[0][b] for p in parts]) for b in range(2)]
    sels = [[np.concatenate([p[1][b][j] for p in parts]) for j in range(2)] for b in range(2)]
    return logits, sels


# ---- 1. chunked prefill + decode == full forward ------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 3, 7, 64, "whole"])
def test_chunked_prefill_then_decode_matches_full_forward(model, seqs, ref, chunk):
    """Ragged batch (X: 70-token prompt in slot 2, Y: 45 tokens in slot 0, joining one step late with a shorter
    first chunk so the two rows' chunk boundaries differ), NaN-poisoned pool, then 6 decode steps.

    Chunk 1 runs through the decode-shaped program (width 1, last-token logits); chunks 3 and 7 through widths
    3 and 7; chunk 64 and the whole prompt through one width-70 program (chunk 64 = rows of 64 valid tokens)."""
    r = Runner(model)
    slots = [X_SLOT, Y_SLOT]
    for s in slots:
        r.admit(s)
    if chunk == "whole":
        plans, width = [[X_PROMPT], [Y_PROMPT]], 70
    else:
        width = 70 if chunk == 64 else chunk
        plans = [chunk_plan(X_PROMPT, chunk),
                 chunk_plan(Y_PROMPT, chunk, first=max(1, chunk // 2), lead=int(chunk < 64))]
    prefill = run_plan(r, slots, seqs, plans, width, "last" if width == 1 else "all")
    decode = run_plan(r, slots, seqs, [[1] * N_DECODE] * 2, 1, "decode", starts=[X_PROMPT, Y_PROMPT])
    assert list(np.asarray(r.pool.lengths)[slots]) == [X_PROMPT + N_DECODE, Y_PROMPT + N_DECODE]
    assert_poison_only_where_unwritten(r.pool, SPEC, r.book)
    check_against_reference(ref, *joined(prefill, decode), [X_PROMPT + N_DECODE, Y_PROMPT + N_DECODE])


# ---- 4. poison: decode-heavy --------------------------------------------------------------------------------

def test_decode_heavy_on_poisoned_pool(model, seqs, ref):
    """X: 5-token prompt then 71 decode steps; Y: 20-token prompt, 31 decode steps, then idle padding rows for
    40 steps. Poisoned pool: every output finite and exact; only the rows the tokens own were written."""
    r = Runner(model)
    slots = [X_SLOT, Y_SLOT]
    for s in slots:
        r.admit(s)
    prefill = run_plan(r, slots, seqs, [[5], [7, 7, 6]], 7, "all")
    decode = run_plan(r, slots, seqs, [[1] * (TOTAL - 5), [1] * 31], 1, "decode", starts=[5, 20])
    assert_poison_only_where_unwritten(r.pool, SPEC, r.book)
    check_against_reference(ref, *joined(prefill, decode), [TOTAL, 51])


# ---- 6. slot reuse ----------------------------------------------------------------------------------------------

def _run_b(r: Runner, seqs):
    """Request B (row 1 of seqs, 40-token prompt in width-7 chunks, 4 decodes) in slot 0, next to idle slot 1."""
    prefill = run_plan(r, [0, 1], [seqs[1], seqs[1]], [chunk_plan(40, 7), []], 7, "all")
    decode = run_plan(r, [0, 1], [seqs[1], seqs[1]], [[1] * 4, []], 1, "decode", starts=[40, 0])
    return np.concatenate([prefill[0][0], decode[0][0]])


@pytest.mark.parametrize("fresh_pool, reset", [("poisoned", True), ("zeros", True), ("poisoned", False)])
def test_slot_reuse_is_bit_identical_to_fresh_pool(model, seqs, ref, fresh_pool, reset):
    """A in slot 0 (C in slot 2 keeps its pages, so B gets A's old pages in another order), release, B in slot 0:
    B's logits are bit-identical to B on a fresh pool. With reset=False the slot's rings are not cleared: validity
    is positional, so A's stale rows must not be read either."""
    fresh = Runner(model, pool=pools.poisoned(SPEC) if fresh_pool == "poisoned" else pools.zeros(SPEC))
    fresh.admit(0)
    fresh.admit(1)
    want = _run_b(fresh, seqs)
    assert rel_err_per_position(want, ref[0][1, :44]).max() <= TOL

    r = Runner(model)
    r.admit(0)
    r.admit(2)
    run_plan(r, [0, 2], [seqs[0], seqs[1]], [chunk_plan(50, 7), chunk_plan(30, 7)], 7, "all")
    run_plan(r, [0, 2], [seqs[0], seqs[1]], [[1] * 3, [1] * 3], 1, "decode", starts=[50, 30])
    old_pages = r.book.page_table[0].copy()
    before = snapshot(r.pool)
    per_slot = [k for k in before if k == "swa_kv" or "state" in k]
    for k in per_slot:
        assert np.isfinite(before[k][:, 0]).all() and np.abs(before[k][:, 0]).max() > 0, k

    if reset:
        r.release(0)  # book.release + pools.reset_slots + sync
        after = snapshot(r.pool)
        for k in per_slot:  # the slot's rings are cleared, not only its counters
            assert (after[k][:, 0] == 0).all(), f"{k} of the released slot was not zeroed"
            assert np.array_equal(after[k][:, 1:], before[k][:, 1:], equal_nan=True), f"{k} of other slots changed"
        assert (after["page_table"][0] == -1).all() and after["lengths"][0] == 0
        assert np.array_equal(after["page_table"][2], before["page_table"][2]) and after["lengths"][2] == 33
        for k in ("c4_kv", "indexer_kv", "c128_kv"):  # paged entries stay: validity is positional
            assert np.array_equal(after[k], before[k], equal_nan=True)
    else:
        r.book.release(0)
        r.pool = r.book.sync(r.pool)

    r.admit(0)
    r.admit(1)
    assert sorted(r.book.page_table[0]) == sorted(old_pages) and list(r.book.page_table[0]) != list(old_pages)
    got = _run_b(r, seqs)
    np.testing.assert_array_equal(got, want)


# ---- 5. bad inputs ---------------------------------------------------------------------------------------------

def test_bad_inputs_raise_before_anything_is_written(model, seqs, ref):
    r = Runner(model)
    slots = [X_SLOT, Y_SLOT]
    for s in slots:
        r.admit(s)
    prefill = run_plan(r, slots, seqs, [[X_PROMPT], [Y_PROMPT]], 70, "all")
    before, lengths = snapshot(r.pool), r.book.lengths.copy()
    nxt = [list(seqs[0, X_PROMPT : X_PROMPT + 3]), list(seqs[1, Y_PROMPT : Y_PROMPT + 3])]

    def rejected(rows, width, match, step_slots=slots):
        with pytest.raises(PoolError, match=match):
            r.step(step_slots, rows, width, "all")
        assert_same_pool(r.pool, before)
        assert not any(a.is_deleted() for a in jax.tree.leaves(r.pool)), "the pool was donated to a step"
        assert (r.book.lengths == lengths).all()

    V = CFG.vocab_size
    rejected([nxt[0], nxt[1][:2] + [V]], 3, rf"row 1 \(slot {Y_SLOT}\): token id {V} at chunk index 2 is outside "
                                            rf"the vocabulary \[0, {V}\)")
    rejected([[-1] + nxt[0][1:], nxt[1]], 3, rf"row 0 \(slot {X_SLOT}\): token id -1 at chunk index 0")
    over = list(seqs[0, :27])  # 70 + 27 = 97 > max_context 96
    rejected([over, nxt[1]], 70, rf"row 0 \(slot {X_SLOT}\): 70 \+ 27 tokens exceed max_context 96")
    rejected([nxt[0], nxt[1]], 3, "row 0: slot 1 is not an admitted request slot", step_slots=[1, Y_SLOT])
    rejected([nxt[0], nxt[1]], 3, r"slots must be distinct, got \[0, 0\]", step_slots=[Y_SLOT, Y_SLOT])
    r.book.admit(1)  # admitted, but no pages reserved
    rejected([nxt[0][:1], nxt[1]], 3, r"row 0 \(slot 1\): no pages reserved for 1 tokens", step_slots=[1, Y_SLOT])
    with pytest.raises(PoolError, match=r"slot 1: 97 tokens exceed the pool's max_context of 96"):
        r.book.reserve(1, 97)
    with pytest.raises(PoolError, match=r"row 0: n_tokens 4 is outside \[0, 3\]"):
        r.book.check_extend([X_SLOT, Y_SLOT], np.zeros((2, 3), np.int32), [4, 1])
    r.book.release(1)
    assert_same_pool(r.pool, before)

    # the pool is intact: decoding continues exactly
    decode = run_plan(r, slots, seqs, [[1] * N_DECODE] * 2, 1, "decode", starts=[X_PROMPT, Y_PROMPT])
    check_against_reference(ref, *joined(prefill, decode), [X_PROMPT + N_DECODE, Y_PROMPT + N_DECODE])


def test_padding_tokens_never_leak(model, seqs):
    """The ids in padding positions (beyond n_tokens, or whole n = 0 rows) do not change any valid output."""
    outs = []
    for pad in (0, CFG.vocab_size - 1):
        r = Runner(model)
        for s in (X_SLOT, Y_SLOT):
            r.admit(s)
        tok = np.full((2, 7), pad, np.int32)
        tok[0, :5] = seqs[0, :5]
        batch = steps.StepBatch(jnp.asarray([X_SLOT, Y_SLOT], jnp.int32), jnp.asarray(tok), jnp.asarray([5, 0]))
        r.book.check_extend([X_SLOT, Y_SLOT], tok, [5, 0])
        out, r.pool = steps.prefill(model.params, r.pool, batch, cfg=CFG, spec=SPEC, all_logits=True)
        r.book.commit([X_SLOT, Y_SLOT], [5, 0])
        assert_poison_only_where_unwritten(r.pool, SPEC, r.book)
        outs.append(np.asarray(out.logits[0, :5]))
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=1e-6 * np.abs(outs[0]).max())


# ---- 3. draft steps ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def speculative_round(model, seqs):
    """One speculative round for a ragged batch, driven step by step on the speculative target spec.

    (a) target prefill in width-7 chunks; after each chunk the draft extends on the prefill path: row i =
        (target streams of token i, id of token i+1), the last row taking the target's sampled token t;
    verification of [t, d1, d2] (width 3; d1 = the draft's proposal); forced ragged acceptance: X keeps only t
        (two rejected rows to roll back), Y keeps t, d1, d2; the target rolls back by lengths alone;
    (b) the draft extends on the decode path with the accepted rows and the ids that follow them (the drafts,
        then the target's bonus token);
    then the target decodes the bonus token and 3 greedy tokens over the rejected rows."""
    target, draft = Runner(model), Runner(model, DRAFT_SPEC, role=Role.DRAFT)
    slots = [X_SLOT, Y_SLOT]
    for s in slots:
        target.admit(s)
        draft.admit(s)
    prompts = [list(seqs[0, :X_PROMPT]), list(seqs[1, :Y_PROMPT])]
    plans = [chunk_plan(X_PROMPT, 7), chunk_plan(Y_PROMPT, 7, first=3, lead=1)]
    plans = [p + [0] * (max(map(len, plans)) - len(p)) for p in plans]
    pos, sampled = [0, 0], [None, None]
    streams, next_ids, draft_logits, target_logits = ([[], []] for _ in range(4))
    for i in range(len(plans[0])):
        rows = [prompts[b][pos[b] : pos[b] + plans[b][i]] for b in range(2)]
        out, n = target.step(slots, rows, 7, "all")
        nxt = []
        for b, lg in enumerate(per_row_logits(out, n, "all")):
            target_logits[b].append(lg)
            ids = prompts[b][pos[b] + 1 : pos[b] + n[b] + 1]
            if n[b] and pos[b] + n[b] == len(prompts[b]):
                sampled[b] = int(lg[-1].argmax())
                ids = ids + [sampled[b]]
            nxt.append(ids)
        dout, _ = draft.step(slots, nxt, 7, "all", streams=out.streams)
        for b, lg in enumerate(per_row_logits(dout, n, "all")):
            draft_logits[b].append(lg)
            streams[b].append(np.asarray(out.streams[b, : n[b]]))
            next_ids[b] += nxt[b]
            pos[b] += n[b]
    draft_prefill_rows = [sum(map(len, d)) for d in draft_logits]

    d1 = [int(np.concatenate(draft_logits[b])[-1].argmax()) for b in range(2)]  # the draft's proposals
    d2 = [(d + 1) % CFG.vocab_size for d in d1]
    verified = [[sampled[b], d1[b], d2[b]] for b in range(2)]
    vout, n = target.step(slots, verified, K + 1, "verify")
    accepted = [1, 3]
    vlogits = per_row_logits(vout, n, "all")
    bonus = [int(vlogits[b][a - 1].argmax()) for b, a in enumerate(accepted)]
    for b, (s, a) in enumerate(zip(slots, accepted)):
        target_logits[b].append(vlogits[b][:a])
        target.book.lengths[s] = len(prompts[b]) + a  # roll back: rejected rows are never read again
    target.pool = target.book.sync(target.pool)

    after = [verified[b][1:a] + [bonus[b]] for b, a in enumerate(accepted)]
    dout, n = draft.step(slots, after, K + 1, "all", streams=vout.streams)
    assert n == accepted
    for b, lg in enumerate(per_row_logits(dout, n, "all")):
        draft_logits[b].append(lg)
        streams[b].append(np.asarray(vout.streams[b, : n[b]]))
        next_ids[b] += after[b]

    tokens = [prompts[b] + verified[b][:a] for b, a in enumerate(accepted)]
    current = list(bonus)
    for _ in range(4):
        out, n = target.step(slots, [[t] for t in current], 1, "decode")
        for b, lg in enumerate(per_row_logits(out, n, "decode")):
            target_logits[b].append(lg)
            tokens[b].append(current[b])
        current = [int(lg[0].argmax()) for lg in per_row_logits(out, n, "decode")]
    return dict(target=target, draft=draft, tokens=tokens, target_logits=target_logits, streams=streams,
                next_ids=next_ids, draft_logits=draft_logits, accepted=accepted,
                draft_prefill_rows=draft_prefill_rows, prompts=prompts)


def test_verify_rollback_then_decode_matches_full_forward(model, speculative_round):
    """The target side of the round: prefill chunks, the accepted verify rows, and decoding over rolled-back rows
    (X rejected two rows, so the 10-row SWA ring and the 16-row state rings hold rejected positions) equal the
    full forward of the final sequences."""
    r = speculative_round
    lengths = [len(t) for t in r["tokens"]]
    assert lengths == [X_PROMPT + 1 + 4, Y_PROMPT + 3 + 4]
    assert list(np.asarray(r["target"].pool.lengths)[[X_SLOT, Y_SLOT]]) == lengths
    ids = np.zeros((2, TOTAL), np.int32)
    for b, t in enumerate(r["tokens"]):
        ids[b, : len(t)] = t
    want = reference(CFG, model.params, jnp.asarray(ids))
    got = [np.concatenate(x) for x in r["target_logits"]]
    check_against_reference((np.asarray(want[0]), None), got, None, lengths)
    assert_poison_only_where_unwritten(r["target"].pool, SPEC, r["target"].book)


def test_draft_extend_both_paths_match_full_mtp(model, speculative_round):
    """Draft logits of both paths equal `mtp_forward_full` over the concatenated (stream, next id) rows."""
    r = speculative_round
    assert DRAFT_SPEC.c4_entries == DRAFT_SPEC.indexer_entries == DRAFT_SPEC.c128_entries == 0
    assert DRAFT_SPEC.c4_state_rows == DRAFT_SPEC.indexer_state_rows == DRAFT_SPEC.c128_state_rows == 0
    assert DRAFT_SPEC.pages_per_slot == 0 and DRAFT_SPEC.swa_rows == CFG.sliding_window + K
    assert r["draft_prefill_rows"] == [X_PROMPT, Y_PROMPT]
    lengths = [len(p) + a for p, a in zip(r["prompts"], r["accepted"])]
    assert list(np.asarray(r["draft"].pool.lengths)[[X_SLOT, Y_SLOT]]) == lengths
    s_all = np.zeros((2, TOTAL, CFG.hc_mult, CFG.hidden_size), np.float32)
    ids_all = np.zeros((2, TOTAL), np.int32)
    for b in range(2):
        s_all[b, : lengths[b]] = np.concatenate(r["streams"][b])
        ids_all[b, : lengths[b]] = r["next_ids"][b]
    want = np.asarray(mtp_reference(CFG, model.params, jnp.asarray(s_all), jnp.asarray(ids_all)))
    for b in range(2):
        got = np.concatenate(r["draft_logits"][b])
        assert got.shape[0] == lengths[b] and np.isfinite(got).all()
        err = rel_err_per_position(got, want[b, : lengths[b]])
        assert err.max() <= TOL, f"request {b}: draft rel err {err.max():.2e} at row {err.argmax()}"
    # the draft ran on zero-capacity compressed pools, and wrote only its SWA ring
    pool = r["draft"].pool
    for name in ("c4_kv", "indexer_kv", "c128_kv", "c4_state_kv", "c4_state_gate", "indexer_state_kv",
                 "indexer_state_gate", "c128_state_kv", "c128_state_gate", "page_table"):
        assert getattr(pool, name).size == 0, name
    assert_poison_only_where_unwritten(pool, DRAFT_SPEC, r["draft"].book)


def _abstract_batch(width: int) -> steps.StepBatch:
    i32 = jnp.int32
    return steps.StepBatch(jax.ShapeDtypeStruct((2,), i32), jax.ShapeDtypeStruct((2, width), i32),
                           jax.ShapeDtypeStruct((2,), i32))


def _abstract_streams(width: int):
    return jax.ShapeDtypeStruct((2, width, CFG.hc_mult, CFG.hidden_size), jnp.float32)


def _eqns(jaxpr, stack=""):
    """Every equation of a jaxpr and its sub-jaxprs, with its full name stack."""
    for eqn in jaxpr.eqns:
        here = f"{stack}/{eqn.source_info.name_stack}"
        yield eqn, here
        for sub in jaxprs_in_params(eqn.params):
            yield from _eqns(sub, here)


@pytest.mark.parametrize("width", [7, K + 1])
def test_draft_trace_has_no_compressor_or_indexer(model, width):
    static = dict(cfg=CFG, logits=steps.Logits.ALL, kernels=resolve(None))
    draft = jax.make_jaxpr(functools.partial(steps._draft_step, spec=DRAFT_SPEC, role=Role.DRAFT, **static))(
        model.params, pools.abstract(DRAFT_SPEC), _abstract_batch(width), _abstract_streams(width))
    target = jax.make_jaxpr(functools.partial(steps._target_step, spec=SPEC, role=Role.TARGET, **static))(
        model.params, pools.abstract(SPEC), _abstract_batch(width))

    target_stacks = [s for _, s in _eqns(target.jaxpr)]
    draft_stacks = [s for _, s in _eqns(draft.jaxpr)]
    # positive control: the target's compressor and indexer code is visible under these scopes
    assert any("compressor" in s for s in target_stacks) and any("indexer" in s for s in target_stacks)
    assert any("draft/mtp" in s for s in draft_stacks)
    assert not [s for s in draft_stacks if "compressor" in s or "indexer" in s or "target/" in s]

    # dataflow: no equation of the draft program reads a compressed pool or a compressor state ring;
    # they pass through untouched
    (call,) = draft.jaxpr.eqns
    inner = call.params["jaxpr"].jaxpr
    offset = len(jax.tree.leaves(model.params))
    names = [f.name for f in dataclasses.fields(KVPool)]
    untouched = {n: inner.invars[offset + i] for i, n in enumerate(names)
                 if n in ("c4_kv", "indexer_kv", "c128_kv") or "state" in n}
    read = {id(v) for e in inner.eqns for v in e.invars}
    assert not [n for n, v in untouched.items() if id(v) in read]
    out_pool = inner.outvars[-len(names):]
    for n, v in untouched.items():
        assert out_pool[names.index(n)] is v, f"draft pool.{n} is not passed through"


def test_target_step_rejects_draft_pool_spec(model):
    batch = steps.StepBatch(jnp.asarray([0, 1], jnp.int32), jnp.zeros((2, 3), jnp.int32), jnp.asarray([1, 1]))
    dpool = pools.zeros(DRAFT_SPEC)
    # at trace time: abstract inputs, nothing runs
    with pytest.raises(PoolError, match=r"target step: the pool spec has 1 layers \(0 CSA, 0 HCA\) but the target "
                                        r"model has 3 \(2 CSA, 1 HCA\); a draft pool spec cannot serve the target"):
        jax.eval_shape(functools.partial(steps.prefill, cfg=CFG, spec=DRAFT_SPEC), model.params,
                       pools.abstract(DRAFT_SPEC), _abstract_batch(3))
    for call in (steps.prefill, steps.decode, steps.verify):
        b = batch if call is not steps.decode else batch._replace(token_ids=batch.token_ids[:, :1])
        with pytest.raises(PoolError, match="a draft pool spec cannot serve the target"):
            call(model.params, dpool, b, cfg=CFG, spec=DRAFT_SPEC)
    assert not any(a.is_deleted() for a in jax.tree.leaves(dpool))
    # the other mismatches
    with pytest.raises(PoolError, match=r"draft step: the draft owns one sliding-window layer; the pool spec has 3"):
        jax.eval_shape(functools.partial(steps.draft_extend, cfg=CFG, spec=SPEC), model.params, pools.abstract(SPEC),
                       _abstract_batch(3), _abstract_streams(3))
    with pytest.raises(PoolError, match=r"target step: pool.swa_kv has float32\[1, 3, 10, 32\], the pool spec "
                                        r"requires float32\[3, 3, 10, 32\]"):
        jax.eval_shape(functools.partial(steps.prefill, cfg=CFG, spec=SPEC), model.params,
                       pools.abstract(DRAFT_SPEC), _abstract_batch(3))
    with pytest.raises(PoolError, match="this step runs the target; got role=Role.DRAFT"):
        jax.eval_shape(functools.partial(steps.prefill, cfg=CFG, spec=DRAFT_SPEC, role=Role.DRAFT), model.params,
                       pools.abstract(DRAFT_SPEC), _abstract_batch(3))


@pytest.mark.parametrize("rows", [[1], [3], [2, 3, 0]])
def test_slot_row_writes_drop_the_null_slot(rows):
    """`steps._set_slot_rows`: a row naming the null slot (max_slots, a padding row) writes nothing, at one row (a
    dynamic_update_slice writing the old value back) as at several (a scatter dropping it); the other slots keep
    their NaN poison."""
    from ds4jax.runtime.steps import _set_slot_rows

    arr = jnp.full((2, 3, 4, 5), jnp.nan, jnp.float32)  # [layers, max_slots = 3, ...]
    rows = jnp.asarray(rows, jnp.int32)
    value = jnp.arange(len(rows) * 20, dtype=jnp.float32).reshape(len(rows), 4, 5)
    got = np.asarray(jax.jit(_set_slot_rows, static_argnums=1)(arr, 1, rows, value))
    want = np.full(arr.shape, np.nan, np.float32)
    for r, slot in enumerate(np.asarray(rows)):
        if slot < 3:
            want[1, slot] = np.asarray(value[r])
    np.testing.assert_array_equal(got, want)
