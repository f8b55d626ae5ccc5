"""Shared pieces of the pool / step tests (a helper module, not collected by pytest).

Compile time dominates these CPU tests (each distinct step shape costs seconds to compile, microseconds to
run), so every test drives the *same* few programs: one tiny config `CFG`, one target pool spec `SPEC`, one
draft spec `DRAFT_SPEC`, batches of `ROWS` rows, and the chunk widths in `WIDTHS`. jax.jit caches are
process-wide, so the modules that import this share the compilations.

`Runner` is the host loop every engine runs: build the padded batch, `PoolBook.check_extend`, launch the
step, `PoolBook.commit`. `run_plan` drives a ragged batch through per-request chunk plans.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import ds4jax
import hf_reference as hr
from ds4jax.model import forward as model_lib
from ds4jax.runtime import pools
from ds4jax.runtime import steps
from ds4jax.model.config import AttentionType as A
from ds4jax.model.config import Config, MlpType, tiny
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.roles import Role

# Two CSA layers and one HCA layer (window 8, CSA ratio 4, HCA ratio 8): a pool-layer index mix-up between
# the layer number and the per-kind index fails loudly (static index out of range), and ~70-token prompts
# wrap the SWA ring (10 rows in SPEC) 7 times and close 17 C4 and 8 C128 windows.
CFG = tiny(num_layers=3, attention_types=(A.CSA, A.HCA, A.CSA), mlp_types=(MlpType.HASH, MlpType.TOPK, MlpType.TOPK))
MAX_CONTEXT = 96
PAGE = 16  # 6 pages per request: entries of one request span several, non-contiguous pages
SLOTS = 3
ROWS = 2  # every step has two rows (two requests, or one request plus an idle admitted slot)
K = 2  # draft tokens per round; verification scores K + 1 positions
# The speculative target spec (draft_tokens K + 1): its SWA ring (10 rows) and state rings (16 rows) are larger
# than the windows they serve, so ring indexing cannot silently assume rows == window; rings == windows (plain
# decoding) run end to end in test_greedy_hf.
SPEC = PoolSpec.for_role(CFG, role=Role.TARGET, max_slots=SLOTS, max_context=MAX_CONTEXT, page_size=PAGE,
                         dtype="float32", draft_tokens=K + 1)
DRAFT_SPEC = PoolSpec.for_role(CFG, role=Role.DRAFT, max_slots=SLOTS, max_context=MAX_CONTEXT, page_size=PAGE,
                               dtype="float32", draft_tokens=K + 1)
TOTAL = 76  # length of the reference sequences (prompt + decoded tokens of the longest request)


def make_model(directory, cfg: Config = CFG, seed: int = 0, mtp: bool = True):
    """A random HF checkpoint of `cfg` (plus random upstream-named MTP tensors), loaded in fp32.

    Returns (ds4jax Model, HF torch model)."""
    hf = hr.save_hf_checkpoint(cfg, directory, seed=seed)
    if mtp:
        hr.add_random_mtp(directory, cfg, seed=seed)
    model = ds4jax.load(directory, dtype=jnp.float32)
    assert model.config == cfg
    return model, hf


@functools.partial(jax.jit, static_argnums=0)
def reference(cfg: Config, params, ids):
    """Cache-free full forward: (logits [b, t, v], indexer selections per CSA layer [b, t, n])."""
    out = model_lib.forward_full(cfg, params, ids)
    return out.logits, tuple(a.attention for a in out.aux if a.attention is not None)


@functools.partial(jax.jit, static_argnums=0)
def mtp_reference(cfg: Config, params, streams, next_ids):
    return model_lib.mtp_forward_full(cfg, params, streams, next_ids).logits


def chunk_plan(length: int, chunk: int, first: int | None = None, lead: int = 0) -> list[int]:
    """Chunk sizes that cover `length` tokens: `lead` idle steps, an optional shorter first chunk, then `chunk`."""
    sizes = [0] * lead
    done = 0
    if first:
        sizes.append(min(first, length))
        done = sizes[-1]
    while done < length:
        sizes.append(min(chunk, length - done))
        done += sizes[-1]
    return sizes


def rel_err_per_position(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """max_v |got - ref| / max_v |ref| for every position of [t, v] logits."""
    return np.abs(got - ref).max(-1) / np.abs(ref).max(-1)


def snapshot(pool) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in vars(pool).items()}


def assert_same_pool(pool, before: dict[str, np.ndarray]) -> None:
    for name, arr in before.items():
        now = np.asarray(getattr(pool, name))
        assert np.array_equal(now, arr, equal_nan=True), f"pool.{name} changed"


class Runner:
    """A pool, its host `PoolBook`, and the validated step loop (check_extend -> step -> commit)."""

    def __init__(self, model, spec: PoolSpec = SPEC, *, role: Role = Role.TARGET, pool=None):
        self.cfg, self.params, self.spec, self.role = model.config, model.params, spec, role
        self.book = pools.PoolBook(spec, model.config.vocab_size)
        self.pool = pools.poisoned(spec) if pool is None else pool

    def admit(self, slot: int, reserve: int = MAX_CONTEXT) -> None:
        self.book.admit(slot)
        self.book.reserve(slot, reserve)
        self.pool = self.book.sync(self.pool)

    def release(self, slot: int) -> None:
        self.book.release(slot)
        self.pool = self.book.sync(pools.reset_slots(self.pool, [slot]))

    def step(self, slots: Sequence[int], rows: Sequence[Sequence[int]], width: int, mode: str,
             streams=None) -> tuple[steps.StepOutput, list[int]]:
        """One step: rows[b] are the token ids appended to slots[b] (padded to `width`).

        mode: "decode" (width 1), "last" / "none" / "all" (prefill logits modes), "verify"; draft runners
        always run `draft_extend` with all logits."""
        n = [len(r) for r in rows]
        tok = np.zeros((len(slots), width), np.int32)
        for b, r in enumerate(rows):
            tok[b, : len(r)] = r
        self.book.check_extend(slots, tok, n)
        batch = steps.StepBatch(jnp.asarray(slots, jnp.int32), jnp.asarray(tok), jnp.asarray(n, jnp.int32))
        kw = dict(cfg=self.cfg, spec=self.spec)
        if self.role is Role.DRAFT:
            out, self.pool = steps.draft_extend(self.params, self.pool, batch, streams, all_logits=True, **kw)
        elif mode == "decode":
            out, self.pool = steps.decode(self.params, self.pool, batch, **kw)
        elif mode == "verify":
            out, self.pool = steps.verify(self.params, self.pool, batch, **kw)
        else:
            out, self.pool = steps.prefill(self.params, self.pool, batch, need_logits=mode != "none",
                                           all_logits=mode == "all", **kw)
        self.book.commit(slots, n)
        return out, n


def per_row_logits(out: steps.StepOutput, n: Sequence[int], mode: str) -> list[np.ndarray]:
    """Logits of the valid tokens of each row, [n_b, v]."""
    lg = np.asarray(out.logits)
    if mode in ("decode", "last"):
        assert lg.ndim == 2
        return [lg[b][None][:k] for b, k in enumerate(n)]  # a padding row (n = 0) has no logits
    return [lg[b, :k] for b, k in enumerate(n)]


def run_plan(runner: Runner, slots: Sequence[int], seqs: Sequence[Sequence[int]], plans: Sequence[list[int]],
             width: int, mode: str, starts: Sequence[int] | None = None):
    """Feed seqs[b] to slots[b] following per-request chunk plans (0 = idle row), one step per plan index.

    Returns per request: logits [tokens, v], selections per CSA layer [tokens, n], streams [tokens, m, e]."""
    pos = list(starts or [0] * len(slots))
    steps_n = max(len(p) for p in plans)
    plans = [p + [0] * (steps_n - len(p)) for p in plans]
    logits = [[] for _ in slots]
    sels = [[] for _ in slots]
    streams = [[] for _ in slots]
    for i in range(steps_n):
        rows = [list(seqs[b][pos[b] : pos[b] + plans[b][i]]) for b in range(len(slots))]
        assert [len(r) for r in rows] == [p[i] for p in plans], "plan runs past the sequence"
        out, n = runner.step(slots, rows, width, mode)
        for b, lg in enumerate(per_row_logits(out, n, mode)):
            logits[b].append(lg)
            sels[b].append([np.asarray(s[b, : n[b]]) for s in out.selections])
            streams[b].append(np.asarray(out.streams[b, : n[b]]))
            pos[b] += n[b]
    cat = lambda xs: np.concatenate(xs, axis=0)
    return ([cat(x) for x in logits], [[cat([s[j] for s in x]) for j in range(len(x[0]))] for x in sels],
            [cat(x) for x in streams])


def written_rows(spec: PoolSpec, book: pools.PoolBook, slot: int, ratio: int) -> tuple[np.ndarray, np.ndarray]:
    """Pool rows of `slot`'s compressed entries that exist (index < length // ratio) and that do not."""
    per_page = spec.page_size // ratio
    count = int(book.lengths[slot]) // ratio
    rows = [int(p) * per_page + j for p in book.page_table[slot] if p >= 0 for j in range(per_page)]
    rows = np.asarray(rows, np.int64)
    return rows[:count], rows[count:]


