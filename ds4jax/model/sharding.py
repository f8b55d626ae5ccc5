"""Logical axes -> mesh axes, as the model code sees them while it is traced (model floor: no runtime imports).

The mesh has the axes ``data`` (request slots / batch rows: data-parallel attention), ``expert`` (routed
experts) and ``tensor`` (query heads, output groups, expert and shared-expert FFN columns, vocabulary).
A layer split adds a ``stage`` axis above them; each stage runs on its own sub-mesh of the three.

Which logical axis goes where is a Flax logical-axis rule set (`default_rules`); `flax.linen` resolves it
(`nn.logical_to_mesh_axes`). `ds4jax.runtime.mesh` places arrays with these rules and enters
``jax.set_mesh(mesh)`` plus ``nn.logical_axis_rules(rules)`` around a step; while tracing, `active()` returns
that mesh and those rules so the few functions that need explicit collectives (expert-parallel MoE, the
vocabulary-parallel embedding) run inside ``shard_map`` with the same specs the arrays were placed with.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
from jax.sharding import AxisType, PartitionSpec as P

MESH_AXES = ("data", "expert", "tensor")
STAGE_AXIS = "stage"

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def default_rules() -> Rules:
    """The layouts of issue 12 in one rule set; axes of size 1 simply do not split anything.

    * routed experts over ``expert``, their FFN columns over ``tensor`` (EP, EP x TP);
    * query heads / output groups / the shared expert's FFN over ``tensor`` (TP attention);
    * vocabulary (embedding rows, head columns) over ``expert`` x ``tensor`` (vocab parallel);
    * batch rows and pool slots / pages over ``data`` (data-parallel attention).
    Everything else (embed, norms, mHC, router, compressors, indexer) is replicated."""
    return (
        ("batch", "data"), ("slots", "data"), ("entries", "data"),
        ("experts", "expert"), ("expert_mlp", "tensor"), ("mlp", "tensor"),
        ("heads", "tensor"), ("o_groups", "tensor"),
        ("vocab", ("expert", "tensor")),
    )


def mesh_spec(shape: Sequence[int], logical: Sequence[str], axis_sizes: Mapping[str, int], rules: Rules,
              exclude: Sequence[str] = ()) -> P:
    """`nn.logical_to_mesh_axes`, then drop mesh axes that do not divide their dimension (or are `exclude`d,
    e.g. already manual) so every placement is even. Placement and shard_map specs both come from here."""
    import flax.linen as nn  # here, not at the top: single-device runs (the CLI) never import flax

    spec = nn.logical_to_mesh_axes(tuple(logical), rules)
    out = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        axes = tuple(a for a in axes if a in axis_sizes and axis_sizes[a] > 1 and a not in exclude)
        while axes and dim % math.prod(axis_sizes[a] for a in axes):
            axes = axes[:-1]
        out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    return P(*out)


def spec_axes(entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


class Active:
    """The context mesh while tracing: axis sizes, which axes are still automatic (not already manual), rules."""

    def __init__(self, mesh, rules: Rules):
        self.mesh = mesh
        self.sizes = dict(mesh.shape)
        self.auto = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t is not AxisType.Manual)
        self.rules = rules

    def spec(self, shape, logical) -> P:
        """The spec over the still-automatic axes (what a nested shard_map or a constraint may name)."""
        manual = [a for a in self.sizes if a not in self.auto]
        return mesh_spec(shape, logical, self.sizes, self.rules, exclude=manual)

    def full_axes(self, size: int, logical: str) -> tuple[str, ...]:
        """Every mesh axis (manual ones included) a dimension of `size` named `logical` is split over."""
        return spec_axes(mesh_spec((size,), (logical,), self.sizes, self.rules)[0])


def active() -> Active | None:
    """The mesh being traced under, if any model axis has more than one device; else None (single device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not any(mesh.shape.get(a, 1) > 1 for a in MESH_AXES):
        return None
    # (also when only already-manual axes are larger than 1: inside a data-parallel step the experts may be
    # split over ``data`` while ``expert`` and ``tensor`` have size 1)
    import flax.linen as nn

    return Active(mesh, tuple(nn.get_logical_axis_rules() or default_rules()))
