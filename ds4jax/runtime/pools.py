"""KV pools: a pytree of arrays whose shapes come only from a `PoolSpec`, plus host-side bookkeeping.

Device side (`KVPool`, donated to every step): one array per row of `pool_layout.POOL_ARRAYS` (shapes, dtypes,
roles, layer kinds and logical axes are listed there and nowhere else); `logical_specs()` gives each array's
logical axes as a `PartitionSpec` for Flax's logical-axis sharding rules.

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
import functools
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.runtime import memory, pool_layout as layout
from ds4jax.runtime.pool_spec import PoolSpec, shapes, total_bytes
from ds4jax.errors import PoolError  # noqa: F401 (re-exported: importable from here too)


def _replace(self, **changes) -> "KVPool":
    return dataclasses.replace(self, **changes)


KVPool = jax.tree_util.register_dataclass(dataclasses.make_dataclass(
    "KVPool", [(name, jax.Array) for name in layout.NAMES], frozen=True,
    namespace={"replace": _replace, "__module__": __name__,
               "__doc__": "The pool arrays of one attention rank, fields in `pool_layout.POOL_ARRAYS` order."}))


@functools.partial(jax.jit, static_argnames=("spec",))
def _filled_program(spec: PoolSpec, fill: jax.Array) -> KVPool:
    return KVPool(**{a.name: jnp.full(layout.shape_of(a, spec), fill if a.empty is None else a.empty,
                                      jnp.dtype(layout.dtype_of(a, spec))) for a in layout.POOL_ARRAYS})


def _filled(spec: PoolSpec, fill: float) -> KVPool:
    """Every array of `spec`'s pool filled, by one program per spec: an eager `jnp.full` per array was a program
    per shape and dtype to fetch from the compilation cache (16 of them: ~0.2 s of a cached `ds4jax generate` on a
    2-core CPU). Not numpy + `device_put` either: on a CPU backend the steps did not donate such buffers in place
    (every donated step copied the pool; tests/test_pools.py). The fill is an argument (NaN is no cache key)."""
    return _filled_program(spec, np.float32(fill))


def zeros(spec: PoolSpec) -> KVPool:
    """A fresh pool: every slot empty, no pages assigned."""
    return _filled(spec, 0.0)


def allocate(spec: PoolSpec) -> KVPool:
    """`zeros` on one device, after checking that it has the memory: a `DeviceMemoryError` names the pools and
    the fields their size grows with, rather than an XLA out-of-memory error. (A mesh's pools are split over its
    devices and placed by `MeshLayout.pool_zeros`.)"""
    memory.check_fits(total_bytes(spec), f"the KV pools ({spec.max_slots} slots x max_context {spec.max_context}, "
                                         f"{spec.num_layers} layers x sliding_window {spec.sliding_window}, "
                                         f"head_dim {spec.head_dim}, {spec.kv_storage_dtype})")
    return zeros(spec)


def poisoned(spec: PoolSpec) -> KVPool:
    """A pool whose storage is all NaN: any read of a row that was never written poisons the output (tests)."""
    return _filled(spec, float("nan"))


def abstract(spec: PoolSpec) -> KVPool:
    return KVPool(**{k: jax.ShapeDtypeStruct(s, jnp.dtype(d)) for k, (s, d) in shapes(spec).items()})


def logical_specs() -> KVPool:
    """Each pool array's logical axis names as a PartitionSpec (map them onto a mesh with Flax's rules)."""
    return KVPool(**{name: jax.sharding.PartitionSpec(*axes) for name, axes in layout.logical_axes().items()})


def check_pool(pool: KVPool, spec: PoolSpec, what: str) -> None:
    """Trace-time check that `pool` has exactly the shapes `spec` describes."""
    for name, (shape, dtype) in shapes(spec).items():
        arr = getattr(pool, name)
        if tuple(arr.shape) != tuple(shape) or jnp.dtype(arr.dtype) != jnp.dtype(dtype):
            raise PoolError(
                f"{what}: pool.{name} has {arr.dtype}{list(arr.shape)}, the pool spec requires {dtype}{list(shape)}")


@functools.partial(jax.jit, donate_argnums=0)
def _reset(pool: KVPool, mask: jax.Array) -> KVPool:
    """Zero every per-slot array of the slots in `mask` [slots] and forget their pages and lengths. The pool is
    donated, as to the steps: the reset writes in place (undonated, every per-slot array of every slot, the SWA and
    state rings, was written to a second copy: a transient second pool of rings at every admission after a release)."""
    def per_slot(a, axis):
        shape = [1] * a.ndim
        shape[axis] = mask.shape[0]
        return jnp.where(mask.reshape(shape), jnp.zeros((), a.dtype), a)

    changes = {}
    for a in layout.POOL_ARRAYS:
        arr = getattr(pool, a.name)
        if a.per_slot:  # [layers, slots, ...]
            changes[a.name] = per_slot(arr, 1)
        elif a.axes[0] == "slots":  # tables: back to their empty value
            m = mask.reshape((-1,) + (1,) * (arr.ndim - 1))
            changes[a.name] = jnp.where(m, jnp.asarray(a.empty, arr.dtype), arr)
    return pool.replace(**changes)


def reset_slots(pool: KVPool, slots: Iterable[int]) -> KVPool:
    """`pool` with `slots` emptied; `pool` is donated (use the returned pool only)."""
    mask = np.zeros(pool.lengths.shape[0], bool)
    mask[list(slots)] = True
    return _reset(pool, mask)  # numpy into the jit: a transfer (jnp.asarray would compile an identity program)


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
        """Validate a step: distinct admitted slots, token ids in the vocabulary, capacity for every row.

        A padding row (n_tokens 0) is not looked at: its slot may be anything (-1, a free slot, or a slot
        another row uses), since a step reads nothing of and writes nothing to a padding row's slot."""
        token_ids = np.asarray(token_ids)
        slots = [int(s) for s in slots]
        if token_ids.ndim != 2 or token_ids.shape[0] != len(slots):
            raise PoolError(f"token_ids must be [rows={len(slots)}, chunk], got shape {token_ids.shape}")
        if len(n_tokens) != len(slots):  # zip below would silently skip the unmatched rows
            raise PoolError(f"n_tokens must have one entry per row ({len(slots)}), got {len(n_tokens)}")
        live = [s for s, n in zip(slots, n_tokens) if int(n) != 0]
        if len(set(live)) != len(live):
            raise PoolError(f"a step's slots must be distinct, got {slots} (padding rows, n_tokens 0, excepted)")
        for row, (slot, n) in enumerate(zip(slots, n_tokens)):
            n = int(n)
            if not 0 <= n <= token_ids.shape[1]:
                raise PoolError(f"row {row}: n_tokens {n} is outside [0, {token_ids.shape[1]}]")
            if n == 0:
                continue
            if not 0 <= slot < self.spec.max_slots or not self.active[slot]:
                raise PoolError(f"row {row}: slot {slot} is not an admitted request slot")
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
            if int(n):
                self.lengths[int(slot)] += int(n)

    def sync(self, pool: KVPool) -> KVPool:
        """Copy the host page tables and lengths into the device pool (a pool placed on a mesh keeps its
        placement: each device receives its part)."""
        table, lengths = self.page_table, self.lengths.astype(np.int32)
        if len(pool.lengths.sharding.device_set) > 1:
            from ds4jax.runtime.distributed import put  # host values onto any process's devices

            return pool.replace(page_table=put(table, pool.page_table.sharding),
                                lengths=put(lengths, pool.lengths.sharding))
        return _set_rows(pool, table, lengths)  # numpy into the jit: transfers, no identity programs
