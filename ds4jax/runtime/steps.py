"""Pure, jit-compiled prefill / decode / verify / draft-extend steps over explicit pools.

Every step is ``(params, pool, batch) -> (StepOutput, pool)`` with the config, the pool spec, the role and the
logits mode static, and the pool donated. The role is keyword-only and decides the network:

* ``Role.TARGET`` runs every layer with its compressed pools;
* ``Role.DRAFT`` runs the MTP block, which is sliding-window only: its trace contains no compressor or indexer
  code, and it accepts a pool spec whose compressed capacities are zero. A target step handed a draft pool spec
  fails at trace time.

A batch is a ragged set of chunks: row b appends ``n_tokens[b]`` tokens to the request in ``slots[b]``.
``prefill`` (any chunk size), ``decode`` (one token) and ``verify`` (k+1 tokens, all logits) are the same
computation with different static shapes and logits modes.
"""

from __future__ import annotations

import enum
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ds4jax.model.config import AttentionType, Config, MlpType
from ds4jax.runtime.executable_cache import cached_jit
from ds4jax.runtime.kernels import Impl, dense_linears, mhc_head, mhc_pre, resolve, routed_experts
from ds4jax.runtime import data_parallel, kv_quant, pool_layout as layout
from ds4jax.runtime.pooled_attention import (LayerPools, PagedLayer, SlotRing, attention_pooled, geometry,
                                             ring_in_place, set_row, window_span)
from ds4jax.model import layer_stack
from ds4jax.model.forward import block, embed, logits_from_streams, mtp_inputs
from ds4jax.model.layer_stack import LayerAt
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pools import KVPool, PoolError, check_pool
from ds4jax.runtime.roles import Role


class Logits(enum.Enum):
    NONE = "none"  # intermediate prefill chunks: skip the vocab projection
    LAST = "last"  # logits of each row's last valid token: [B, v]
    ALL = "all"  # logits of every chunk token: [B, C, v] (verification, parity tests)


class StepBatch(NamedTuple):
    slots: jax.Array  # [B] int32 pool slot of each row (distinct among rows with tokens; ignored for n = 0)
    token_ids: jax.Array  # [B, C] int32 (draft: the ids of the NEXT tokens, see draft_extend)
    n_tokens: jax.Array  # [B] int32 valid tokens per row (0 = padding row)


class StepOutput(NamedTuple):
    logits: jax.Array | None  # [B, v] or [B, C, v] float32, per `Logits`
    streams: jax.Array  # [B, C, m, e] final hyper-connection streams (pre hc_head): the draft's input
    selections: tuple  # per CSA layer: indexer selection [B, C, n] (diagnostics and tests)


