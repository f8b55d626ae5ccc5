"""Pooled steps on a `MeshLayout`: prefill / decode / verify with params and pools placed on the mesh.

`MeshSteps` has the call signatures of `ds4jax.runtime.steps` (and `zeros`, `book`), so the generation loop
runs unchanged on a mesh (``runner = model.layout.steps(cfg)`` instead of the module).

* Pools are one `KVPool` per layer stage, holding that stage's layers (a stage-local `PoolSpec`).
* Within a stage, arrays are placed by their logical axes (`pool_layout.POOL_ARRAYS`) and the layout's rules:
  per-slot arrays split by slot over ``data``, paged arrays by entry (whole pages) over ``data``, the rest
  replicated.
* Data-parallel attention (``data`` > 1): the whole stage step runs inside ``shard_map`` over ``data``: each
  data shard runs the unchanged single-device step on its rows, its slots and its pages (`ShardedPoolBook`
  allocates a slot's pages from its shard's range), so no pool row ever leaves its device; the MoE inside
  runs expert-parallel over the remaining axes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ds4jax.model.config import AttentionType, Config
from ds4jax.model.forward import embed
from ds4jax.model import params as params_lib
from ds4jax.model.sharding import mesh_spec, spec_axes
from ds4jax.runtime import pool_layout, steps as steps_lib
from ds4jax.runtime.kernels import resolve
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pooled_attention import geometry
from ds4jax.runtime.pools import KVPool, PoolBook, PoolError, zeros as pool_zeros
from ds4jax.runtime.steps import Logits, StepBatch, StepOutput

# Logical axes of every pool array, from the one pool-layout table; "slots" and "entries" go over ``data``.
POOL_AXES = {a.name: a.axes for a in pool_layout.POOL_ARRAYS}


def stage_config(cfg: Config, lo: int, hi: int) -> Config:
    """Layers [lo, hi) seen as a model of their own (pool layer indices are then stage-local)."""
    return cfg.replace(num_layers=hi - lo, attention_types=cfg.attention_types[lo:hi], mlp_types=cfg.mlp_types[lo:hi])


def stage_spec(spec: PoolSpec, view: Config) -> PoolSpec:
    """The part of `spec` that a stage with `view`'s layers holds (kinds it lacks get zero capacity)."""
    csa, hca = len(view.layers_of(AttentionType.CSA)), len(view.layers_of(AttentionType.HCA))
    return dataclasses.replace(
        spec, num_layers=view.num_layers, num_csa_layers=csa, num_hca_layers=hca,
        c4_state_rows=spec.c4_state_rows if csa else 0, indexer_state_rows=spec.indexer_state_rows if csa else 0,
        c128_state_rows=spec.c128_state_rows if hca else 0,
        c4_pages=spec.c4_pages if csa else 0, c4_entries=spec.c4_entries if csa else 0,
        indexer_entries=spec.indexer_entries if csa else 0,
        c128_pages=spec.c128_pages if hca else 0, c128_entries=spec.c128_entries if hca else 0,
        pages_per_slot=spec.pages_per_slot if csa or hca else 0)


def data_local_spec(spec: PoolSpec, data: int) -> PoolSpec:
    """What one ``data`` shard holds: its slots and its pages."""
    if data == 1:
        return spec
    for name in ("max_slots", "c4_pages", "c128_pages"):
        if getattr(spec, name) % data:
            raise PoolError(f"data-parallel pools: spec.{name}={getattr(spec, name)} is not divisible by data={data}")
    return dataclasses.replace(
        spec, max_slots=spec.max_slots // data, c4_pages=spec.c4_pages // data, c4_entries=spec.c4_entries // data,
        indexer_entries=spec.indexer_entries // data, c128_pages=spec.c128_pages // data,
        c128_entries=spec.c128_entries // data)


class ShardedPoolBook(PoolBook):
    """`PoolBook` whose slots and pages are split into `data` equal ranges: slot s takes pages only from the range
    of its shard s // (max_slots / data), the shard that holds its rows."""

    def __init__(self, spec: PoolSpec, vocab_size: int, data: int):
        super().__init__(spec, vocab_size)
        self.data = data
        per = spec.num_pages // data
        self.shard_free = [list(range(d * per, (d + 1) * per))[::-1] for d in range(data)]
        self.free_pages = _AllFree(self.shard_free)

    def shard_of(self, slot: int) -> int:
        return slot // (self.spec.max_slots // self.data)

    def reserve(self, slot: int, new_length: int) -> None:
        self.free_pages = self.shard_free[self.shard_of(slot)]  # PoolBook.reserve pops from free_pages
        try:
            super().reserve(slot, new_length)
        finally:
            self.free_pages = _AllFree(self.shard_free)

    def release(self, slot: int) -> None:
        if 0 <= slot < self.spec.max_slots:
            self.free_pages = self.shard_free[self.shard_of(slot)]
        try:
            super().release(slot)
        finally:
            self.free_pages = _AllFree(self.shard_free)

class _AllFree(list):
    """Read-only view of every shard's free pages (len / iteration for reports)."""

    def __init__(self, lists):
        super().__init__(p for free in lists for p in free)


def check_rows(slots: Sequence[int], max_slots: int, data: int) -> None:
    """Row r of a data-parallel step runs on shard r // (rows / data); its slot must live there."""
    rows = len(slots)
    if rows % data:
        raise PoolError(f"data-parallel step: {rows} rows are not divisible by data={data}")
    for r, s in enumerate(slots):
        home, runs = int(s) // (max_slots // data), r // (rows // data)
        if home != runs:
            raise PoolError(f"row {r}: slot {s} lives on data shard {home}, but row {r} runs on shard {runs} "
                            f"(order a step's rows by slot shard)")


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "rules", "first", "last", "logits", "kernels", "data"),
                   donate_argnames=("pool",))
