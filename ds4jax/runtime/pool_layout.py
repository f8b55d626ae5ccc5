"""The KV-pool layout, described once: every pool array with its shape rule, dtype, role, layer kind and
logical axes. `KVPool`, `shapes(spec)`, the byte-report groups, `reset_slots` and the steps' per-layer
load/store are all derived from `POOL_ARRAYS`; nothing else lists the arrays.

| array               | shape rule (PoolSpec fields)                                     | dtype       | roles  | layers    |
|---------------------|------------------------------------------------------------------|-------------|--------|-----------|
| swa_kv              | num_layers, max_slots, swa_rows, head_dim                        | kv storage  | T, D   | every     |
| c4_kv               | num_csa_layers, c4_entries, head_dim                             | kv storage  | T      | CSA       |
| indexer_kv          | num_csa_layers, indexer_entries, index_head_dim                  | kv storage  | T      | CSA       |
| c128_kv             | num_hca_layers, c128_entries, head_dim                           | kv storage  | T      | HCA       |
| swa_kv_scale        | swa_scale_layers, max_slots, swa_rows                            | float32     | T, D   | every     |
| c4_kv_scale         | csa_scale_layers, c4_entries                                     | float32     | T      | CSA       |
| indexer_kv_scale    | csa_scale_layers, indexer_entries                                | float32     | T      | CSA       |
| c128_kv_scale       | hca_scale_layers, c128_entries                                   | float32     | T      | HCA       |
| c4_state_kv/_gate   | num_csa_layers, max_slots, c4_state_rows, c4_state_width         | state_dtype | T      | CSA       |
| indexer_state_*     | num_csa_layers, max_slots, indexer_state_rows, indexer_state_width | state_dtype | T    | CSA       |
| c128_state_kv/_gate | num_hca_layers, max_slots, c128_state_rows, c128_state_width     | state_dtype | T      | HCA       |
| page_table          | max_slots, pages_per_slot                                        | int32       | T      | -         |
| lengths             | max_slots                                                        | int32       | T, D   | -         |

(`format_table()` prints this from the table itself, logical axes included.) An array outside a role's set
still exists in that role's pool, with zero size (the draft spec has no compressed capacity).

"kv storage" is `PoolSpec.kv_storage_dtype`: the model's dtype, or FP8 E4M3 with `kv_dtype="fp8"`; then each row of a
KV array has its float32 scale at the same index of its `*_scale` array (`ds4jax.runtime.kv_quant`). Without an
FP8 cache the scale arrays have no layers (zero size), so the default pools hold exactly what they always did.

Logical axes (for Flax logical-axis sharding rules; the mesh maps them onto devices):

* ``pool_layers`` the layer axis of an array (all layers, or the CSA / HCA layers in order);
* ``slots`` request slots; ``swa_rows`` / ``state_rows`` ring rows of one slot;
* ``entries`` paged rows shared by all slots (page n owns rows [n·z/ratio, (n+1)·z/ratio));
* ``kv_dim`` / ``index_dim`` / ``state_dim`` the feature width; ``slot_pages`` a slot's page-table row.

A layer's view (`layer_field`): per-slot arrays are gathered for the step's rows and scattered back in place;
paged arrays are handed over whole with the layer's index, read in place and scattered into in place, so a
step never copies a layer's slice of a pool out and back.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from ds4jax.model.config import AttentionType
from ds4jax.runtime.roles import Role

EVERY_LAYER = (AttentionType.SLIDING, AttentionType.CSA, AttentionType.HCA)


@dataclasses.dataclass(frozen=True)
class PoolArray:
    name: str
    shape: tuple[str, ...]  # PoolSpec attribute of each axis' size
    axes: tuple[str, ...]  # logical axis names, one per axis
    dtype: str  # PoolSpec attribute holding the dtype name, or a dtype name
    roles: frozenset  # roles that use the array (in the others' pools it has zero size)
    layers: tuple  # attention kinds with an entry on the leading axis; () = not per layer
    field: str | None  # the `LayerPools` field a layer reads/writes (None: not per layer)
    group: str  # byte-report bucket
    empty: int | None = None  # value of a fresh pool (None: the caller's fill, 0 or NaN)

    @property
    def per_slot(self) -> bool:
        """Indexed by slot after the layer axis: gathered for a step's rows, reset with its slot."""
        return "slots" in self.axes[1:2]

    @property
    def paged(self) -> bool:
        return "entries" in self.axes


_T, _TD = frozenset({Role.TARGET}), frozenset({Role.TARGET, Role.DRAFT})
_CSA, _HCA = (AttentionType.CSA,), (AttentionType.HCA,)


def _ring(name, layers_field, rows, width, layers, field):
    return PoolArray(name, (layers_field, "max_slots", rows, width), ("pool_layers", "slots", "state_rows", "state_dim"),
                     "state_dtype", _T, layers, field, "states")