def _validate_static(cfg: Config, spec: PoolSpec, role: Role, pool: KVPool, batch: StepBatch) -> None:
    name = f"{role.name.lower()} step"
    if role is Role.TARGET:
        need_csa, need_hca = len(cfg.layers_of(AttentionType.CSA)), len(cfg.layers_of(AttentionType.HCA))
        if spec.num_layers != cfg.num_layers or spec.num_csa_layers != need_csa or spec.num_hca_layers != need_hca:
            raise PoolError(
                f"{name}: the pool spec has {spec.num_layers} layers ({spec.num_csa_layers} CSA, "
                f"{spec.num_hca_layers} HCA) but the target model has {cfg.num_layers} ({need_csa} CSA, {need_hca} "
                f"HCA); a draft pool spec cannot serve the target")
        if need_csa and (spec.c4_entries == 0 or spec.indexer_entries == 0):
            raise PoolError(f"{name}: the pool spec has no C4/indexer capacity (a draft spec?)")
        if need_hca and spec.c128_entries == 0:
            raise PoolError(f"{name}: the pool spec has no C128 capacity (a draft spec?)")
        for kind, ratio, rows, what in (
            (AttentionType.CSA, cfg.csa_ratio, spec.c4_state_rows, "c4_state_rows"),
            (AttentionType.CSA, cfg.csa_ratio, spec.indexer_state_rows, "indexer_state_rows"),
            (AttentionType.HCA, cfg.hca_ratio, spec.c128_state_rows, "c128_state_rows"),
        ):
            span = window_span(ratio, kind is AttentionType.CSA)
            if cfg.layers_of(kind) and rows < span + max(spec.draft_tokens - 2, 0):
                raise PoolError(f"{name}: spec.{what}={rows} cannot hold a {span}-token window plus "
                                f"{spec.draft_tokens} speculative tokens")
    else:
        if spec.num_layers != 1 or spec.num_csa_layers or spec.num_hca_layers:
            raise PoolError(f"{name}: the draft owns one sliding-window layer; the pool spec has "
                            f"{spec.num_layers} layers ({spec.num_csa_layers} CSA, {spec.num_hca_layers} HCA)")
    if spec.swa_rows < cfg.sliding_window:
        raise PoolError(f"{name}: spec.swa_rows={spec.swa_rows} is smaller than the window {cfg.sliding_window}")
    if spec.head_dim != cfg.head_dim:
        raise PoolError(f"{name}: spec.head_dim={spec.head_dim} but the model's head_dim is {cfg.head_dim}")
    check_pool(pool, spec, name)
    b = batch.slots.shape[0]
    if batch.token_ids.ndim != 2 or batch.token_ids.shape[0] != b or batch.n_tokens.shape != (b,):
        raise PoolError(f"{name}: batch shapes slots {batch.slots.shape}, token_ids {batch.token_ids.shape}, "
                        f"n_tokens {batch.n_tokens.shape} disagree")
    if b > spec.max_slots:
        raise PoolError(f"{name}: {b} rows exceed the pool's {spec.max_slots} slots")


def _load_layer(pool: KVPool, rows: jax.Array, at: LayerAt, in_place: frozenset) -> LayerPools:
    """A layer's view of the pools (arrays and fields from `pool_layout`): slot rings of the step's `rows`
    (the null slot max_slots of a padding row reads zeros), paged pools whole with the layer's index. The
    rings named in `in_place` (`_in_place_rings`) whole as well (`SlotRing`): attention writes and reads them in
    place."""
    fields = {}
    for a in layout.of_layer(at.attention):
        arr, i = getattr(pool, a.name), at.rank(a.layers)
        if not arr.shape[0]:  # no layers: a scale array without an FP8 cache (the field stays None)
            continue
        if a.field in in_place:
            fields[a.field] = SlotRing(arr, i, rows)
        else:
            fields[a.field] = _slot_rows(arr, i, rows) if a.per_slot else PagedLayer(arr, i)
    return LayerPools(**fields)


def _in_place_rings(pool: KVPool, kind: AttentionType, cfg: Config, chunk: int, dtype) -> frozenset:
    """The `LayerPools` fields of the per-slot rings that a step of `chunk` tokens writes and reads in place
    (`pooled_attention.SlotRing`): a ring with room for the chunk beyond the span its reads need
    (`ring_in_place`: the SWA window, a compressor's window; decode always) that stores the chunk's values as
    they are read. That is an FP8 SWA ring (the keys are quantized first either way) or one of the step's dtype,
    and a compressor ring of a dtype that holds the step's exactly; otherwise the snapshot, which reads the fresh
    values unrounded (a bf16 ring under an f32 model)."""
    fields = set()
    ring = pool.swa_kv
    if ring_in_place(ring.shape[2], cfg.sliding_window, chunk) and (ring.dtype == dtype or
                                                                   kv_quant.is_fp8(ring.dtype)):
        fields |= {"ring", "ring_scale"}
    if kind is not AttentionType.SLIDING:
        span = window_span(cfg.compress_ratio_of(kind), kind is AttentionType.CSA)
        for a in layout.of_layer(kind):
            arr = getattr(pool, a.name)
            if a.group == "states" and ring_in_place(arr.shape[2], span, chunk) and (
                    jnp.promote_types(dtype, arr.dtype) == arr.dtype):
                fields.add(a.field)
    return frozenset(fields)


