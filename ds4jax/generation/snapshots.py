"""Exact prefix snapshots: a request's whole serving state after prefilling a prompt prefix, reusable by any later
request whose prompt starts with that prefix.

A snapshot of a prefix of length L holds, from the request's slot:

* target pools: every per-slot array (SWA ring, compressor state rings of C4 / indexer / C128) and the rows of
  the pages covering positions [0, L) of every paged array (C4 entries, indexer keys, C128 entries), with an FP8
  KV cache their row scales too (the pool spec, hence the fingerprint, names the KV dtype);
* the draft pool's per-slot arrays when speculating (its ring; restored at length L-1, see below);
* the target's logits and final streams at position L-1.

On restore the arrays are written into a fresh slot (pages are the new slot's own), the target length is L and
the draft length L-1: the draft's row L-1 needs the id of token L, which is the first sampled token when the
prompt equals the prefix, or the prompt's token L otherwise, so `loops.restore_call` recomputes it. The first
token is sampled from the saved logits with the request's own seed: results equal the no-snapshot path.

`SnapshotStore` is an LRU store in host memory bounded by a byte budget, keyed by (sha256 of the ids, length)
and checked against the exact ids, so a hash collision can never restore the wrong state. Each snapshot carries
the fingerprints of the engine that made it (model weights, every element; config, dtype, pool specs); restoring it
elsewhere gives `ErrorCode.INVALID_SNAPSHOT`. `save` / `load` use safetensors (ids and fingerprints in the metadata).
On a layer split every stage's pool is extracted and injected on its own (`stage_programs.StagePrograms`), the
arrays held with their layer axes concatenated: the one-device layout.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ds4jax.model import layer_stack
from ds4jax.runtime import kv_quant
from ds4jax.runtime.executable_cache import cached_jit
from ds4jax.runtime.pool_layout import POOL_ARRAYS
from ds4jax.runtime.pool_spec import shapes
from ds4jax.runtime.pools import KVPool

# paged arrays and the compression ratio (cfg attribute) that sets their entries per page (an FP8 cache's row
# scales are paged like the rows they scale, and travel with them)
PAGED = {"c4_kv": "csa_ratio", "indexer_kv": "csa_ratio", "c128_kv": "hca_ratio", "c4_kv_scale": "csa_ratio",
         "indexer_kv_scale": "csa_ratio", "c128_kv_scale": "hca_ratio"}


def per_slot_names(pool: KVPool) -> list[str]:
    """Arrays with a slot axis after the layer axis (SWA ring and compressor state rings)."""
    return [a.name for a in POOL_ARRAYS if a.per_slot]


def ids_key(ids: Sequence[int]) -> tuple[str, int]:
    return hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest(), len(ids)


@dataclasses.dataclass
class Snapshot:
    ids: tuple[int, ...]
    fingerprint: dict[str, str]
    arrays: dict[str, np.ndarray]  # "target/<name>", "draft/<name>", "last_logits", "last_stream"
    pages: int  # pages of the target's paged arrays held

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    @property
    def has_draft(self) -> bool:
        """Whether it holds the draft's state (not when it was saved while the draft was parked)."""
        return any(k.startswith("draft/") for k in self.arrays)


