"""KV pools: a pytree of arrays whose shapes come only from a `PoolSpec`, plus host-side bookkeeping.

Device side (`KVPool`, donated to every step):

| array                 | shape (from the spec)                                      | holds                                  |
|-----------------------|------------------------------------------------------------|----------------------------------------|
| swa_kv                | [layers, slots, swa_rows, d]                               | K=V ring; row of position p = p % rows |
| c4_kv / indexer_kv    | [csa_layers, c4_entries, d] / [.., indexer_entries, di]    | compressed CSA entries, paged          |
| c128_kv               | [hca_layers, c128_entries, d]                              | compressed HCA entries, paged          |
| *_state_kv / _gate    | [csa/hca layers, slots, state_rows, c*w]                   | raw projections of recent tokens       |
| page_table            | [slots, pages_per_slot] int32 (-1 = no page)               | page p of a request -> pool page id    |
| lengths               | [slots] int32                                              | committed tokens per request           |

A page covers `page_size` tokens, i.e. page_size/ratio compressed entries; entry j of a request lives at pool
row ``page_table[slot, j*ratio // page_size] * (page_size // ratio) + j % (page_size // ratio)``.

Validity is positional: a ring or state row is used only if the position it holds is a committed position the
reader needs, and compressed entries only if their index is below the request's entry count. Stale rows from
earlier requests or rejected speculative tokens are therefore never read; `reset_slots` still zeroes them so a
reused slot is bit-identical to a fresh one.

Host side (`PoolBook`) mirrors lengths and page tables, allocates pages, and validates every step's inputs
before anything runs (JAX would otherwise clamp gathers and drop scatters silently).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.runtime.pool_spec import PoolSpec, shapes
from ds4jax.errors import PoolError  # noqa: F401 (re-exported: importable from here too)


_ARRAYS = (
    "swa_kv", "c4_kv", "indexer_kv", "c128_kv",
    "c4_state_kv", "c4_state_gate", "indexer_state_kv", "indexer_state_gate", "c128_state_kv", "c128_state_gate",
    "page_table", "lengths",
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    swa_kv: jax.Array
    c4_kv: jax.Array
    indexer_kv: jax.Array
    c128_kv: jax.Array
    c4_state_kv: jax.Array
    c4_state_gate: jax.Array
    indexer_state_kv: jax.Array
    indexer_state_gate: jax.Array
    c128_state_kv: jax.Array
    c128_state_gate: jax.Array
    page_table: jax.Array
    lengths: jax.Array

    def replace(self, **changes) -> "KVPool":
        return dataclasses.replace(self, **changes)


def _filled(spec: PoolSpec, fill: float) -> KVPool:
    arrays = {}
    for name, (shape, dtype) in shapes(spec).items():
        if name == "page_table":
            arrays[name] = jnp.full(shape, -1, jnp.int32)
        elif name == "lengths":
            arrays[name] = jnp.zeros(shape, jnp.int32)
        else:
            arrays[name] = jnp.full(shape, fill, jnp.dtype(dtype))
    missing = set(_ARRAYS) - set(arrays)
    if missing:
        raise PoolError(f"pool spec shapes lack arrays {sorted(missing)}")
    return KVPool(**{k: arrays[k] for k in _ARRAYS})


def zeros(spec: PoolSpec) -> KVPool:
    """A fresh pool: every slot empty, no pages assigned."""
    return _filled(spec, 0.0)


def poisoned(spec: PoolSpec) -> KVPool:
    """A pool whose storage is all NaN: any read of a row that was never written poisons the output (tests)."""
    return _filled(spec, float("nan"))


def abstract(spec: PoolSpec) -> KVPool:
    return KVPool(**{k: jax.ShapeDtypeStruct(s, jnp.dtype(d)) for k, (s, d) in shapes(spec).items()})


def check_pool(pool: KVPool, spec: PoolSpec, what: str) -> None:
    """Trace-time check that `pool` has exactly the shapes `spec` describes."""
    for name, (shape, dtype) in shapes(spec).items():
        arr = getattr(pool, name)
        if tuple(arr.shape) != tuple(shape) or jnp.dtype(arr.dtype) != jnp.dtype(dtype):
            raise PoolError(
                f"{what}: pool.{name} has {arr.dtype}{list(arr.shape)}, the pool spec requires {dtype}{list(shape)}")


@jax.jit
def _reset(pool: KVPool, mask: jax.Array) -> KVPool:
    """Zero every per-slot array of the slots in `mask` [slots] and forget their pages and lengths."""
    def per_slot(a, axis):
        shape = [1] * a.ndim
        shape[axis] = mask.shape[0]
        return jnp.where(mask.reshape(shape), jnp.zeros((), a.dtype), a)

    changes = {name: per_slot(getattr(pool, name), 1) for name in _ARRAYS if "state" in name or name == "swa_kv"}
    changes["page_table"] = jnp.where(mask[:, None], -1, pool.page_table)
    changes["lengths"] = jnp.where(mask, 0, pool.lengths)
    return pool.replace(**changes)


def reset_slots(pool: KVPool, slots: Iterable[int]) -> KVPool:
    mask = np.zeros(pool.lengths.shape[0], bool)
    mask[list(slots)] = True
    return _reset(pool, jnp.asarray(mask))


@jax.jit
def _set_rows(pool: KVPool, page_table: jax.Array, lengths: jax.Array) -> KVPool:
    return pool.replace(page_table=page_table, lengths=lengths)


class PoolBook:
    """Host mirror of a pool's page tables and lengths: page allocation and step validation.

    Every check runs before a step is launched, so a bad request raises `PoolError` and no pool is touched.
    """

    def __init__(self, spec: PoolSpec, vocab_size: int):
        self.spec = spec
        self.vocab_size = vocab_size
        self.lengths = np.zeros(spec.max_slots, np.int64)
        self.page_table = np.full((spec.max_slots, spec.pages_per_slot), -1, np.int32)
        self.active = np.zeros(spec.max_slots, bool)
        self.free_pages = list(range(spec.num_pages))[::-1]

    # ---- slots -----------------------------------------------------------------------------------
    def admit(self, slot: int | None = None) -> int:
        if slot is None:
            free = np.flatnonzero(~self.active)
            if free.size == 0:
                raise PoolError(f"all {self.spec.max_slots} request slots are in use")
            slot = int(free[0])
        if not 0 <= slot < self.spec.max_slots:
            raise PoolError(f"slot {slot} is outside [0, {self.spec.max_slots})")
        if self.active[slot]:
            raise PoolError(f"slot {slot} is already in use")
        self.active[slot] = True
        self.lengths[slot] = 0
        return slot

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.spec.max_slots or not self.active[slot]:
            raise PoolError(f"slot {slot} is not an admitted request slot (max_slots {self.spec.max_slots})")

    def release(self, slot: int) -> None:
        """Return the slot's pages; releasing a free slot again is a no-op."""
        if not 0 <= slot < self.spec.max_slots:
            raise PoolError(f"slot {slot} is outside [0, {self.spec.max_slots})")
        pages = self.page_table[slot]
        self.free_pages.extend(int(p) for p in pages[pages >= 0])
        self.page_table[slot] = -1
        self.lengths[slot] = 0
        self.active[slot] = False

    def pages_needed(self, new_length: int) -> int:
        if self.spec.pages_per_slot == 0:  # a sliding-window-only pool (the draft) has no paged storage
            return 0
        return -(-new_length // self.spec.page_size)

    def reserve(self, slot: int, new_length: int) -> None:
        """Make sure `slot` has pages for positions [0, new_length)."""
        self._check_slot(slot)
        if new_length > self.spec.max_context:
            raise PoolError(
                f"slot {slot}: {new_length} tokens exceed the pool's max_context of {self.spec.max_context}")
        need = self.pages_needed(new_length)
        have = int((self.page_table[slot] >= 0).sum())
        if need - have > len(self.free_pages):
            raise PoolError(f"slot {slot}: needs {need - have} more pages, only {len(self.free_pages)} are free")
        for p in range(have, need):
            self.page_table[slot, p] = self.free_pages.pop()

    # ---- validation ------------------------------------------------------------------------------
    def check_extend(self, slots: Sequence[int], token_ids: np.ndarray, n_tokens: Sequence[int]) -> None:
        """Validate a step: distinct admitted slots, token ids in the vocabulary, capacity for every row."""
        token_ids = np.asarray(token_ids)
        slots = [int(s) for s in slots]
        if len(set(slots)) != len(slots):
            raise PoolError(f"a step's slots must be distinct, got {slots}")
        if token_ids.ndim != 2 or token_ids.shape[0] != len(slots):
            raise PoolError(f"token_ids must be [rows={len(slots)}, chunk], got shape {token_ids.shape}")
        if len(n_tokens) != len(slots):  # zip below would silently skip the unmatched rows
            raise PoolError(f"n_tokens must have one entry per row ({len(slots)}), got {len(n_tokens)}")
        for row, (slot, n) in enumerate(zip(slots, n_tokens)):
            n = int(n)
            if not 0 <= slot < self.spec.max_slots or not self.active[slot]:
                raise PoolError(f"row {row}: slot {slot} is not an admitted request slot")
            if not 0 <= n <= token_ids.shape[1]:
                raise PoolError(f"row {row}: n_tokens {n} is outside [0, {token_ids.shape[1]}]")
            ids = token_ids[row, :n]
            bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
            if bad.size:
                raise PoolError(
                    f"row {row} (slot {slot}): token id {int(ids[bad[0]])} at chunk index {int(bad[0])} is outside "
                    f"the vocabulary [0, {self.vocab_size})")
            new_length = int(self.lengths[slot]) + n
            if new_length > self.spec.max_context:
                raise PoolError(
                    f"row {row} (slot {slot}): {self.lengths[slot]} + {n} tokens exceed max_context "
                    f"{self.spec.max_context}")
            if self.pages_needed(new_length) > int((self.page_table[slot] >= 0).sum()):
                raise PoolError(f"row {row} (slot {slot}): no pages reserved for {new_length} tokens")

    def commit(self, slots: Sequence[int], n_tokens: Sequence[int]) -> None:
        for slot, n in zip(slots, n_tokens):
            self.lengths[int(slot)] += int(n)

    def sync(self, pool: KVPool) -> KVPool:
        """Copy the host page tables and lengths into the device pool."""
        return _set_rows(pool, jnp.asarray(self.page_table), jnp.asarray(self.lengths.astype(np.int32)))