def _slot_rows(arr: jax.Array, i, rows: jax.Array) -> jax.Array:
    """arr[i, rows] with the null slot (rows == max_slots: a padding row) read as zeros. Not `mode="fill"`: JAX
    lowers that to an in-range gather plus a reduction of the index vector's bounds, which XLA:GPU left as a
    kernel of its own per array and layer (~8 launches of a batch-1 decode step); here the gather is in range by
    construction and the one comparison fuses with it."""
    inside = rows < arr.shape[1]
    got = arr.at[i, jnp.where(inside, rows, 0)].get(mode="promise_in_bounds")
    return jnp.where(inside.reshape(inside.shape + (1,) * (got.ndim - 1)), got, jnp.zeros((), got.dtype))


def _set_slot_rows(arr: jax.Array, i, rows: jax.Array, value: jax.Array) -> jax.Array:
    """arr[i, rows] = value with the null slot (rows == max_slots: a padding row) dropped. One row (decode and
    verify at batch 1) is a dynamic_update_slice that writes the slot's old value back for the null slot: XLA:GPU
    turned the one-index scatter with mode="drop" into that update plus an in-bounds reduction over the index, a
    kernel of its own per array and layer (11 of a `flash_slice(4)` decode step's launches). Several rows stay a
    scatter: padding rows all name the null slot, and a write back of their old values could collide with a real
    row's write."""
    if rows.shape[0] != 1:
        return arr.at[i, rows].set(value, mode="drop")
    return set_row(arr, (i, rows[0]), value, rows[0] < arr.shape[1])


def _store_layer(pool: KVPool, new: LayerPools, rows: jax.Array, at: LayerAt) -> KVPool:
    """Write a layer's updated rings back to their slots in place (padding rows' null slot is dropped); paged
    pools were already updated in place."""
    changes = {}
    for a in layout.of_layer(at.attention):
        value = getattr(new, a.field)
        if value is None:  # not loaded (`_load_layer`)
            continue
        if isinstance(value, SlotRing):  # written in place by attention
            changes[a.name] = value.pool
        elif a.per_slot:
            arr, i = getattr(pool, a.name), at.rank(a.layers)
            changes[a.name] = _set_slot_rows(arr, i, rows, value.astype(arr.dtype))
        else:
            changes[a.name] = value.pool
    return pool.replace(**changes)


def _pooled_block(x, token_ids, p, pool, rows, g, at: LayerAt, cfg: Config, spec: PoolSpec, impl: Impl):
    """`model.block` with the pooled attention; returns (streams, pool with this layer updated, selection)."""
    in_place = _in_place_rings(pool, at.attention, cfg, g.positions.shape[1], x.dtype)
    layer_pools = _load_layer(pool, rows, at, in_place)

    def attention(h):
        y, new, selection = attention_pooled(
            h, layer_pools, g, p["attn"], cfg, at.attention, page_size=spec.page_size,
            max_entries=spec.pages_per_slot * spec.page_size, window=cfg.sliding_window, impl=impl)
        return y, (new, selection)

    routed = functools.partial(routed_experts, impl=impl)
    x, aux = block(x, token_ids, p, cfg, at.mlp, attention, routed, functools.partial(mhc_pre, cfg=cfg, impl=impl))
    new, selection = aux.attention
    return x, _store_layer(pool, new, rows, at), selection


def _logits(streams, head_params, norm, head, batch: StepBatch, cfg: Config, mode: Logits, impl: Impl):
    if mode is Logits.NONE:
        return None
    if mode is Logits.LAST and streams.shape[1] == 1:
        # one position a row (decode): nothing to choose. The clipped index is always 0, but XLA kept the
        # take_along_axis in the head's mHC mixing product, which it then wrote to memory instead of fusing it
        # into its reduction (one launch more a step, scripts/step_kernels.py)
        streams = streams[:, 0]
    elif mode is Logits.LAST:
        last = jnp.clip(batch.n_tokens - 1, 0, streams.shape[1] - 1)
        streams = jnp.take_along_axis(streams, last[:, None, None, None], axis=1)[:, 0]
    return logits_from_streams(streams, head_params, norm, head, cfg, functools.partial(mhc_head, cfg=cfg, impl=impl))