def _stage_step(top, layers, pool, batch, x, *, cfg, spec, rules, first, last, logits, kernels, data):
    def body(top, layers, pool, batch, x):
        with nn.logical_axis_rules(rules):
            table = pool.page_table
            if data > 1:  # global slot / page ids -> this shard's
                shard = jax.lax.axis_index("data")
                batch = batch._replace(slots=batch.slots - shard * pool.lengths.shape[0])
                per = spec.num_pages
                pool = pool.replace(page_table=jnp.where(table >= 0, table - shard * per, -1))
            steps_lib._validate_static(cfg, spec, steps_lib.Role.TARGET, pool, batch)
            ids = batch.token_ids
            # as in steps._step: padding rows address the null slot max_slots (fill reads, dropped writes)
            live = (batch.n_tokens > 0) & (batch.slots >= 0) & (batch.slots < spec.max_slots)
            slots = jnp.where(live, batch.slots, spec.max_slots)
            start = pool.lengths.at[slots].get(mode="fill", fill_value=0)
            g = geometry(start, batch.n_tokens, ids.shape[1], pool.page_table.at[slots].get(mode="fill", fill_value=-1))
            if first:
                x = embed(top, ids, cfg)
            for j, p in enumerate(layers):
                kind, mlp = cfg.attention_types[j], cfg.mlp_types[j]
                with jax.named_scope(f"stage/layer{j}_{kind.name.lower()}"):
                    x, pool, _ = steps_lib._pooled_block(x, ids, p, pool, slots, g, j, kind, mlp, cfg, spec, kernels)
            pool = pool.replace(lengths=pool.lengths.at[slots].add(batch.n_tokens, mode="drop"), page_table=table)
            out = None
            if last:
                out = steps_lib._logits(x, top["hc_head"], top["norm"], top["head"], batch, cfg, logits)
            return x, out, pool

    if data == 1:
        return body(top, layers, pool, batch, x)
    d = P("data")
    decl = params_lib.declare(cfg)
    top_specs = {k: data_part(decl[k], rules) for k in top}
    layer_specs = [data_part(p, rules) for p in decl["layers"]]
    pool_specs = KVPool(**{k: P(*[("data" if a in ("slots", "entries") else None) for a in v])
                           for k, v in POOL_AXES.items()})
    out_logits = None if not last or logits is Logits.NONE else d
    fn = jax.shard_map(body, in_specs=(top_specs, layer_specs, pool_specs, d, None if x is None else d),
                       out_specs=(d, out_logits, pool_specs), axis_names={"data"}, check_vma=False)
    return fn(top, layers, pool, batch, x)


def data_part(decl, rules):
    """Per-parameter shard_map specs naming only ``data`` (params split over it, e.g. experts over data x expert,
    enter each data shard as their local block; every other axis stays automatic inside)."""
    sizes = dict(jax.sharding.get_abstract_mesh().shape)

    def one(info):
        spec = mesh_spec(info.shape, info.axes, sizes, rules)
        return P(*[("data" if "data" in spec_axes(e) else None) for e in spec])

    return jax.tree.map(one, decl, is_leaf=lambda v: isinstance(v, params_lib.ParamInfo))


