"""Ahead-of-time plans of sharded steps: lower and compile a decode step or prefill chunk on abstract, sharded
shapes (nothing is allocated), then read per-device memory from XLA's memory analysis and the collectives from
the compiled HLO. Used by ``scripts/plan_mesh.py`` (Flash / Pro past one machine) and ``scripts/bench_mesh.py``.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.model import params as params_lib
from ds4jax.model.config import Config

from ds4jax.runtime.mesh_steps import POOL_AXES, stage_config, stage_step
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pools import KVPool
from ds4jax.runtime.roles import Role
from ds4jax.runtime.steps import Logits, StepBatch

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}
_OP = re.compile(r"=\s*(\(?[a-z0-9]+\[[^=]*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


@dataclasses.dataclass
class Plan:
    name: str
    step: str
    devices: int
    stages: int
    params_bytes: int  # busiest device, from the shardings
    pool_bytes: int
    temp_bytes: int  # largest per-layer program's temporaries (XLA memory analysis)
    programs: int  # distinct per-layer programs compiled
    collectives: dict  # op -> (count, bytes) summed over the step's layers
    compile_s: float

    @property
    def peak_bytes(self) -> int:
        return self.params_bytes + self.pool_bytes + self.temp_bytes


def collectives(hlo: str) -> dict[str, tuple[int, int]]:
    """Collective ops in a compiled HLO module: op -> (count, result bytes summed)."""
    count, size = Counter(), Counter()
    for line in hlo.splitlines():
        m = _OP.search(line)
        if not m or "-done" in line:
            continue
        op = m.group(2)
        count[op] += 1
        for dtype, dims in _SHAPE.findall(m.group(1)):
            n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            size[op] += n * _DTYPE_BYTES.get(dtype, 4)
    return {op: (count[op], size[op]) for op in count}


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def plan_step(layout, cfg: Config, spec: PoolSpec, *, rows: int, chunk: int, name: str, dtype=jnp.bfloat16,
              kernels=None) -> Plan:
    """Plan one pooled step (`chunk` tokens for each of `rows` rows) on abstract, sharded inputs.

    Compile time stays bounded whatever the depth: the step is compiled as per-layer programs (layer i alone, the
    first with the embedding, the last with the head, each on its stage's sub-mesh), and layers with the same
    (attention, MoE) kind share one compiled program, like iterations of a scan: Flash needs 6 programs, not a
    43-layer one. Params and pools per device come from the shardings; the peak adds the largest program's
    temporaries; collectives are summed over all layers."""
    from ds4jax.runtime.kernels import resolve
    from ds4jax.runtime.mesh_steps import stage_spec
    from ds4jax.runtime.pool_spec import shapes

    kernels = resolve(kernels)
    params = _abstract(params_lib.abstract(cfg, dtype), layout.param_shardings(cfg))
    report = layout.memory_report(cfg, spec, dtype)
    found, sizes, compiled_of, t0 = Counter(), Counter(), {}, time.perf_counter()
    last_layer = cfg.num_layers - 1
    for i in range(cfg.num_layers):
        s = layout.stage_of(i, cfg.num_layers)
        first, last = i == 0, i == last_layer
        view = stage_config(cfg, i, i + 1)
        key = (s, view.attention_types, view.mlp_types, first, last)
        if key not in compiled_of:
            sp = stage_spec(spec, view)
            pool = KVPool(**{k: jax.ShapeDtypeStruct(shp, jnp.dtype(dt), sharding=layout.sharding(shp, POOL_AXES[k], s))
                             for k, (shp, dt) in shapes(sp).items()})
            put = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=layout.batch_sharding(shape, s))
            batch = StepBatch(put((rows,), jnp.int32), put((rows, chunk), jnp.int32), put((rows,), jnp.int32))
            x = None if first else put((rows, chunk, cfg.hc_mult, cfg.hidden_size), dtype)
            top = {k: params[k] for k in (("embed",) if first else ()) + (("hc_head", "norm", "head") if last else ())}
            with layout.active(s):
                compiled = stage_step.lower(
                    {**top, "layers": params["layers"][i : i + 1]}, pool, batch, x, cfg=view, spec=sp,
                    rules=layout.rules, logits=Logits.LAST if last else Logits.NONE, kernels=kernels).compile()
            compiled_of[key] = (compiled.memory_analysis().temp_size_in_bytes, collectives(compiled.as_text()))
        for op, (c, b) in compiled_of[key][1].items():
            found[op] += c
            sizes[op] += b
    temp = max(t for t, _ in compiled_of.values())
    step = "decode" if chunk == 1 else f"prefill {chunk}"
    return Plan(name, f"{step} x {rows}", layout.mesh.devices.size, layout.num_stages, report["params"],
                report["pools"], temp, len(compiled_of), {op: (found[op], sizes[op]) for op in found},
                time.perf_counter() - t0)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def markdown(plans: list[Plan]) -> str:
    head = ("| model / layout | step | devices | stages | params / device | pools / device | peak / device "
            "| collectives per step (count, bytes) | programs | compile s |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for p in plans:
        coll = ", ".join(f"{op} {c} ({format_bytes(b)})" for op, (c, b) in sorted(p.collectives.items())) or "none"
        rows.append(f"| {p.name} | {p.step} | {p.devices} | {p.stages} | {format_bytes(p.params_bytes)} | "
                    f"{format_bytes(p.pool_bytes)} | {format_bytes(p.peak_bytes)} | {coll} | {p.programs} | "
                    f"{p.compile_s:.0f} |")
    return head + "\n".join(rows) + "\n"


def target_spec(cfg: Config, *, slots: int, context: int, dtype="bfloat16") -> PoolSpec:
    return PoolSpec.for_role(cfg, role=Role.TARGET, max_slots=slots, max_context=context, page_size=256, dtype=dtype)


__all__ = ["Plan", "collectives", "markdown", "plan_step", "target_spec"]