POOL_ARRAYS: tuple[PoolArray, ...] = (
    PoolArray("swa_kv", ("num_layers", "max_slots", "swa_rows", "head_dim"),
              ("pool_layers", "slots", "swa_rows", "kv_dim"), "kv_storage_dtype", _TD, EVERY_LAYER, "ring", "swa"),
    PoolArray("c4_kv", ("num_csa_layers", "c4_entries", "head_dim"), ("pool_layers", "entries", "kv_dim"),
              "kv_storage_dtype", _T, _CSA, "entries", "c4_kv"),
    PoolArray("indexer_kv", ("num_csa_layers", "indexer_entries", "index_head_dim"),
              ("pool_layers", "entries", "index_dim"), "kv_storage_dtype", _T, _CSA, "index_entries", "indexer"),
    PoolArray("c128_kv", ("num_hca_layers", "c128_entries", "head_dim"), ("pool_layers", "entries", "kv_dim"),
              "kv_storage_dtype", _T, _HCA, "entries", "c128_kv"),
    PoolArray("swa_kv_scale", ("swa_scale_layers", "max_slots", "swa_rows"), ("pool_layers", "slots", "swa_rows"),
              "float32", _TD, EVERY_LAYER, "ring_scale", "swa"),
    PoolArray("c4_kv_scale", ("csa_scale_layers", "c4_entries"), ("pool_layers", "entries"), "float32", _T, _CSA,
              "entries_scale", "c4_kv"),
    PoolArray("indexer_kv_scale", ("csa_scale_layers", "indexer_entries"), ("pool_layers", "entries"), "float32", _T,
              _CSA, "index_entries_scale", "indexer"),
    PoolArray("c128_kv_scale", ("hca_scale_layers", "c128_entries"), ("pool_layers", "entries"), "float32", _T, _HCA,
              "entries_scale", "c128_kv"),
    _ring("c4_state_kv", "num_csa_layers", "c4_state_rows", "c4_state_width", _CSA, "state_kv"),
    _ring("c4_state_gate", "num_csa_layers", "c4_state_rows", "c4_state_width", _CSA, "state_gate"),
    _ring("indexer_state_kv", "num_csa_layers", "indexer_state_rows", "indexer_state_width", _CSA, "index_state_kv"),
    _ring("indexer_state_gate", "num_csa_layers", "indexer_state_rows", "indexer_state_width", _CSA,
          "index_state_gate"),
    _ring("c128_state_kv", "num_hca_layers", "c128_state_rows", "c128_state_width", _HCA, "state_kv"),
    _ring("c128_state_gate", "num_hca_layers", "c128_state_rows", "c128_state_width", _HCA, "state_gate"),
    PoolArray("page_table", ("max_slots", "pages_per_slot"), ("slots", "slot_pages"), "int32", _T, (), None,
              "tables", empty=-1),
    PoolArray("lengths", ("max_slots",), ("slots",), "int32", _TD, (), None, "tables", empty=0),
)

NAMES: tuple[str, ...] = tuple(a.name for a in POOL_ARRAYS)
BY_NAME: dict[str, PoolArray] = {a.name: a for a in POOL_ARRAYS}
GROUPS: tuple[str, ...] = tuple(dict.fromkeys(a.group for a in POOL_ARRAYS))
LAYER_FIELDS: tuple[str, ...] = tuple(dict.fromkeys(a.field for a in POOL_ARRAYS if a.field))


def shape_of(array: PoolArray, spec) -> tuple[int, ...]:
    return tuple(int(getattr(spec, f)) for f in array.shape)


def dtype_of(array: PoolArray, spec) -> str:
    return getattr(spec, array.dtype) if hasattr(spec, array.dtype) else array.dtype


def of_layer(kind: AttentionType) -> tuple[PoolArray, ...]:
    """The arrays a layer of `kind` reads and writes."""
    return tuple(a for a in POOL_ARRAYS if kind in a.layers)


def layer_index(layer_kinds: tuple, layer: int, array: PoolArray) -> int:
    """Index of model layer `layer` on `array`'s leading axis (its rank among layers of the array's kinds)."""
    return sum(1 for k in layer_kinds[:layer] if k in array.layers)


def logical_axes() -> dict[str, tuple[str, ...]]:
    """name -> logical axis names (feed `jax.sharding.PartitionSpec(*axes)` to Flax's logical-axis rules)."""
    return {a.name: a.axes for a in POOL_ARRAYS}


def format_table(spec=None) -> str:
    """The layout as a markdown table; with a spec, each array's concrete shape too."""
    head = "| array | shape rule | logical axes | dtype | roles | layers |" + (" shape |" if spec else "")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in POOL_ARRAYS:
        kinds = "every" if a.layers == EVERY_LAYER else ("-" if not a.layers else
                                                         ", ".join(k.name for k in a.layers))
        roles = ", ".join(r.name.lower() for r in Role if r in a.roles)
        row = f"| {a.name} | {', '.join(a.shape)} | {', '.join(a.axes)} | {a.dtype} | {roles} | {kinds} |"
        if spec is not None:
            row += f" {list(shape_of(a, spec))} ({math.prod(shape_of(a, spec)):,} items) |"
        rows.append(row)
    return "\n".join(rows)