class SnapshotStore:
    """LRU snapshots under a byte budget; `evictions` counts snapshots dropped to make room."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = int(budget_bytes)
        self._items: collections.OrderedDict[tuple[str, int], Snapshot] = collections.OrderedDict()
        self.evictions = 0
        self.rejected = 0  # snapshots larger than the whole budget

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items.values()))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._items.values())

    def put(self, snap: Snapshot) -> bool:
        key = ids_key(snap.ids)
        self._items.pop(key, None)
        if snap.nbytes > self.budget_bytes:
            self.rejected += 1
            return False
        self._items[key] = snap
        while self.nbytes > self.budget_bytes:
            self._items.popitem(last=False)
            self.evictions += 1
        return True

    def longest_prefix(self, ids: Sequence[int], usable=None) -> Snapshot | None:
        """The stored snapshot of the longest prefix of `ids` (exact ids compared) that `usable(snapshot)` accepts
        (None: any), marked recently used."""
        for length in sorted({k[1] for k in self._items}, reverse=True):
            if length > len(ids):
                continue
            key = ids_key(ids[:length])
            snap = self._items.get(key)
            if snap is not None and snap.ids == tuple(int(t) for t in ids[:length]) and (usable is None
                                                                                         or usable(snap)):
                self._items.move_to_end(key)
                return snap
        return None

    def clear(self) -> None:
        self._items.clear()

    # ---- disk --------------------------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """All snapshots to one safetensors file (arrays; ids, fingerprints and pages in the metadata). FP8 arrays
        (an FP8 KV cache) are stored as their bytes, their dtype in the metadata: safetensors' numpy side has no
        float8 types."""
        from safetensors.numpy import save_file

        tensors, meta = {}, []
        for i, snap in enumerate(self._items.values()):
            fp8 = {}
            for name, arr in snap.arrays.items():
                if arr.dtype.name in kv_quant.FP8_MAX:
                    fp8[name], arr = arr.dtype.name, arr.view(np.uint8)
                tensors[f"{i}/{name}"] = np.ascontiguousarray(arr)
            meta.append({"ids": list(snap.ids), "fingerprint": snap.fingerprint, "pages": snap.pages, "fp8": fp8})
        save_file(tensors, path, metadata={"ds4jax_snapshots": json.dumps(meta)})

    def load(self, path: str) -> int:
        """Add every snapshot of a file written by `save` (compatibility is checked when one is used)."""
        from safetensors import safe_open

        with safe_open(path, framework="numpy") as f:
            meta = json.loads(f.metadata()["ds4jax_snapshots"])
            arrays = [dict() for _ in meta]
            for key in f.keys():
                i, name = key.split("/", 1)
                arrays[int(i)][name] = f.get_tensor(key)
        for m, arr in zip(meta, arrays):
            for name, dtype in m.get("fp8", {}).items():
                arr[name] = arr[name].view(getattr(ml_dtypes, dtype))
            self.put(Snapshot(tuple(m["ids"]), dict(m["fingerprint"]), arr, int(m["pages"])))
        return len(meta)


# ---- device side ------------------------------------------------------------------------------------------------

def _page_rows(page_table, slot, entries_per_page: int, pages: int):
    """Pool rows of the slot's first `pages` logical pages (padding pages map to row 0; callers mask)."""
    table = jax.lax.dynamic_index_in_dim(page_table, slot, keepdims=False)[:pages]
    rows = jnp.maximum(table, 0)[:, None] * entries_per_page + jnp.arange(entries_per_page)[None, :]
    return rows.reshape(-1), jnp.repeat(table >= 0, entries_per_page)


@functools.partial(jax.jit, static_argnames=("ratios",))
def extract(pool: KVPool, slot, ratios: tuple):
    """Per-slot arrays [:, slot] and every paged array's rows of the slot's pages (all pages_per_slot of them)."""
    out = {name: getattr(pool, name)[:, slot] for name in per_slot_names(pool)}
    pages = pool.page_table.shape[1]
    for name, per_page in ratios:
        rows, _ = _page_rows(pool.page_table, slot, per_page, pages)
        out[name] = getattr(pool, name)[:, rows]
    return out


@functools.partial(jax.jit, static_argnames=("ratios",), donate_argnames=("pool",))
def inject(pool: KVPool, slot, arrays: dict, n_pages, length, ratios: tuple) -> KVPool:
    """Write a snapshot's arrays into `slot` (whose pages are already in the page table); set its length."""
    changes = {name: getattr(pool, name).at[:, slot].set(arrays[name].astype(getattr(pool, name).dtype))
               for name in per_slot_names(pool)}
    pages = pool.page_table.shape[1]
    for name, per_page in ratios:
        target = getattr(pool, name)
        rows, has_page = _page_rows(pool.page_table, slot, per_page, pages)
        keep = has_page & (jnp.arange(rows.shape[0]) < n_pages * per_page)
        rows = jnp.where(keep, rows, target.shape[1])  # out of range: dropped
        changes[name] = target.at[:, rows].set(arrays[name].astype(target.dtype), mode="drop")
    changes["lengths"] = pool.lengths.at[slot].set(length)
    return pool.replace(**changes)


