"""Data-parallel attention: a pooled step traced under a mesh whose ``data`` axis is larger than one runs inside
``shard_map`` over ``data``, each shard on its rows, its slots and its pages.

`steps.step` calls `per_shard` itself, so every caller of the steps (the steps' own jits, the engine's fused
prefill / decode / speculative programs, `MeshSteps`) gets data parallelism from the context mesh alone.

* Rows: row r runs on shard r // (rows / data) (`check_rows`); the caller orders rows by slot shard.
* Slots: shard d holds slots [d * S/d, (d+1) * S/d) and pages [d * P/d, (d+1) * P/d) (`ShardedPoolBook`
  allocates that way); inside, slot and page ids become shard-local, so the unchanged single-device step runs
  on the local pools. A row whose slot lives on another shard reads and writes nothing there (the null slot).
* Params split over ``data`` (e.g. experts over data x expert) enter as each shard's block; every other mesh
  axis stays automatic inside (the MoE and kernels under it run expert / tensor parallel as usual).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from ds4jax.errors import PoolError
from ds4jax.model import params as params_lib
from ds4jax.model.config import Config
from ds4jax.model.sharding import default_rules, mesh_spec, spec_axes
from ds4jax.runtime import pool_layout
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.model import layer_stack

DATA = "data"


def data_size() -> int:
    """Size of the context mesh's ``data`` axis while it is still automatic (1: no data parallelism)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get(DATA, 1) == 1:
        return 1
    kind = dict(zip(mesh.axis_names, mesh.axis_types))[DATA]
    return 1 if kind is AxisType.Manual else mesh.shape[DATA]


def local_spec(spec: PoolSpec, data: int) -> PoolSpec:
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


def shard_of(slot: int, max_slots: int, data: int) -> int:
    return slot // (max_slots // data)


def rows_over_data(tree):
    """Pin arrays indexed by request slot / row on their leading axis to the ``data`` split alone (the rest
    replicated) when traced under a mesh; unchanged otherwise. A program's per-slot outputs then keep the
    placement they came in with, so the next call does not compile again for a new input sharding."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA not in mesh.axis_names:
        return tree
    n = mesh.shape[DATA]
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, P(DATA if a.shape[0] % n == 0 else None)), tree)


def _param_specs(params: dict, cfg: Config, rules) -> dict:
    """shard_map specs naming only ``data`` for the params present (a layer-split stage passes a subset; a parked
    part is None)."""
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    decl = params_lib.declare(cfg)
    missing = sorted(set(params) - set(decl))
    if missing:
        raise PoolError(f"data-parallel step: params {missing} are not declared for this config")

    def one(info):
        spec = mesh_spec(info.shape, info.axes, sizes, rules)
        return P(*[(DATA if DATA in spec_axes(e) else None) for e in spec])

    # a parked part (`Engine.park`: its entry is None) has no arrays, so no specs either
    specs = {k: None if params[k] is None else
             jax.tree.map(one, decl[k], is_leaf=lambda v: isinstance(v, params_lib.ParamInfo)) for k in params}
    if layer_stack.is_stacked(params):  # a stacked leaf: the per-layer spec behind its (unsharded) layer axis
        specs["layers"] = layer_stack.stack_like(params["layers"], specs["layers"],
                                                 combine=lambda first, *_: P(None, *first))
    return specs


def _pool_specs(pool):
    return type(pool)(**{a.name: P(*[(DATA if x in ("slots", "entries") else None) for x in a.axes])
                         for a in pool_layout.POOL_ARRAYS})


def per_shard(step: Callable, params: dict, pool, batch, streams, *, cfg: Config, spec: PoolSpec, **static: Any):
    """``step(params, pool, batch, streams, cfg=, spec=local spec, **static) -> (StepOutput, pool)`` run per data
    shard, on global pools and rows (see the module docstring)."""
    data = data_size()
    local = local_spec(spec, data)
    import flax.linen as nn  # here, not at the top: a cached `ds4jax generate` never traces (tests/test_startup_imports.py)

    rules = tuple(nn.get_logical_axis_rules() or default_rules())
    rows = P(DATA)

    def body(params, pool, batch, streams):
        shard = jax.lax.axis_index(DATA)
        table = pool.page_table
        pool = pool.replace(page_table=jnp.where(table >= 0, table - shard * local.num_pages, -1))
        batch = batch._replace(slots=batch.slots - shard * local.max_slots)
        with nn.logical_axis_rules(rules):
            out, pool = step(params, pool, batch, streams, cfg=cfg, spec=local, **static)
        return out, pool.replace(page_table=table)

    pools = _pool_specs(pool)  # every output of a step (logits, streams, selections) is split by row
    fn = jax.shard_map(body, in_specs=(_param_specs(params, cfg, rules), pools, rows, None if streams is None else rows),
                       out_specs=(rows, pools), axis_names={DATA}, check_vma=False)
    return fn(params, pool, batch, streams)