def assert_poison_only_where_unwritten(pool, spec: PoolSpec, book: pools.PoolBook) -> None:
    """On a NaN-poisoned pool that has never been reset: exactly the storage the committed tokens own is
    finite, everything else is still NaN (nothing was written by padding, nothing beyond capacity).

    SWA and state rings: row r of a slot of length L is written iff some position p < L has p % rows == r.
    Paged pools: entry j of a slot is written iff j < L // ratio."""
    for name, ratio in (("swa_kv", None), ("c4_state_kv", None), ("c4_state_gate", None),
                        ("indexer_state_kv", None), ("indexer_state_gate", None), ("c128_state_kv", None),
                        ("c128_state_gate", None)):
        arr = np.asarray(getattr(pool, name))  # [layers, slots, rows, w]
        if arr.size == 0:
            continue
        rows = arr.shape[2]
        for slot in range(spec.max_slots):
            length = int(book.lengths[slot]) if book.active[slot] else 0
            written = np.arange(rows) < length  # positions 0..L-1 cover rows 0..min(L, rows)-1
            finite = np.isfinite(arr[:, slot]).all(axis=(0, 2))
            nan = np.isnan(arr[:, slot]).all(axis=(0, 2))
            assert (finite == written).all() and (nan == ~written).all(), (
                f"{name} slot {slot} (length {length}): finite rows {np.flatnonzero(finite).tolist()}")
    for name, ratio in (("c4_kv", spec.csa_ratio), ("indexer_kv", spec.csa_ratio), ("c128_kv", spec.hca_ratio)):
        arr = np.asarray(getattr(pool, name))  # [layers, entries, w]
        if arr.size == 0:
            continue
        expect = np.zeros(arr.shape[1], bool)
        for slot in np.flatnonzero(book.active):
            yes, no = written_rows(spec, book, int(slot), ratio)
            expect[yes] = True
        finite = np.isfinite(arr).all(axis=(0, 2))
        nan = np.isnan(arr).all(axis=(0, 2))
        assert (finite == expect).all() and (nan == ~expect).all(), (
            f"{name}: rows written {np.flatnonzero(finite).tolist()}, expected {np.flatnonzero(expect).tolist()}")