def entries_per_page(cfg, spec) -> tuple[tuple[str, int], ...]:
    """Paged arrays of `spec` that hold anything, with their entries per page (static argument of extract)."""
    paged = {a.name for a in POOL_ARRAYS if a.paged}
    if paged != set(PAGED):
        raise RuntimeError(f"snapshots know the paged arrays {sorted(PAGED)}, the pool layout has {sorted(paged)}")
    out = []
    for name, ratio in PAGED.items():
        per_page = spec.page_size // getattr(cfg, ratio)
        layers = shapes(spec)[name][0][0]  # a scale array has no layers without an FP8 cache
        if layers and spec.pages_per_slot:
            out.append((name, per_page))
    return tuple(out)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def _rows_digest(x) -> jax.Array:
    """[n, 2] uint32 for x [n, ...]: for each x[i], two wrapping sums of every element's bits times an odd weight
    of its position in x[i]. Changing any one element changes both (an odd weight is invertible mod 2**32), so
    weights that differ anywhere differ here. No reshape: a leaf sharded over a mesh keeps its sharding (partial
    sums, then one all-reduce of 8 bytes a row)."""
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:  # an 8-byte element becomes two uint32 words on a trailing axis
        bits = jax.lax.bitcast_convert_type(x, _UINT[jnp.dtype(x.dtype).itemsize]).astype(jnp.uint32)
    # each element's row-major position within its row, from per-axis iotas (wrapping past 2**32: the weights
    # stay odd)
    pos, stride = jnp.zeros(bits.shape, jnp.uint32), 1
    for axis in reversed(range(1, bits.ndim)):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= bits.shape[axis]
    odd = (pos << 1) | jnp.uint32(1)
    mixed = (pos * jnp.uint32(0x9E3779B1)) | jnp.uint32(1)
    within = tuple(range(1, bits.ndim))
    return jnp.stack([jnp.sum(bits * odd, axis=within, dtype=jnp.uint32),
                      jnp.sum((bits ^ pos) * mixed, axis=within, dtype=jnp.uint32)], axis=-1)


def _host_rows_digest(x: np.ndarray) -> np.ndarray:
    """`_rows_digest` in numpy, the same numbers (wrapping uint32 arithmetic, exact in any order): no program to
    compile, for weights small enough to read back (`_HOST_DIGEST_BYTES`)."""
    bits = x.astype(np.uint32) if x.dtype == np.bool_ else x.view(f"uint{8 * x.dtype.itemsize}").astype(np.uint32)
    flat = bits.reshape(bits.shape[0], -1)
    pos = np.arange(flat.shape[1], dtype=np.uint32)
    odd = (pos << np.uint32(1)) | np.uint32(1)
    mixed = (pos * np.uint32(0x9E3779B1)) | np.uint32(1)
    return np.stack([(flat * odd).sum(axis=1, dtype=np.uint32),
                     ((flat ^ pos) * mixed).sum(axis=1, dtype=np.uint32)], axis=-1)


# Weights up to this size are digested on the host: the digest program of the default model's 220 leaves compiled
# 9.4 s of XLA on an H100 inside the Engine's cold warm-up (docs/benchmarks/startup_h100_b5fb11b.json) and ~1.5 s
# on the 2-core CPU, where reading its 28 MB back and summing them in numpy takes milliseconds.
_HOST_DIGEST_BYTES = 256 << 20


