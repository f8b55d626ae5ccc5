"""Attention over explicit pools for a ragged batch of token chunks (the building block of every step).

A step row b processes n[b] <= C tokens of the request in slot slots[b], at positions start[b] + i, where
start[b] = pool.lengths[slot]. Per layer:

1. SWA: the ring is read *before* this chunk writes it (snapshot), and keys are [ring rows ; fresh chunk rows],
   so a token never sees a row overwritten by a later token of its own chunk. The ring is then rewritten with
   the last rows of the chunk (a gather per ring row, so duplicate positions never race in a scatter).
2. Compressors: the entries whose window closes inside the chunk are pooled from [state ring ; fresh tokens] and
   written to the paged pool, so windows straddling chunk boundaries give the same entries as a full forward.
   The state ring is then rewritten like the SWA ring.
3. Compressed keys: HCA attends to all visible entries; CSA runs the indexer over the request's indexer keys and
   attends to the selected entries.

All reads are masked by position: a row is used only if it holds a committed position the query may see.
Padding rows (n = 0) and padding tokens write nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.config import AttentionType, Config
from ds4jax.layers import compressor, indexer
from ds4jax.layers.attention import attend, layer_inv_freq, output_projection, project_qkv, sliding_mask


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


def entry_rows(page_table: jax.Array, entries: jax.Array, ratio: int, page_size: int) -> jax.Array:
    """Pool rows of logical entries [B, ...] of each request (pages must exist; callers mask the rest)."""
    per_page = page_size // ratio
    page = jnp.take_along_axis(page_table, (entries // per_page).reshape(entries.shape[0], -1), axis=1)
    page = page.reshape(entries.shape)
    return jnp.maximum(page, 0) * per_page + entries % per_page


class CompressorState(NamedTuple):
    kv: jax.Array  # [B, Rs, c*w] raw kv projections of recent tokens
    gate: jax.Array  # [B, Rs, c*w] gate projections + ape


def compress_chunk(x, p, state: CompressorState, g: ChunkGeometry, *, ratio: int, overlap: bool, width: int,
                   inv_freq, eps: float):
    """Entries closed by this chunk and the updated state ring.

    Returns (entries [B, E, width], entry ids [B, E], entry valid [B, E], new state). E = C // ratio + 1."""
    b, chunk, _ = x.shape
    kv, gate = compressor.project(x, p)
    gate = gate + p["ape"].astype(gate.dtype)[g.positions % ratio]
    rows = state.kv.shape[1]
    span = 2 * ratio if overlap else ratio
    e_max = chunk // ratio + 1
    first = g.start // ratio  # [B]
    ids = first[:, None] + jnp.arange(e_max, dtype=jnp.int32)[None, :]  # [B, E]
    ok = ids < ((g.start + g.n) // ratio)[:, None]
    # token position of every slot of every new entry
    offset = -ratio if overlap else 0
    pos = ids[..., None] * ratio + offset + jnp.arange(span, dtype=jnp.int32)  # [B, E, span]
    fresh_idx = jnp.clip(pos - g.start[:, None, None], 0, chunk - 1)
    from_fresh = pos >= g.start[:, None, None]
    ring_idx = jnp.mod(pos, rows)

    def gather(fresh, ring):
        f = jnp.take_along_axis(fresh, fresh_idx.reshape(b, -1)[..., None], axis=1).reshape(pos.shape + (-1,))
        r = jnp.take_along_axis(ring, ring_idx.reshape(b, -1)[..., None], axis=1).reshape(pos.shape + (-1,))
        return jnp.where(from_fresh[..., None], f.astype(jnp.float32), r.astype(jnp.float32))

    slot_kv, slot_gate = gather(kv, state.kv), gather(gate, state.gate)  # [B, E, span, c*w]
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
    entries = compressor.pool(slot_kv.astype(x.dtype), slot_gate, p, ids * ratio, inv_freq, eps)
    new_state = CompressorState(rewrite_ring(state.kv, kv, g), rewrite_ring(state.gate, gate, g))
    return entries, ids, ok, new_state


def write_entries(pool: jax.Array, entries, ids, ok, g: ChunkGeometry, ratio: int, page_size: int) -> jax.Array:
    """Scatter new entries [B, E, w] into pool [N, w]; padding entries go to the out-of-range row N, which the
    explicit mode='drop' discards (the one intentional drop; host validation guarantees real rows exist)."""
    rows = entry_rows(g.page_table, ids, ratio, page_size)
    rows = jnp.where(ok, rows, pool.shape[0])
    return pool.at[rows.reshape(-1)].set(entries.reshape(-1, entries.shape[-1]).astype(pool.dtype), mode="drop")


def request_entries(pool: jax.Array, g: ChunkGeometry, ratio: int, page_size: int, capacity: int):
    """All compressed entries of each request: ([B, capacity, w] zeroed where not yet written, count [B])."""
    ids = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32)[None, :], (g.start.shape[0], capacity))
    count = (g.start + g.n) // ratio
    exists = ids < count[:, None]
    rows = entry_rows(g.page_table, ids, ratio, page_size)
    keys = pool[jnp.where(exists, rows, 0)]
    return jnp.where(exists[..., None], keys, jnp.zeros((), keys.dtype)), count


