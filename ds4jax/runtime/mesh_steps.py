"""Pooled steps on a `MeshLayout` stage by stage: prefill / decode / verify with params and pools on the mesh.

`ds4jax.Engine` runs one-stage meshes itself (its fused programs trace `steps.step` under the mesh). A layer
split needs one program per stage (stages live on disjoint devices), so it runs here: `MeshSteps` has the call
signatures of `ds4jax.runtime.steps` (and `zeros`, `book`, `sync`), each stage one `stage_step` = `steps.step`
over its layers, the hyper-connection state handed from stage to stage. The engine on a layer split
(`generation/stage_programs.py`) uses its pools, books and `stage_step`.

* Pools are one `KVPool` per layer stage, holding that stage's layers (a stage-local `PoolSpec`).
* Within a stage, arrays are placed by their logical axes (`pool_layout.POOL_ARRAYS`) and the layout's rules:
  per-slot arrays split by slot over ``data``, paged arrays by entry (whole pages) over ``data``, the rest
  replicated.
* Data-parallel attention (``data`` > 1): `steps.step` runs per data shard on its rows, its slots and its pages
  (`data_parallel`; `ShardedPoolBook` allocates a slot's pages from its shard's range), so no pool row ever
  leaves its device; the MoE inside runs expert-parallel over the remaining axes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from ds4jax.model.config import AttentionType, Config
from ds4jax.runtime import pool_layout, steps as steps_lib
from ds4jax.runtime.data_parallel import check_rows, local_spec
from ds4jax.runtime.distributed import put  # host values onto any process's devices
from ds4jax.runtime.kernels import resolve
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pools import PoolBook, PoolError
from ds4jax.runtime.roles import Role
from ds4jax.runtime.steps import Logits, StepBatch, StepOutput
from ds4jax.model import layer_stack

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


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "rules", "logits", "kernels"), donate_argnames=("pool",))
def stage_step(params, pool, batch, x, *, cfg, spec, rules, logits, kernels):
    """The layers of one stage (`cfg` = `stage_config`; params: their ``layers``, plus ``embed`` on the first stage
    and the head on the last) as `steps.step`: embeds when `x` is None; logits NONE on all but the last stage.
    ``layers`` is `layer_stack.layer_range` of the model's: a `LayerStack` of the stage's own segments (its repeated
    units run under `lax.scan`, pool rows by stage-local rank) or, unrolled, a list.
    Data parallelism comes from the context mesh (`data_parallel`). Returns (StepOutput, pool)."""
    with nn.logical_axis_rules(rules):
        return steps_lib.step(params, pool, batch, x, cfg=cfg, spec=spec, role=Role.TARGET, logits=logits,
                              kernels=kernels)


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
        return tuple(self.layout.pool_shardings(sp, s) for s, sp in enumerate(self.stage_specs(spec)))

    # ---- the pools / book API of the generation loop -------------------------------------------------
    def zeros(self, spec: PoolSpec) -> tuple:
        local_spec(spec, self.data)  # divisibility errors before anything is allocated
        return tuple(self.layout.pool_zeros(sp, s) for s, sp in enumerate(self.stage_specs(spec)))

    def book(self, spec: PoolSpec, vocab_size: int) -> PoolBook:
        return ShardedPoolBook(spec, vocab_size, self.data) if self.data > 1 else PoolBook(spec, vocab_size)

    def sync(self, book: PoolBook, pools: tuple, spec: PoolSpec) -> tuple:
        out = []
        for pool, sp, sh in zip(pools, self.stage_specs(spec), self.pool_shardings(spec)):
            table = book.page_table[:, : sp.pages_per_slot]
            out.append(pool.replace(page_table=put(table, sh.page_table),
                                    lengths=put(book.lengths.astype(np.int32), sh.lengths)))
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
            # host arrays go as transfers (`jnp.asarray` of numpy would compile an identity program per shape)
            b = StepBatch(*(put(a if isinstance(a, jax.Array) else np.asarray(a)) for a in batch))
            if x is not None:  # the hyper-connection state moves to this stage
                x = put(x)
            top = {k: params[k] for k in (("embed",) if first else ()) + (("hc_head", "norm", "head") if last else ())}
            mode = logits if last else Logits.NONE
            with self.layout.active(s):
                res, pool = stage_step({**top, "layers": layer_stack.layer_range(params["layers"], lo, hi)}, pools[s], b, x,
                                       cfg=stage_config(self.cfg, lo, hi), spec=specs[s], rules=self.layout.rules,
                                       logits=mode, kernels=kernels)
            x, out = res.streams, res.logits
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