def head_logits(params, streams, batch: StepBatch, *, cfg: Config, mode: Logits, kernels: Impl):
    """The target's vocabulary projection of a step's final `streams` [B, C, m, e] (what `step` appends unless its
    `logits` is NONE): the last hyper-connection and norm by `kernels`, then the head."""
    return _logits(streams, params["hc_head"], params["norm"], params["head"], batch, cfg, mode, kernels)


def step(params, pool: KVPool, batch: StepBatch, streams_in, *, cfg: Config, spec: PoolSpec, role: Role,
         logits: Logits, kernels: Impl = Impl.REFERENCE):
    """One traced pooled step (call it inside a jit; the functions below and the engine's fused programs do).

    Role.TARGET embeds `batch.token_ids`, or continues from `streams_in` [B, C, m, e] when given (a later stage
    of a layer split, whose `cfg` is that stage's layers: `mesh_steps.stage_config`); the vocabulary projection
    runs unless `logits` is NONE (a stage without the head passes NONE). Role.DRAFT runs the MTP block on
    `streams_in`. Under a mesh with a ``data`` axis the step runs per data shard (`data_parallel`)."""
    if data_parallel.data_size() > 1:
        return data_parallel.per_shard(_step, params, pool, batch, streams_in, cfg=cfg, spec=spec, role=role,
                                       logits=logits, kernels=kernels)
    return _step(params, pool, batch, streams_in, cfg=cfg, spec=spec, role=role, logits=logits, kernels=kernels)


def _step(params, pool: KVPool, batch: StepBatch, streams_in, *, cfg: Config, spec: PoolSpec, role: Role,
          logits: Logits, kernels: Impl = Impl.REFERENCE):
    # the dense linears by `kernels` too (a trace-time choice); the scope names the whole step in profiles
    # (its geometry and head as well as its layers: scripts/spec_anatomy.py groups kernels by it). None = this
    # backend's default (it installed the GPU kernels on the CPU when passed on unresolved)
    kernels = resolve(kernels)
    with dense_linears(kernels), jax.named_scope(f"{role.value}_step"):
        return _layers_and_logits(params, pool, batch, streams_in, cfg=cfg, spec=spec, role=role, logits=logits,
                                  kernels=kernels)


def _layers_and_logits(params, pool: KVPool, batch: StepBatch, streams_in, *, cfg: Config, spec: PoolSpec,
                       role: Role, logits: Logits, kernels: Impl):
    _validate_static(cfg, spec, role, pool, batch)
    token_ids = batch.token_ids
    # A padding row (n = 0; or a slot outside the pool, which the host check rejects) addresses the null slot
    # max_slots, owned by no request: its reads give empty values (fill) and its writes are dropped, so it
    # neither sees nor touches any live request. (Negative slots would wrap, hence the explicit range.)
    live = (batch.n_tokens > 0) & (batch.slots >= 0) & (batch.slots < spec.max_slots)
    slots = jnp.where(live, batch.slots, spec.max_slots)
    start = pool.lengths.at[slots].get(mode="fill", fill_value=0)
    g = geometry(start, batch.n_tokens, token_ids.shape[1],
                 pool.page_table.at[slots].get(mode="fill", fill_value=-1))
    selections = []
    if role is Role.TARGET:
        x = embed(params, token_ids, cfg) if streams_in is None else streams_in

        def layer(carry, p, at: LayerAt):
            x, pool = carry
            x, pool, sel = _pooled_block(x, token_ids, p, pool, slots, g, at, cfg, spec, kernels)
            return (x, pool), sel

        with jax.named_scope("target"):
            (x, pool), per_layer = layer_stack.run(cfg, params["layers"], (x, pool), layer)
        selections = [sel for sel in per_layer if sel is not None]
        head_params, norm = params.get("hc_head"), params.get("norm")
    else:
        if "mtp" not in params:
            raise PoolError("draft step: the model has no MTP block (its checkpoint shipped no mtp.* tensors)")
        mtp = params["mtp"]
        with jax.named_scope("draft/mtp"):
            x = mtp_inputs(cfg, params, streams_in, token_ids)
            view = _draft_view(cfg)
            at = LayerAt(AttentionType.SLIDING, MlpType.TOPK, first=0, schedule=layer_stack.kinds(view))
            x, pool, _ = _pooled_block(x, token_ids, mtp["block"], pool, slots, g, at, view, spec, kernels)
        head_params, norm = mtp["hc_head"], mtp["norm"]
    pool = pool.replace(lengths=pool.lengths.at[slots].add(batch.n_tokens, mode="drop"))
    out = StepOutput(_logits(x, head_params, norm, params.get("head"), batch, cfg, logits, kernels), x,
                     tuple(selections))
    return out, pool