class LayerPools(NamedTuple):
    """One layer's slice of the pools, gathered for the step's slots (None where the layer has no such pool)."""
    ring: jax.Array  # [B, R, d]
    entries: jax.Array | None  # [N, d] shared pool (C4 or C128)
    state: CompressorState | None
    index_entries: jax.Array | None  # [N4, di]
    index_state: CompressorState | None


def attention_pooled(x, pools: LayerPools, g: ChunkGeometry, p: dict, cfg: Config, kind: AttentionType, *,
                     page_size: int, max_entries: int, window: int):
    """x [B, C, e] normalised -> (y [B, C, e], updated LayerPools, indexer selection or None)."""
    inv_freq = layer_inv_freq(cfg, kind)
    q_latent, q, kv = project_qkv(x, g.positions, p, cfg, inv_freq)
    ring_pos = ring_positions(g.start, pools.ring.shape[1])
    ring_ok = ring_pos >= 0
    keys = jnp.concatenate([jnp.where(ring_ok[..., None], pools.ring, 0).astype(kv.dtype),
                            jnp.where(g.valid[..., None], kv, 0)], axis=1)
    key_pos = jnp.concatenate([ring_pos, g.positions], axis=1)
    key_ok = jnp.concatenate([ring_ok, g.valid], axis=1)
    valid = key_ok[:, None, :] & sliding_mask(g.positions, key_pos, window)
    new = pools._replace(ring=rewrite_ring(pools.ring, kv, g))
    selection = None
    if kind is not AttentionType.SLIDING:
        ratio = cfg.compress_ratio_of(kind)
        overlap = kind is AttentionType.CSA
        ents, ids, ok, state = compress_chunk(x, p["compressor"], pools.state, g, ratio=ratio, overlap=overlap,
                                              width=cfg.head_dim, inv_freq=inv_freq, eps=cfg.rms_norm_eps)
        table = write_entries(pools.entries, ents, ids, ok, g, ratio, page_size)
        new = new._replace(entries=table, state=state)
        capacity = max_entries // ratio
        comp, _ = request_entries(table, g, ratio, page_size, capacity)
        visible = jnp.arange(capacity)[None, None, :] < ((g.positions + 1) // ratio)[..., None]
        visible = visible & g.valid[..., None]
        if overlap:
            ip = p["indexer"]
            ients, iids, iok, istate = compress_chunk(x, ip["compressor"], pools.index_state, g, ratio=ratio,
                                                      overlap=True, width=cfg.index_head_dim, inv_freq=inv_freq,
                                                      eps=cfg.rms_norm_eps)
            itable = write_entries(pools.index_entries, ients, iids, iok, g, ratio, page_size)
            new = new._replace(index_entries=itable, index_state=istate)
            ikeys, _ = request_entries(itable, g, ratio, page_size, capacity)
            iq, iw = indexer.queries(q_latent, x, g.positions, ip, cfg, inv_freq)
            selection = indexer.select(indexer.scores(iq, iw, ikeys, cfg), visible, cfg.index_topk)
            b, c, _ = selection.shape
            chosen = jnp.zeros((b, c, capacity + 1), bool)
            chosen = jax.vmap(jax.vmap(lambda row, sel: row.at[jnp.where(sel < 0, capacity, sel)].set(True)))(
                chosen, selection)[..., :capacity]
            visible = visible & chosen
        keys = jnp.concatenate([keys, comp.astype(keys.dtype)], axis=1)
        valid = jnp.concatenate([valid, visible], axis=-1)
    o = attend(q, keys, valid, p["sink"], cfg.head_dim**-0.5)
    return output_projection(o, g.positions, p, cfg, inv_freq), new, selection