@cached_jit  # a cached warm-up loads it like the engine's programs: no tracing of a few hundred leaf digests
@functools.partial(jax.jit, static_argnames="stacked")
def _digests(leaves, *, stacked):
    """[rows, 2]: the digest of each leaf (`stacked[i]` False) or of each row of a stacked leaf (its layers, when
    True: one reduction over the stack, not one a layer), leaf after leaf; each row is the digest of that array
    alone (`_rows_digest` of it with a leading axis of one)."""
    return jnp.concatenate([_rows_digest(leaf if s else leaf[None]) for leaf, s in zip(leaves, stacked)])


def _digest_arrays(arrays: list, stacked: list[bool]) -> list[np.ndarray]:
    """Each array's row digests ([rows, 2]; one row unless stacked): on the host when the weights are small and
    this process holds all of them, else one program per device set (a layer split's stages hold disjoint
    devices; weights spread over several processes are digested where they are, every process getting the rows)."""
    total = sum(x.size * jnp.dtype(x.dtype).itemsize for x in arrays)
    readable = all(getattr(x, "is_fully_addressable", True) for x in arrays)
    if readable and total <= _HOST_DIGEST_BYTES and all(jnp.dtype(x.dtype).itemsize <= 4 for x in arrays):
        host = jax.device_get(arrays)
        return [_host_rows_digest(x if s else x[None]) for x, s in zip(host, stacked)]
    groups = collections.defaultdict(list)
    for i, x in enumerate(arrays):
        groups[tuple(sorted(d.id for d in x.devices())) if isinstance(x, jax.Array) else ()].append(i)
    out = [None] * len(arrays)
    for idx in groups.values():
        got = np.asarray(jax.device_get(_digests([arrays[i] for i in idx], stacked=tuple(stacked[i] for i in idx))))
        start = 0
        for i in idx:
            n = arrays[i].shape[0] if stacked[i] else 1
            out[i], start = got[start:start + n], start + n
    return out


class _Row:
    """Stands for a stacked leaf while unstacking the params' structure: indexing it names (leaf, row)."""

    def __init__(self, leaf: int, row: int | None = None):
        self.leaf, self.row = leaf, row

    def __getitem__(self, row: int) -> "_Row":
        return _Row(self.leaf, row)


def _per_layer(params) -> tuple[list, list, Any]:
    """The params' leaves as the per-layer layout orders them: ([leaf], [row or None], treedef). The digest is
    then the same whether a model runs its layers stacked (scan) or unrolled, so snapshots move between them."""
    leaves, treedef = jax.tree.flatten(params)
    refs = layer_stack.unstacked_params(jax.tree.unflatten(treedef, [_Row(i) for i in range(len(leaves))]))
    refs, per_layer = jax.tree.flatten(refs, is_leaf=lambda x: isinstance(x, _Row))
    return [leaves[r.leaf] for r in refs], [r.row for r in refs], per_layer


def fingerprint(model, tspec, dspec) -> dict[str, str]:
    """What must match for a snapshot to be valid: model weights (every element of every tensor: one pass over
    them, in one program a device set, or on the host for small weights), config, dtype, pool specs."""
    h = lambda text: hashlib.sha256(text.encode()).hexdigest()[:16]
    leaves, at_row, treedef = _per_layer(model.params)
    shapes = [(x.shape if r is None else x.shape[1:], str(x.dtype)) for x, r in zip(leaves, at_row)]
    digest = hashlib.sha256(repr((treedef, shapes)).encode())
    # each array once (a stacked leaf stands for every row of it), then the rows back in the per-layer order
    arrays, stacked, seen = [], [], set()
    for x, r in zip(leaves, at_row):
        if id(x) not in seen:
            seen.add(id(x))
            arrays.append(x)
            stacked.append(r is not None)
    by_array = {id(x): got for x, got in zip(arrays, _digest_arrays(arrays, stacked))}
    rows = [by_array[id(x)][0 if r is None else r] for x, r in zip(leaves, at_row)]
    digest.update(np.stack(rows).tobytes())
    return {"model": digest.hexdigest()[:16], "config": h(repr(model.config)),
            "dtype": str(jnp.dtype(model.params["embed"].dtype)), "pool": h(repr((tspec, dspec)))}