@functools.lru_cache(maxsize=None)
def _draft_view(cfg: Config) -> Config:
    """The MTP block seen as a one-layer sliding-window model (so pool layer 0 is the draft's ring)."""
    return cfg.replace(num_layers=1, attention_types=(AttentionType.SLIDING,), mlp_types=(MlpType.TOPK,))


_STATIC = ("cfg", "spec", "role", "logits", "kernels")


@cached_jit
@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("pool",))
def _target_step(params, pool, batch, *, cfg, spec, role, logits, kernels):
    if role is not Role.TARGET:
        raise PoolError(f"this step runs the target; got role={role}")
    return step(params, pool, batch, None, cfg=cfg, spec=spec, role=role, logits=logits, kernels=kernels)


@cached_jit
@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("pool",))
def _draft_step(params, pool, batch, streams, *, cfg, spec, role, logits, kernels):
    if role is not Role.DRAFT:
        raise PoolError(f"draft_extend runs the MTP draft; got role={role}")
    return step(params, pool, batch, streams, cfg=cfg, spec=spec, role=role, logits=logits, kernels=kernels)


def prefill(params, pool: KVPool, batch: StepBatch, *, cfg: Config, spec: PoolSpec, role: Role = Role.TARGET,
            need_logits: bool = True, all_logits: bool = False, kernels: Impl | str | None = None):
    """Append a chunk of each request's prompt. Intermediate chunks pass need_logits=False (no vocab projection).

    Returns (StepOutput, pool); logits are [B, v] for each row's last token, or [B, C, v] with all_logits."""
    mode = Logits.ALL if all_logits else (Logits.LAST if need_logits else Logits.NONE)
    return _target_step(params, pool, batch, cfg=cfg, spec=spec, role=role, logits=mode, kernels=resolve(kernels))


def decode(params, pool: KVPool, batch: StepBatch, *, cfg: Config, spec: PoolSpec, role: Role = Role.TARGET,
           kernels: Impl | str | None = None):
    """One token per request: batch.token_ids is [B, 1]. Returns (StepOutput with logits [B, v], pool)."""
    if batch.token_ids.shape[1] != 1:
        raise PoolError(f"decode takes one token per row, got token_ids {batch.token_ids.shape}")
    return _target_step(params, pool, batch, cfg=cfg, spec=spec, role=role, logits=Logits.LAST,
                        kernels=resolve(kernels))


def verify(params, pool: KVPool, batch: StepBatch, *, cfg: Config, spec: PoolSpec, role: Role = Role.TARGET,
           kernels: Impl | str | None = None):
    """Score k+1 positions per request in one step (logits at every position) — speculative verification."""
    return _target_step(params, pool, batch, cfg=cfg, spec=spec, role=role, logits=Logits.ALL,
                        kernels=resolve(kernels))


def draft_extend(params, pool: KVPool, batch: StepBatch, streams: jax.Array, *, cfg: Config, spec: PoolSpec,
                 role: Role = Role.DRAFT, all_logits: bool = False, kernels: Impl | str | None = None):
    """Run the MTP draft over rows (target streams of position i, id of token i+1) at positions start + i.

    Both draft paths use it: after target prefill (token_ids = prompt shifted left by one plus the sampled token,
    streams = the target's per-token streams) and after verification (the accepted tokens and their streams).
    streams: [B, C, m, e]. Returns (StepOutput with logits of each row's last token, pool)."""
    mode = Logits.ALL if all_logits else Logits.LAST
    return _draft_step(params, pool, batch, streams, cfg=cfg, spec=spec, role=role, logits=mode,
                       kernels=resolve(kernels))
