"""Sharded execution: `make_mesh(expert=, tensor=, data=, layer_split=)` -> a `MeshLayout` that places params
and pools with Flax logical-axis rules and runs the model on the mesh.

```python
layout = ds4jax.make_mesh(expert=4, tensor=2)               # over jax.devices(); data=, layer_split= likewise
model = ds4jax.load(path, dtype=jnp.float32, mesh=layout)   # params placed by the rules, read per shard
ds4jax.forward_logits(model, ids)                           # same call as on one device
```

The jax mesh has axes ``(stage, data, expert, tensor)``. Without a layer split there is one stage. With
``layer_split=n`` (n equal ranges) or explicit ``[(0, 20), (20, 43)]`` ranges, stage s owns a contiguous layer
range on its own sub-mesh (``data x expert x tensor`` devices), embedding on the first stage and the head on the
last; the hyper-connection state ``[tokens, hc, hidden]`` moves from stage to stage (`layer_split.py`).

Within a stage everything is GSPMD (``jit`` over arrays placed with `NamedSharding`) except the pieces that need
explicit collectives, which run in ``shard_map`` with specs from the same rules (`ds4jax.model.sharding`): the
expert-parallel MoE (`model/layers/moe_sharded.py`) and the Pallas kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ds4jax.errors import InputError
from ds4jax.runtime.distributed import init_distributed  # noqa: F401  (ds4jax.init_distributed)
from ds4jax.model import layer_stack, params as params_lib
from ds4jax.model.config import Config
from ds4jax.model.sharding import MESH_AXES, STAGE_AXIS, Rules, default_rules, mesh_spec


class MeshError(InputError):
    """A mesh that cannot be built or does not fit the model; the message names the culprit."""


@dataclasses.dataclass(frozen=True, eq=False)
class MeshLayout:
    mesh: Mesh  # axes (stage, data, expert, tensor)
    layer_split: int | tuple[tuple[int, int], ...] | None
    rules: Rules

    # ---- geometry -------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.mesh.shape[STAGE_AXIS]

    @property
    def stages(self) -> tuple[Mesh, ...]:
        return tuple(Mesh(self.mesh.devices[s], MESH_AXES) for s in range(self.num_stages))

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {a: self.mesh.shape[a] for a in MESH_AXES}

    def describe(self) -> str:
        sizes = " x ".join(f"{a} {n}" for a, n in self.axis_sizes.items() if n > 1) or "1 device"
        split = f", {self.num_stages} layer stages" if self.num_stages > 1 else ""
        return f"{sizes}{split} ({self.mesh.devices.size} devices)"

    def stage_ranges(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        return split_ranges(self.layer_split, num_layers, self.num_stages)

    def stage_of(self, layer: int, num_layers: int) -> int:
        for s, (lo, hi) in enumerate(self.stage_ranges(num_layers)):
            if lo <= layer < hi:
                return s
        raise MeshError(f"layer {layer} is in no stage of {self.stage_ranges(num_layers)}")

    # ---- shardings ------------------------------------------------------------------------------
    def sharding(self, shape: Sequence[int], logical: Sequence[str], stage: int = 0) -> NamedSharding:
        mesh = self.stages[stage]
        spec = list(mesh_spec(shape, logical, dict(mesh.shape), self.rules))
        while spec and spec[-1] is None:  # the canonical form, as jit outputs carry it (else equal placements
            spec.pop()  # compare unequal and the engine's programs compile again on their own outputs)
        if 0 in tuple(shape):  # an empty array (a pool of a layer kind the model or stage lacks): jit outputs carry
            spec = []  # it replicated, so placing it so keeps a step's pools what its outputs are (no second compile)
        return NamedSharding(mesh, P(*spec))

    def param_shardings(self, cfg: Config, params: Any = None) -> Any:
        """NamedSharding of every parameter (tree of `params.declare(cfg)`, pruned to `params`' keys)."""
        last = self.num_stages - 1

        def of(path, info):
            keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
            stage = 0 if keys[0] == "embed" else last
            if keys[0] == "layers":
                stage = self.stage_of(keys[1], cfg.num_layers)
            return self.sharding(info.shape, info.axes, stage)

        tree = jax.tree_util.tree_map_with_path(of, params_lib.declare(cfg),
                                                is_leaf=lambda x: isinstance(x, params_lib.ParamInfo))
        if params is not None and "mtp" not in params:
            tree.pop("mtp", None)
        if layer_stack.is_stacked(params):  # the stacked axis (layers of one segment member) stays whole
            tree["layers"] = layer_stack.stack_like(params["layers"], tree["layers"],
                                                    combine=lambda first, *_: layer_stack.stacked_sharding(first))
        return tree

    def place(self, params: Any, cfg: Config) -> Any:
        """Put params (host or single-device arrays) onto the mesh. Each device receives only its shard."""
        shardings = self.param_shardings(cfg, params)
        if jax.process_count() == 1:
            return jax.device_put(params, shardings)
        # several processes: each builds its own devices' blocks from its copy (device_put would first check with
        # an all-gather per leaf that every process passed the same values)
        return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, np.asarray(x).__getitem__, dtype=x.dtype),
                            params, shardings)

    def pool_shardings(self, spec, stage: int = 0):
        """A `KVPool` of the NamedSharding of each pool array of `spec` (by its logical axes) on a stage."""
        from ds4jax.runtime.pool_layout import POOL_ARRAYS
        from ds4jax.runtime.pool_spec import shapes
        from ds4jax.runtime.pools import KVPool

        axes = {a.name: a.axes for a in POOL_ARRAYS}
        return KVPool(**{k: self.sharding(shape, axes[k], stage) for k, (shape, _) in shapes(spec).items()})

    def pool_zeros(self, spec, stage: int = 0):
        """A fresh pool of `spec` created in place on a stage: each device allocates only its part."""
        return _zeros_placed(spec, self.pool_shardings(spec, stage))

    def batch_sharding(self, shape: Sequence[int], stage: int = 0) -> NamedSharding:
        """Rows over ``data`` (when it divides them), everything else replicated."""
        return self.sharding(shape, ("batch",) + tuple(f"_rest{i}" for i in range(1, len(shape))), stage)

    @contextlib.contextmanager
    def active(self, stage: int = 0):
        """Trace under this stage's mesh and the rules (jit caches are keyed on the mesh)."""
        import flax.linen as nn  # here: `ds4jax generate` imports this module, and flax costs its start-up ~0.1 s

        with jax.set_mesh(self.stages[stage]), nn.logical_axis_rules(self.rules):
            yield

    # ---- running ---------------------------------------------------------------------------------
    def forward_logits(self, model, token_ids) -> jax.Array:
        from ds4jax.runtime.layer_split import forward_logits

        return forward_logits(self, model, token_ids)

    def steps(self, cfg: Config):
        """The pooled steps on this mesh (`mesh_steps.MeshSteps`: the API of `ds4jax.runtime.steps`)."""
        from ds4jax.runtime.mesh_steps import MeshSteps

        return MeshSteps(self, cfg)

    def memory_report(self, cfg: Config, spec=None, dtype: Any = jnp.bfloat16,
                      quantized: str | None = None) -> dict[str, int]:
        """Bytes of params (in `dtype`; with `quantized` "fp8" / "fp4", as a checkpoint quantized so loads with
        ``weights="checkpoint"``: `stored_footprint`) and of a pool `spec` on the busiest device, from the
        shardings alone (a quantized leaf's values and scales split like the leaf)."""
        per_device: dict[Any, list[int]] = {d: [0, 0] for d in self.mesh.devices.flat}

        def add(leaf, sharding, col, nbytes=None):
            whole = nbytes if nbytes is not None else math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
            block = round(whole * math.prod(sharding.shard_shape(leaf.shape)) / max(1, math.prod(leaf.shape)))
            for d in sharding.device_set:
                per_device[d][col] += block

        from ds4jax.io.stored_footprint import leaf_bytes

        leaves = jax.tree.leaves(params_lib.abstract(cfg, dtype))
        shardings = jax.tree.leaves(self.param_shardings(cfg), is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        for leaf, sharding, nbytes in zip(leaves, shardings, leaf_bytes(cfg, dtype, quantized), strict=True):
            add(leaf, sharding, 0, nbytes)
        if spec is not None:
            from ds4jax.runtime.pool_spec import shapes

            steps = self.steps(cfg)
            for sp, sh in zip(steps.stage_specs(spec), steps.pool_shardings(spec)):
                for name, (shape, dt) in shapes(sp).items():
                    add(jax.ShapeDtypeStruct(shape, jnp.dtype(dt)), getattr(sh, name), 1)
        busiest = max(per_device.values(), key=sum)
        return {"params": busiest[0], "pools": busiest[1], "total": sum(busiest),
                "devices": len(per_device)}

    def configure(self, cfg: Config, *, role, max_context: int, memory_budget_bytes: int, max_slots: int | None = None,
                  params_dtype: Any = jnp.bfloat16, **kwargs):
        """`ds4jax.configure` for this mesh: `memory_budget_bytes` is per device. Pools get what the params leave;
        each ``data`` rank sizes its own pools (slots and pages then multiply by ``data``). Returns
        (the global PoolSpec, `memory_report` of it: per-device params / pools / total bytes)."""
        from ds4jax.runtime.pool_spec import configure

        data = self.axis_sizes["data"]
        params = self.memory_report(cfg, None, params_dtype)["params"]
        free = int(memory_budget_bytes) - params
        if free <= 0:
            raise MeshError(f"memory_budget_bytes={memory_budget_bytes:,}: the params alone take {params:,} B per "
                            f"device on {self.describe()}")
        if max_slots is not None and max_slots % data:
            raise MeshError(f"max_slots={max_slots} must be divisible by data={data}")
        widest = max(hi - lo for lo, hi in self.stage_ranges(cfg.num_layers))
        rank_budget = int(free * cfg.num_layers / widest)  # a device holds its stage's share of its rank's pools
        rank = configure(cfg, role=role, max_context=max_context, memory_budget_bytes=rank_budget,
                         max_slots=None if max_slots is None else max_slots // data, **kwargs)
        spec = dataclasses.replace(
            rank, max_slots=rank.max_slots * data, c4_pages=rank.c4_pages * data, c4_entries=rank.c4_entries * data,
            indexer_entries=rank.indexer_entries * data, c128_pages=rank.c128_pages * data,
            c128_entries=rank.c128_entries * data)
        return spec, self.memory_report(cfg, spec, params_dtype)

    def per_device_bytes(self, tree: Any) -> dict[Any, int]:
        """Bytes each device holds of a placed pytree (shards actually resident on it)."""
        out: dict[Any, int] = {d: 0 for d in self.mesh.devices.flat}
        for leaf in jax.tree.leaves(tree):
            for shard in leaf.addressable_shards:
                out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
        return out


def _zeros_placed(spec, shardings):
    from ds4jax.runtime.pools import zeros

    return jax.jit(zeros, static_argnums=0, out_shardings=shardings)(spec)


def split_ranges(layer_split, num_layers: int, stages: int) -> tuple[tuple[int, int], ...]:
    """Resolve ``layer_split`` (None, a stage count, or (start, stop) ranges) against a model's layer count.

    Ranges must be contiguous, in order, non-empty and cover [0, num_layers) exactly once."""
    if layer_split is None or isinstance(layer_split, int):
        n = stages
        if not 1 <= n <= num_layers:
            raise MeshError(f"layer_split={layer_split}: cannot split {num_layers} layers into {n} stages")
        bounds = [round(i * num_layers / n) for i in range(n + 1)]
        return tuple((bounds[i], bounds[i + 1]) for i in range(n))
    ranges = tuple((int(a), int(b)) for a, b in layer_split)
    covered = []
    for a, b in ranges:
        if not 0 <= a < b <= num_layers:
            raise MeshError(f"layer_split range ({a}, {b}) is empty or outside the model's layers [0, {num_layers})")
        covered.extend(range(a, b))
    if covered != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(covered))
        twice = sorted({i for i in covered if covered.count(i) > 1})
        why = (f"leaves layers {missing} uncovered" if missing else
               f"covers layers {twice} twice" if twice else "is not in layer order")
        raise MeshError(f"layer_split {list(ranges)} must cover layers 0..{num_layers - 1} exactly once, in order: "
                        f"it {why}")
    return ranges


def make_mesh(*, expert: int = 1, tensor: int = 1, data: int = 1, layer_split=None, devices=None,
              rules: Rules | None = None) -> MeshLayout:
    """A `MeshLayout` over the first stages x data x expert x tensor of `devices` (default ``jax.devices()``,
    every process's devices when running multi-host).

    ``layer_split``: None (one stage), an int (that many stages, equal layer ranges), or explicit
    ``[(start, stop), ...]`` layer ranges (checked against the model when params are placed)."""
    for name, n in (("expert", expert), ("tensor", tensor), ("data", data)):
        if not isinstance(n, int) or n < 1:
            raise MeshError(f"make_mesh: {name}={n!r} must be a positive int")
    if layer_split is None:
        stages = 1
    elif isinstance(layer_split, int):
        if layer_split < 1:
            raise MeshError(f"make_mesh: layer_split={layer_split} must be >= 1")
        stages = layer_split
    else:
        layer_split = tuple((int(a), int(b)) for a, b in layer_split)
        if not layer_split:
            raise MeshError("make_mesh: layer_split is an empty list of ranges")
        stages = len(layer_split)
    if devices is None:
        init_distributed()
    devices = list(jax.devices() if devices is None else devices)
    need = stages * data * expert * tensor
    if need > len(devices):
        raise MeshError(f"make_mesh: {stages} stage(s) x data {data} x expert {expert} x tensor {tensor} = {need} "
                        f"devices, only {len(devices)} available")
    grid = np.array(devices[:need], dtype=object).reshape(stages, data, expert, tensor)
    return MeshLayout(Mesh(grid, (STAGE_AXIS,) + MESH_AXES), layer_split, tuple(rules or default_rules()))


def place_model(model, layout: MeshLayout):
    """A copy of `model` with its params placed on `layout` (the public calls then run on the mesh)."""
    from ds4jax.model.handle import Model

    cfg, params = model.config, model.params
    layout.stage_ranges(cfg.num_layers)  # fail early on a bad split
    ranges = layer_stack.stage_ranges(cfg, layout)
    if layer_stack.is_stacked(params) and \
            params["layers"].segments != layer_stack.plan_stages(layer_stack.kinds(cfg), ranges):
        # stacked for another split (e.g. one stage): per-layer copies placed, then stacked on each stage's devices
        # consuming them (restacking before placing would build the whole new stack on the model's device)
        placed = layout.place(layer_stack.unstacked_params(params), cfg)
        params = {**placed, "layers": layer_stack.stack(cfg, placed["layers"], combine=layer_stack.stack_consuming,
                                                        ranges=ranges)}
    else:
        params = layout.place(params, cfg)
    return Model(cfg, params, layout, scan_layers=model.scan_layers)

