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
the fingerprints of the engine that made it (model weights, every element; config, dtype, pool specs); restoring it elsewhere
gives `ErrorCode.INVALID_SNAPSHOT`. `save` / `load` use safetensors (ids and fingerprints in the metadata).
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

    def longest_prefix(self, ids: Sequence[int]) -> Snapshot | None:
        """The stored snapshot of the longest prefix of `ids` (exact ids compared), marked recently used."""
        for length in sorted({k[1] for k in self._items}, reverse=True):
            if length > len(ids):
                continue
            key = ids_key(ids[:length])
            snap = self._items.get(key)
            if snap is not None and snap.ids == tuple(int(t) for t in ids[:length]):
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


def _leaf_digest(x) -> jax.Array:
    """[2] uint32: two wrapping sums of every element's bits times an odd weight of its position. Changing any one
    element changes both (an odd weight is invertible mod 2**32), so weights that differ anywhere differ here.
    No reshape: a leaf sharded over a mesh keeps its sharding (partial sums, then one all-reduce of 8 bytes)."""
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:  # an 8-byte element becomes two uint32 words on a trailing axis
        bits = jax.lax.bitcast_convert_type(x, _UINT[jnp.dtype(x.dtype).itemsize]).astype(jnp.uint32)
    # the row-major position of each element from per-axis iotas (wrapping past 2**32: the weights stay odd)
    pos, stride = jnp.zeros(bits.shape, jnp.uint32), 1
    for axis in reversed(range(bits.ndim)):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= bits.shape[axis]
    odd = (pos << 1) | jnp.uint32(1)
    mixed = (pos * jnp.uint32(0x9E3779B1)) | jnp.uint32(1)
    return jnp.stack([jnp.sum(bits * odd, dtype=jnp.uint32), jnp.sum((bits ^ pos) * mixed, dtype=jnp.uint32)])


@cached_jit  # a cached warm-up loads it like the engine's programs: no tracing of a few hundred leaf digests
@functools.partial(jax.jit, static_argnames="rows")
def _digests(leaves, *, rows):
    """Digest of each leaf, or of row `rows[i]` of a stacked leaf (a layer of a `LayerStack`; None: whole leaves)."""
    return jnp.stack([_leaf_digest(leaf if r is None else leaf[r]) for leaf, r in zip(leaves, rows)])


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
    """What must match for a snapshot to be valid: model weights (every element of every tensor, one pass over
    them in one program), config, dtype, pool specs."""
    h = lambda text: hashlib.sha256(text.encode()).hexdigest()[:16]
    leaves, at_row, treedef = _per_layer(model.params)
    shapes = [(x.shape if r is None else x.shape[1:], str(x.dtype)) for x, r in zip(leaves, at_row)]
    digest = hashlib.sha256(repr((treedef, shapes)).encode())
    # one program per device set (a layer split's stages hold disjoint devices), rows back in leaf order
    groups = collections.defaultdict(list)
    for i, x in enumerate(leaves):
        groups[tuple(sorted(d.id for d in x.devices())) if isinstance(x, jax.Array) else ()].append(i)
    rows = [None] * len(leaves)
    for idx in groups.values():
        got = _digests([leaves[i] for i in idx], rows=tuple(at_row[i] for i in idx))
        for i, row in zip(idx, np.asarray(jax.device_get(got))):
            rows[i] = row
    digest.update(np.stack(rows).tobytes())
    return {"model": digest.hexdigest()[:16], "config": h(repr(model.config)),
            "dtype": str(jnp.dtype(model.params["embed"].dtype)), "pool": h(repr((tspec, dspec)))}
