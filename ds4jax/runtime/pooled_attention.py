"""Attention over explicit pools for a ragged batch of token chunks (the building block of every step).

A step row b processes n[b] <= C tokens of the request in slot slots[b], at positions start[b] + i, where
start[b] = pool.lengths[slot]. Per layer:

1. SWA: the ring is read *before* this chunk writes it (snapshot), and keys are [ring rows ; fresh chunk rows],
   so a token never sees a row overwritten by a later token of its own chunk. The ring is then rewritten with
   the last rows of the chunk (a gather per ring row, so duplicate positions never race in a scatter). Where
   the ring has room for the chunk beyond the window (`ring_in_place`: decode always) the chunk's rows are
   written first instead and the kernel reads the ring in place (`SlotRing`): no snapshot copy.
2. Compressors: the entries whose window closes inside the chunk are pooled from [state ring ; fresh tokens] and
   written to the paged pool, so windows straddling chunk boundaries give the same entries as a full forward.
   The state ring is then rewritten like the SWA ring, or, in place, written first and the windows read from it.
3. Compressed keys: HCA attends to all visible entries; CSA runs the indexer over the request's indexer keys and
   attends to the selected entries. Attention and indexer go through `ds4jax.runtime.kernels` (Pallas or reference).

With an FP8 KV cache (`PoolSpec.kv_dtype`, `kv_quant`) every SWA key, compressed entry and indexer key is
quantized when it is produced (one float32 scale per row, written beside it) and the kernels read the stored
values and scales; the compressor state rings keep their dtype.

All reads are masked by position: a row is used only if it holds a committed position the query may see.
Padding rows (n = 0) and padding tokens write nothing. A page id outside the pool (-1 = none) maps to no row:
writes to it are dropped and a request's readable entries end before it (`entry_rows`, `readable_entries`),
so nothing is ever clamped onto another request's page.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ds4jax.model.config import AttentionType, Config
from ds4jax.model.layers import compressor, indexer
from ds4jax.runtime import kernels, kv_quant
from ds4jax.runtime.kernels import Impl
from ds4jax.model.layers.attention import (index_rounding, kv_rounding, layer_inv_freq, output_projection,
                                           project_qkv)


class ChunkGeometry(NamedTuple):
    start: jax.Array  # [B] first position of the chunk (tokens already committed)
    n: jax.Array  # [B] valid tokens in the chunk
    positions: jax.Array  # [B, C]
    valid: jax.Array  # [B, C] bool
    page_table: jax.Array  # [B, P] pool page of each request page (-1 = none)


def geometry(start: jax.Array, n: jax.Array, chunk: int, page_table: jax.Array) -> ChunkGeometry:
    idx = jnp.arange(chunk, dtype=jnp.int32)[None, :]
    return ChunkGeometry(start, n, start[:, None] + idx, idx < n[:, None], page_table)


def ring_positions(start: jax.Array, rows: int) -> jax.Array:
    """[B, rows]: the newest committed position p < start with p % rows == r (negative = never written)."""
    r = jnp.arange(rows, dtype=jnp.int32)[None, :]
    last = start[:, None] - 1
    return last - jnp.mod(last - r, rows)


def rewrite_ring(old: jax.Array, fresh: jax.Array, g: ChunkGeometry) -> jax.Array:
    """New ring contents after appending the chunk: old [B, R, w], fresh [B, C, w] -> [B, R, w]."""
    rows = old.shape[1]
    r = jnp.arange(rows, dtype=jnp.int32)[None, :]
    end = g.start + g.n  # [B]
    src = (g.n[:, None] - 1) - jnp.mod(end[:, None] - 1 - r, rows)  # chunk index of the newest token on row r
    has = src >= 0
    picked = jnp.take_along_axis(fresh, jnp.clip(src, 0, fresh.shape[1] - 1)[..., None], axis=1)
    return jnp.where(has[..., None], picked.astype(old.dtype), old)


def entry_rows(page_table: jax.Array, entries: jax.Array, ratio: int, page_size: int, num_pages: int) -> jax.Array:
    """Pool rows of logical entries [B, ...] of each request; -1 where the entry's page is missing or its page id
    is outside [0, num_pages): such an entry has no row (nothing is clamped onto another request's page)."""
    per_page = page_size // ratio
    page = jnp.take_along_axis(page_table, (entries // per_page).reshape(entries.shape[0], -1), axis=1,
                               mode="fill", fill_value=-1).reshape(entries.shape)
    owned = (page >= 0) & (page < num_pages)
    return jnp.where(owned, page * per_page + entries % per_page, -1)


def readable_entries(page_table: jax.Array, ratio: int, page_size: int, num_pages: int) -> jax.Array:
    """[B] entries of each request up to its first missing page: reads never go past a hole in the table."""
    owned = (page_table >= 0) & (page_table < num_pages)  # [B, P]
    first_missing = jnp.where(owned.all(axis=1), owned.shape[1], jnp.argmin(owned, axis=1))
    return first_missing.astype(jnp.int32) * (page_size // ratio)


class PagedLayer(NamedTuple):
    """A paged pool array of every layer [layers, N, w] and the index of the running layer on its first axis.

    Kernels read it in place through a free reshape to [layers * N, w] (rows offset by layer * N); writes
    scatter into it in place. No layer slice is ever copied out and back."""
    pool: jax.Array
    layer: int

    @property
    def rows(self) -> int:
        return self.pool.shape[1]

    def flat(self) -> jax.Array:
        """[layers * N, w] (a scale array [layers, N]: [layers * N])."""
        return self.pool.reshape(-1, *self.pool.shape[2:])

    def flat_rows(self, rows: jax.Array) -> jax.Array:
        """Rows of this layer [..] (-1 = none) as rows of `flat()`."""
        return jnp.where(rows >= 0, rows + self.layer * self.rows, -1)


def ring_in_place(ring_rows: int, window: int, chunk: int) -> bool:
    """Whether a chunk may write its keys into the SWA ring before its queries read it: the rows it overwrites
    hold positions before start + chunk - ring_rows, which no query of the chunk sees (its window starts at
    start - window + 1) when ring_rows >= window + chunk - 1. Decode (one token) always may."""
    return ring_rows >= window + chunk - 1


def set_row(arr: jax.Array, index: tuple, value: jax.Array, write: jax.Array) -> jax.Array:
    """arr[index] = value where `write` (a bool scalar), else arr unchanged; index: scalars of arr's leading axes
    (clamped into range when `write` is false). One dynamic_update_slice that writes the old row back when it must
    not write: XLA:GPU made a one-row scatter with mode="drop" an update plus a kernel of its own for the bounds
    or the old row, per array and layer; this form fuses into one kernel with the row's computation."""
    start = tuple(index) + (0,) * (arr.ndim - len(index))
    size = (1,) * len(index) + arr.shape[len(index):]
    old = jax.lax.dynamic_slice(arr, start, size)
    return jax.lax.dynamic_update_slice(arr, jnp.where(write, value.reshape(size).astype(arr.dtype), old), start)


class SlotRing(NamedTuple):
    """A per-slot ring array of every layer [layers, S, R, ...] (the SWA keys or their row scales [layers, S, R],
    a compressor's state), the running layer's index and each step row's slot [B] (S = the null slot of a
    padding row).

    Where `ring_in_place` allows it, the chunk's rows are written into it first and its reads take the ring in
    place through a free reshape to [layers * S * R, ...]. The snapshot way (the slot's ring gathered as
    [B, R, ...]) copies the slot's ring, concatenates or selects it with the fresh rows and writes the whole
    ring back: the SWA keys took three launches a layer at decode against one (`scripts/step_kernels.py`)."""
    pool: jax.Array
    layer: int | jax.Array
    slots: jax.Array

    @property
    def rows(self) -> int:
        return self.pool.shape[2]

    def flat(self) -> jax.Array:
        return self.pool.reshape(-1, *self.pool.shape[3:])

    @property
    def base(self) -> int | jax.Array:
        """The running layer's first row in `flat()`."""
        return self.layer * self.pool.shape[1] * self.rows

    def layer_rows(self, positions: jax.Array, ok: jax.Array) -> jax.Array:
        """Rows counted from `base` that hold positions [B, ...] of each row's slot (the same for every layer);
        -1 where not ok or the slot is null (a row of the null slot would be another layer's, or past the
        array)."""
        n_slots = self.pool.shape[1]
        lead = (-1,) + (1,) * (positions.ndim - 1)
        live = (self.slots < n_slots).reshape(lead)
        return jnp.where(ok & live, (self.slots * self.rows).reshape(lead) + jnp.mod(positions, self.rows), -1)

    def flat_rows(self, positions: jax.Array, ok: jax.Array) -> jax.Array:
        """`layer_rows` as rows of `flat()`."""
        rows = self.layer_rows(positions, ok)
        return jnp.where(rows >= 0, rows + self.base, -1)

    def write(self, values: jax.Array, g: ChunkGeometry) -> SlotRing:
        """The chunk's rows values [B, C, ...] written at their positions; padding tokens and null slots write
        nothing. One row is a dynamic_update_slice that writes the old row back when it must not write (a
        scatter with mode="drop" costs XLA:GPU a kernel more, see `steps._set_slot_rows`)."""
        n_slots = self.pool.shape[1]
        values = values.astype(self.pool.dtype)
        if values.shape[:2] == (1, 1):
            write = g.valid[0, 0] & (self.slots[0] < n_slots)
            new = set_row(self.pool, (self.layer, self.slots[0], jnp.mod(g.positions[0, 0], self.rows)), values, write)
        else:
            slots = jnp.where(g.valid & (self.slots < n_slots)[:, None], self.slots[:, None], n_slots)  # [B, C]
            new = self.pool.at[self.layer, slots, jnp.mod(g.positions, self.rows)].set(values, mode="drop")
        return self._replace(pool=new)


class CompressorState(NamedTuple):
    kv: jax.Array | SlotRing  # [B, Rs, c*w] raw kv projections of recent tokens (or the rings in place)
    gate: jax.Array | SlotRing  # [B, Rs, c*w] gate projections + ape


def compress_chunk(x, p, state: CompressorState, g: ChunkGeometry, *, ratio: int, overlap: bool, width: int,
                   inv_freq, eps: float, rounding=None):
    """Entries closed by this chunk and the updated state ring (`rounding`: `compressor.pool`'s).

    Returns (entries [B, E, width], entry ids [B, E], entry valid [B, E], new state). E = C // ratio + 1."""
    b, chunk, _ = x.shape
    kv, gate = compressor.project(x, p)
    gate = gate + p["ape"].astype(gate.dtype)[g.positions % ratio]
    span = window_span(ratio, overlap)
    e_max = chunk // ratio + 1
    first = g.start // ratio  # [B]
    ids = first[:, None] + jnp.arange(e_max, dtype=jnp.int32)[None, :]  # [B, E]
    ok = ids < ((g.start + g.n) // ratio)[:, None]
    # token position of every slot of every new entry
    offset = -ratio if overlap else 0
    pos = ids[..., None] * ratio + offset + jnp.arange(span, dtype=jnp.int32)  # [B, E, span]
    if isinstance(state.kv, SlotRing):  # rings in place: the chunk written first, then every window read from them
        new_state = CompressorState(state.kv.write(kv, g), state.gate.write(gate, g))
        slot_kv, slot_gate = _ring_slots(new_state.kv, pos), _ring_slots(new_state.gate, pos)
    else:
        slot_kv, slot_gate = _snapshot_slots(kv, state.kv, pos, g), _snapshot_slots(gate, state.gate, pos, g)
        new_state = CompressorState(rewrite_ring(state.kv, kv, g), rewrite_ring(state.gate, gate, g))
    if overlap:  # previous window uses the first half of the channels, the current window the second half
        first_half = (jnp.arange(span) < ratio)[None, None, :, None]
        slot_kv = jnp.where(first_half, slot_kv[..., :width], slot_kv[..., width:])
        slot_gate = jnp.where(first_half, slot_gate[..., :width], slot_gate[..., width:])
        before_start = (pos < 0)[..., None]
        slot_kv = jnp.where(before_start, 0.0, slot_kv)
        slot_gate = jnp.where(before_start, -jnp.inf, slot_gate)
    # zero what padding entries read so nothing non-finite flows anywhere
    slot_kv = jnp.where(ok[..., None, None], slot_kv, 0.0)
    slot_gate = jnp.where(ok[..., None, None], slot_gate, 0.0)
    entries = compressor.pool(slot_kv.astype(x.dtype), slot_gate, p, ids * ratio, inv_freq, eps, rounding)
    return entries, ids, ok, new_state


def window_span(ratio: int, overlap: bool) -> int:
    """Tokens in one compressor window: 2 ratio with CSA's overlap, else ratio."""
    return 2 * ratio if overlap else ratio


def _snapshot_slots(fresh, ring, pos, g: ChunkGeometry) -> jax.Array:
    """Values at positions pos [B, E, span] from [a slot's ring (read before the chunk writes it) ; the chunk's
    fresh rows]: f32 [B, E, span, c*w]."""
    b, chunk = fresh.shape[:2]
    fresh_idx = jnp.clip(pos - g.start[:, None, None], 0, chunk - 1).reshape(b, -1)
    f = jnp.take_along_axis(fresh, fresh_idx[..., None], axis=1).reshape(pos.shape + (-1,))
    r = jnp.take_along_axis(ring, jnp.mod(pos, ring.shape[1]).reshape(b, -1)[..., None], axis=1)
    from_fresh = pos >= g.start[:, None, None]
    return jnp.where(from_fresh[..., None], f.astype(jnp.float32), r.reshape(f.shape).astype(jnp.float32))


def _ring_slots(ring: SlotRing, pos) -> jax.Array:
    """Values at positions pos [B, E, span] from rings in place that hold the chunk: f32 [B, E, span, c*w].
    A negative position or a null slot reads some row (the callers mask those slots)."""
    rows = jnp.maximum(ring.flat_rows(pos, pos >= 0), 0)
    return ring.flat().at[rows].get(mode="promise_in_bounds").astype(jnp.float32)


def write_entries(paged: PagedLayer, entries, ids, ok, g: ChunkGeometry, ratio: int, page_size: int) -> PagedLayer:
    """Scatter new entries [B, E, w] (or their scales [B, E]) into the layer's rows in place. Padding entries and
    entries without a page go to the out-of-range row N, which mode="drop" discards (host validation guarantees
    real rows exist). One entry (decode at batch 1) is a `set_row`."""
    n = paged.rows
    rows = entry_rows(g.page_table, ids, ratio, page_size, n // (page_size // ratio))
    write = ok & (rows >= 0)
    values = entries.reshape(-1, *paged.pool.shape[2:])
    if values.shape[0] == 1:
        return paged._replace(pool=set_row(paged.pool, (paged.layer, rows.reshape(())), values, write.reshape(())))
    new = paged.pool.at[paged.layer, jnp.where(write, rows, n).reshape(-1)].set(values.astype(paged.pool.dtype),
                                                                               mode="drop")
    return paged._replace(pool=new)


class LayerPools(NamedTuple):
    """What one layer reads and writes (fields named by `pool_layout.POOL_ARRAYS`; None where the layer has no
    such array): slot rings gathered for the step's rows, paged pools whole with the layer's index. The *_scale
    fields exist with an FP8 KV cache only (`kv_quant`): the float32 scale of each row of the array they follow."""
    ring: jax.Array | SlotRing  # [B, R, d] gathered, or the whole ring array in place (`ring_in_place`)
    entries: PagedLayer | None = None  # C4 (CSA) or C128 (HCA) entries
    state_kv: jax.Array | None = None  # [B, Rs, c*w] compressor ring
    state_gate: jax.Array | None = None
    index_entries: PagedLayer | None = None  # indexer keys (CSA)
    index_state_kv: jax.Array | None = None
    index_state_gate: jax.Array | None = None
    ring_scale: jax.Array | SlotRing | None = None  # [B, R] (or in place, as `ring`)
    entries_scale: PagedLayer | None = None
    index_entries_scale: PagedLayer | None = None

    @property
    def fp8(self) -> bool:
        return self.ring_scale is not None


def store_entries(paged: PagedLayer, scales: PagedLayer | None, entries, ids, ok, g: ChunkGeometry, ratio: int,
                  page_size: int) -> tuple[PagedLayer, PagedLayer | None]:
    """`write_entries`, quantized on the way in when the pool is FP8 (`scales` given): values and row scales."""
    if scales is None:
        return write_entries(paged, entries, ids, ok, g, ratio, page_size), None
    values, row_scales = kv_quant.quantize(entries, paged.pool.dtype)
    return (write_entries(paged, values, ids, ok, g, ratio, page_size),
            write_entries(scales, row_scales, ids, ok, g, ratio, page_size))


def window_rows(g: ChunkGeometry, ring_rows: int, window: int) -> jax.Array:
    """Rows of the step's [ring ; fresh] key buffer (flattened over B) each query attends in its window.

    Returns [B, C, window] int32, -1 where the position is before 0 or the query is padding."""
    b, chunk = g.positions.shape
    span = ring_rows + chunk
    p = g.positions[..., None] - (window - 1) + jnp.arange(window, dtype=jnp.int32)  # [B, C, W]
    start = g.start[:, None, None]
    local = jnp.where(p >= start, ring_rows + (p - start), jnp.mod(p, ring_rows))
    rows = jnp.arange(b, dtype=jnp.int32)[:, None, None] * span + local
    return jnp.where((p >= 0) & g.valid[..., None], rows, -1)


def _swa_snapshot(kv, pools: LayerPools, g: ChunkGeometry, window: int):
    """The SWA keys of a chunk that reads the slots' rings before writing them: (the [ring ; fresh] buffer of
    every row [B * (R + C), d], its row scales or None, pools with the rewritten rings, the rows each query
    attends [B, C, window])."""
    ring_rows = pools.ring.shape[1]
    ring_ok = ring_positions(g.start, ring_rows) >= 0
    swa_scale = None
    if pools.fp8:  # the chunk's keys are quantized before anything reads them, its own queries included
        kv_stored, kv_scale = kv_quant.quantize(kv, pools.ring.dtype)
        swa = jnp.concatenate([jnp.where(ring_ok[..., None], pools.ring, 0),
                               jnp.where(g.valid[..., None], kv_stored, 0)], axis=1)  # [B, R + C, d] FP8
        swa_scale = jnp.concatenate([jnp.where(ring_ok, pools.ring_scale, 0), jnp.where(g.valid, kv_scale, 0)],
                                    axis=1).reshape(-1)
        new = pools._replace(ring=rewrite_ring(pools.ring, kv_stored, g),
                             ring_scale=rewrite_ring(pools.ring_scale[..., None], kv_scale[..., None], g)[..., 0])
    else:
        swa = jnp.concatenate([jnp.where(ring_ok[..., None], pools.ring, 0).astype(kv.dtype),
                               jnp.where(g.valid[..., None], kv, 0)], axis=1)  # [B, R + C, d]
        new = pools._replace(ring=rewrite_ring(pools.ring, kv, g))
    return swa.reshape(-1, kv.shape[-1]), swa_scale, new, window_rows(g, ring_rows, window)


def _swa_in_place(kv, pools: LayerPools, g: ChunkGeometry, window: int):
    """`_swa_snapshot` for rings in place (`ring_in_place`): the chunk's keys written first (quantized with an
    FP8 cache), then the window's rows read from the whole ring array."""
    ring, ring_scale = pools.ring, pools.ring_scale
    if pools.fp8:
        kv, kv_scale = kv_quant.quantize(kv, ring.pool.dtype)
        ring_scale = ring_scale.write(kv_scale, g)
    ring = ring.write(kv, g)
    p = g.positions[..., None] - (window - 1) + jnp.arange(window, dtype=jnp.int32)  # [B, C, W]
    idx = ring.layer_rows(p, (p >= 0) & g.valid[..., None])  # from the layer's first row (the kernel's a_base)
    return (ring.flat(), None if ring_scale is None else ring_scale.flat(),
            pools._replace(ring=ring, ring_scale=ring_scale), idx)


def attention_pooled(x, pools: LayerPools, g: ChunkGeometry, p: dict, cfg: Config, kind: AttentionType, *,
                     page_size: int, max_entries: int, window: int, impl: Impl):
    """x [B, C, e] normalised -> (y [B, C, e], updated LayerPools, indexer selection [B, C, n] or None).

    Attention runs over two row lists per query (the kernels' interface): list A indexes this step's
    [ring ; fresh] SWA buffer (or the rings in place, `SlotRing`), list B indexes the compressed pool in place
    (all visible HCA entries, or the CSA entries the indexer selected)."""
    b, chunk, _ = x.shape
    inv_freq = layer_inv_freq(cfg, kind)
    q_latent, q, kv = project_qkv(x, g.positions, p, cfg, inv_freq)
    a_base = None  # list A's rows from this row of `swa` (the rings in place: the layer's first)
    if isinstance(pools.ring, SlotRing):
        swa, swa_scale, new, idx_a = _swa_in_place(kv, pools, g, window)
        a_base = jnp.asarray(pools.ring.base, jnp.int32)
    else:
        swa, swa_scale, new, idx_a = _swa_snapshot(kv, pools, g, window)
    table_scale = None  # the compressed pool's row scales with an FP8 cache
    selection, table = None, jnp.zeros((0, cfg.head_dim), kv.dtype)
    idx_b = jnp.zeros((b, chunk, 0), jnp.int32)
    if kind is not AttentionType.SLIDING:
        ratio = cfg.compress_ratio_of(kind)
        overlap = kind is AttentionType.CSA
        capacity = max_entries // ratio
        num_pages = pools.entries.rows // (page_size // ratio)
        with jax.named_scope("compressor"):
            ents, ids, ok, state = compress_chunk(
                x, p["compressor"], CompressorState(pools.state_kv, pools.state_gate), g, ratio=ratio,
                overlap=overlap, width=cfg.head_dim, inv_freq=inv_freq, eps=cfg.rms_norm_eps,
                rounding=kv_rounding(cfg))
            paged, paged_scale = store_entries(pools.entries, pools.entries_scale, ents, ids, ok, g, ratio, page_size)
        new = new._replace(entries=paged, entries_scale=paged_scale, state_kv=state.kv, state_gate=state.gate)
        table = paged.flat()
        table_scale = None if paged_scale is None else paged_scale.flat()
        all_ids = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (b, capacity))
        rows_of = entry_rows(g.page_table, all_ids, ratio, page_size, num_pages)  # [B, capacity], -1 = no page
        readable = readable_entries(g.page_table, ratio, page_size, num_pages)  # [B]
        n_visible = jnp.where(g.valid, jnp.minimum((g.positions + 1) // ratio, readable[:, None]), 0)  # [B, C]
        if overlap:
            with jax.named_scope("indexer"):
                ip = p["indexer"]
                # the indexer's projections of x (its compressor's two, the head weights) behind an optimization
                # barrier (no kernel): XLA:GPU's dot merger joined them with the attention's four into one GEMM of
                # seven weights, too many pieces for the GEMM fusion's operand, so every step first copied the
                # seven into one [4096, 4160] weight (68 MB of traffic a CSA layer at Flash sizes). As two groups
                # (four and three weights) each concatenation stays inside its GEMM's operand
                # (`scripts/step_kernels.py --deviceless sm90`)
                x_index = jax.lax.optimization_barrier(x)
                ients, iids, iok, istate = compress_chunk(
                    x_index, ip["compressor"], CompressorState(pools.index_state_kv, pools.index_state_gate), g,
                    ratio=ratio, overlap=True, width=cfg.index_head_dim, inv_freq=inv_freq, eps=cfg.rms_norm_eps,
                    rounding=index_rounding(cfg))
                ipaged, ipaged_scale = store_entries(pools.index_entries, pools.index_entries_scale, ients, iids,
                                                     iok, g, ratio, page_size)
                new = new._replace(index_entries=ipaged, index_entries_scale=ipaged_scale, index_state_kv=istate.kv,
                                   index_state_gate=istate.gate)
                iq, iw = indexer.queries(q_latent, x_index, g.positions, ip, cfg, inv_freq)
                key_rows = jnp.broadcast_to(ipaged.flat_rows(rows_of)[:, None, :], (b, chunk, capacity))
                selection = kernels.indexer_topk(
                    iq.reshape(b * chunk, *iq.shape[2:]), iw.reshape(b * chunk, -1), ipaged.flat(),
                    key_rows.reshape(b * chunk, capacity), n_visible.reshape(-1), k=min(cfg.index_topk, capacity),
                    impl=impl, key_scale=None if ipaged_scale is None else ipaged_scale.flat()).reshape(b, chunk, -1)
            # selection ids are < n_visible (-1 = none), so every chosen entry has a row
            chosen_rows = jnp.take_along_axis(paged.flat_rows(rows_of), selection.reshape(b, -1), axis=1,
                                              mode="fill", fill_value=-1)
            idx_b = jnp.where(selection >= 0, chosen_rows.reshape(selection.shape), -1)
        else:
            visible = all_ids[:, None, :] < n_visible[..., None]  # [B, C, capacity]
            idx_b = jnp.where(visible, paged.flat_rows(rows_of)[:, None, :], -1)
    o = kernels.sparse_attention(
        q.reshape(b * chunk, cfg.num_heads, cfg.head_dim), swa,
        idx_a.reshape(b * chunk, -1), table if pools.fp8 else table.astype(kv.dtype), idx_b.reshape(b * chunk, -1),
        p["sink"], scale=cfg.head_dim**-0.5, impl=impl, kv_a_scale=swa_scale,
        kv_b_scale=table_scale, a_base=a_base).reshape(q.shape)
    return output_projection(o, g.positions, p, cfg, inv_freq), new, selection