@dataclasses.dataclass(frozen=True, eq=False)
class MeshSteps:
    """`ds4jax.runtime.steps` on a mesh, for one model config."""

    layout: Any  # MeshLayout
    cfg: Config

    @property
    def data(self) -> int:
        return self.layout.axis_sizes["data"]

    def ranges(self):
        return self.layout.stage_ranges(self.cfg.num_layers)

    def stage_specs(self, spec: PoolSpec) -> list[PoolSpec]:
        return [stage_spec(spec, stage_config(self.cfg, lo, hi)) for lo, hi in self.ranges()]

    def pool_shardings(self, spec: PoolSpec) -> tuple:
        from ds4jax.runtime.pool_spec import shapes

        out = []
        for s, sp in enumerate(self.stage_specs(spec)):
            mesh = self.layout.stages[s]
            out.append(KVPool(**{k: NamedSharding(mesh, mesh_spec(shape, POOL_AXES[k], dict(mesh.shape),
                                                                 self.layout.rules))
                                 for k, (shape, _) in shapes(sp).items()}))
        return tuple(out)

    # ---- the pools / book API of the generation loop -------------------------------------------------
    def zeros(self, spec: PoolSpec) -> tuple:
        data_local_spec(spec, self.data)  # divisibility errors before anything is allocated
        return tuple(jax.jit(pool_zeros, static_argnums=0, out_shardings=sh)(sp)
                     for sp, sh in zip(self.stage_specs(spec), self.pool_shardings(spec)))

    def book(self, spec: PoolSpec, vocab_size: int) -> PoolBook:
        return ShardedPoolBook(spec, vocab_size, self.data) if self.data > 1 else PoolBook(spec, vocab_size)

    def sync(self, book: PoolBook, pools: tuple, spec: PoolSpec) -> tuple:
        out = []
        for pool, sp, sh in zip(pools, self.stage_specs(spec), self.pool_shardings(spec)):
            table = book.page_table[:, : sp.pages_per_slot]
            out.append(pool.replace(page_table=jax.device_put(table, sh.page_table),
                                    lengths=jax.device_put(book.lengths.astype(np.int32), sh.lengths)))
        return tuple(out)

    # ---- steps ------------------------------------------------------------------------------------
    def _run(self, params, pools: tuple, batch: StepBatch, spec: PoolSpec, logits: Logits, kernels):
        if self.data > 1:
            check_rows(np.asarray(batch.slots).tolist(), spec.max_slots, self.data)
        kernels = resolve(kernels)
        ranges, specs = self.ranges(), self.stage_specs(spec)
        x, out, new = None, None, []
        for s, (lo, hi) in enumerate(ranges):
            first, last = s == 0, s == len(ranges) - 1
            put = lambda a: jax.device_put(a, self.layout.batch_sharding(a.shape, s))
            b = StepBatch(*(put(jnp.asarray(a)) for a in batch))
            if x is not None:  # the hyper-connection state moves to this stage
                x = put(x)
            top = {k: params[k] for k in (("embed",) if first else ()) + (("hc_head", "norm", "head") if last else ())}
            view = stage_config(self.cfg, lo, hi)
            with self.layout.active(s):
                x, out, pool = _stage_step(top, params["layers"][lo:hi], pools[s], b, x, cfg=view,
                                           spec=data_local_spec(specs[s], self.data), rules=self.layout.rules,
                                           first=first, last=last, logits=logits, kernels=kernels, data=self.data)
            new.append(pool)
        return StepOutput(out, x, ()), tuple(new)

    def prefill(self, params, pools, batch, *, cfg: Config, spec: PoolSpec, need_logits: bool = True,
                all_logits: bool = False, kernels=None):
        mode = Logits.ALL if all_logits else (Logits.LAST if need_logits else Logits.NONE)
        return self._run(params, pools, batch, spec, mode, kernels)

    def decode(self, params, pools, batch, *, cfg: Config, spec: PoolSpec, kernels=None):
        if batch.token_ids.shape[1] != 1:
            raise PoolError(f"decode takes one token per row, got token_ids {batch.token_ids.shape}")
        return self._run(params, pools, batch, spec, Logits.LAST, kernels)

    def verify(self, params, pools, batch, *, cfg: Config, spec: PoolSpec, kernels=None):
        return self._run(params, pools, batch, spec, Logits.ALL, kernels)


def gather_pools(pools: tuple, steps: MeshSteps, spec: PoolSpec) -> dict[str, np.ndarray]:
    """The stage pools as one host copy in the single-device layout (layer axes concatenated; tests, debugging)."""
    out = {}
    for name in POOL_AXES:
        parts = [np.asarray(getattr(p, name)) for p in pools]
        if name in ("page_table", "lengths"):
            out[name] = max(parts, key=lambda a: a.size)
        else:  # stages without a layer kind hold zero-size arrays for it
            out[name] = np.concatenate([a for a in parts if a.shape[0]] or parts[:1], axis=0)
    return out
